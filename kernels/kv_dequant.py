"""Reading a quantized KV cache inside the attention kernels (``kv_cache_dtype``, ``minillm/kv/quant.py``).

Why it exists: both paged kernels (decode in ``paged_attention.py``, prefill in ``flash_attention.py``)
take the same optional ``k_scale`` / ``v_scale`` pools and dequantize right after loading a tile, so
only the quantized bytes cross the memory bus. One compile-time switch, ``KV_QUANT``, picks the
code; with ``NO_QUANT`` none of it is compiled, and the kernel is the one it was before.

- ``PER_TOKEN`` (int8, fp8): one scale per token and KV head. The tiles are never multiplied by
  it: q . (s_j k_j) = s_j (q . k_j), so K's scale multiplies token j's *score*, and
  sum_j p_j (s_j v_j) = sum_j (p_j s_j) v_j, so V's scale multiplies its softmax *weight*. That is
  a [rows, BLOCK_N] multiply instead of a [BLOCK_N, head_dim] one, and int8 and e4m3 values
  convert exactly to fp16 / bf16 for ``tl.dot``.
- ``INT4_GROUPS`` (int4): a scale and a minimum per 16 channels. They vary along the dot's
  reduction axis, so they cannot be factored out: the tile itself is dequantized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minillm.kernels.checks import FLOAT_DTYPES, check
from minillm.kernels.int_float import int8_to_float
from minillm.kv.quant import dequantize_kv, format_of, kv_layout

# The KV_QUANT values; constexpr so that the kernels may read them as globals.
NO_QUANT, PER_TOKEN, INT4_GROUPS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


def kv_quant_mode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tl.constexpr:
    """Check a cache's pools and scales against q ([..., head_dim]); return the kernels' KV_QUANT.

    A float cache must match q's dtype and come without scales; a quantized one (int8, fp8, or
    uint8 = packed int4) needs both scale pools in ``kv_layout``'s shape, with equal strides."""
    kind = format_of(k_cache.dtype)
    if kind == "auto":
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            check(cache.dtype == q.dtype, f"{name} has dtype {cache.dtype} but q has {q.dtype}; they must match "
                  "(or be a quantized cache: int8, float8_e4m3fn, uint8 = packed int4)")
        check(k_scale is None and v_scale is None, f"k_scale / v_scale dequantize a quantized KV cache, but the "
              f"cache holds {k_cache.dtype}; pass None")
        return NO_QUANT
    check(v_cache.dtype == k_cache.dtype, f"k_cache holds {k_cache.dtype} but v_cache {v_cache.dtype}; they must match")
    check(k_scale is not None and v_scale is not None,
          f"an {kind} KV cache ({k_cache.dtype}) needs its scales: pass k_scale and v_scale")
    head_dim = q.shape[-1]
    layout = kv_layout(kind, head_dim, q.dtype)
    check(k_cache.shape[-1] == layout.width, f"an {kind} cache for head_dim {head_dim} has a last dim of "
          f"{layout.width}, got k_cache {tuple(k_cache.shape)}")
    want = (*k_cache.shape[:-1], *layout.scale_shape)
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        check(tuple(scale.shape) == want and scale.dtype in FLOAT_DTYPES,
              f"{name} must be a float tensor of shape {want} for this {kind} cache, "
              f"got {scale.dtype} {tuple(scale.shape)}")
        check(scale.device == q.device, f"{name} is on {scale.device} but q is on {q.device}")
    check(k_scale.stride() == v_scale.stride(), f"k_scale and v_scale need equal strides, got {k_scale.stride()} "
          f"and {v_scale.stride()}")
    if kind == "int4":  # the kernels step (scale, minimum) pairs as 2 and 1
        check(k_scale.stride()[-2:] == (2, 1), f"int4 scales need contiguous (scale, minimum) pairs, got "
              f"strides {k_scale.stride()}")
        return INT4_GROUPS
    return PER_TOKEN


def dequantize_as_kernels_do(data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """K or V as the kernels multiply them, in fp32, for the references: int8 and fp8 codes are exact
    in fp16 / bf16 and their scales apply in fp32, so they are exact; int4 values are computed in
    fp32 and rounded to q's ``dtype`` for ``tl.dot`` (in bf16 a 2^-9 relative step, small next to
    int4's own but not next to a test's tolerance). A float pool comes back in fp32."""
    if format_of(data.dtype) == "int4":
        return dequantize_kv(data, scales, dtype).float()
    return dequantize_kv(data, scales, torch.float32)


def scale_strides(k_scale: torch.Tensor | None) -> tuple[int, int, int]:
    """(block, slot, head) strides of a scale pool; zeros stand in when there is none."""
    return (0, 0, 0) if k_scale is None else k_scale.stride()[:3]


@triton.jit
def dequant_int4(raw, high, params, mask):
    """Packed int4 -> fp32: ``raw`` a uint8 tile, ``high`` where a value sits in its byte's high
    nibble, ``params`` pointers to each value's group (scale, minimum) pair."""
    nibble = tl.where(high, raw >> 4, raw & 15)
    scale = tl.load(params, mask=mask, other=0.0).to(tl.float32)
    minimum = tl.load(params + 1, mask=mask, other=0.0).to(tl.float32)
    return nibble.to(tl.float32) * scale + minimum


@triton.jit
def per_token_codes(raw, like):
    """int8 or e4m3 codes -> ``like``'s dtype, exactly; int8 through ``int8_to_float`` (no I2F per value)."""
    if raw.dtype == tl.int8:
        return int8_to_float(raw).to(like.dtype)
    return raw.to(like.dtype)
