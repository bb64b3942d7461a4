"""Writing a step's new K and V into the paged KV cache, both in one kernel.

Why it exists: the torch path stores K and V with two ``index_put`` kernels per layer. At batch 1
a llama2-7b decode step is ~4.5 ms of GPU time, and each of those 64 small launches costs ~3 µs
inside a CUDA graph (figures/h200/profile_b1.json) — writing both from one program per token
halves them. vLLM does the same with its ``reshape_and_cache`` kernel.

An int8 cache (``kv_cache_dtype="int8"``, ``minillm/kv/quant.py``) is written by the same
program: it takes each head's absolute maximum, rounds the scale to fp16 as ``quantize_kv`` does,
and stores the codes and the scale, bit for bit what ``quantize_kv`` gives. Through torch ops that
was about a dozen kernels per layer (abs, amax, clamp, cast, divide, round, four index_puts), which
in the eager prefill and mixed steps cost more than the attention. (fp8 and int4 stay on the torch
path: Triton's CPU interpreter does not round fp32 to e4m3 as the GPU and torch do, so a kernel
for fp8 could not be checked bit for bit in CI; int4 packs channel pairs.)

``rope_store_kv`` goes one step further for an unquantized cache: the same program also applies RoPE to
the token's q and k heads (in place) before it stores k, so a decode layer launches one kernel where the
RoPE kernel and this one were two; its arithmetic is the RoPE kernel's (``fused_layer_ops.rotated_halves``).

Layout: ``k``/``v`` [tokens, kv_heads, head_dim] (any row stride, contiguous heads and dims, as
the slices of the fused qkv projection are); pools [num_blocks, block_size, kv_heads, head_dim],
contiguous, so slot s = block * block_size + offset is row s of the pool viewed as
[slots, kv_heads * head_dim]; ``slot_mapping`` int64 [tokens]. Scale pools [num_blocks, block_size,
kv_heads] fp16, contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES
from .checks import check as _check
from .checks import check_runnable
from .fused_layer_ops import check_rope_inputs, rotated_halves
from .int_float import round_half_even
from .kv_formats import CODE_MAX, STORAGE_DTYPES

# Pools store_kv quantizes into -> their largest code (quantize_kv's).
QUANTIZED_POOLS = {STORAGE_DTYPES["int8"]: CODE_MAX["int8"]}


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """What ``store_kv`` does: token t's K and V go to slot ``slot_mapping[t]`` of the pools."""
    heads, dim = k_pool.shape[-2:]
    k_pool.view(-1, heads, dim)[slot_mapping] = k
    v_pool.view(-1, heads, dim)[slot_mapping] = v


@triton.jit
def _quantize_row(X, t, stride, slot, Pool, ScalePool, top, inv_top, HEADS: tl.constexpr, DIM: tl.constexpr,
                  HEADS_P2: tl.constexpr, DIM_P2: tl.constexpr):
    """Token t's [HEADS, DIM] row of X -> int8 codes in Pool's slot and one fp16 scale per head."""
    h = tl.arange(0, HEADS_P2)
    d = tl.arange(0, DIM_P2)
    mask = (h < HEADS)[:, None] & (d < DIM)[None, :]
    x = tl.load(X + t * stride + h[:, None] * DIM + d[None, :], mask=mask, other=0.0).to(tl.float32)
    # As quantize_kv: the scale is absmax times the fp32 reciprocal of top (a product rounds alike on
    # every device; a divide by a scalar would not), clamped to fp16's range and rounded to fp16; the
    # codes are x divided by the scale *as stored*, clamped to [-top, top] (that scale may be a bit small).
    scale = tl.minimum(tl.maximum(tl.max(tl.abs(x), axis=1) * inv_top, 2.0 ** -24), 65504.0).to(tl.float16)
    y = tl.math.div_rn(x, scale.to(tl.float32)[:, None])  # IEEE division, as torch's: the rounding must match
    y = tl.minimum(tl.maximum(y, -top), top)
    codes = round_half_even(y).to(tl.int8)  # as torch.round
    tl.store(Pool + slot * HEADS * DIM + h[:, None] * DIM + d[None, :], codes, mask=mask)
    tl.store(ScalePool + slot * HEADS + h, scale, mask=h < HEADS)


@triton.jit
def _store_quantized_kv_kernel(K, V, KPool, VPool, KScale, VScale, Slots, stride_k, stride_v, top, inv_top,
                               HEADS: tl.constexpr, DIM: tl.constexpr, HEADS_P2: tl.constexpr,
                               DIM_P2: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t)
    _quantize_row(K, t, stride_k, slot, KPool, KScale, top, inv_top, HEADS, DIM, HEADS_P2, DIM_P2)
    _quantize_row(V, t, stride_v, slot, VPool, VScale, top, inv_top, HEADS, DIM, HEADS_P2, DIM_P2)


@triton.jit
def _store_kv_kernel(K, V, KPool, VPool, Slots, stride_k, stride_v, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t)
    cols = tl.arange(0, BLOCK)
    mask = cols < ROW
    tl.store(KPool + slot * ROW + cols, tl.load(K + t * stride_k + cols, mask=mask), mask=mask)
    tl.store(VPool + slot * ROW + cols, tl.load(V + t * stride_v + cols, mask=mask), mask=mask)


@triton.jit
def _rope_store_kv_kernel(Q, K, V, Cos, Sin, KPool, VPool, Slots, stride_qt, stride_kt, stride_vt, stride_c, num_heads,
                          KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr):
    """Token t: q's and k's heads rotated in place (``rotated_halves``, as the RoPE kernel), and the rotated k
    and v stored at its slot of the pools. Heads are 2 * HALF apart in q, k, v and the pools (checked)."""
    t = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF)[None, :]
    cos = tl.load(Cos + t * stride_c + dims).to(tl.float32)
    sin = tl.load(Sin + t * stride_c + dims).to(tl.float32)
    heads = tl.arange(0, BLOCK_H)[:, None]
    q_ptr = Q + t * stride_qt + heads * (2 * HALF) + dims
    q1, q2 = rotated_halves(q_ptr, heads < num_heads, cos, sin, HALF)
    tl.store(q_ptr, q1, mask=heads < num_heads)
    tl.store(q_ptr + HALF, q2, mask=heads < num_heads)
    slot = tl.load(Slots + t)
    kv_heads = tl.arange(0, BLOCK_KV)[:, None]
    kv_mask = kv_heads < KV_HEADS
    row = kv_heads * (2 * HALF) + dims  # a head's first half in a token's [KV_HEADS, 2 * HALF] row
    k_at = K + t * stride_kt + row
    k1, k2 = rotated_halves(k_at, kv_mask, cos, sin, HALF)
    tl.store(k_at, k1, mask=kv_mask)  # in place, as rope does
    tl.store(k_at + HALF, k2, mask=kv_mask)
    k_pool_at = KPool + slot * (KV_HEADS * 2 * HALF) + row
    tl.store(k_pool_at, k1, mask=kv_mask)
    tl.store(k_pool_at + HALF, k2, mask=kv_mask)
    v_at = V + t * stride_vt + row
    v_pool_at = VPool + slot * (KV_HEADS * 2 * HALF) + row
    tl.store(v_pool_at, tl.load(v_at, mask=kv_mask), mask=kv_mask)
    tl.store(v_pool_at + HALF, tl.load(v_at + HALF, mask=kv_mask), mask=kv_mask)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_pool: torch.Tensor, v_pool: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """RoPE on q [tokens, heads, D] and k [tokens, kv_heads, D], in place, then ``store_kv`` of the rotated k
    and of v: one kernel where ``fused_layer_ops.rope`` and ``store_kv`` were two, with their bits. The Triton
    paged context (``kv/paged_triton.py``) calls it in every step with prefill rows over an unquantized cache; a
    decode-only step leaves this work to the decode kernel (``paged_decode_attention``'s ``new_kv``), which does it
    with the same arithmetic (``rotated_halves``). cos/sin: [tokens, D], as
    ``rope`` takes them. q, k and v must not overlap (the slices of one qkv row do not): v is read after k is
    written."""
    _check(k_pool.dtype == k.dtype, f"the pools hold {k_pool.dtype} and k is {k.dtype}; rope_store_kv stores k's "
           f"dtype as it is (a quantized cache goes through rope, then store_kv)")
    _check_store_inputs(k, v, k_pool, v_pool, slot_mapping, None, None)
    _check(q.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2] and q.dtype == k.dtype
           and q.stride(1) == q.shape[2], f"q is {q.dtype} {tuple(q.shape)} (strides {q.stride()}); expected "
           f"{k.dtype} [{k.shape[0]}, heads, {k.shape[2]}] with contiguous heads and dims")
    for name, x in (("q", q), ("k", k)):
        check_rope_inputs(name, x, cos, sin)
    if k.shape[0] == 0:
        return
    heads, kv_heads, dim = q.shape[1], k.shape[1], k.shape[2]
    _rope_store_kv_kernel[(k.shape[0],)](q, k, v, cos, sin, k_pool, v_pool, slot_mapping, q.stride(0), k.stride(0),
                                         v.stride(0), cos.stride(0), heads, KV_HEADS=kv_heads, HALF=dim // 2,
                                         BLOCK_H=triton.next_power_of_2(heads),
                                         BLOCK_KV=triton.next_power_of_2(kv_heads))


def _check_store_inputs(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    for name, t in (("k", k), ("v", v)):
        _check(t.dim() == 3, f"{name} must be [tokens, kv_heads, head_dim], got shape {tuple(t.shape)}")
        _check(t.shape == k.shape, f"{name} has shape {tuple(t.shape)} but k has {tuple(k.shape)}")
        _check(t.stride(2) == 1 and t.stride(1) == t.shape[2],
               f"{name} needs contiguous heads and dims, got strides {t.stride()}")
    quantized = k_pool.dtype in QUANTIZED_POOLS
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        _check(pool.dim() == 4 and pool.shape[-2:] == k.shape[-2:] and pool.is_contiguous(),
               f"{name} must be a contiguous [blocks, block_size, {k.shape[1]}, {k.shape[2]}] pool, "
               f"got shape {tuple(pool.shape)}")
        _check(k.dtype == v.dtype and k.dtype in FLOAT_DTYPES and pool.dtype in (k.dtype, *QUANTIZED_POOLS)
               and pool.dtype == k_pool.dtype,
               f"k and v must share one of {FLOAT_DTYPES}, and the pools that dtype or one of {QUANTIZED_POOLS}; "
               f"got {k.dtype}, {v.dtype}, {k_pool.dtype}, {v_pool.dtype}")
        check_runnable(name, pool)
    for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
        expected = (*k_pool.shape[:3],)
        fits = scales is not None and scales.dtype == torch.float16 and scales.shape == expected \
            and scales.is_contiguous() and scales.device == k_pool.device
        _check(fits if quantized else scales is None,
               f"{name} must be a contiguous float16 {expected} pool with an int8 cache and None otherwise; "
               f"got {None if scales is None else (scales.dtype, tuple(scales.shape))} with a {k_pool.dtype} cache")
    _check(slot_mapping.dtype == torch.int64 and slot_mapping.shape == (k.shape[0],),
           f"slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Store token t's ``k[t]`` and ``v[t]`` at pool slot ``slot_mapping[t]``, one program per token;
    int8 pools are quantized on the way in, their per-head scales going to ``k_scale`` / ``v_scale``."""
    _check_store_inputs(k, v, k_pool, v_pool, slot_mapping, k_scale, v_scale)
    quantized = k_pool.dtype in QUANTIZED_POOLS
    if k.shape[0] == 0:
        return
    if quantized:
        heads, dim = k.shape[1:]
        top = QUANTIZED_POOLS[k_pool.dtype]
        _store_quantized_kv_kernel[(k.shape[0],)](
            k, v, k_pool, v_pool, k_scale, v_scale, slot_mapping, k.stride(0), v.stride(0), top, 1.0 / top,
            HEADS=heads, DIM=dim, HEADS_P2=triton.next_power_of_2(heads), DIM_P2=triton.next_power_of_2(dim))
        return
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(k.shape[0],)](k, v, k_pool, v_pool, slot_mapping, k.stride(0), v.stride(0),
                                    ROW=row, BLOCK=triton.next_power_of_2(row))
