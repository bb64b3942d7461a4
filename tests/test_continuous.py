"""Continuous batching over the paged KV cache: outputs equal solo runs whatever the schedule does
(arrival order, chunk sizes, block sizes, KV budgets small enough to force preemption, priorities),
and every block comes back."""

import random
from collections import deque

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from minillm.config import EngineConfig
from minillm.engine import Engine
from minillm.kv.paged import BlockAllocator, BlockTables, PagedBatch, PagedKVCache, PagedStep
from minillm.kv.quant import dequantize_kv, quantize_kv
from minillm.model.config import PRESETS
from minillm.request import Request

VOCAB = PRESETS["tiny"].vocab_size


def sharpen(engine: Engine) -> Engine:
    """Dummy weights give nearly flat logits, where float noise could flip a greedy choice; a
    scaled head makes every argmax decisive, so equality tests test the schedule, not rounding."""
    engine.model.lm_head.weight.mul_(30)
    return engine


# On a GPU machine every engine of these tests runs on the GPU (the Triton backend with CUDA graphs),
# else on the CPU with the kernels under the interpreter (tests/conftest.py switches it on). One
# device for all: dummy weights are drawn by the device's own generator, so a CPU reference would
# hold other weights than a GPU engine.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_engine(**kwargs) -> Engine:
    defaults = dict(model="tiny", load_format="dummy", dtype="float32", device=DEVICE)
    if torch.device(kwargs.get("device", DEVICE)).type == "cuda":
        # Without a budget each engine sizes its KV blocks to fill 90 % of the GPU (gpu_memory_utilization),
        # and a test that holds two engines at once (a reference and the engine under test) runs out.
        defaults["memory_budget"] = "2GB"
    return sharpen(Engine(EngineConfig(**{**defaults, **kwargs})))


_solo_cache: dict = {}


def solo_output(prompt: tuple, max_tokens: int) -> list[int]:
    """The request run alone (static engine, batch of one): the reference."""
    key = (prompt, max_tokens)
    if key not in _solo_cache:
        engine = _solo_cache.setdefault("engine", tiny_engine(max_num_seqs=1))
        engine.add_request(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        outputs = []
        while engine.has_unfinished():
            outputs += [o for o in engine.step() if o.finished]
        _solo_cache[key] = outputs[0].outputs[0].token_ids
    return _solo_cache[key]


requests_strategy = st.lists(
    st.tuples(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=40).map(tuple),  # prompt
              st.integers(1, 12),  # max_tokens
              st.integers(0, 2)),  # priority
    min_size=1, max_size=6)


def check_outputs_equal_solo_runs(requests, block_size, token_budget, spare_blocks, policy, arrivals, max_num_seqs,
                                  attention_backend="torch", **engine_kwargs) -> Engine:
    """Run the requests as scheduled; every output equals its solo run and every block (GPU, and
    CPU swap space if any) is free at the end. Returns the engine for further checks."""
    # The cache holds the largest single request plus a few blocks: tight enough to preempt.
    largest = max(-(-(len(p) + m) // block_size) for p, m, _ in requests)
    engine = tiny_engine(batching="continuous", block_size=block_size, max_num_batched_tokens=token_budget,
                         num_kv_blocks=largest + spare_blocks, scheduling_policy=policy, max_num_seqs=max_num_seqs,
                         attention_backend=attention_backend, **engine_kwargs)
    pending = sorted(enumerate(requests), key=lambda item: arrivals[item[0]])  # arrival step per request
    finished, step = {}, 0
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0][0]] <= step:
            index, (prompt, max_tokens, priority) = pending.pop(0)
            engine.add_request(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                               request_id=str(index), priority=priority if policy == "priority" else 0)
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
        assert step < 2000, "the engine stopped making progress"
    for index, (prompt, max_tokens, _) in enumerate(requests):
        assert finished[str(index)].outputs[0].token_ids == solo_output(prompt, max_tokens), index
    if engine.prefix_cache is not None:  # nothing runs: every cached block is unlocked and evictable
        assert engine.prefix_cache.num_evictable_blocks == engine.prefix_cache.num_cached_blocks
        engine.prefix_cache.reset()
        assert engine.prefix_cache.num_cached_blocks == 0 and not engine.prefix_cache.root.children
    for tables in (engine.block_tables, engine.scheduler.cpu_block_tables):
        if tables is not None:
            assert tables.allocator.num_free == tables.allocator.num_blocks and not tables.tables
            assert set(tables.allocator.ref_counts) == {0}
    return engine


schedules = dict(token_budget=st.integers(1, 48), spare_blocks=st.integers(0, 12),
                 policy=st.sampled_from(["fcfs", "priority"]),
                 arrivals=st.lists(st.integers(0, 4), min_size=6, max_size=6), max_num_seqs=st.integers(1, 6))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests_strategy, block_size=st.sampled_from([1, 2, 4, 16]), **schedules)
def test_outputs_equal_solo_runs_under_any_schedule(requests, block_size, token_budget, spare_blocks, policy,
                                                    arrivals, max_num_seqs):
    check_outputs_equal_solo_runs(requests, block_size, token_budget, spare_blocks, policy, arrivals, max_num_seqs)


# The same property on the Triton kernels (under the interpreter on a CPU): fewer examples, it is slower.
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests_strategy, block_size=st.sampled_from([2, 4, 16]), **schedules)
def test_triton_backend_outputs_equal_solo_runs(requests, block_size, token_budget, spare_blocks, policy, arrivals,
                                                max_num_seqs):
    check_outputs_equal_solo_runs(requests, block_size, token_budget, spare_blocks, policy, arrivals, max_num_seqs,
                                  attention_backend="triton")


def test_preemption_happens_and_keeps_outputs():
    engine = tiny_engine(batching="continuous", block_size=2, num_kv_blocks=12, max_num_batched_tokens=64)
    prompts = [list(range(10 + i, 18 + i)) for i in range(4)]
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert outputs[str(i)].outputs[0].token_ids == solo_output(tuple(prompt), 10)


def test_urgent_request_preempts_a_less_urgent_one():
    engine = tiny_engine(batching="continuous", block_size=4, num_kv_blocks=6, scheduling_policy="priority")
    engine.add_request(list(range(5, 21)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                       request_id="slow", priority=5)
    engine.step()
    engine.add_request(list(range(30, 42)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       request_id="urgent", priority=0)
    first_finished = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished and first_finished is None:
                first_finished = o.request_id
    assert first_finished == "urgent" and engine.scheduler.num_preemptions >= 1


def test_a_request_that_can_never_fit_is_rejected_at_add():
    engine = tiny_engine(batching="continuous", block_size=4, num_kv_blocks=5)
    with pytest.raises(ValueError, match="holds only 20"):
        engine.add_request(list(range(2, 20)), SamplingParams(max_tokens=8))
    assert not engine.has_unfinished()


def test_abort_frees_blocks_of_running_and_waiting_requests():
    engine = tiny_engine(batching="continuous", block_size=4, num_kv_blocks=64, max_num_seqs=1)
    a = engine.add_request(list(range(2, 30)), SamplingParams(max_tokens=20, ignore_eos=True))
    b = engine.add_request(list(range(2, 9)), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.block_tables.allocator.num_free < 64
    assert engine.abort(a).outputs[0].finish_reason == "abort"
    assert engine.abort(b).outputs[0].finish_reason == "abort"
    assert engine.block_tables.allocator.num_free == 64 and not engine.has_unfinished()


def test_long_prompt_is_prefilled_in_chunks():
    engine = tiny_engine(batching="continuous", max_num_batched_tokens=8)
    engine.add_request(list(range(2, 31)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    steps_before_first_token = 0
    while not engine.step():
        steps_before_first_token += 1
    assert steps_before_first_token == 3  # 29 prompt tokens = chunks of 8, 8, 8, then 5 with a token


def test_block_allocator_reference_counts():
    allocator = BlockAllocator(3)
    a = allocator.allocate()
    allocator.share(a)
    allocator.release(a)
    assert allocator.num_free == 2
    allocator.release(a)
    assert allocator.num_free == 3
    with pytest.raises(ValueError, match="already free"):
        allocator.release(a)
    with pytest.raises(ValueError, match="is free"):
        allocator.share(a)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8", "int4"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_paged_attention_equals_dense_attention_on_random_blocks(backend, kv_cache_dtype):
    """write_kv stores the new tokens (quantized, with a quantized cache); decode rows and prefill
    chunks then give attention over what the cache holds, dequantized, whichever backend reads it."""
    torch.manual_seed(0)
    config = PRESETS["tiny"]
    cache = PagedKVCache(config, num_blocks=32, block_size=4, dtype=torch.float32, device=DEVICE,
                         kv_cache_dtype=kv_cache_dtype)
    for pools in ((cache.k, cache.k_scale), (cache.v, cache.v_scale)):  # stale data everywhere: it must be masked
        stale = torch.randn(*cache.k.shape[:-1], config.head_dim).to(DEVICE)
        for pool, values in zip(pools, (stale,) if kv_cache_dtype == "auto" else quantize_kv(stale, kv_cache_dtype)):
            pool.copy_(values)
    tables = BlockTables(BlockAllocator(32), 4)
    perm = torch.randperm(32).tolist()  # scattered blocks
    tables.allocator.free_ids = deque(perm)
    query_lens, context_lens = [1, 1, 5, 9], [7, 13, 5, 14]
    for i, ctx in enumerate(context_lens):
        tables.grow(str(i), ctx)
    H, Hkv, D = config.num_heads, config.num_kv_heads, config.head_dim
    N = sum(query_lens)
    q, k, v = (torch.randn(1, N, heads, D).to(DEVICE) for heads in (H, Hkv, Hkv))
    slots = sum((tables.slots(str(i), c - n, c) for i, (n, c) in enumerate(zip(query_lens, context_lens))), [])
    step = PagedStep.from_host(slots, [tables.tables[str(i)] for i in range(4)], query_lens, context_lens,
                               torch.device(DEVICE), pad_block=perm[0])  # padding: a live block, never read
    if backend == "triton":
        from minillm.kv.paged_triton import TritonPagedBatch as make_attention
    else:
        make_attention = PagedBatch
    out = make_attention(cache, step)(0, q, k, v)
    layer = cache.layer(0)
    pool_k = dequantize_kv(layer.k, layer.k_scale, torch.float32).reshape(-1, Hkv, D)
    pool_v = dequantize_kv(layer.v, layer.v_scale, torch.float32).reshape(-1, Hkv, D)
    if kv_cache_dtype != "auto":  # quantized, not copied, and within a rounding step
        assert not torch.equal(pool_k[slots], k[0]) and (pool_k[slots] - k[0]).abs().max() < 0.3
    start = 0
    for i, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        flat_k = pool_k[tables.slots(str(i), 0, ctx)]
        flat_v = pool_v[tables.slots(str(i), 0, ctx)]
        qi = q[0, start:start + n].transpose(0, 1)  # [H, n, D]
        ki = flat_k.transpose(0, 1).repeat_interleave(H // Hkv, 0)
        vi = flat_v.transpose(0, 1).repeat_interleave(H // Hkv, 0)
        scores = qi @ ki.transpose(1, 2) / D ** 0.5
        causal = torch.arange(ctx, device=DEVICE)[None, :] <= torch.arange(ctx - n, ctx, device=DEVICE)[:, None]
        expected = (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vi).transpose(0, 1)
        torch.testing.assert_close(out[0, start:start + n], expected, rtol=1e-5, atol=1e-5)
        start += n


def test_continuous_matches_transformers_on_the_embedded_model(smollm, hf_smollm):
    llm = LLM(batching="continuous", dtype="float32", device="cpu", max_num_batched_tokens=24,
              block_size=4, num_kv_blocks=48)
    prompts = [smollm.tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):",
                                                      "Three primary colors are")]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected = hf_smollm.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                      eos_token_id=2)[0, len(prompt):].tolist()
        assert output.outputs[0].token_ids == expected


def test_step_stats_account_for_every_token():
    engine = tiny_engine(batching="continuous", block_size=4, num_kv_blocks=40, max_num_batched_tokens=16)
    prompts = [list(range(3, 3 + n)) for n in (5, 20, 9)]
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    stats = list(engine.stats)
    # Every prompt token is computed once and every output token but the last is fed back once.
    assert sum(s.num_tokens for s in stats) == sum(map(len, prompts)) + 3 * 5
    assert max(s.num_tokens for s in stats) <= 16 and max(s.num_seqs for s in stats) == 3
    assert 0 < max(s.kv_usage for s in stats) <= 1 and stats[-1].num_preemptions == 0


def test_dynamic_batching_groups_similar_lengths_and_keeps_outputs():
    engine = tiny_engine(batching="dynamic", max_num_seqs=2, bucket_width=16, batch_timeout=0.0)
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 7, 45)]  # buckets 0, 2, 0, 2
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    batches, outputs = [], {}
    while engine.has_unfinished():
        if not any(not r.finished for r in engine.scheduler.running):
            engine.step()  # the step that forms and prefills a new batch
            batches.append(sorted(len(r.prompt_token_ids) for r in engine.scheduler.running))
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert batches == [[5, 7], [40, 45]]
    for i, prompt in enumerate(prompts):
        assert outputs[str(i)].outputs[0].token_ids == solo_output(tuple(prompt), 4)


def test_block_ids_out_of_range_are_refused():
    allocator = BlockAllocator(4)
    allocator.allocate()
    for bad in (-1, 4):
        with pytest.raises(ValueError, match=f"block {bad} is not a block id"):
            allocator.release(bad)
        with pytest.raises(ValueError, match=f"block {bad} is not a block id"):
            allocator.share(bad)


def test_request_token_ids_slices_prompt_and_output_without_joining():
    rng = random.Random(7)
    for _ in range(200):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 12))]
        request = Request("r", None, prompt, SamplingParams())
        request.output_token_ids = [rng.randrange(1000) for _ in range(rng.randint(0, 12))]
        whole = prompt + request.output_token_ids
        start = rng.randint(0, len(whole))
        end = rng.randint(start, len(whole))
        assert request.token_ids(start, end) == whole[start:end]
