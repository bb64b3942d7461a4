"""The ``multi-turn`` workload: concurrent chats in a closed loop, each turn sent after the last one's answer.

Why: chat is what prefix caching is for, and only a closed loop shows it. A chat's next prompt is its
history, then the answer the model really gave, then the user's new message, and the user sends it only
after reading that answer: by then the previous turn's prompt and answer are computed and cached, and the
new turn prefills only what is new. A list of turns made in advance (``multi-turn-open`` in
``workloads.py``) has neither: its answers are stand-ins, and every turn arrives at t = 0, before the
turn it follows has been answered.

Here ``num_chats`` chats run at once through the engine's own API (``add_request`` / ``step``): a chat's
turn k + 1 is added when turn k has finished, ``think_time`` seconds later, and its arrival time is that
moment, so TTFT counts any wait for the engine. ``next_turn_prompt`` is the one rule that makes a turn,
a pure function the online client can share.

Two hit rates come out, and they must agree where nothing was evicted or preempted: the engine's (its
prefix cache's ``queries`` / ``hits``, and ``num_cached_tokens`` per request) and the transcript's own
``shared_token_fraction`` — the prompt tokens, in whole blocks, that equal the start of a request that had
already finished (its prompt and answer, but the answer's last token, whose K/V are never computed),
never counting a prompt's last token (computed again for its logits), as every block-granular prefix
cache does.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from dataclasses import dataclass

from tqdm.auto import tqdm

from minillm.bench.metrics import RequestTiming, serving_metrics
from minillm.bench.workloads import WorkloadRequest, random_tokens
from minillm.request import RequestOutput, SamplingParams

# scale -> (num_chats, num_turns, message_tokens: each user message, max_tokens: each answer); BENCHMARKS.md's.
SIZES = {"gpu": (64, 4, 64, 64), "cpu": (8, 4, 64, 64)}


@dataclass
class ChatScript:
    """What the users will say: chat c's turn k message is ``messages[c][k]``; every answer is
    ``max_tokens`` long (greedy, EOS ignored, so the work does not depend on the weights)."""

    messages: list[list[list[int]]]
    max_tokens: int
    think_time: float = 0.0  # seconds between an answer and the next turn

    @property
    def num_chats(self) -> int:
        return len(self.messages)

    @property
    def num_turns(self) -> int:
        return len(self.messages[0])

    def first_turns(self) -> list[WorkloadRequest]:
        """Every chat's first turn as a plain request (a warm-up knows nothing more in advance)."""
        return [WorkloadRequest(next_turn_prompt([], [], chat[0]), self.max_tokens) for chat in self.messages]


def make_chats(scale: str = "gpu", num_chats: int | None = None, seed: int = 0, vocab_size: int = 32000,
               think_time: float = 0.0, num_turns: int | None = None, message_tokens: int | None = None,
               max_tokens: int | None = None) -> ChatScript:
    """The seeded chats of ``multi-turn`` at a scale (``SIZES``); any size can be overridden."""
    if scale not in SIZES:
        raise ValueError(f"scale must be 'gpu' or 'cpu', got {scale!r}")
    given = dict(num_chats=num_chats, num_turns=num_turns, message_tokens=message_tokens, max_tokens=max_tokens)
    sizes = {name: default if given[name] is None else given[name] for name, default in zip(given, SIZES[scale])}
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(think_time, bool) or not isinstance(think_time, (int, float)) or not 0 <= think_time < math.inf:
        raise ValueError(f"think_time must be a finite number of seconds >= 0, got {think_time!r}")
    rng = random.Random(f"multi-turn-{seed}")
    messages = [[random_tokens(rng, sizes["message_tokens"], vocab_size) for _ in range(sizes["num_turns"])]
                for _ in range(sizes["num_chats"])]
    return ChatScript(messages, sizes["max_tokens"], think_time)


def next_turn_prompt(previous_prompt: list[int], answer: list[int], user_message: list[int]) -> list[int]:
    """A chat's next prompt: the previous prompt, the answer it got, then the user's new message (the first
    turn: empty history and answer)."""
    return [*previous_prompt, *answer, *user_message]


class FinishedPrefixes:
    """The whole-block prefixes of finished requests, as a trie of blocks: what a block-granular prefix
    cache that never evicts would hold, computed from the transcript alone."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.root: dict = {}

    def add(self, prompt: list[int], answer: list[int]) -> None:
        """A request finished: its K/V cover the prompt and the answer but its last token."""
        tokens, node, bs = prompt + answer[:-1], self.root, self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            node = node.setdefault(tuple(tokens[start:start + bs]), {})

    def shared_tokens(self, prompt: list[int]) -> int:
        """Tokens at the start of ``prompt`` found here, in whole blocks, the last token excluded."""
        node, bs, found = self.root, self.block_size, 0
        while found + bs <= len(prompt) - 1:
            node = node.get(tuple(prompt[found:found + bs]))
            if node is None:
                break
            found += bs
        return found


@dataclass
class ChatTurn:
    chat: int
    turn: int
    output: RequestOutput
    shared_tokens: int  # of its prompt, equal to an already finished request's start (FinishedPrefixes)


@dataclass
class ChatRun:
    turns: list[ChatTurn]  # by chat, then turn
    duration: float  # seconds from the first turns' arrival to the last answer

    def timings(self) -> list[RequestTiming]:
        return [RequestTiming(t.output.metrics.arrival_time, t.output.metrics.token_times,
                              len(t.output.prompt_token_ids)) for t in self.turns]

    def token_ids(self) -> list[list[int]]:
        return [t.output.outputs[0].token_ids for t in self.turns]


def run_chats(engine, script: ChatScript, use_tqdm: bool = True) -> ChatRun:
    """Drive ``engine`` (continuous batching) through the chats, in a closed loop; the transcript."""
    if engine.config.batching != "continuous":
        raise ValueError(f"multi-turn chats run on continuous batching, the engine has {engine.config.batching!r}")
    params = SamplingParams(max_tokens=script.max_tokens, temperature=0.0, ignore_eos=True)
    finished = FinishedPrefixes(engine.config.block_size)
    prompts: list[list[int]] = [[] for _ in range(script.num_chats)]
    answers: list[list[int]] = [[] for _ in range(script.num_chats)]
    in_flight: dict[str, tuple[int, int, int]] = {}  # request id -> (chat, turn, shared tokens)
    done: list[ChatTurn] = []
    start = time.perf_counter()
    due = [(start, chat, 0) for chat in range(script.num_chats)]  # (when a turn is sent, chat, turn): a heap
    bar = tqdm(total=script.num_chats * script.num_turns, desc="chat turns", unit="turn", disable=not use_tqdm)
    while due or in_flight:
        while due and due[0][0] <= time.perf_counter():
            sent, chat, turn = heapq.heappop(due)
            prompts[chat] = next_turn_prompt(prompts[chat], answers[chat], script.messages[chat][turn])
            request_id = engine.add_request(prompts[chat], params, arrival_time=sent)
            in_flight[request_id] = (chat, turn, finished.shared_tokens(prompts[chat]))
        if not in_flight:  # every chat is thinking
            time.sleep(max(0.0, due[0][0] - time.perf_counter()))
            continue
        for output in engine.step():
            if not output.finished:
                continue
            chat, turn, shared = in_flight.pop(output.request_id)
            answers[chat] = output.outputs[0].token_ids
            finished.add(prompts[chat], answers[chat])
            done.append(ChatTurn(chat, turn, output, shared))
            bar.update()
            if turn + 1 < script.num_turns:
                heapq.heappush(due, (output.metrics.finished_time + script.think_time, chat, turn + 1))
    bar.close()
    duration = max(t.output.metrics.finished_time for t in done) - start
    return ChatRun(sorted(done, key=lambda t: (t.chat, t.turn)), duration)


def _fraction(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def chat_metrics(run: ChatRun) -> dict:
    """Per turn index and overall: the prefix hits the engine reported per request (``num_cached_tokens``),
    the transcript's shared-token fraction, mean TTFT and output throughput (a turn's output tokens over
    the time from its first arrival to its last answer)."""
    per_turn = []
    for index in sorted({t.turn for t in run.turns}):
        turns = [t for t in run.turns if t.turn == index]
        prompt = sum(len(t.output.prompt_token_ids) for t in turns)
        span = (max(t.output.metrics.finished_time for t in turns)
                - min(t.output.metrics.arrival_time for t in turns))
        per_turn.append({
            "turn": index, "requests": len(turns), "mean_prompt_tokens": prompt / len(turns),
            "cached_token_fraction": _fraction(sum(t.output.num_cached_tokens for t in turns), prompt),
            "shared_token_fraction": _fraction(sum(t.shared_tokens for t in turns), prompt),
            "mean_ttft_ms": 1000 * sum(t.output.metrics.ttft for t in turns) / len(turns),
            "output_throughput": sum(len(t.output.outputs[0].token_ids) for t in turns) / span})
    prompt = sum(len(t.output.prompt_token_ids) for t in run.turns)
    return {"num_chats": len({t.chat for t in run.turns}), "num_turns": len(per_turn),
            "cached_token_fraction": _fraction(sum(t.output.num_cached_tokens for t in run.turns), prompt),
            "shared_token_fraction": _fraction(sum(t.shared_tokens for t in run.turns), prompt),
            "turns": per_turn}


def chat_run_metrics(run: ChatRun) -> dict:
    """vLLM's serving metrics of every turn as one request each, with ``chat_metrics``."""
    return serving_metrics(run.timings(), run.duration) | chat_metrics(run)


def format_turns(runs: dict[str, dict]) -> str:
    """One table of every run's turns: prompt tokens, cached (the engine's hits) and shared (the
    transcript's) fractions, mean TTFT, output throughput."""
    width = max(map(len, runs)) + 2
    lines = [f"{'by turn':<{width}}{'turn':>5}{'prompt':>8}{'cached':>8}{'shared':>8}{'TTFT ms':>10}{'out tok/s':>11}"]
    for name, metrics in runs.items():
        for t in metrics["turns"]:
            lines.append(f"{name:<{width}}{t['turn'] + 1:>5}{t['mean_prompt_tokens']:>8.0f}"
                         f"{t['cached_token_fraction']:>8.1%}{t['shared_token_fraction']:>8.1%}"
                         f"{t['mean_ttft_ms']:>10.1f}{t['output_throughput']:>11.1f}")
    return "\n".join(lines)
