"""CUDA-graph decode: the capture sizes everywhere; on a GPU, graph replay against eager steps."""

from __future__ import annotations

import pytest
import torch

from minillm import SamplingParams
from minillm.cuda_graphs import capture_sizes
from test_continuous import tiny_engine  # tests/ is on sys.path (pytest's rootdir-less import)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@pytest.mark.parametrize("max_batch, expected", [(1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]),
                                                 (20, [1, 2, 4, 8, 16, 20]), (32, [1, 2, 4, 8, 16, 24, 32])])
def test_capture_sizes_cover_every_batch(max_batch, expected):
    assert capture_sizes(max_batch) == expected


def random_requests(count: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """``count`` prompts of 1-39 random tokens and their output lengths (1-29)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 300, (int(n),), generator=generator).tolist()
               for n in torch.randint(1, 40, (count,), generator=generator)]
    return prompts, torch.randint(1, 30, (count,), generator=generator).tolist()


def run_staggered(engine, prompts, max_tokens):
    """Requests arrive one per step, so decode batches grow and shrink through many capture sizes."""
    outputs, pending, step = {}, list(enumerate(prompts)), 0
    while pending or engine.has_unfinished():
        if pending:
            index, prompt = pending.pop(0)
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens[index], temperature=0, ignore_eos=True),
                               request_id=str(index))
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        step += 1
    return outputs


@needs_cuda
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8", "int4"])  # quantizing writes inside the graph
def test_graph_replay_gives_the_eager_tokens(kv_cache_dtype):
    prompts, max_tokens = random_requests(12, seed=0)
    results = {}
    for eager in (True, False):
        # A tight cache forces preemptions; a small token budget, chunked prefills.
        engine = tiny_engine(batching="continuous", device="cuda", enforce_eager=eager, block_size=4,
                             num_kv_blocks=60, max_num_batched_tokens=24, max_num_seqs=10,
                             kv_cache_dtype=kv_cache_dtype)
        results[eager] = run_staggered(engine, prompts, max_tokens)
        assert (engine.runner.graphs is None) == eager
    assert engine.runner.graphs.num_replays > 10
    assert results[False] == results[True]


@needs_cuda
def test_greedy_rows_take_minillm_argmax_with_torch_tokens():
    """On a GPU the sampler's argmax is kernels/greedy.py's; the tokens agree with torch's argmax."""
    from minillm.kernels.greedy import greedy_argmax
    prompts, max_tokens = random_requests(6, seed=1)
    results = {}
    for kernel in (True, False):
        engine = tiny_engine(batching="continuous", device="cuda", max_num_seqs=4)
        assert engine.runner.sampler.argmax is greedy_argmax
        if not kernel:
            engine.runner.sampler.argmax = lambda logits: logits.argmax(dim=-1)
        results[kernel] = run_staggered(engine, prompts, max_tokens)
    assert results[True] == results[False] and len(results[True]) == len(prompts)
