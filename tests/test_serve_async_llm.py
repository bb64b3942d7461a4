"""AsyncLLM: streams from async code equal the offline engine's outputs; a consumer that leaves aborts its
request and frees its blocks; the waiting queue is bounded and loses nothing; the step hook sees every step;
an engine failure costs only the requests of that step; shutdown finishes or aborts what is in flight."""

from __future__ import annotations

import asyncio

import pytest

from minillm import LLM, SamplingParams
from minillm.serve import AsyncLLM, EngineShutdownError, QueueFullError
from serving import (ENGINE_KWARGS, async_llm, engine_paused, make_async_llm, tiny_chat_model_dir,  # noqa: F401
                     wait_for_empty_engine, wait_until)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


async def collect(llm: AsyncLLM, prompt, params) -> list:
    return [output async for output in llm.generate(prompt, params)]


def test_concurrent_streams_equal_the_offline_engine(async_llm, tiny_chat_model_dir):
    offline = LLM(str(tiny_chat_model_dir), **ENGINE_KWARGS).generate(PROMPTS, greedy(12), use_tqdm=False)

    async def main():
        return await asyncio.gather(*(collect(async_llm, p, greedy(12)) for p in PROMPTS))

    for streamed, expected in zip(asyncio.run(main()), offline):
        last = streamed[-1]
        assert last.finished and all(not o.finished for o in streamed[:-1])
        assert last.outputs[0].token_ids == expected.outputs[0].token_ids
        assert last.outputs[0].text == expected.outputs[0].text and len(expected.outputs[0].token_ids) == 12
        for before, after in zip(streamed, streamed[1:]):  # cumulative: each output extends the one before
            assert after.outputs[0].token_ids[:len(before.outputs[0].token_ids)] == before.outputs[0].token_ids
            assert after.outputs[0].text.startswith(before.outputs[0].text)
    wait_for_empty_engine(async_llm)


def test_leaving_a_stream_early_aborts_and_frees_blocks(async_llm):
    async def main():
        seen = 0
        async for output in async_llm.generate(PROMPTS[0], greedy(400)):
            seen = len(output.outputs[0].token_ids)
            if seen >= 3:
                break
        return seen

    assert asyncio.run(main()) >= 3
    wait_for_empty_engine(async_llm)


def test_cancelling_the_consumer_task_aborts(async_llm):
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in async_llm.generate(PROMPTS[1], greedy(400)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        assert async_llm.num_running == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_for_empty_engine(async_llm)


def test_full_waiting_queue_refuses_at_once_and_loses_nothing(async_llm):
    async_llm.max_waiting_requests = 2

    async def main():
        with engine_paused(async_llm):
            queued = [asyncio.create_task(collect(async_llm, p, greedy(5))) for p in PROMPTS[:2]]
            await asyncio.to_thread(wait_until, lambda: async_llm.num_waiting == 2)
            with pytest.raises(QueueFullError, match="max_waiting_requests=2"):
                await async_llm.add_request(PROMPTS[2], greedy(5))
        return await asyncio.gather(*queued)

    try:
        finished = asyncio.run(main())
    finally:
        async_llm.max_waiting_requests = None
    assert [len(outputs[-1].outputs[0].token_ids) for outputs in finished] == [5, 5]
    assert all(outputs[-1].outputs[0].finish_reason == "length" for outputs in finished)
    wait_for_empty_engine(async_llm)


def test_arrival_is_when_the_request_was_added(async_llm):
    """The time a request waits for the engine thread (busy with a step) counts in its queue time and TTFT."""
    async def main():
        with engine_paused(async_llm):
            first = asyncio.create_task(collect(async_llm, PROMPTS[0], greedy(2)))
            await asyncio.to_thread(wait_until, lambda: async_llm.num_waiting == 1 and not async_llm._commands)
            second = asyncio.create_task(collect(async_llm, PROMPTS[1], greedy(2)))  # queued behind the held step
            await asyncio.sleep(0.3)
        return await first, await second

    _, second = asyncio.run(main())
    metrics = second[-1].metrics
    assert metrics.time_in_queue >= 0.3 and metrics.ttft >= metrics.time_in_queue


def test_bad_input_raises_where_it_is_awaited(async_llm):
    async def main():
        with pytest.raises(ValueError, match="max_model_len"):
            await async_llm.add_request(list(range(5, 5 + async_llm.max_model_len)), greedy(4))
        with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
            await async_llm.add_request(PROMPTS[0], {"max_tokens": 4})

    asyncio.run(main())
    assert async_llm.is_running
    wait_for_empty_engine(async_llm)


def test_step_callbacks_see_every_step(async_llm):
    seen = []
    async_llm.step_callbacks.append(lambda stats, outputs: seen.append((stats, outputs)))
    try:
        outputs = asyncio.run(collect(async_llm, PROMPTS[2], greedy(6)))
    finally:
        async_llm.step_callbacks.clear()
    steps = [stats for stats, _ in seen if stats is not None]
    prompt_len = len(outputs[-1].prompt_token_ids)
    assert sum(s.num_tokens for s in steps) == prompt_len + 6 - 1  # the prompt, then one token per decode
    assert all(s.num_seqs == 1 and 0 <= s.kv_usage <= 1 for s in steps)
    assert steps[0].kv_usage > 0 and steps[-1].kv_usage == 0  # blocks held while it runs, freed when it ends
    delivered = [o for _, step_outputs in seen for o in step_outputs]
    assert delivered[-1].finished and delivered[-1].outputs[0].token_ids == outputs[-1].outputs[0].token_ids


def test_a_failing_step_fails_its_batch_and_the_loop_goes_on(make_async_llm, monkeypatch):
    llm = make_async_llm(max_num_seqs=1)  # one request runs, the next waits outside the batch
    step, failed = llm.engine.step, []

    def failing_on_the_third_step():
        if len(llm.engine.stats) == 2 and not failed:
            failed.append(True)
            raise RuntimeError("injected failure")
        return step()

    monkeypatch.setattr(llm.engine, "step", failing_on_the_third_step)

    async def main():
        return await asyncio.gather(*(collect(llm, p, greedy(8)) for p in PROMPTS[:2]), return_exceptions=True)

    running, waiting = asyncio.run(main())
    assert isinstance(running, RuntimeError) and "injected failure" in str(running)
    assert waiting[-1].finished and len(waiting[-1].outputs[0].token_ids) == 8
    wait_for_empty_engine(llm)
    monkeypatch.undo()
    outputs = asyncio.run(collect(llm, PROMPTS[0], greedy(8)))
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 8


def test_a_step_that_fails_before_any_batch_fails_everything_without_spinning(make_async_llm, monkeypatch):
    llm = make_async_llm(max_num_seqs=1)

    def broken():
        raise RuntimeError("broken scheduler")

    monkeypatch.setattr(llm.engine, "step", broken)

    async def main():
        return await asyncio.gather(*(collect(llm, p, greedy(4)) for p in PROMPTS[:3]), return_exceptions=True)

    assert all(isinstance(result, RuntimeError) for result in asyncio.run(main()))
    wait_for_empty_engine(llm)
    assert llm.is_running


def test_graceful_shutdown_finishes_in_flight_requests(make_async_llm):
    llm = make_async_llm()

    async def main():
        streams = [asyncio.create_task(collect(llm, p, greedy(10))) for p in PROMPTS]
        await asyncio.to_thread(wait_until, lambda: llm.num_running == len(PROMPTS))
        await asyncio.to_thread(llm.shutdown, None)
        with pytest.raises(EngineShutdownError):
            await llm.add_request(PROMPTS[0], greedy(2))
        return await asyncio.gather(*streams)

    for outputs in asyncio.run(main()):
        assert outputs[-1].outputs[0].finish_reason == "length" and len(outputs[-1].outputs[0].token_ids) == 10
    assert not llm.is_running


def test_shutdown_with_no_time_aborts_in_flight_requests(make_async_llm):
    llm = make_async_llm()

    async def main():
        streams = [asyncio.create_task(collect(llm, p, greedy(400))) for p in PROMPTS]
        await asyncio.to_thread(wait_until, lambda: llm.num_running == len(PROMPTS))
        await asyncio.to_thread(llm.shutdown, 0)
        return await asyncio.gather(*streams)

    for outputs in asyncio.run(main()):
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        assert len(outputs[-1].outputs[0].token_ids) < 400
    allocator = llm.engine.block_tables.allocator
    assert allocator.num_free == allocator.num_blocks and not llm.engine.requests


def test_bad_max_waiting_requests(tiny_llm):
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"max_waiting_requests.*{bad!r}"):
            AsyncLLM.from_llm(tiny_llm, max_waiting_requests=bad)
