"""Preemption by swapping (preemption_mode="swap"): a preempted request's KV blocks go to CPU swap
space and come back at readmission. Outputs equal solo runs and the recompute engine's, nothing is
recomputed, every GPU and CPU block comes back (abort included), and a full swap space falls back
to recomputation."""

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minillm import SamplingParams
from minillm.cli import build_parser
from minillm.cli_args import engine_kwargs
from minillm.config import EngineConfig
from minillm.kv.paged import BlockAllocator, BlockTables, PagedKVCache
from minillm.kv.swap import KVSwapper
from minillm.model.config import PRESETS
from minillm.request import Request, RequestStatus
from minillm.scheduler import ContinuousScheduler
from test_continuous import check_outputs_equal_solo_runs, requests_strategy, schedules, solo_output, tiny_engine

KV_BYTES_PER_TOKEN = PRESETS["tiny"].kv_bytes_per_token(4)  # float32


def swap_space(num_blocks: int, block_size: int) -> int:
    """Bytes of CPU memory that hold exactly ``num_blocks`` blocks of the tiny model."""
    return num_blocks * block_size * KV_BYTES_PER_TOKEN


# The continuous tests' schedules, tighter (several requests, few spare blocks) so most examples preempt.
crowded = dict(schedules, requests=requests_strategy.filter(lambda r: len(r) >= 2),
               spare_blocks=st.integers(0, 3), max_num_seqs=st.integers(2, 6))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.sampled_from([1, 2, 4, 16]), swap_blocks=st.integers(1, 10), **crowded)
def test_swap_outputs_equal_solo_runs_under_any_schedule(requests, block_size, swap_blocks, token_budget,
                                                         spare_blocks, policy, arrivals, max_num_seqs):
    # Swap spaces from one block (nearly every victim falls back to recomputation) to plenty.
    engine = check_outputs_equal_solo_runs(requests, block_size, token_budget, spare_blocks, policy, arrivals,
                                           max_num_seqs, preemption_mode="swap",
                                           swap_space=swap_space(swap_blocks, block_size))
    s = engine.scheduler
    event("swapped" if s.num_swap_outs else "did not swap")  # --hypothesis-show-statistics
    event("fell back to recompute" if s.num_swap_fallbacks else "never fell back")
    assert s.num_swap_ins == s.num_swap_outs  # everyone swapped out came back
    assert s.num_swap_outs + s.num_swap_fallbacks <= s.num_preemptions


PROMPTS = [list(range(10 + i, 18 + i)) for i in range(4)]  # 8 tokens each; 12 blocks of 2 force preemption


def run(swap_blocks: int | None, attention_backend: str = "torch"):
    """The four prompts through a cache of 12 blocks of 2 tokens, recomputing (None) or swapping."""
    mode = dict(preemption_mode="swap", swap_space=swap_space(swap_blocks, 2)) if swap_blocks else {}
    engine = tiny_engine(batching="continuous", block_size=2, num_kv_blocks=12, max_num_batched_tokens=64,
                         attention_backend=attention_backend, **mode)
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return engine, [outputs[str(i)] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton: under the interpreter on a CPU
def test_swap_happens_keeps_outputs_and_recomputes_nothing(backend):
    recompute, expected = run(None)
    swap, got = run(swap_blocks=40, attention_backend=backend)
    assert got == expected == [solo_output(tuple(p), 10) for p in PROMPTS]
    s = swap.scheduler
    assert s.num_preemptions == recompute.scheduler.num_preemptions > 0
    assert s.num_swap_outs == s.num_swap_ins == s.num_preemptions and s.num_swap_fallbacks == 0
    # Swapping computes every prompt token once and feeds every output token but the last once;
    # recomputation prefills the preempted contexts again.
    no_recompute = sum(map(len, PROMPTS)) + len(PROMPTS) * 9
    assert sum(st.num_tokens for st in swap.stats) == no_recompute
    assert sum(st.num_tokens for st in recompute.stats) > no_recompute
    assert swap.stats[-1].num_preemptions == s.num_preemptions
    cpu = s.cpu_block_tables
    assert cpu.allocator.num_free == cpu.allocator.num_blocks == 40 and not cpu.tables


@pytest.mark.parametrize("swap_blocks, swaps, fallbacks", [(3, 0, 4), (4, 1, 3), (10, 4, 0)])
def test_a_full_swap_space_falls_back_to_recompute(swap_blocks, swaps, fallbacks):
    # Each victim holds 4 or 5 blocks of computed tokens: 3 CPU blocks swap nobody, 4 swap one at a time.
    engine, got = run(swap_blocks)
    assert got == [solo_output(tuple(p), 10) for p in PROMPTS]
    s = engine.scheduler
    assert (s.num_swap_outs, s.num_swap_fallbacks, s.num_preemptions) == (swaps, fallbacks, 4)
    assert s.cpu_block_tables.allocator.num_free == swap_blocks


def test_abort_of_a_swapped_request_frees_its_cpu_blocks():
    engine = tiny_engine(batching="continuous", block_size=2, num_kv_blocks=12, max_num_batched_tokens=64,
                         preemption_mode="swap", swap_space=swap_space(40, 2))
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    scheduler, cpu = engine.scheduler, engine.scheduler.cpu_block_tables
    while not any(r.status is RequestStatus.SWAPPED for r in scheduler.waiting):
        engine.step()
    victim = next(r for r in scheduler.waiting if r.status is RequestStatus.SWAPPED)
    assert victim.num_computed_tokens > 0 and victim.request_id not in engine.block_tables.tables
    assert len(cpu.tables[victim.request_id]) == cpu.blocks_for(victim.num_computed_tokens)
    assert engine.abort(victim.request_id).outputs[0].finish_reason == "abort"
    assert victim.request_id not in cpu.tables and cpu.allocator.num_free == 40
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    for i, prompt in enumerate(PROMPTS):
        if str(i) != victim.request_id:
            assert outputs[str(i)] == solo_output(tuple(prompt), 10)
    assert cpu.allocator.num_free == 40 and not cpu.tables
    assert engine.block_tables.allocator.num_free == 12 and not engine.block_tables.tables


def test_swapped_request_waits_for_its_whole_context_and_comes_back_by_copy():
    """The scheduler alone: it lists the copies, and readmission needs blocks for the swapped
    context plus the next token, above the watermark."""
    gpu, cpu = BlockTables(BlockAllocator(6), 4), BlockTables(BlockAllocator(8), 4)
    scheduler = ContinuousScheduler(gpu, max_num_seqs=4, max_num_batched_tokens=64, watermark_blocks=1,
                                    cpu_block_tables=cpu)
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    a, b = (Request(rid, None, list(range(10, 18)), params, arrival_time=0.0) for rid in "ab")
    scheduler.add(a)
    scheduler.add(b)

    def step():
        batch = scheduler.schedule(0.0)
        for request, n in zip(batch.requests, batch.num_new_tokens):  # what the engine does after the forward
            request.num_computed_tokens += n
            if request.num_computed_tokens == request.num_tokens:
                request.output_token_ids.append(7)
                if len(request.output_token_ids) == request.params.max_tokens:
                    request.finish("length")
                    scheduler.finish(request)
        return [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)], batch.swaps

    assert step() == ([("a", 8), ("b", 8)], [])  # 2 blocks each, 2 left
    for _ in range(4):  # tokens 9..12: a third block each, then the cache is full
        assert step() == ([("a", 1), ("b", 1)], [])
    b_blocks = list(gpu.tables["b"])
    # a's 13th token needs a fourth block: b, the newest, is swapped out with its 12 computed tokens.
    assert step() == ([("a", 1)], [("out", b_blocks, cpu.tables["b"])])
    assert b.status is RequestStatus.SWAPPED and b.num_computed_tokens == 12 and "b" not in gpu.tables
    assert cpu.allocator.num_free == 5 and scheduler.waiting == [b]
    # 2 GPU blocks are free: enough for one more token, but b needs 4 (12 tokens + 1) plus the watermark.
    assert step() == ([("a", 1)], []) and a.finished
    cpu_blocks = list(cpu.tables["b"])
    assert step() == ([("b", 1)], [("in", cpu_blocks, gpu.tables["b"][:3])])  # one decode token, no prefill
    assert len(gpu.tables["b"]) == 4 and b.status is RequestStatus.RUNNING
    assert cpu.allocator.num_free == 8 and not cpu.tables
    assert (scheduler.num_preemptions, scheduler.num_swap_outs, scheduler.num_swap_ins) == (1, 1, 1)


def test_swapper_copies_every_layer_k_and_v_in_the_order_given():
    cache = PagedKVCache(PRESETS["tiny"], num_blocks=4, block_size=2, dtype=torch.float32, device="cpu")
    cache.k.normal_(), cache.v.normal_()
    swapper = KVSwapper(cache, num_blocks=3)
    swapper.k.normal_(), swapper.v.normal_()
    gpu_k, gpu_v, cpu_k, cpu_v = cache.k.clone(), cache.v.clone(), swapper.k.clone(), swapper.v.clone()
    # GPU block 2 leaves for CPU block 0; then CPU block 1 lands in GPU block 2 (freed by the swap out).
    swapper.run([("out", [3, 2], [2, 0]), ("in", [1], [2])])
    for pool, before, cpu_before in ((swapper.k, gpu_k, cpu_k), (swapper.v, gpu_v, cpu_v)):
        assert torch.equal(pool[:, [2, 0]], before[:, [3, 2]]) and torch.equal(pool[:, 1], cpu_before[:, 1])
    for pool, before, cpu_before in ((cache.k, gpu_k, cpu_k), (cache.v, gpu_v, cpu_v)):
        assert torch.equal(pool[:, 2], cpu_before[:, 1]) and torch.equal(pool[:, [0, 1, 3, 4]], before[:, [0, 1, 3, 4]])
    with pytest.raises(ValueError, match="neither 'out' nor 'in'"):
        swapper.run([("sideways", [0], [0])])


def test_config_and_cli_validation():
    with pytest.raises(ValueError, match=r"preemption_mode 'swapp' is not supported; valid: \('recompute', 'swap'\)"):
        EngineConfig(batching="continuous", preemption_mode="swapp")
    with pytest.raises(ValueError, match="preemption_mode='swap' needs batching='continuous' \\(now 'static'\\)"):
        EngineConfig(preemption_mode="swap")
    for bad in ("lots", 0, -1, "-2GiB", True, None):
        with pytest.raises(ValueError, match=f"swap_space {bad!r} is not a memory size|swap_space must be"):
            EngineConfig(batching="continuous", preemption_mode="swap", swap_space=bad)
    assert EngineConfig(swap_space="512MiB").swap_space == 512 * 2**20
    assert EngineConfig().preemption_mode == "recompute" and EngineConfig().swap_space == 4 * 2**30
    with pytest.raises(ValueError, match=r"swap_space of 100 bytes holds no KV block \(one block of 2 tokens needs "
                                         f"{2 * KV_BYTES_PER_TOKEN:,} bytes\\)"):
        tiny_engine(batching="continuous", block_size=2, preemption_mode="swap", swap_space=100)
    args = build_parser().parse_args(["generate", "hi", "--batching", "continuous", "--preemption-mode", "swap",
                                      "--swap-space", "1MiB"])
    kwargs = engine_kwargs(args)
    assert (kwargs["preemption_mode"], kwargs["swap_space"]) == ("swap", "1MiB")
    assert EngineConfig(**kwargs).swap_space == 2**20
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--preemption-mode", "never"])
