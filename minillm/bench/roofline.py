"""The roofline: how fast a step *could* be on this device, so every measurement can say "x % of the limit".

A step is bounded by two ceilings: the bytes it must move (over memory bandwidth) and the FLOPs it
must do (over peak matmul throughput). Its time floor is the larger of the two (Williams, Waterman &
Patterson, "Roofline", CACM 2009). This file measures both ceilings on the device at hand and counts
bytes and FLOPs for any ``ModelConfig``, so a notebook or a benchmark compares like with like.

Counting conventions (stated once, used everywhere):

- Matmul FLOPs: ``2 * params * tokens`` (one multiply-add per weight per token; Kaplan et al. 2020,
  "Scaling Laws for Neural Language Models", sec. 2.1). Counts the embedding table like a matmul
  (exact for tied embeddings via the LM head; a slight overcount otherwise).
- Attention FLOPs: ``4 * layers * heads * head_dim`` per (query, key) pair: ``2*head_dim`` for the
  q·k score and ``2*head_dim`` for weighting v, per head and layer (PaLM, Chowdhery et al. 2022,
  appendix B, counts the same 4·L·H·D·T per token without masking). Causally, new token i of a
  chunk of ``n`` after ``p`` cached tokens sees ``p + i`` keys (i = 1..n), so the pairs are
  ``n*p + n*(n+1)/2`` — about T²/2 for a prefill of T tokens, ``context`` for one decode token.
- Bytes: a decode step reads all weights once (``params * dtype_bytes``, the convention of
  BENCHMARKS.md) plus every running sequence's K and V for its context. A prefill reads the weights
  once and writes K and V for its tokens. Activations are ignored (small next to the weights).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from minillm.model.config import ModelConfig


@dataclass
class Ceilings:
    """What this device can do at most, as measured by ``measure_ceilings``."""

    device: str  # e.g. "cpu" or "NVIDIA H200"
    dtype: str  # the matmul dtype peak_tflops was measured in
    bandwidth_gbs: float  # device-to-device copy, GB/s (10^9 bytes), read + write counted
    peak_tflops: float  # n×n×n matmul, TFLOP/s (10^12 FLOP)

    @property
    def ridge_intensity(self) -> float:
        """FLOP/byte where the two roofs meet: below it a step is memory-bound, above compute-bound."""
        return self.peak_tflops * 1e12 / (self.bandwidth_gbs * 1e9)


# -- measuring the ceilings ---------------------------------------------------------------------


def _best_seconds(fn, device: torch.device, repeats: int) -> float:
    """Fastest wall time of ``fn()`` over ``repeats`` calls after one warm-up (CUDA synchronized).

    The fastest, not the median: a ceiling is what the device can do at most, and noise (other
    processes on a shared CPU, clock ramps) only ever makes a run slower.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_bandwidth(device: str | torch.device, nbytes: int | None = None, repeats: int = 10) -> float:
    """GB/s of a device-to-device copy of ``nbytes`` (read + write both counted).

    Default sizes are well past the last-level cache (256 MiB on a CPU, 1 GiB on a GPU), so the
    number is DRAM/HBM bandwidth, not cache bandwidth.
    """
    device = torch.device(device)
    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**28)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), device, repeats)
    return 2 * src.nbytes / seconds / 1e9


def measure_host_to_device_bandwidth(device: str | torch.device, nbytes: int | None = None,
                                     repeats: int = 5) -> float:
    """GB/s of a copy of ``nbytes`` from host memory (pinned when ``device`` is a GPU) to ``device``,
    bytes counted once: the link that offloaded weights cross (PCIe on a GPU; on a CPU, a memcpy)."""
    device = torch.device(device)
    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**28)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda").fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    seconds = _best_seconds(lambda: dst.copy_(src, non_blocking=True), device, repeats)
    return nbytes / seconds / 1e9


def measure_matmul_flops(device: str | torch.device, dtype: torch.dtype = torch.float32, n: int | None = None,
                         repeats: int = 10) -> float:
    """TFLOP/s of an n×n×n matmul (2·n³ FLOPs). Default n: 8192 on a GPU, 2048 on a CPU."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _best_seconds(lambda: a @ b, device, repeats)
    return 2 * n**3 / seconds / 1e12


def measure_ceilings(device: str | torch.device, dtype: torch.dtype = torch.float32) -> Ceilings:
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Ceilings(name, str(dtype).removeprefix("torch."), measure_bandwidth(device),
                    measure_matmul_flops(device, dtype))


# -- counting bytes and FLOPs -------------------------------------------------------------------


def weight_bytes(config: ModelConfig, dtype_bytes: float) -> float:
    return config.num_params * dtype_bytes


def attention_flops(config: ModelConfig, new_tokens: int, past_tokens: int = 0) -> float:
    """FLOPs of causal attention for ``new_tokens`` queries after ``past_tokens`` cached ones."""
    pairs = new_tokens * past_tokens + new_tokens * (new_tokens + 1) / 2
    return 4 * config.num_layers * config.num_heads * config.head_dim * pairs


def prefill_flops(config: ModelConfig, tokens: int) -> float:
    """One sequence's prefill: 2·params·T + 4·L·H·D·T(T+1)/2."""
    return 2 * config.num_params * tokens + attention_flops(config, tokens)


def prefill_bytes(config: ModelConfig, dtype_bytes: float, tokens: int) -> float:
    """Weights read once, K and V written for every prompt token."""
    return weight_bytes(config, dtype_bytes) + config.kv_bytes_per_token(dtype_bytes) * tokens


def decode_flops(config: ModelConfig, batch: int, context: int) -> float:
    """One decode step: ``batch`` sequences, each one new token attending to ``context`` tokens
    (its own included)."""
    return batch * (2 * config.num_params + attention_flops(config, 1, context - 1))


def decode_bytes(config: ModelConfig, dtype_bytes: float, batch: int, context: int, *,
                 weights: float | None = None, kv_per_token: float | None = None) -> float:
    """One decode step: all weights once, plus K and V of ``context`` tokens for each sequence.
    ``weights`` / ``kv_per_token`` give the bytes a quantized model or KV cache really holds; by default
    every parameter and cached value takes ``dtype_bytes``."""
    weights = weight_bytes(config, dtype_bytes) if weights is None else weights
    kv_per_token = config.kv_bytes_per_token(dtype_bytes) if kv_per_token is None else kv_per_token
    return weights + batch * context * kv_per_token


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOP per byte moved: compare with ``Ceilings.ridge_intensity``."""
    return flops / nbytes


def time_floor(flops: float, nbytes: float, ceilings: Ceilings) -> float:
    """Seconds the step needs at least: max(bytes / bandwidth, FLOPs / peak)."""
    return max(nbytes / (ceilings.bandwidth_gbs * 1e9), flops / (ceilings.peak_tflops * 1e12))


def attainable_tflops(intensity: float, ceilings: Ceilings) -> float:
    """The roofline itself: min(peak, bandwidth · intensity), in TFLOP/s."""
    return min(ceilings.peak_tflops, ceilings.bandwidth_gbs * 1e9 * intensity / 1e12)


def decode_roofline_tok_s(config: ModelConfig, dtype_bytes: float, batch: int, context: int,
                          ceilings: Ceilings, **stored_bytes: float | None) -> float:
    """The most output tokens per second a decode step of ``batch`` sequences at ``context`` can give
    (``stored_bytes``: ``decode_bytes``'s ``weights`` and ``kv_per_token``)."""
    seconds = time_floor(decode_flops(config, batch, context),
                         decode_bytes(config, dtype_bytes, batch, context, **stored_bytes), ceilings)
    return batch / seconds


def prefill_roofline_tok_s(config: ModelConfig, dtype_bytes: float, tokens: int, ceilings: Ceilings) -> float:
    """The most prompt tokens per second a prefill of ``tokens`` can process."""
    return tokens / time_floor(prefill_flops(config, tokens), prefill_bytes(config, dtype_bytes, tokens), ceilings)


def compute_bound_batch(config: ModelConfig, dtype_bytes: float, context: int, ceilings: Ceilings) -> float:
    """The smallest batch at which a decode step at ``context`` stops being memory-bound.

    Solves B·flops_per_seq / peak = (weights + B·kv_per_seq) / bandwidth for B. Returns ``inf`` when
    the per-sequence KV reads alone outweigh the per-sequence FLOPs (long contexts): then no batch
    size makes decode compute-bound, because every added sequence brings its own bytes.
    """
    bandwidth, peak = ceilings.bandwidth_gbs * 1e9, ceilings.peak_tflops * 1e12
    per_seq = decode_flops(config, 1, context) / peak - context * config.kv_bytes_per_token(dtype_bytes) / bandwidth
    if per_seq <= 0:
        return float("inf")
    return weight_bytes(config, dtype_bytes) / bandwidth / per_seq
