"""What a user asks for and what they get back: SamplingParams, Request, RequestOutput.

Field names follow vLLM's offline API (``SamplingParams(max_tokens=..., temperature=...)``,
``out.outputs[0].text``) so code written for vLLM reads the same here. Bad parameters fail here,
with a ``ValueError`` naming the value, before any tensor work happens.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
import time
from dataclasses import dataclass, field


MAX_N = 128  # sequences per prompt at most (OpenAI's limit for n)
MAX_LOGPROBS = 20  # top log-probabilities per token at most (OpenAI's limit for top_logprobs)


def invalid(param: str, message: str) -> ValueError:
    """The ValueError for a bad parameter, carrying its name in ``param`` (a server puts it in its error reply)."""
    error = ValueError(message)
    error.param = param
    return error


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
    # More than one answer, and what shapes or reports each token (the OpenAI API's knobs, vLLM's names):
    n: int = 1  # sequences per prompt, sharing its KV blocks (continuous batching); seeded: sequence i uses seed + i
    presence_penalty: float = 0.0  # subtracted once from the logit of every token generated so far, in [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per occurrence from the logit of generated tokens, in [-2, 2]
    repetition_penalty: float = 1.0  # > 0; prompt and generated tokens' logits: positive / it, negative * it
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (after temperature), in [0, 1]
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    logprobs: int | None = None  # return this many top log-probabilities per generated token (plus its own), <= 20
    prompt_logprobs: int | None = None  # the same for every prompt token but the first (None there), <= 20

    def __post_init__(self):
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise invalid("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise invalid("temperature",
                          f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise invalid("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise invalid("top_k", f"top_k must be -1, 0 (both: off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise invalid("seed", f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise invalid("stop", f"stop strings must be non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise invalid("stop_token_ids", f"stop_token_ids must be integers, got {self.stop_token_ids!r}")
        self._check_scoring_params()

    def _check_scoring_params(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise invalid("n", f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise invalid(name, f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise invalid("repetition_penalty", f"repetition_penalty must be a finite number > 0 (1 = off), "
                                                f"got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise invalid("min_p", f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise invalid("logit_bias", f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise invalid("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                    raise invalid("logit_bias", f"logit_bias values must be numbers in [-100, 100], "
                                                f"got {bias!r} for token {token}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise invalid(name, f"{name} must be None or an integer in [0, {MAX_LOGPROBS}] (top log-probabilities "
                                    f"per token), got {value!r}")

    def check_engine(self, vocab_size: int, batching: str) -> None:
        """What these parameters cannot check alone: logit_bias's token ids against the model's vocabulary, and
        n > 1 against the batching mode (its sequences share the prompt's blocks of the paged KV cache)."""
        outside = [t for t in self.logit_bias or () if t >= vocab_size]
        if outside:
            raise invalid("logit_bias", f"logit_bias token ids must be in [0, {vocab_size}), got {outside}")
        if self.n > 1 and batching != "continuous":
            raise invalid("n", f"n={self.n} needs batching='continuous' (its sequences share the prompt's paged KV "
                               f"blocks); with batching={batching!r} use n=1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @functools.cached_property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias change this request's logits before any token is picked (``logits_processors``).
        Cached: the sampler asks it of every row in every step."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @functools.cached_property
    def one_token_at_a_time(self) -> bool:
        """Penalties count the tokens generated so far, and log-probabilities come back with every token: both
        need the host between two tokens, so such a request never runs several passes ahead (``multi_step.py``)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logprobs is not None)


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
class Logprob:
    """A token's log-probability: the log-softmax of the model's raw logits (fp32), before temperature, penalties,
    logit bias or any filter (vLLM's default, "raw logprobs"); ``rank`` 1 = the most likely token."""

    logprob: float
    rank: int
    decoded_token: str | None = None  # the token's text alone (None without a tokenizer)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # With SamplingParams.logprobs: per generated token, {token id: Logprob} for the token and the top ones.
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None  # the sum of the generated tokens' log-probabilities


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # SamplingParams.n of them, index 0..n-1
    finished: bool
    metrics: RequestMetrics
    # With SamplingParams.prompt_logprobs: per prompt token, as CompletionOutput.logprobs; None for the first.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
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
        self.index = 0  # which of its prompt's n sequences this is (``sequence_group.py``)
        self.shares_prompt_of: Request | None = None  # n > 1: the sequence whose prompt blocks it shares
        # Asked-for log-probabilities so far (``logprobs.py`` appends them); None when not asked for.
        self.logprobs: list[dict[int, Logprob]] | None = None if params.logprobs is None else []
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = \
            None if params.prompt_logprobs is None else [None]  # the first prompt token has none

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
        prompt_logprobs = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [self.completion(text)],
                             self.finished, self.metrics, prompt_logprobs, self.num_cached_tokens)

    def completion(self, text: str | None = None) -> CompletionOutput:
        """This sequence's part of the output, a snapshot; ``text`` overrides the cumulative text."""
        text = self.text if text is None else text
        if not self.finished and self.params.stop:
            # A stop string may still complete: hold back what could be its start (as vLLM does),
            # so a stream never shows text that the finished output will not contain.
            text = text[: max(0, len(text) - (max(map(len, self.params.stop)) - 1))]
        logprobs, cumulative = None, None
        if self.logprobs is not None:
            logprobs, cumulative = list(self.logprobs), self.cumulative_logprob
        return CompletionOutput(self.index, text, list(self.output_token_ids), self.finish_reason, self.stop_reason,
                                logprobs, cumulative)


def output_budget(request: Request, max_model_len: int) -> int:
    """Tokens this request may generate in all: its max_tokens, capped so prompt + output fits."""
    return min(request.params.max_tokens, max_model_len - request.num_prompt_tokens)
