"""What a user asks for and what they get back: SamplingParams, Request, RequestOutput.

Field names follow vLLM's offline API (``SamplingParams(max_tokens=..., temperature=...)``,
``out.outputs[0].text``) so code written for vLLM reads the same here. Bad parameters fail here
(``minillm/validation.py``), with a ``ValueError`` naming the value, before any tensor work happens.
"""

from __future__ import annotations

import enum
import functools
import itertools
import time
from dataclasses import dataclass, field

from minillm.validation import (InvalidArgument, InvalidArgumentType, check_bool, check_float, check_int,
                                check_strings, check_token_ids, describe)

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (vLLM's threshold): dividing by 1e-40 overflows
SEED_RANGE = (-2**63, 2**64)  # what torch.Generator.manual_seed takes (a negative seed wraps modulo 2**64)
MAX_N = 128  # sequences per prompt at most (OpenAI's limit for n)
MAX_LOGPROBS = 20  # top log-probabilities per token at most (OpenAI's limit for top_logprobs)


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
            n=check_int("n", self.n, minimum=1, below=MAX_N + 1, valid=f"an integer in [1, {MAX_N}]"),
            presence_penalty=check_float("presence_penalty", self.presence_penalty, minimum=-2.0, maximum=2.0,
                                         valid="a number in [-2, 2]"),
            frequency_penalty=check_float("frequency_penalty", self.frequency_penalty, minimum=-2.0, maximum=2.0,
                                          valid="a number in [-2, 2]"),
            repetition_penalty=check_float("repetition_penalty", self.repetition_penalty, above=0.0,
                                           valid="a finite number > 0 (1 = off)"),
            min_p=check_float("min_p", self.min_p, minimum=0.0, maximum=1.0, valid="a number in [0, 1]"),
            logit_bias=self._checked_logit_bias(),
            logprobs=self._checked_logprobs("logprobs"),
            prompt_logprobs=self._checked_logprobs("prompt_logprobs"),
        )
        for name, value in checked.items():  # numpy numbers become Python ones, lists tuples
            object.__setattr__(self, name, value)

    def _checked_logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        if not isinstance(self.logit_bias, dict):
            raise InvalidArgumentType("logit_bias", f"logit_bias must be a dict of token id -> bias, "
                                                    f"got {describe(self.logit_bias)}")
        return {check_int("logit_bias", token, minimum=0, valid="a dict whose keys are token ids (integers >= 0)"):
                check_float("logit_bias", bias, minimum=-100.0, maximum=100.0,
                            valid="a dict whose values are numbers in [-100, 100]")
                for token, bias in self.logit_bias.items()}

    def _checked_logprobs(self, name: str) -> int | None:
        value = getattr(self, name)
        return None if value is None else check_int(
            name, value, minimum=0, below=MAX_LOGPROBS + 1,
            valid=f"None or an integer in [0, {MAX_LOGPROBS}] (top log-probabilities per token)")

    def check_engine(self, vocab_size: int, batching: str) -> None:
        """What these parameters cannot check alone: logit_bias's token ids against the model's vocabulary, and
        n > 1 against the batching mode (its sequences share the prompt's blocks of the paged KV cache)."""
        outside = [t for t in self.logit_bias or () if t >= vocab_size]
        if outside:
            raise InvalidArgument("logit_bias", f"logit_bias token ids must be in [0, {vocab_size}), got {outside}")
        if self.n > 1 and batching != "continuous":
            raise InvalidArgument("n", f"n={self.n} needs batching='continuous' (its sequences share the prompt's "
                                       f"paged KV blocks); with batching={batching!r} use n=1")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

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
