"""Drive a real engine through a list of prompts, step by step, for the exercises' wired-in tests.

Step by step rather than ``LLM.generate``: a learner's broken piece could stall the engine, and a
test should then fail with a message, not hang."""

from __future__ import annotations


def run_requests(engine, prompts, params, max_steps: int = 1000) -> list[list[int]]:
    """Add every prompt (request ids "0", "1", ...), step until all finish; each one's output tokens."""
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(index))
    finished, steps = {}, 0
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
        assert steps < max_steps, "the engine stopped making progress"
    return [finished[str(i)].outputs[0].token_ids for i in range(len(prompts))]
