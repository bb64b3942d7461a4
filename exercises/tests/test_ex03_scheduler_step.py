"""Tests for exercise 03, one scheduler step: the rules one by one on hand-built queues, then random
workloads step for step against minillm's own scheduler, then the real engine.

Run from the repository root: ``pytest exercises/tests/test_ex03_scheduler_step.py --impl=mine``.
"""

from __future__ import annotations

import random

import pytest

from minillm.kv.paged import BlockAllocator, BlockTables
from minillm.request import Request, RequestStatus, SamplingParams
from minillm.scheduler import ContinuousScheduler
from drive import run_requests  # exercises/tests is on sys.path (pytest)


def make_scheduler(fill, *, num_blocks=64, block_size=4, max_num_seqs=8, budget=16, watermark=0,
                   policy="fcfs") -> ContinuousScheduler:
    """A scheduler over a real block allocator whose step is ``fill`` (the learner's or minillm's)."""
    scheduler = ContinuousScheduler(BlockTables(BlockAllocator(num_blocks), block_size), max_num_seqs, budget,
                                    policy, watermark_blocks=watermark)
    if fill is not None:
        scheduler.fill_token_budget = fill
    return scheduler


def add(scheduler, request_id: str, prompt_len: int, max_tokens: int = 8, arrival: float = 0.0,
        priority: int = 0) -> Request:
    request = Request(request_id, None, list(range(10, 10 + prompt_len)),
                      SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), priority, arrival)
    scheduler.add(request)
    return request


def step(scheduler, now: float = 0.0) -> list[tuple[str, int]]:
    """One step as the engine runs it: schedule, then account for the computed tokens (a request
    whose whole context is computed gets a token; one with max_tokens tokens finishes)."""
    batch = scheduler.schedule(now)
    if batch is None:
        return []
    for request, n in zip(batch.requests, batch.num_new_tokens):
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens:
            request.output_token_ids.append(7)
            if len(request.output_token_ids) >= request.params.max_tokens:
                request.finish("length", now=now)
                scheduler.finish(request)
    return [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)]


def check_invariants(scheduler, scheduled: list[tuple[str, int]]) -> None:
    """What every step must satisfy, whatever the queues hold."""
    ids = [rid for rid, _ in scheduled]
    assert len(ids) == len(set(ids)), f"a request is scheduled twice in one step: {scheduled}"
    assert all(n >= 1 for _, n in scheduled), f"every scheduled request computes at least one token: {scheduled}"
    total = sum(n for _, n in scheduled)
    assert total <= scheduler.max_num_batched_tokens, \
        f"{total} tokens scheduled, over the budget of {scheduler.max_num_batched_tokens}: {scheduled}"
    assert len(scheduler.running) <= scheduler.max_num_seqs, "more running requests than max_num_seqs"
    tables = scheduler.block_tables
    for request in scheduler.running:  # blocks for everything computed so far, and no more
        assert len(tables.tables.get(request.request_id, ())) == tables.blocks_for(request.num_computed_tokens), \
            f"request {request.request_id} holds the wrong number of blocks"


def test_empty_queues_schedule_nothing(impl):
    scheduler = make_scheduler(impl.fill_token_budget)
    assert impl.fill_token_budget(scheduler, 0.0) == []
    assert scheduler.schedule(0.0) is None


def test_short_prompts_are_admitted_whole_then_decode_one_token_each(impl):
    scheduler = make_scheduler(impl.fill_token_budget, budget=32)
    for rid, n in (("a", 5), ("b", 3), ("c", 4)):
        add(scheduler, rid, n)
    assert step(scheduler) == [("a", 5), ("b", 3), ("c", 4)], "each prompt in one piece, in arrival order"
    assert [r.status for r in scheduler.running] == [RequestStatus.RUNNING] * 3
    assert step(scheduler) == [("a", 1), ("b", 1), ("c", 1)], "then one decode token each"
    assert not scheduler.waiting


def test_worked_example_from_the_docstring(impl):
    scheduler = make_scheduler(impl.fill_token_budget, budget=8, max_num_seqs=3)
    add(scheduler, "A", 3, max_tokens=20)
    add(scheduler, "B", 20, max_tokens=20)
    assert step(scheduler) == [("A", 3), ("B", 5)]
    assert step(scheduler) == [("A", 1), ("B", 7)]  # B: 12 of 20 computed now
    add(scheduler, "C", 5)
    add(scheduler, "D", 2)
    assert step(scheduler) == [("A", 1), ("B", 7)], "the running requests take the whole budget"
    assert step(scheduler) == [("A", 1), ("B", 1), ("C", 5)], "D waits: max_num_seqs=3"
    assert step(scheduler) == [("A", 1), ("B", 1), ("C", 1)]


def test_long_prompt_is_split_into_chunks_of_the_budget(impl):
    scheduler = make_scheduler(impl.fill_token_budget, budget=8)
    add(scheduler, "long", 29, max_tokens=3)
    steps = [step(scheduler) for _ in range(6)]
    assert steps == [[("long", 8)], [("long", 8)], [("long", 8)], [("long", 5)], [("long", 1)], [("long", 1)]]
    assert not scheduler.has_unfinished()


def test_token_budget_is_shared_and_never_exceeded(impl):
    scheduler = make_scheduler(impl.fill_token_budget, budget=10, num_blocks=200)
    for i, n in enumerate((7, 13, 2, 25, 4, 9)):
        add(scheduler, f"r{i}", n, max_tokens=5)
    first = step(scheduler)
    assert first == [("r0", 7), ("r1", 3)], "the second prompt gets what is left of the budget, then it is spent"
    for _ in range(40):
        scheduled = step(scheduler)
        check_invariants(scheduler, scheduled)
        if not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished()


def test_running_requests_come_before_admissions(impl):
    scheduler = make_scheduler(impl.fill_token_budget, budget=6)
    add(scheduler, "a", 2)
    add(scheduler, "b", 2)
    assert step(scheduler) == [("a", 2), ("b", 2)]
    add(scheduler, "new", 10)
    assert step(scheduler) == [("a", 1), ("b", 1), ("new", 4)], "decodes first, the newcomer gets the rest"
    assert step(scheduler) == [("a", 1), ("b", 1), ("new", 4)]
    assert step(scheduler) == [("a", 1), ("b", 1), ("new", 2)]


def test_unfinished_prefill_continues_before_a_newcomer(impl):
    scheduler = make_scheduler(impl.fill_token_budget, budget=8)
    add(scheduler, "first", 20)
    assert step(scheduler) == [("first", 8)]
    add(scheduler, "second", 3)
    assert step(scheduler) == [("first", 8)], "the running prefill keeps the budget"
    assert step(scheduler) == [("first", 4), ("second", 3)]


def test_max_num_seqs_is_respected(impl):
    scheduler = make_scheduler(impl.fill_token_budget, budget=64, max_num_seqs=2)
    add(scheduler, "a", 3, max_tokens=1)
    add(scheduler, "b", 3, max_tokens=3)
    add(scheduler, "c", 3)
    add(scheduler, "d", 3)
    assert step(scheduler) == [("a", 3), ("b", 3)], "only max_num_seqs=2 sequences at once"
    # a finished in that step (max_tokens=1): one place is free, c takes it.
    assert step(scheduler) == [("b", 1), ("c", 3)]
    assert [r.request_id for r in scheduler.waiting] == ["d"]


def test_admission_keeps_the_watermark(impl):
    # 10 blocks of 4 tokens, 2 kept free at admission.
    scheduler = make_scheduler(impl.fill_token_budget, budget=64, num_blocks=10, watermark=2)
    add(scheduler, "a", 16)  # 4 blocks: 6 free, 4 + 2 <= 6
    add(scheduler, "b", 16)  # 4 blocks: 2 free after, which is the watermark: still fine
    add(scheduler, "c", 1)  # 1 block: 1 + 2 > 2, so it waits
    assert step(scheduler) == [("a", 16), ("b", 16)]
    assert scheduler.block_tables.allocator.num_free == 2
    # Running requests may use the watermark's blocks: a and b each grow into a fifth block.
    assert step(scheduler) == [("a", 1), ("b", 1)]
    assert scheduler.block_tables.allocator.num_free == 0
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_admission_is_first_come_first_served(impl):
    scheduler = make_scheduler(impl.fill_token_budget, budget=64, num_blocks=8)
    add(scheduler, "late", 2, arrival=3.0)
    add(scheduler, "early", 2, arrival=1.0)
    add(scheduler, "middle", 2, arrival=2.0)
    add(scheduler, "future", 2, arrival=99.0)
    assert step(scheduler, now=5.0) == [("early", 2), ("middle", 2), ("late", 2)], \
        "admit in arrival order (scheduler.next_waiting), and only requests that have arrived"
    assert [r.request_id for r in scheduler.waiting] == ["future"]


def test_a_request_that_does_not_fit_blocks_the_ones_behind_it(impl):
    # 6 blocks of 4 tokens: "big" needs 5 of the 4 left, so it waits, and "small" may not overtake it.
    scheduler = make_scheduler(impl.fill_token_budget, budget=64, num_blocks=6)
    add(scheduler, "running", 8, max_tokens=2)
    assert step(scheduler) == [("running", 8)]
    add(scheduler, "big", 20)
    add(scheduler, "small", 1)
    assert step(scheduler) == [("running", 1)], "FCFS: nobody overtakes a request that does not fit"
    assert step(scheduler) == [("big", 20), ("small", 1)], "once the running request finished, in arrival order"


def test_priority_policy_admits_the_most_urgent_first(impl):
    scheduler = make_scheduler(impl.fill_token_budget, budget=5, policy="priority")
    add(scheduler, "low", 3, priority=2)
    add(scheduler, "high", 3, priority=0)
    add(scheduler, "mid", 3, priority=1)
    assert step(scheduler) == [("high", 3), ("mid", 2)]


def test_a_step_that_preempts_admits_nobody(impl):
    # 5 blocks of 2 tokens. a and b each take 2 blocks for their 4-token prompts: 1 block left.
    scheduler = make_scheduler(impl.fill_token_budget, budget=64, num_blocks=5, block_size=2, policy="priority")
    a = add(scheduler, "a", 4, priority=1)
    b = add(scheduler, "b", 4, priority=1)
    assert step(scheduler) == [("a", 4), ("b", 4)]
    add(scheduler, "c", 1, priority=0)  # the most urgent of all; its 1 block is free, so nobody is preempted for it
    # Both decodes need a third block: a takes the last free one, and b, the least urgent running
    # request, is preempted, which frees its 2 blocks. c would fit in them now, but a step that had
    # to preempt admits nobody.
    assert step(scheduler) == [("a", 1)]
    assert scheduler.num_preemptions == 1
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"] and scheduler.running == [a]
    assert "b" not in scheduler.block_tables.tables
    assert step(scheduler) == [("a", 1), ("c", 1)], "the next step admits again, the most urgent first"


def test_preemption_takes_the_least_urgent_and_keeps_the_more_urgent(impl):
    # 6 blocks of 2: three 3-token prompts take 2 blocks each and the 4th token fits in them. The
    # 5th token of each needs a third block, with none free: c, the newest, is preempted, and its
    # 2 blocks go to a and b.
    scheduler = make_scheduler(impl.fill_token_budget, budget=64, num_blocks=6, block_size=2)
    for rid in "abc":
        add(scheduler, rid, 3, max_tokens=10)
    assert step(scheduler) == [("a", 3), ("b", 3), ("c", 3)]
    assert step(scheduler) == [("a", 1), ("b", 1), ("c", 1)]
    assert step(scheduler) == [("a", 1), ("b", 1)], "c is preempted to make room for a and b"
    assert scheduler.num_preemptions == 1
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    assert scheduler.block_tables.allocator.num_free == 0


def run_lockstep(impl, seed: int) -> int:
    """One random workload through minillm's scheduler and through the learner's, step for step."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    config = dict(block_size=block_size, budget=rng.randint(1, 40), max_num_seqs=rng.randint(1, 6),
                  policy=rng.choice(["fcfs", "priority"]))
    requests = []
    for i in range(rng.randint(1, 8)):
        requests.append((f"r{i}", rng.randint(1, 40), rng.randint(1, 12), rng.randint(0, 5), rng.randint(0, 2)))
    largest = max(-(-(p + m) // block_size) for _, p, m, _, _ in requests)
    num_blocks = largest + rng.randint(0, 12)  # tight enough to preempt now and then
    watermark = rng.randint(0, max(0, num_blocks - largest))
    schedulers = {"minillm": make_scheduler(None, num_blocks=num_blocks, watermark=watermark, **config),
                  "yours": make_scheduler(impl.fill_token_budget, num_blocks=num_blocks, watermark=watermark, **config)}
    preemptions = 0
    for t in range(3000):
        for rid, prompt, max_tokens, arrival, priority in requests:
            if arrival == t:
                for scheduler in schedulers.values():
                    add(scheduler, rid, prompt, max_tokens, float(arrival),
                        priority if config["policy"] == "priority" else 0)
        expected = step(schedulers["minillm"], float(t))
        got = step(schedulers["yours"], float(t))
        where = f"seed {seed}, step {t}, {config}, num_blocks={num_blocks}, watermark={watermark}"
        assert got == expected, f"{where}: scheduled {got}, minillm's scheduler schedules {expected}"
        check_invariants(schedulers["yours"], got)
        preemptions = schedulers["minillm"].num_preemptions
        if t > 5 and not any(s.has_unfinished() for s in schedulers.values()):
            break
    else:
        pytest.fail(f"seed {seed}: the workload never finished")
    allocator = schedulers["yours"].block_tables.allocator
    assert allocator.num_free == allocator.num_blocks, "blocks left allocated after every request finished"
    return preemptions


def test_same_steps_as_minillm_on_random_workloads(impl):
    preempting = sum(run_lockstep(impl, seed) > 0 for seed in range(150))
    assert preempting > 10, "the random workloads should exercise preemption"


# -- the real engine ---------------------------------------------------------------------------------------

PROMPTS = [[5 + i + 7 * j for j in range(4 + 5 * i)] for i in range(6)]  # 4 .. 29 tokens


def run_engine(engine, max_steps=1000):
    """The prompts through the engine: outputs, and each step's (sequences, tokens)."""
    outputs = run_requests(engine, PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), max_steps)
    return outputs, [(s.num_seqs, s.num_tokens) for s in engine.stats]


def test_wired_into_minillm(impl):
    """Swap the step into a live engine: the same batches and greedy tokens as minillm's own."""
    probe = make_scheduler(impl.fill_token_budget)
    assert impl.fill_token_budget(probe, 0.0) == []  # before anything else: the stub raises here
    from minillm import LLM

    def make_engine():
        llm = LLM("tiny", load_format="dummy", dtype="float32", device="cpu", batching="continuous",
                  block_size=4, num_kv_blocks=20, max_num_batched_tokens=12, max_num_seqs=4)
        # Dummy weights give nearly flat logits; a scaled head makes every greedy choice decisive.
        llm.engine.model.lm_head.weight.mul_(30)
        return llm.engine

    reference = make_engine()
    expected, expected_work = run_engine(reference)
    assert reference.scheduler.num_preemptions > 0, "the workload should force preemption"
    assert max(n for _, n in expected_work) == 12, "the workload should fill the token budget (chunked prefill)"

    engine = make_engine()
    calls = []

    def counted(scheduler, now):
        calls.append(now)
        return impl.fill_token_budget(scheduler, now)

    engine.scheduler.fill_token_budget = counted  # an instance attribute: called as counted(scheduler, now)
    got, work = run_engine(engine)
    assert calls, "the engine never called the swapped-in fill_token_budget"
    assert work == expected_work, "different batches (sequences, tokens per step) from minillm's scheduler"
    assert engine.scheduler.num_preemptions == reference.scheduler.num_preemptions
    assert got == expected, "different greedy tokens from minillm's scheduler"
    allocator = engine.block_tables.allocator
    assert allocator.num_free == allocator.num_blocks and not engine.block_tables.tables
