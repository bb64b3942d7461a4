"""Where the KV memory goes: tokens used against tokens reserved, contiguous cache vs paged cache.

The vLLM paper (Kwon et al., SOSP 2023, Fig. 2) found that servers which reserve one contiguous
slab of the longest allowed length per request fill only 20–40 % of their KV memory with tokens,
and that PagedAttention fills over 96 %. This module computes the same two fractions for the
requests a minillm run actually served (their prompt lengths and the output tokens they actually
generated), so the benchmark JSON and notebook 02 can state them next to the throughput.

The two layouts, as minillm builds them:

- **contiguous** (``StaticRunner``): every sequence of a static batch holds a row of
  ``max_model_len`` tokens from the batch's first step to its last, finished or not;
- **paged** (``PagedRunner``): a request holds ``ceil(tokens / block_size)`` blocks, grown as
  it generates and freed when it finishes.

"Used" is what the live requests need: a request with a prompt of ``p`` tokens counts ``p + k``
tokens once it has generated ``k`` (the engine in fact stores one fewer, the newest token's K/V
being computed in the next step; counting the whole length keeps the arithmetic plain and the same
as notebook 02). Two ways to add it up:

- **over time** (the headline, as vLLM's figure is an average over a run): every engine step of
  every request weighs the same; a request's step ``k = 1 .. outputs`` produces its ``k``-th token.
  The static batches are formed first come, first served, ``batch_size`` at a time, and a batch
  lives for its longest request's steps. The paged count is per request and so does not depend on
  the schedule; it leaves out chunked prefill and preemption, which the real engine may add.
- **at peak**: each request once, at its final length (prompt + all its outputs) — the upper
  bound of what it ever needs; the batch size does not enter.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServedRequest:
    """One request as it was served: its prompt length and the tokens it actually generated."""

    num_prompt_tokens: int
    num_output_tokens: int


@dataclass(frozen=True)
class Utilisation:
    """Tokens used against tokens reserved (token-steps for the over-time counts)."""

    used: int
    reserved: int

    @property
    def fraction(self) -> float:
        return self.used / self.reserved


def _check(requests: list[ServedRequest], **settings: int) -> None:
    for name, value in settings.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not requests:
        raise ValueError("no requests: utilisation needs at least one served request")
    for index, r in enumerate(requests):
        if r.num_prompt_tokens < 1 or r.num_output_tokens < 1:
            raise ValueError(f"request {index} has {r.num_prompt_tokens} prompt and {r.num_output_tokens} output "
                             f"tokens; both must be >= 1 (leave out requests that generated nothing)")
        total = r.num_prompt_tokens + r.num_output_tokens
        if "max_model_len" in settings and total > settings["max_model_len"]:
            raise ValueError(f"request {index} has {total} tokens, more than max_model_len="
                             f"{settings['max_model_len']}: it could not have been served")


def _length_after_each_step(r: ServedRequest) -> range:
    """The request's length (prompt + outputs so far) during each of its steps."""
    return range(r.num_prompt_tokens + 1, r.num_prompt_tokens + r.num_output_tokens + 1)


def _blocks_in_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size) * block_size


def contiguous_at_peak(requests: list[ServedRequest], max_model_len: int) -> Utilisation:
    """Each request at its final length against the ``max_model_len`` row it reserves."""
    _check(requests, max_model_len=max_model_len)
    used = sum(r.num_prompt_tokens + r.num_output_tokens for r in requests)
    return Utilisation(used, len(requests) * max_model_len)


def paged_at_peak(requests: list[ServedRequest], block_size: int) -> Utilisation:
    """Each request at its final length against the whole blocks that hold it."""
    _check(requests, block_size=block_size)
    lengths = [r.num_prompt_tokens + r.num_output_tokens for r in requests]
    return Utilisation(sum(lengths), sum(_blocks_in_tokens(n, block_size) for n in lengths))


def contiguous_over_time(requests: list[ServedRequest], max_model_len: int, batch_size: int) -> Utilisation:
    """Static batches of ``batch_size`` in order; each row reserves ``max_model_len`` tokens for
    every step of its batch, while only its request's steps use any (finished rows idle)."""
    _check(requests, max_model_len=max_model_len, batch_size=batch_size)
    used = reserved = 0
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        steps = max(r.num_output_tokens for r in batch)
        used += sum(sum(_length_after_each_step(r)) for r in batch)
        reserved += len(batch) * max_model_len * steps
    return Utilisation(used, reserved)


def paged_over_time(requests: list[ServedRequest], block_size: int) -> Utilisation:
    """Every step of every request: its length against the whole blocks holding it then."""
    _check(requests, block_size=block_size)
    used = reserved = 0
    for r in requests:
        for length in _length_after_each_step(r):
            used += length
            reserved += _blocks_in_tokens(length, block_size)
    return Utilisation(used, reserved)


def kv_memory_summary(requests: list[ServedRequest], *, max_model_len: int, block_size: int,
                      batch_size: int) -> dict:
    """The benchmark JSON's ``kv_memory`` entry: both layouts, over time (headline) and at peak."""
    peak_contiguous = contiguous_at_peak(requests, max_model_len)
    peak_paged = paged_at_peak(requests, block_size)
    return {
        "contiguous_utilisation": contiguous_over_time(requests, max_model_len, batch_size).fraction,
        "paged_utilisation": paged_over_time(requests, block_size).fraction,
        "contiguous_utilisation_at_peak": peak_contiguous.fraction,
        "paged_utilisation_at_peak": peak_paged.fraction,
        "used_tokens_at_peak": peak_contiguous.used,
        "contiguous_reserved_tokens_at_peak": peak_contiguous.reserved,
        "paged_reserved_tokens_at_peak": peak_paged.reserved,
        "num_requests": len(requests),
        "max_model_len": max_model_len,
        "block_size": block_size,
        "static_batch_size": batch_size,
        "counted": "used / reserved tokens; headline over time (every step of every request weighs the same), "
                   "also at each request's peak; see minillm/bench/kv_waste.py",
    }
