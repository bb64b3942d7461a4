"""What a user asks for and what they get back: SamplingParams, Request, RequestOutput.

Field names follow vLLM's offline API (``SamplingParams(max_tokens=..., temperature=...)``,
``out.outputs[0].text``) so code written for vLLM reads the same here. Bad parameters fail here
(``minillm/validation.py``), with a ``ValueError`` naming the value, before any tensor work happens.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from minillm.validation import check_bool, check_float, check_int, check_strings, check_token_ids

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (vLLM's threshold): dividing by 1e-40 overflows
SEED_RANGE = (-2**63, 2**64)  # what torch.Generator.manual_seed takes (a negative seed wraps modulo 2**64)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop. Checked when built, and frozen after: change one
    with ``dataclasses.replace(params, max_tokens=64)``, which checks again.

    ``temperature`` 0, or any value below ``GREEDY_BELOW`` (1e-5), is greedy: the argmax, as in vLLM.
    ``seed`` is an integer in [-2**63, 2**64), the range of ``torch.Generator``. ``stop`` and
    ``stop_token_ids`` come back as tuples. Bad values raise a ``ValueError`` (a ``TypeError`` too when
    the type is wrong) naming the field, the value and what would be valid.
    """

    max_tokens: int = 16  # tokens to generate at most
    temperature: float = 1.0  # 0 (or below 1e-5) = greedy
    top_p: float = 1.0  # nucleus sampling: keep the smallest set with this much probability mass
    top_k: int = 0  # keep the k most likely tokens; 0 or -1 = all
    seed: int | None = None  # per-request generator, so results do not depend on batch mates
    stop: tuple[str, ...] | list[str] | str | None = None  # stop strings (not included in the output text)
    stop_token_ids: tuple[int, ...] | list[int] | None = None  # extra token ids that end generation
    ignore_eos: bool = False  # keep going past EOS (benchmarks with fixed output lengths)
    skip_special_tokens: bool = True

    def __post_init__(self):
        checked = dict(
            max_tokens=check_int("max_tokens", self.max_tokens, minimum=1, valid="a positive integer"),
            temperature=check_float("temperature", self.temperature, minimum=0.0,
                                    valid="a finite number >= 0 (0 = greedy)"),
            top_p=check_float("top_p", self.top_p, above=0.0, maximum=1.0, valid="a number in (0, 1]"),
            top_k=check_int("top_k", self.top_k, minimum=-1, valid="-1, 0 (both: off) or a positive integer"),
            seed=None if self.seed is None else check_int("seed", self.seed, minimum=SEED_RANGE[0], below=SEED_RANGE[1],
                                                          valid="None or an integer in [-2**63, 2**64)"),
            stop=check_strings("stop", self.stop),
            stop_token_ids=tuple(check_token_ids("stop_token_ids", [] if self.stop_token_ids is None
                                                 else self.stop_token_ids)),
            ignore_eos=check_bool("ignore_eos", self.ignore_eos),
            skip_special_tokens=check_bool("skip_special_tokens", self.skip_special_tokens),
        )
        for name, value in checked.items():  # numpy numbers become Python ones, lists tuples
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


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
                             self.finished, self.metrics)


def output_budget(request: Request, max_model_len: int) -> int:
    """Tokens this request may generate in all: its max_tokens, capped so prompt + output fits."""
    return min(request.params.max_tokens, max_model_len - request.num_prompt_tokens)
