"""What a user asks for and what they get back: SamplingParams, Request, RequestOutput.

Field names follow vLLM's offline API (``SamplingParams(max_tokens=..., temperature=...)``,
``out.outputs[0].text``) so code written for vLLM reads the same here. Bad parameters fail here,
with a ``ValueError`` naming the value, before any tensor work happens.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


@dataclass
class SamplingParams:
    max_tokens: int = 16  # tokens to generate at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling: keep the smallest set with this much probability mass
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = all
    seed: int | None = None  # per-request generator, so results do not depend on batch mates
    stop: list[str] | str | None = None  # stop strings (not included in the output text)
    stop_token_ids: list[int] | None = None  # extra token ids that end generation
    ignore_eos: bool = False  # keep going past EOS (benchmarks with fixed output lengths)
    skip_special_tokens: bool = True

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (both: off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its K/V in CPU swap space; waits to be swapped back in
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.perf_counter`` seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token, for ITL

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1), vLLM's definition; None with fewer than 2 tokens."""
        n = len(self.token_times)
        if n < 2 or self.finished_time is None:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def itl(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was first admitted (vLLM's name)


_arrival_order = itertools.count()


class Request:
    """One request's state inside the engine. Only the engine mutates it."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, priority: int = 0, arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.metrics = RequestMetrics(arrival_time=time.perf_counter() if arrival_time is None else arrival_time)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache (paged engine)
        self.num_cached_tokens = 0  # of them, found in the prefix cache at its first admission
        self.num_preemptions = 0
        self.seq = next(_arrival_order)  # breaks ties between equal arrival times
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""  # detokenized output so far (stop strings already cut off)
        self.generator = None  # torch.Generator when params.seed is set (made by the sampler)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence (a decode
        step asks for one token of a sequence that may be thousands long)."""
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt):end - len(prompt)]
        return prompt[start:] + self.output_token_ids[:end - len(prompt)]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str, stop_reason: int | str | None = None, now: float | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.metrics.finished_time = time.perf_counter() if now is None else now

    def to_output(self, text: str | None = None) -> RequestOutput:
        """A snapshot; ``text`` overrides the cumulative text."""
        text = self.text if text is None else text
        if not self.finished and self.params.stop:
            # A stop string may still complete: hold back what could be its start (as vLLM does),
            # so a stream never shows text that the finished output will not contain.
            text = text[: max(0, len(text) - (max(map(len, self.params.stop)) - 1))]
        completion = CompletionOutput(0, text, list(self.output_token_ids), self.finish_reason, self.stop_reason)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion],
                             self.finished, self.metrics, self.num_cached_tokens)


def output_budget(request: Request, max_model_len: int) -> int:
    """Tokens this request may generate in all: its max_tokens, capped so prompt + output fits."""
    return min(request.params.max_tokens, max_model_len - request.num_prompt_tokens)
