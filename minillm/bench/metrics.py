"""vLLM's serving metrics, computed the same way for minillm and for every peer.

Input: per request, its arrival time, the time of every generated token and its input/output
lengths. Output: a dict under vLLM ``bench``'s JSON keys (``output_throughput``, ``mean_ttft_ms``,
``p99_itl_ms`` ...), so numbers can be compared with published vLLM runs.
TTFT = arrival -> first token; TPOT = (e2e - TTFT) / (output - 1); ITL = every gap between tokens.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class RequestTiming:
    arrival_time: float
    token_times: list[float]  # one per generated token
    num_input_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def latency_summary(name: str, seconds: list[float]) -> dict[str, float]:
    """``mean_{name}_ms``, ``median_{name}_ms``, ``p95_{name}_ms``, ``p99_{name}_ms`` (0 when there are none)."""
    if not seconds:
        return {f"{stat}_{name}_ms": 0.0 for stat in ("mean", "median", "p95", "p99")}
    ms = [s * 1000 for s in seconds]
    return {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": statistics.median(ms),
            f"p95_{name}_ms": percentile(ms, 95), f"p99_{name}_ms": percentile(ms, 99)}


def serving_metrics(timings: list[RequestTiming], duration: float) -> dict[str, float]:
    done = [t for t in timings if t.token_times]
    total_in = sum(t.num_input_tokens for t in done)
    total_out = sum(t.num_output_tokens for t in done)
    ttft = [t.token_times[0] - t.arrival_time for t in done]
    e2el = [t.token_times[-1] - t.arrival_time for t in done]
    tpot = [(t.token_times[-1] - t.token_times[0]) / (t.num_output_tokens - 1) for t in done
            if t.num_output_tokens > 1]
    itl = [b - a for t in done for a, b in zip(t.token_times, t.token_times[1:])]
    metrics = {
        "duration": duration,
        "completed": len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        metrics.update(latency_summary(name, values))
    return metrics
