"""Async scheduling (``EngineConfig.async_scheduling``, ``MultiStepScheduler.chain``): a pure decode batch's
successor is launched before its tokens are read. Greedy outputs equal solo runs under chunked prefill,
admission, preemption and multi-step passes; every chained batch stays within its requests' budgets and
has K/V blocks for every pass; the host reads a batch only after its successor is launched; arrivals,
aborts and stops end the chain, and every block comes back. (SmolLM2's outputs against synchronous
scheduling, stops of every kind, and any schedule of the tiny model's with these checks: test_multi_step.py.)"""

from __future__ import annotations

from unittest import mock

import pytest

from minillm import SamplingParams
from minillm.cli import build_parser
from minillm.cli_args import engine_kwargs
from minillm.config import EngineConfig
from minillm.multi_step import MultiStepScheduler
from minillm.request import output_budget
from test_continuous import check_outputs_equal_solo_runs, solo_output, tiny_engine


class ChainChecks:
    """Wraps the scheduler's ``chain``: each batch it chains continues the one in flight with the same
    requests, one token each, within every request's budget counting the tokens in flight, with blocks for
    every pass, and the allocator's count exact."""

    def __init__(self):
        self.num_steps: list[int] = []

        chain = MultiStepScheduler.chain

        def checked(scheduler, batch):
            chained = chain(scheduler, batch)
            if chained is not None:
                self.check(scheduler, batch, chained)
            return chained

        self.patch = mock.patch.object(MultiStepScheduler, "chain", checked)

    def check(self, scheduler, batch, chained) -> None:
        k, in_flight = chained.num_steps, chained.in_flight
        self.num_steps.append(k)
        assert 1 <= k <= scheduler.num_scheduler_steps and in_flight == batch.num_steps
        assert chained.requests == batch.requests and chained.num_new_tokens == [1] * len(batch.requests)
        assert not scheduler.waiting
        tables = scheduler.block_tables
        if scheduler.prefix_cache is None:
            held = sum(map(len, tables.tables.values()))
            assert tables.allocator.num_free + held == tables.allocator.num_blocks
        for request in chained.requests:
            assert request.num_computed_tokens == request.num_tokens - 1  # the host has not read `batch`
            assert len(request.output_token_ids) + in_flight + k <= output_budget(request, scheduler.max_model_len)
            # The last pass writes position num_tokens - 1 + in_flight + k - 1.
            assert len(tables.tables[request.request_id]) * tables.block_size >= request.num_tokens + in_flight + k - 1


@pytest.mark.parametrize("k", [1, 3])
def test_preemption_and_arrivals_with_chains_equal_solo_runs(k):
    """Seven requests, three slots, chunked prefill, a cache that forces preemption, staggered arrivals: chains
    form between the scheduler's decisions, and some are cut short by budgets."""
    requests = [((5, 17, 42, 99, 7), 13, 0), ((3,), 9, 0), (tuple(range(250, 264)), 17, 0), ((8, 9), 5, 0),
                (tuple(range(20, 31)), 11, 0), ((77, 78, 79), 21, 0), ((140,) * 7, 3, 0)]
    checks = ChainChecks()
    with checks.patch:
        engine = check_outputs_equal_solo_runs(requests, block_size=2, token_budget=6, spare_blocks=2, policy="fcfs",
                                               arrivals=[0, 0, 0, 1, 2, 4, 9], max_num_seqs=3,
                                               num_scheduler_steps=k, max_model_len=64, async_scheduling=True)
    assert engine.scheduler.num_preemptions > 0
    assert len(checks.num_steps) >= 3, checks.num_steps  # (16 chained batches at k = 1, 4 at k = 3)
    if k > 1:
        assert any(n < k for n in checks.num_steps), checks.num_steps


def test_the_host_reads_a_batch_after_launching_its_successor():
    """One request decoding 12 tokens, one pass a batch: batch t's tokens are read (postprocessed) only after
    batch t + 1 is launched, fed batch t's last tokens on the device, except for the last."""
    engine = tiny_engine(batching="continuous")
    assert engine.config.async_scheduling  # the default where it can run
    events = []
    launch, postprocess = engine.runner.launch_steps, engine._postprocess_passes

    def launched(batch, first_ids=None):
        events.append(("launch", first_ids is not None))
        return launch(batch, first_ids)

    def read(batch, passes):
        events.append(("read", len(passes)))
        return postprocess(batch, passes)

    with mock.patch.object(engine.runner, "launch_steps", launched), \
            mock.patch.object(engine, "_postprocess_passes", read):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), request_id="a")
        outputs = {}
        while engine.has_unfinished():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outputs["a"].outputs[0].token_ids == solo_output((5, 6, 7), 12)
    # The prefill samples token 1 synchronously; tokens 2..12 come from 11 decode batches, 10 of them chained.
    assert events == [("launch", False), ("launch", True)] + [("read", 1), ("launch", True)] * 9 + [("read", 1)] * 2
    assert engine._in_flight is None
    assert engine.block_tables.allocator.num_free == engine.block_tables.allocator.num_blocks


def test_an_arrival_ends_the_chain_and_is_admitted_next():
    engine = tiny_engine(batching="continuous", num_scheduler_steps=2)
    params = SamplingParams(max_tokens=15, temperature=0, ignore_eos=True)
    engine.add_request([5, 6, 7], params, request_id="a")
    finished = {}
    for _ in range(4):  # the prefill, then chained decode batches
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine._in_flight is not None
    engine.add_request([40, 41], params, request_id="b")
    engine.step()  # reads the batch in flight and chains nothing: b waits for the scheduler
    assert engine._in_flight is None and engine.requests["b"].num_computed_tokens == 0
    engine.step()  # the scheduler admits b
    assert engine.requests["b"].num_computed_tokens > 0
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["a"].outputs[0].token_ids == solo_output((5, 6, 7), 15)
    assert finished["b"].outputs[0].token_ids == solo_output((40, 41), 15)
    assert engine.block_tables.allocator.num_free == engine.block_tables.allocator.num_blocks


def test_an_abort_while_in_flight_drops_its_tokens_and_frees_its_blocks():
    engine = tiny_engine(batching="continuous")
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request([5, 6, 7], params, request_id="a")
    engine.add_request([100, 3], params, request_id="b")
    for _ in range(5):
        engine.step()
    assert engine._in_flight is not None
    aborted = engine.abort("a")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    kept = list(aborted.outputs[0].token_ids)
    finished = {}
    while engine.has_unfinished():
        outputs = engine.step()
        assert all(o.request_id != "a" for o in outputs)
        finished.update({o.request_id: o for o in outputs if o.finished})
    assert engine.requests.get("a") is None and len(kept) < 20
    assert finished["b"].outputs[0].token_ids == solo_output((100, 3), 20)
    assert engine.block_tables.allocator.num_free == engine.block_tables.allocator.num_blocks


def test_config_says_where_async_scheduling_runs():
    assert EngineConfig(model="tiny", batching="continuous").async_scheduling is True
    assert EngineConfig(model="tiny", batching="static").async_scheduling is False
    assert EngineConfig(model="tiny", batching="continuous", async_scheduling=False).async_scheduling is False
    with pytest.raises(ValueError, match="batching='continuous' in one process"):
        EngineConfig(model="tiny", batching="static", async_scheduling=True)
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        EngineConfig(model="tiny", batching="continuous", tensor_parallel_size=2, async_scheduling=True)
    with pytest.raises(ValueError, match="True, False or None"):
        EngineConfig(model="tiny", batching="continuous", async_scheduling="yes")
    for flags, value in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        args = build_parser().parse_args(["bench", "latency", "--batching", "continuous", *flags])
        assert engine_kwargs(args)["async_scheduling"] is value
