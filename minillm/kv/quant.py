"""KV-cache quantization: K and V stored in 8 or 4 bits with scales (``kv_cache_dtype``).

Why it exists: a decode step reads every cached K/V byte of every running sequence, and the KV cache
is what decides how many sequences fit in memory. Storing it in fewer bits makes both cheaper: INT8
halves the bytes of a bf16 cache, so a memory budget holds about twice the tokens and attention
reads half as much. The price is a rounding error in every attention score and output, which
notebook 06 measures (perplexity, attention error) rather than assumes.

The formats, per token and KV head (a vector x of ``head_dim`` values):

- ``"int8"``: symmetric, one scale per token per head: s = max|x| / 127, q = round(x / s) in
  [-127, 127], x ~ q * s. Per-token scales need no calibration and are final once the token is
  written, which a paged cache filled one token at a time requires.
- ``"fp8"``: float8 e4m3 (Micikevicius et al., "FP8 Formats for Deep Learning", 2022,
  https://arxiv.org/abs/2209.05433) with the same per-token-per-head scale, s = max|x| / 448
  (e4m3's largest finite value): a relative rather than uniform rounding error.
- ``"int4"``: asymmetric, group-wise along ``head_dim``: each run of ``INT4_GROUP_SIZE`` channels
  has a scale s = (max - min) / 15 and its minimum m, q = round((x - m) / s) in [0, 15], x ~ q * s + m
  (asymmetric group quantization as in KIVI, Liu et al. 2024, https://arxiv.org/abs/2402.02750).
  Two values share a byte: byte j of a token-head holds channel j in its low nibble and channel
  j + head_dim / 2 in its high nibble (halves, not neighbours, so a kernel finds channel d in byte
  d mod head_dim/2 without shuffling values between lanes).

Why groups of 16 channels for int4: keys carry a few outlier channels (KVQuant, Hooper et al. 2024,
https://arxiv.org/abs/2401.18079), and one scale over many channels spends the 16 levels on the
outlier. On the embedded SmolLM2-135M (held-out pydoc_data text, 3 x 512 tokens, notebook 06)
groups of 16 raised perplexity by 4.2 %, groups of 32 by 6.3 %, 64 by 18 %, and symmetric int4 at
32 by 18 %: only 16 keeps the rise under 5 %.

Scales (and int4 minima) are float16: 2 bytes per token-head in int8, so a bf16 head of 128 values
shrinks from 256 bytes to 130. fp16 covers scales from 2^-24 to 65504, i.e. vectors with max|x| up
to 8e6 (int8) — far beyond any activation the models here produce.
"""

from __future__ import annotations

import torch

from minillm.kernels.kv_formats import (CODE_MAX, FP8_MAX, INT4_GROUP_SIZE, KV_CACHE_DTYPES, SCALE_DTYPE,  # noqa: F401
                                        STORAGE_DTYPES, KVLayout, check_kv_cache_dtype, dequantize_kv, format_of,
                                        kv_layout)
from minillm.model.config import ModelConfig

_SMALLEST_SCALE = 2.0 ** -24  # fp16's smallest subnormal: an all-zero vector must not divide by 0


def kv_bytes_per_token(config: ModelConfig, kv_cache_dtype: str, dtype: torch.dtype) -> int:
    """Bytes of K and V one token occupies across all layers, scales included (``dtype``: the model's)."""
    per_head = kv_layout(kv_cache_dtype, config.head_dim, dtype).bytes_per_token_head()
    return 2 * config.num_layers * config.num_kv_heads * per_head


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    return scale.clamp(_SMALLEST_SCALE, torch.finfo(SCALE_DTYPE).max).to(SCALE_DTYPE)


def quantize_kv(x: torch.Tensor, kv_cache_dtype: str,
                group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """K or V [..., head_dim] -> (data, scales) in ``kv_layout``'s shapes (module docstring).

    The values are divided by the scale *as stored* (rounded to fp16), so that dequantizing with it
    gives back x within half a step. ``group_size`` (int4 only) exists for experiments such as
    notebook 06's sweep; the engine's caches use ``INT4_GROUP_SIZE``."""
    if kv_cache_dtype not in STORAGE_DTYPES:
        raise ValueError(f"quantize_kv takes a quantized kv_cache_dtype {tuple(STORAGE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    x = x.float()
    if kv_cache_dtype == "int4":
        if x.shape[-1] % group_size or x.shape[-1] % 2:
            raise ValueError(f"int4 packs channel pairs in groups of {group_size}: head_dim={x.shape[-1]} must "
                             f"be even and a multiple of {group_size}")
        groups = x.unflatten(-1, (-1, group_size))
        low, high = groups.amin(-1), groups.amax(-1)
        scale = _fp16_scale((high - low) / 15)
        minimum = low.to(SCALE_DTYPE)
        q = ((groups - minimum.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, 15)
        q = q.flatten(-2).to(torch.uint8)
        half = x.shape[-1] // 2
        return q[..., :half] | (q[..., half:] << 4), torch.stack([scale, minimum], dim=-1)
    top = CODE_MAX[kv_cache_dtype]
    # Times the fp32 reciprocal, not "/ top": torch on CUDA computes a division by a scalar that way and
    # on CPU exactly, so only the product gives the same scales everywhere (and in kernels/kv_store.py).
    scale = _fp16_scale(x.abs().amax(-1) * (1.0 / top))
    scaled = (x / scale.float()[..., None]).clamp_(-top, top)  # rounding the scale may push past the top
    if kv_cache_dtype == "int8":
        return scaled.round_().to(torch.int8), scale
    return scaled.to(torch.float8_e4m3fn), scale
