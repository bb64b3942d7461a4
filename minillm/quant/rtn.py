"""Round-to-nearest (RTN) quantization: the grid every weight method here ends on, and the baseline.

A group of weights (one output channel's input channels ``[k0, k0 + group_size)``, or the whole row
when ``group_size == -1``) gets a scale ``s`` and an integer zero point ``z``; a weight ``w`` is
stored as the code ``q = clamp(round(w / s) + z, 0, 2^bits - 1)`` and read back as ``(q - z) * s``.

The grid is GPTQ's quantizer (Frantar et al. 2022, reference code ``quant.py``): the range always
contains 0; asymmetric: ``s = (max - min) / (2^bits - 1)``, ``z = round(-min / s)``; symmetric:
``s = 2 * max|w| / (2^bits - 1)`` and ``z = 2^(bits - 1)``. So the same formula dequantizes both,
and INT8 symmetric codes minus 128 are the signed INT8 weights the W8A16 layout stores.

Scales are rounded up to float16 where they are made: quantized checkpoints store them in float16
(GPTQ's layout), so a model and its saved checkpoint dequantize to exactly the same weights, and
rounding up keeps every weight of the group inside the grid. The
last group of a row may be shorter than ``group_size`` (576 inputs in groups of 128: 4.5 groups).
"""

from __future__ import annotations

import torch

# The smallest normal float16: a scale below it would lose precision (or become 0) when stored.
MIN_SCALE = 2.0 ** -14


def num_groups(in_features: int, group_size: int) -> int:
    """Groups per row: ceil(in_features / group_size), or 1 for per-channel (-1)."""
    return 1 if group_size == -1 else -(-in_features // group_size)


def round_up_to_float16(x: torch.Tensor) -> torch.Tensor:
    """The smallest float16 value >= ``x`` (positive float32): a scale rounded up still spans the whole
    range. The next float16 up is the next bit pattern (positive floats order like their bits)."""
    half = x.half()
    up = (half.view(torch.int16) + 1).view(torch.float16)
    return torch.where(half.float() < x, up, half).float()


def minmax_params(x: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point per row of ``x`` [rows, n] (one group per row), both float32 [rows] (the
    zero point holds an integer)."""
    maxq = 2 ** bits - 1
    x = x.float()
    xmin, xmax = x.amin(dim=1).clamp(max=0), x.amax(dim=1).clamp(min=0)
    if sym:
        xmax = torch.maximum(-xmin, xmax)
        xmin = -xmax
    flat = xmax == xmin  # an all-zero group: any scale represents it; avoid dividing by 0
    xmin, xmax = torch.where(flat, -1.0, xmin), torch.where(flat, 1.0, xmax)
    scale = ((xmax - xmin) / maxq).clamp(min=MIN_SCALE)
    scale = round_up_to_float16(scale)
    if sym:
        zero = torch.full_like(scale, (maxq + 1) // 2)
    else:
        zero = torch.round(-xmin / scale).clamp(0, maxq)
    return scale, zero


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes in [0, 2^bits - 1] of float32 ``x`` on the grid (``scale``, ``zero`` broadcast against it),
    as float32 integers (stored as uint8 by the callers)."""
    return torch.clamp(torch.round(x / scale) + zero, 0, 2 ** bits - 1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """float32 values of ``codes``: (q - z) * s."""
    return (codes - zero) * scale


def grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w`` [out, in] as float32 rows of one group each, [out * groups, size]. A short last group is
    padded with zeros: every range already contains 0, so they change no group's scale or zero point."""
    out_features, in_features = w.shape
    size = in_features if group_size == -1 else group_size
    pad = num_groups(in_features, group_size) * size - in_features
    return (torch.nn.functional.pad(w.float(), (0, pad)) if pad else w.float()).reshape(-1, size)


def ungrouped(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The inverse of ``grouped``: [out * groups, size] -> ``shape`` [out, in] (padding dropped)."""
    return x.reshape(shape[0], -1)[:, :shape[1]]


def quantize_groupwise(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> tuple[torch.Tensor, ...]:
    """RTN of a weight ``w`` [out, in] in groups along the input dim.

    Returns ``codes`` [out, in] uint8, ``scales`` [out, groups] float32, ``zeros`` [out, groups] int32
    (groups = ceil(in / group_size); the last one may be short; ``group_size=-1``: one group per row).
    """
    rows = grouped(w, group_size)
    scale, zero = minmax_params(rows, bits, sym)  # one (scale, zero) per (output channel, group)
    codes = ungrouped(quantize(rows, scale[:, None], zero[:, None], bits), w.shape).to(torch.uint8)
    return codes, scale.reshape(w.shape[0], -1), zero.reshape(w.shape[0], -1).to(torch.int32)


def expand_groups(params: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """[out, groups] -> [out, in]: each group's value repeated over its input channels."""
    if group_size == -1:
        return params.expand(-1, in_features)
    return params.repeat_interleave(group_size, dim=1)[:, :in_features]


def fake_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> torch.Tensor:
    """The weight RTN would run with: quantized, then dequantized (float32) — what searches try out
    many times, so computed in place in one buffer (the same arithmetic as quantize + dequantize)."""
    rows = grouped(w, group_size)
    scale, zero = minmax_params(rows, bits, sym)
    scale, zero = scale[:, None], zero[:, None]
    q = rows / scale
    q.round_().add_(zero).clamp_(0, 2 ** bits - 1).sub_(zero).mul_(scale)
    return ungrouped(q, w.shape)
