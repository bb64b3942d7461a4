"""Multi-step decoding (num_scheduler_steps = k): k decode passes per scheduler step, the tokens fed
back on the device. Greedy outputs equal k = 1's on SmolLM2 (lengths, stop strings, stop tokens,
EOS) and equal solo runs on the tiny model under chunked prefill, admission and preemption; the
scheduler never plans past a request's budget or without KV blocks for every pass, and every block
comes back; seeded sampling draws the same tokens; tensor parallelism follows rank 0's tokens."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams
from minillm.cli import build_parser, main
from minillm.cli_args import engine_kwargs
from minillm.config import EngineConfig
from minillm.scheduler import ContinuousScheduler
from minillm.tokenizer import encode_chat
from test_async_scheduling import ChainChecks
from test_continuous import DEVICE, check_outputs_equal_solo_runs, requests_strategy, schedules, sharpen, tiny_engine
from test_cuda_graphs import needs_cuda
from test_prefix_cache import shared_requests

STEPS = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def smollm_continuous():
    """One SmolLM2 engine for every k: k lives in the scheduler, the only part that reads it (loading
    the model once per k would cost more than all the generation here)."""
    return LLM(dtype="float32", device="cpu", batching="continuous")


def generate_with_steps(llm: LLM, k: int, prompts, params, async_scheduling: bool = True) -> tuple[list, int]:
    """Outputs with k passes per scheduler step, and how many scheduler steps they took."""
    llm.engine.scheduler.num_scheduler_steps = k
    llm.engine.config.async_scheduling = async_scheduling  # (read at each step)
    steps_before = len(llm.engine.stats)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, len(llm.engine.stats) - steps_before


def test_greedy_smollm_outputs_equal_one_step_for_every_k(smollm_continuous):
    llm = smollm_continuous
    chat = encode_chat(llm.tokenizer, [{"role": "user", "content": "Reply with one word: yes or no?"}])
    story = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
    prompts = ["The capital of France is", "def fibonacci(n):", {"prompt_token_ids": chat}, story, story]
    plain = [SamplingParams(max_tokens=n, temperature=0) for n in (19, 7, 23, 21, 21)]
    # The stops come from k = 1's own output: a string and a token id from the middle of the story.
    reference, _ = generate_with_steps(llm, 1, prompts, plain, async_scheduling=False)
    story_text, story_ids = reference[3].outputs[0].text, reference[4].outputs[0].token_ids
    stop_string = story_text[len(story_text) // 2:len(story_text) // 2 + 4]
    params = plain[:3] + [SamplingParams(max_tokens=21, temperature=0, stop=stop_string),
                          SamplingParams(max_tokens=21, temperature=0, stop_token_ids=[story_ids[9]])]
    # Synchronous one pass a step is the reference; every k runs with async scheduling (the default), k = 4
    # also without.
    expected, one_step_count = generate_with_steps(llm, 1, prompts, params, async_scheduling=False)
    finish = [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in expected]
    # Each way of ending is exercised: length, EOS (stop with no reason), stop string, stop token.
    assert finish == [("length", None), ("length", None), ("stop", None), ("stop", stop_string),
                      ("stop", story_ids[9])], finish
    assert len(expected[4].outputs[0].token_ids) == story_ids.index(story_ids[9]) + 1
    for k, async_scheduling in [(k, True) for k in STEPS] + [(4, False)]:
        outputs, step_count = generate_with_steps(llm, k, prompts, params, async_scheduling)
        assert k == 1 or step_count < one_step_count, f"k={k} ran no multi-step batch"
        for got, want in zip(outputs, expected):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, (k, async_scheduling, got.prompt)
            assert got.outputs[0].text == want.outputs[0].text, (k, async_scheduling, got.prompt)
            assert (got.outputs[0].finish_reason, got.outputs[0].stop_reason) == \
                   (want.outputs[0].finish_reason, want.outputs[0].stop_reason), (k, async_scheduling, got.prompt)
    assert llm.engine.block_tables.allocator.num_free == llm.engine.block_tables.allocator.num_blocks


class PlanChecks:
    """Wraps ``ContinuousScheduler.schedule``: each batch it plans must be k = 1's work, with its
    passes within every request's budget, blocks for all of them, and the allocator's count exact."""

    def __init__(self):
        self.num_steps: list[int] = []
        original = ContinuousScheduler.schedule

        def checked(scheduler, now):
            batch = original(scheduler, now)
            if batch is not None and batch.requests:
                self.check(scheduler, batch)
            return batch

        self.patch = mock.patch.object(ContinuousScheduler, "schedule", checked)

    def check(self, scheduler: ContinuousScheduler, batch) -> None:
        k = batch.num_steps
        self.num_steps.append(k)
        assert 1 <= k <= scheduler.num_scheduler_steps
        tables = scheduler.block_tables
        if scheduler.prefix_cache is None:  # no block is shared: the tables hold exactly the allocated ones
            held = sum(map(len, tables.tables.values()))
            assert tables.allocator.num_free + held == tables.allocator.num_blocks
        if k == 1:
            return
        for request, n in zip(batch.requests, batch.num_new_tokens):
            assert n == 1 and request.num_computed_tokens == request.num_tokens - 1  # pure decode
            assert len(request.output_token_ids) + k <= request.params.max_tokens
            assert request.num_tokens + k <= scheduler.max_model_len
            assert len(tables.tables[request.request_id]) * tables.block_size >= request.num_tokens + k - 1


@pytest.mark.parametrize("k", [2, 3, 8])
def test_tiny_batch_with_admission_chunks_and_preemption_equals_solo_runs(k):
    """Seven requests, three sequence slots, 6-token budget (chunked prefill), a cache that holds the
    largest request plus 2 blocks (preemption), staggered arrivals, outputs of different lengths."""
    requests = [((5, 17, 42, 99, 7), 13, 0), ((3,), 9, 0), (tuple(range(250, 264)), 17, 0), ((8, 9), 5, 0),
                (tuple(range(20, 31)), 11, 0), ((77, 78, 79), 21, 0), ((140,) * 7, 3, 0)]
    checks = PlanChecks()
    with checks.patch:
        engine = check_outputs_equal_solo_runs(requests, block_size=2, token_budget=6, spare_blocks=2, policy="fcfs",
                                               arrivals=[0, 0, 0, 1, 2, 4, 9], max_num_seqs=3,
                                               num_scheduler_steps=k, max_model_len=64)
    assert engine.scheduler.num_preemptions > 0
    assert max(checks.num_steps) == k, checks.num_steps
    if k > 2:  # budgets (max_tokens 3, 5, ...) or blocks cut some batches short
        assert any(1 < n < k for n in checks.num_steps), checks.num_steps


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=requests_strategy, block_size=st.sampled_from([1, 2, 4, 16]), k=st.integers(1, 8), **schedules)
def test_tiny_outputs_equal_solo_runs_under_any_schedule(requests, block_size, token_budget, spare_blocks, policy,
                                                         arrivals, max_num_seqs, k):
    """With async scheduling (the default): the scheduler's batches and the ones chained between them."""
    checks, chains = PlanChecks(), ChainChecks()
    with checks.patch, chains.patch:
        check_outputs_equal_solo_runs(requests, block_size, token_budget, spare_blocks, policy, arrivals,
                                      max_num_seqs, num_scheduler_steps=k)
    event("multi-step batches" if max(checks.num_steps) > 1 else "single passes only")
    event("chained batches" if chains.num_steps else "no chain")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stems=st.lists(st.lists(st.integers(2, 299), min_size=0, max_size=30), min_size=3, max_size=3),
       picks=shared_requests, block_size=st.sampled_from([1, 2, 4]), k=st.integers(2, 8),
       preemption_mode=st.sampled_from(["recompute", "swap"]), **schedules)
def test_prefix_cache_and_swap_outputs_equal_solo_runs(stems, picks, block_size, k, preemption_mode, token_budget,
                                                       spare_blocks, policy, arrivals, max_num_seqs):
    """The passes' K/V past a stop are never cached: only computed whole blocks enter the tree."""
    requests = [(tuple(stems[stem] + suffix), max_tokens, priority) for stem, suffix, max_tokens, priority in picks]
    checks, chains = PlanChecks(), ChainChecks()
    with checks.patch, chains.patch:
        engine = check_outputs_equal_solo_runs(requests, block_size, token_budget, spare_blocks, policy, arrivals,
                                               max_num_seqs, num_scheduler_steps=k, enable_prefix_caching=True,
                                               preemption_mode=preemption_mode, swap_space=4 * block_size * 512)
    event("multi-step batches" if max(checks.num_steps) > 1 else "single passes only")
    event("prefix hits" if engine.prefix_cache.hits else "no hits")


def test_tokens_after_a_stop_token_are_dropped():
    """Stop tokens end requests in the middle of a k = 8 batch: the rest of their passes is
    computed but never reported, and their blocks come back."""
    prompts = [[5, 6, 7], [100, 3], [40, 41, 42, 43, 44, 45]]
    reference = tiny_engine(batching="continuous")
    free_run = {}
    for i, prompt in enumerate(prompts):
        reference.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), request_id=str(i))
    while reference.has_unfinished():
        free_run.update({o.request_id: o.outputs[0].token_ids for o in reference.step() if o.finished})
    # Each request stops at a token of its own free run: after 3, 6 and 10 tokens (within one k = 8 batch or two).
    stops = [free_run[str(i)][n - 1] for i, n in enumerate((3, 6, 10))]
    results = {}
    for k in (1, 8):
        engine = tiny_engine(batching="continuous", num_scheduler_steps=k)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                      stop_token_ids=[stops[i]]), request_id=str(i))
        while engine.has_unfinished():
            results.setdefault(k, {}).update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
        assert engine.block_tables.allocator.num_free == engine.block_tables.allocator.num_blocks
    for i in range(3):
        got, want = results[8][str(i)], results[1][str(i)]
        assert got.token_ids == want.token_ids == free_run[str(i)][:free_run[str(i)].index(stops[i]) + 1]
        assert got.stop_reason == stops[i]


def sampled_tokens(k: int, seeds: list[int | None], engine_seed: int = 0) -> list[list[int]]:
    engine = tiny_engine(batching="continuous", num_scheduler_steps=k, seed=engine_seed)
    engine.model.lm_head.weight.div_(30)  # undo sharpen: flat logits, so a sampler that misbehaves shows
    prompts = [[5, 6, 7], [100, 3], [40, 41, 42, 43]]
    for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
        engine.add_request(prompt, SamplingParams(max_tokens=(11, 4, 9)[i], temperature=0.9, top_p=0.9, seed=seed,
                                                  ignore_eos=True), request_id=str(i))
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [outputs[str(i)] for i in range(len(prompts))]


def test_seeded_sampling_draws_the_same_tokens_for_every_k():
    expected = sampled_tokens(1, [11, 22, 33])
    assert len({tuple(t) for t in expected}) == 3
    for k in (2, 4, 8):
        assert sampled_tokens(k, [11, 22, 33]) == expected, k


def test_unseeded_sampling_is_reproducible_for_a_fixed_seed_and_k():
    first = sampled_tokens(4, [None, None, None], engine_seed=5)
    assert sampled_tokens(4, [None, None, None], engine_seed=5) == first


def test_tensor_parallel_ranks_follow_rank_0s_tokens():
    """Two processes, k = 4: greedy and seeded sampled outputs equal one process's with k = 1 (the
    sampled ones only match if the worker feeds rank 0's tokens, not its own)."""
    kwargs = dict(load_format="dummy", dtype="float32", device="cpu", batching="continuous",
                  attention_backend="torch", max_model_len=64)
    prompts = [[5, 17, 42, 99, 7], [3], [250, 251, 252, 253, 254, 255, 256, 257, 258], [8, 9]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (9, 14, 21, 17)] + \
             [SamplingParams(max_tokens=n, temperature=1.0, seed=n, ignore_eos=True) for n in (11, 19, 23, 13)]
    results = []
    for extra in (dict(), dict(tensor_parallel_size=2, num_scheduler_steps=4)):
        with LLM("tiny", **kwargs, **extra) as llm:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts * 2, params, use_tqdm=False)])
            passes = [s.num_passes for s in llm.engine.stats]
    assert max(passes) == 4
    assert results[1] == results[0]


@needs_cuda
def test_cuda_graph_passes_equal_one_step():
    """On a GPU: the static input_ids buffer filled from the device (by the pass before, or by the batch in
    flight with async scheduling) gives synchronous k = 1's tokens."""
    prompts = [torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 17, 40)]
    results = {}
    for k, async_scheduling in ((1, False), (1, True), (8, True), (8, False)):
        engine = tiny_engine(batching="continuous", device="cuda", num_scheduler_steps=k, max_num_seqs=4,
                             async_scheduling=async_scheduling)
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(max_tokens=(21, 9, 30)[i], temperature=0, ignore_eos=True),
                               request_id=str(i))
        outputs = results.setdefault((k, async_scheduling), {})
        while engine.has_unfinished():
            outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        assert engine.runner.graphs.num_replays > 20 and max(s.num_passes for s in engine.stats) == k
    assert all(tokens == results[1, False] for tokens in results.values())


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "4"])
def test_bad_num_scheduler_steps_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=f"num_scheduler_steps must be a positive integer.*got {value!r}"):
        EngineConfig(batching="continuous", num_scheduler_steps=value)


@pytest.mark.parametrize("kwargs, needs", [(dict(batching="static"), "batching='continuous'"),
                                           (dict(batching="continuous", pipeline_parallel_size=2), "not supported")])
def test_multi_step_is_refused_where_it_is_not_built(kwargs, needs):
    with pytest.raises(ValueError, match=f"num_scheduler_steps=4 .*{needs}"):
        EngineConfig(num_scheduler_steps=4, **kwargs)


def test_llm_and_the_bench_cli_pass_num_scheduler_steps_to_the_scheduler(tmp_path):
    args = build_parser().parse_args(["bench", "latency", "--batching", "continuous", "--num-scheduler-steps", "8"])
    assert engine_kwargs(args)["num_scheduler_steps"] == 8
    out = tmp_path / "latency.json"
    main(["bench", "latency", "--model", "tiny", "--load-format", "dummy", "--scale", "cpu", "--num-requests", "1",
          "--batching", "continuous", "--num-scheduler-steps", "8", "--output", str(out)])
    result = json.loads(out.read_text())
    assert result["engine"]["num_scheduler_steps"] == 8 and result["runs"]["minillm"]["mean_decode_tok_s"] > 0
    llm = LLM("tiny", load_format="dummy", dtype="float32", device=DEVICE, batching="continuous",
              num_scheduler_steps=8)
    assert llm.engine.scheduler.num_scheduler_steps == 8
    sharpen(llm.engine)
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
                            use_tqdm=False)) == 1
    assert [s.num_passes for s in llm.engine.stats] == [1, 8]
