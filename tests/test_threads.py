"""One LLM shared by several threads: its lock serialises their calls, so every call gets exactly the
outputs it gets alone, with static and with continuous batching, greedy and seeded, over many runs
(without the lock, threads stepping one engine at once corrupt each other's batches)."""

from __future__ import annotations

import threading

import pytest

from minillm import LLM, SamplingParams

REPETITIONS = 20
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=seed, ignore_eos=True)


# Each thread's calls, in order: (method, prompt or messages, sampling params). Mixed prompts: text, token
# ids, dicts, chats, streams; several prompts per call, greedy and seeded side by side.
CALLS = [
    [("generate", ["The capital of France is", "def fibonacci(n):"], [GREEDY, seeded(1)]),
     ("stream", "Once upon a time", GREEDY)],
    [("chat", [{"role": "user", "content": "Name a color."}], seeded(2)),
     ("generate", [[5, 9, 40, 41, 77], {"prompt": "Red, green"}], GREEDY)],
    [("stream", "def fibonacci(n): return", seeded(3)),
     ("generate", [{"prompt_token_ids": [12, 13, 14]}, "a small model"], [seeded(4), GREEDY])],
    [("generate", ["Paris.", "The capital", "n - 1"], [seeded(5), GREEDY, seeded(6)]),
     ("chat", [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
               [{"role": "user", "content": "Once upon"}]], GREEDY)],
]


def run_call(llm: LLM, method: str, prompt, params):
    """What a call returned, as plain data to compare: token ids and text of each output, or a stream's text."""
    if method == "stream":
        return "".join(llm.stream(prompt, params))
    outputs = llm.generate(prompt, params, use_tqdm=False) if method == "generate" else llm.chat(prompt, params)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]


@pytest.fixture(scope="module", params=["static", "continuous"])
def shared_llm(request, tiny_text_model_dir):
    llm = LLM(str(tiny_text_model_dir), dtype="float32", device="cpu", batching=request.param, max_model_len=64)
    # Streams share their steps with other threads' calls; a sharper head makes every argmax decisive, so a
    # different batch mate cannot flip a choice through float rounding.
    llm.engine.model.lm_head.weight.mul_(30)
    return llm


def test_threads_sharing_an_llm_get_their_solo_outputs(shared_llm):
    solo = [[run_call(shared_llm, *call) for call in calls] for calls in CALLS]
    assert all(len(outputs) == len(calls) for outputs, calls in zip(solo, CALLS))
    for repetition in range(REPETITIONS):
        results: list = [None] * len(CALLS)
        start = threading.Barrier(len(CALLS))

        def worker(index: int) -> None:
            start.wait()
            try:
                results[index] = [run_call(shared_llm, *call) for call in CALLS[index]]
            except BaseException as e:  # reported by the main thread
                results[index] = e

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(CALLS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads), f"a thread hangs (repetition {repetition})"
        for index, result in enumerate(results):
            if isinstance(result, BaseException):
                raise AssertionError(f"thread {index} raised in repetition {repetition}") from result
            assert result == solo[index], f"thread {index}, repetition {repetition}"
        assert not shared_llm.engine.requests and not shared_llm.engine.has_unfinished()


def test_a_suspended_stream_does_not_block_other_threads(shared_llm):
    prompt, other = "Once upon a time", ["The capital of France is", "Red, green"]
    alone = run_call(shared_llm, "stream", prompt, GREEDY), run_call(shared_llm, "generate", other, GREEDY)
    stream = shared_llm.stream(prompt, GREEDY)
    text = next(stream)  # the consumer pauses with its request in the engine
    result = []
    thread = threading.Thread(target=lambda: result.append(run_call(shared_llm, "generate", other, GREEDY)))
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive() and result == [alone[1]]
    assert text + "".join(stream) == alone[0]
    assert not shared_llm.engine.requests
