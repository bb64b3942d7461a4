"""A step's batch composition must not choose which Triton kernel variant runs.

Triton compiles one variant of a kernel per *specialisation*: the constexprs, and for every other
argument not listed in ``do_not_specialize``, whether an integer is 1 or a multiple of 16 and
whether a pointer sits on a 16-byte boundary (``triton.jit``; ``specialize_impl`` in
``triton/runtime/jit.py``). If the engine's arguments move between those classes from step to
step, a run meets new variants as it goes and stops for a compile each time. The warm-up cannot be
trusted to have met them all: replayed on a CPU, the schedule of the open-loop multi-turn benchmark
(`multi-turn-open`) as it ran for figures/h200/prefix_cache_multi_turn_fcfs.json meets a new
paged-prefill variant at its 18th step, and one stall of 0.9 s there accounts for the prefix-cache
run's TTFT and TPOT shifts and its 24 % lower throughput.

The paged prefill kernel reads the rows of a mixed step that follow its decode rows, through views
``context_lens[n:]`` and ``block_tables[n:]`` (``TritonPagedBatch``): n * 4 bytes into int32
tensors, so on a 16-byte boundary only for some n. Here a step is run with every n from 0 to 7
and each launch's specialisation is computed as Triton's rule does, skipping the arguments the
kernel declares per-step (``PER_STEP_ARGS``): it must come out the same every time.

The throughput harness counts the compiles inside each timed run (``minillm.bench.jit_compiles``),
so a variant the warm-up missed shows in the JSON instead of as a slower engine; tested last.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import triton
import triton.language as tl

from minillm.bench.jit_compiles import CompileCounter
from minillm.kernels import flash_attention
from minillm.kv.paged import BlockAllocator, BlockTables, PagedKVCache, PagedStep
from minillm.kv.paged_triton import TritonPagedBatch
from minillm.model.config import PRESETS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def specialization(kernel, args, not_specialized) -> tuple:
    """What Triton keys a launch's compiled variant on, for the positional (non-constexpr) arguments."""
    names = list(inspect.signature(kernel.fn).parameters)
    key = []
    for name, arg in zip(names, args):
        if name in not_specialized or isinstance(arg, (bool, float)) or arg is None:
            continue
        if isinstance(arg, torch.Tensor):
            key.append((name, arg.data_ptr() % 16 == 0))
        else:
            key.append((name, arg == 1, arg % 16 == 0))
    return tuple(key)


def run_mixed_step(num_decode: int, generator: torch.Generator) -> None:
    """One layer's attention over ``num_decode`` decode rows then two prefill chunks whose prompts
    start with a cached prefix, on random K/V in scattered blocks."""
    config = PRESETS["tiny"]
    block_size, num_blocks = 4, 64
    cache = PagedKVCache(config, num_blocks, block_size, torch.float32, DEVICE)
    cache.k.copy_(torch.randn(cache.k.shape, generator=generator))
    cache.v.copy_(torch.randn(cache.v.shape, generator=generator))
    tables = BlockTables(BlockAllocator(num_blocks), block_size)
    decode_ctx = torch.randint(2, 20, (num_decode,), generator=generator).tolist()
    query_lens, context_lens = [1] * num_decode + [5, 9], decode_ctx + [13, 9]
    for i, ctx in enumerate(context_lens):
        tables.grow(str(i), ctx)
    slots = sum((tables.slots(str(i), c - n, c) for i, (n, c) in enumerate(zip(query_lens, context_lens))), [])
    step = PagedStep.from_host(slots, [tables.tables[str(i)] for i in range(len(query_lens))], query_lens,
                               context_lens, torch.device(DEVICE))
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    q, k, v = (torch.randn(1, sum(query_lens), h, dim, generator=generator).to(DEVICE)
               for h in (heads, kv_heads, kv_heads))
    TritonPagedBatch(cache, step)(0, q, k, v)


def test_paged_prefill_specialisation_does_not_follow_the_number_of_decode_rows():
    kernel = flash_attention._attention_kernel
    launches = []
    hook = lambda *args, **kwargs: launches.append(args)  # noqa: E731
    kernel.add_pre_run_hook(hook)
    try:
        generator = torch.Generator().manual_seed(0)
        for num_decode in range(8):
            run_mixed_step(num_decode, generator)
    finally:
        kernel.pre_run_hooks.remove(hook)
    assert len(launches) == 8  # one prefill launch per step
    context_lens_at = list(inspect.signature(kernel.fn).parameters).index("context_lens")
    # The situation that matters does occur: some steps hand the kernel views off a 16-byte boundary.
    assert {args[context_lens_at].data_ptr() % 16 == 0 for args in launches} == {True, False}
    keys = [specialization(kernel, args, flash_attention.PER_STEP_ARGS) for args in launches]
    changing = {a[0] for key in keys for a, b in zip(key, keys[0]) if a != b}
    assert not changing, f"the prefill kernel's variant follows the decode rows through {sorted(changing)}"


def test_compile_counter_counts_the_hook_calls_and_keeps_an_earlier_hook():
    """Triton calls ``jit_cache_hook`` before each compile and skips the compile if it returns true:
    the counter counts the calls, passes an earlier hook's answer on, and puts that hook back."""
    runtime = pytest.importorskip("triton.knobs").runtime
    seen = []

    def earlier(**kwargs):
        seen.append(kwargs["key"])
        return kwargs["key"] == "skip"

    saved, runtime.jit_cache_hook = runtime.jit_cache_hook, earlier
    try:
        with CompileCounter() as compiles:
            answers = [runtime.jit_cache_hook(key=key, repr=key, fn=None, compile={}, is_manual_warmup=False,
                                              already_compiled=False) for key in ("a", "skip", "b")]
        assert runtime.jit_cache_hook is earlier
    finally:
        runtime.jit_cache_hook = saved
    assert compiles.count == 3 and seen == ["a", "skip", "b"] and answers == [False, True, False]


@triton.jit
def _add_one_kernel(X, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(X + offsets, tl.load(X + offsets) + 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter compiles nothing")
def test_compile_counter_sees_a_real_compile_once():
    x = torch.randn(16, device="cuda")
    expected = x + 1
    with CompileCounter() as first:
        _add_one_kernel[(1,)](x, N=16)
    with CompileCounter() as again:
        _add_one_kernel[(1,)](x, N=16)
    assert (first.count, again.count) == (1, 0)
    torch.testing.assert_close(x, expected + 1)
