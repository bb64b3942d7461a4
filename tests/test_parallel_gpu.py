"""Tensor parallelism on two GPUs (NCCL, CUDA graphs with the collectives captured): the full-size
model gives the same greedy tokens split over two GPUs as on one. Needs two CUDA devices, so it is
skipped on CPU machines (CI); tests/test_parallel.py covers the same code over gloo there.

fp32, because the promise is about the split, not about rounding: in bf16 a different order of the
all-reduce's sum flips near-tied tokens of dummy weights (their logits are almost flat).
"""

import gc
import json
import os
import subprocess
import sys

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
    assert greedy_tokens(tensor_parallel_size=2) == greedy_tokens()


def test_tp2_with_the_symmetric_memory_all_reduce_gives_the_same_tokens(monkeypatch):
    # Two ranks' sum is a + b in either order: the one-shot all-reduce must match NCCL's bit for bit.
    nccl = greedy_tokens(expect_fused=False, tensor_parallel_size=2)
    monkeypatch.setenv("MINILLM_TP_ALLREDUCE", "symm_mem")
    assert greedy_tokens(tensor_parallel_size=2) == nccl


def test_pp2_on_two_gpus_gives_the_one_gpu_tokens():
    assert greedy_tokens(pipeline_parallel_size=2) == greedy_tokens()


def test_close_destroys_the_captured_graphs_first():
    llm = LLM("tiny", load_format="dummy", batching="continuous", tensor_parallel_size=2)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.graphs
    llm.close()  # would wait forever in NCCL's teardown with the graphs alive
    assert not graphs.graphs


# In a process of its own: this one has set up symmetric memory for the symm_mem test above, and a second
# setup with new workers waits forever with torch 2.11 (all_reduce.check_fresh_process refuses it).
FUSED_SCRIPT = """
import importlib.util, json, os
os.environ["MINILLM_TP_ALLREDUCE"] = "fused"
spec = importlib.util.spec_from_file_location("gpu_tests", {path!r})
tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tests)
print("TOKENS", json.dumps(tests.greedy_tokens("bfloat16", expect_fused=True, tensor_parallel_size=2)))
"""


def test_tp2_with_the_all_reduce_fused_into_the_norms_gives_nccls_tokens():
    # The fused kernel adds the two partials in fp32 and rounds once: exact for two 16-bit values, so
    # NCCL's bits, in bf16 too, where near-ties would show any difference.
    nccl = greedy_tokens("bfloat16", expect_fused=False, tensor_parallel_size=2)
    run = subprocess.run([sys.executable, "-c", FUSED_SCRIPT.format(path=__file__)], capture_output=True, text=True,
                         timeout=600, env={k: v for k, v in os.environ.items() if k != "MINILLM_TP_ALLREDUCE"})
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    assert json.loads(lines[-1][len("TOKENS "):]) == nccl
