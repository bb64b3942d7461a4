"""Tensor parallelism on two GPUs (NCCL, CUDA graphs with the collectives captured): the full-size
model gives the same greedy tokens split over two GPUs as on one. Needs two CUDA devices, so it is
skipped on CPU machines (CI); tests/test_parallel.py covers the same code over gloo there.

fp32, because the promise is about the split, not about rounding: in bf16 a different order of the
all-reduce's sum flips near-tied tokens of dummy weights (their logits are almost flat).
"""

import gc

import pytest
import torch

from minillm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def greedy_tokens(dtype="float32", expect_fused=None, **kwargs) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(100, 30000, (n,), generator=g).tolist() for n in (5, 70, 300, 33)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM("llama2-7b", load_format="dummy", dtype=dtype, batching="continuous", max_model_len=512,
             num_kv_blocks=256, max_num_seqs=8, **kwargs) as llm:
        if expect_fused is not None:  # the path this run took: the final norm sums down_proj's output or not
            assert (llm.engine.model.model.norm.reduce_input is not None) == expect_fused
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    gc.collect()
    torch.cuda.empty_cache()
    return tokens


def test_tp2_on_two_gpus_gives_the_one_gpu_tokens():
    # tp_all_reduce's default: fused, on GPUs that are peers
    assert greedy_tokens(expect_fused=True, tensor_parallel_size=2) == greedy_tokens()


def test_tp2_with_the_symmetric_memory_all_reduce_gives_the_same_tokens():
    # Two ranks' sum is a + b in either order: the one-shot all-reduce must match NCCL's bit for bit.
    # This process has set up symmetric memory for the engine above already: the rendezvous count catch-up.
    nccl = greedy_tokens(expect_fused=False, tensor_parallel_size=2, tp_all_reduce="nccl")
    assert greedy_tokens(tensor_parallel_size=2, tp_all_reduce="symm_mem") == nccl


def test_pp2_on_two_gpus_gives_the_one_gpu_tokens():
    assert greedy_tokens(pipeline_parallel_size=2) == greedy_tokens()


def test_close_destroys_the_captured_graphs_first():
    llm = LLM("tiny", load_format="dummy", batching="continuous", tensor_parallel_size=2)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.graphs
    llm.close()  # would wait forever in NCCL's teardown with the graphs alive
    assert not graphs.graphs


def test_tp2_with_the_all_reduce_fused_into_the_norms_gives_nccls_tokens():
    # The fused kernel adds the two partials in fp32 and rounds once: exact for two 16-bit values, so
    # NCCL's bits, in bf16 too, where near-ties would show any difference. In this process, after the
    # symmetric-memory engines above (all_reduce._catch_up).
    nccl = greedy_tokens("bfloat16", expect_fused=False, tensor_parallel_size=2, tp_all_reduce="nccl")
    assert greedy_tokens("bfloat16", expect_fused=True, tensor_parallel_size=2, tp_all_reduce="fused") == nccl
