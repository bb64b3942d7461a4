"""RoPE and the new token's K/V store done by the paged decode kernel itself: ``paged_attention``'s ``new_kv``.

Why it exists: a batch-1 decode layer ran RoPE and the K/V store (``kv_store.rope_store_kv``) as a kernel of its own
before attention, ~3 us of a ~67 us llama2-7b INT4 layer, most of it the launch and the kernel boundary. In a
decode-only step over an unquantized cache the decode kernel does that work instead (``kv/paged_triton.py`` asks
for it): each program (sequence, KV head, split) rotates its own
query heads with ``fused_layer_ops.rotated_halves``, the arithmetic ``rope_store_kv`` uses, and the one program whose
split holds the new token (position ctx - 1) rotates its KV head's new k and stores k and v at the token's slot,
then synchronises its threads before it reads its tiles. No other program reads that position, so nothing else
waits. The pools get ``rope_store_kv``'s bits; the output can differ in its last bit on a GPU, where the rotated q
reaches the dot from registers rather than from memory (``paged_decode_attention``'s docstring).

With the norms folded into the INT4 GEMVs, q, k and v may arrive as qkv_proj's fp32 row before its norm's 1 / rms
(PENDING; ``hopper/w4_gemv_norms.py``): each program forms 1 / rms from the sums of squares the GEMV stored and scales
the values as it loads them, rounded to the cache's dtype as the GEMV would have written them.

Measured on the H200 (figures/h200/sweeps/latency_rope_in_decode.json, engines ABBA ABBA): 1.029x the INT4 batch-1
decode tok/s of llama2-7b, 1.010x bf16's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_layer_ops import check_rope_inputs, rotated, rotated_halves
from .kv_dequant import NO_QUANT
from .fused_layer_ops import holds_squares


@triton.jit
def stored_inv_rms(Squares, slots, SLOTS: tl.constexpr, width, eps):
    """1 / rms of a row of ``width`` inputs from the ``slots`` sums of squares at Squares (SLOTS: a power of two at
    least as large): the norm that qkv_proj's GEMV left to this kernel (``hopper/w4_gemv_norms.py``; its Gluon
    twin there)."""
    lanes = tl.arange(0, SLOTS)
    return 1.0 / tl.sqrt(tl.sum(tl.load(Squares + lanes, mask=lanes < slots, other=0.0), axis=0) / width + eps)


@triton.jit
def _scaled(x_ptr, mask, inv, PENDING: tl.constexpr, DTYPE: tl.constexpr):
    """The values at x_ptr; PENDING: fp32 values times ``inv``, rounded to DTYPE (as the GEMV would have written
    them had it applied its norm's 1 / rms itself)."""
    if PENDING:
        return (tl.load(x_ptr, mask=mask, other=0.0) * inv).to(DTYPE)
    else:
        return tl.load(x_ptr, mask=mask, other=0.0)


@triton.jit
def _new_halves(x_ptr, mask, cos, sin, inv, HALF: tl.constexpr, PENDING: tl.constexpr, DTYPE: tl.constexpr):
    """``rotated_halves`` of the rows at x_ptr, scaled first where PENDING (``_scaled``)."""
    if PENDING:
        return rotated(_scaled(x_ptr, mask, inv, PENDING, DTYPE), _scaled(x_ptr + HALF, mask, inv, PENDING, DTYPE),
                       cos, sin)
    else:
        return rotated_halves(x_ptr, mask, cos, sin, HALF)


@triton.jit
def rope_and_store_new_kv(Q, b, kv_head, heads, row_ok, ctx, start, end, stride_qb, stride_qh, K, V, stride_kb,
                          stride_kt, stride_kh, NewK, NewV, Cos, Sin, Slots, stride_nk, stride_nv, stride_c, inv,
                          BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr,
                          PENDING: tl.constexpr):
    """``paged_attention._split_kernel``'s NEW_KV work: its query heads' rows of q, rotated -> [GROUP_PAD, HEAD_DIM];
    and if this program's split [start, end) holds the new token (position ctx - 1), its KV head's new k, rotated,
    and v stored at the token's slot, visible to the whole program before it reads its tiles. PENDING: q, k and v
    are qkv_proj's fp32 row before its norm's 1 / rms (``inv``), which each value gets as it is loaded."""
    HALF: tl.constexpr = HEAD_DIM // 2
    DTYPE: tl.constexpr = K.dtype.element_ty
    half = tl.arange(0, HALF)[None, :]
    cos = tl.load(Cos + b * stride_c + half).to(tl.float32)
    sin = tl.load(Sin + b * stride_c + half).to(tl.float32)
    q1, q2 = _new_halves(Q + b * stride_qb + heads[:, None] * stride_qh + half, row_ok[:, None], cos, sin, inv, HALF,
                         PENDING, DTYPE)
    if (ctx - 1 >= start) & (ctx - 1 < end):
        slot = tl.load(Slots + b)
        at = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt + kv_head * stride_kh + half
        k1, k2 = _new_halves(NewK + b * stride_nk + kv_head * HEAD_DIM + half, half < HALF, cos, sin, inv, HALF,
                             PENDING, DTYPE)
        tl.store(K + at, k1)
        tl.store(K + at + HALF, k2)
        v_at = NewV + b * stride_nv + kv_head * HEAD_DIM + half
        tl.store(V + at, _scaled(v_at, half < HALF, inv, PENDING, DTYPE))
        tl.store(V + at + HALF, _scaled(v_at + HALF, half < HALF, inv, PENDING, DTYPE))
        tl.debug_barrier()  # the stores made before any thread of the program loads the tile that holds the slot
    return tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (GROUP_PAD, HEAD_DIM))  # [halves] -> [head_dim]


def check_new_kv(q, k_cache, quant, new_kv, pending: bool = False) -> None:
    """``paged_decode_attention``'s ``new_kv`` = (k, v, cos, sin, slot_mapping): what the kernel's NEW_KV reads;
    ``pending``: q, k and v are fp32 (a row its norm's 1 / rms is still to be applied to)."""
    if len(new_kv) != 5:
        raise ValueError(f"new_kv must be (k, v, cos, sin, slot_mapping), got {len(new_kv)} items")
    k, v, cos, sin, slots = new_kv
    batch, _, dim = q.shape
    if quant != NO_QUANT:
        raise ValueError(f"new_kv needs an unquantized cache (it stores k and v as they are), got {k_cache.dtype}")
    if dim < 16:
        raise ValueError(f"new_kv needs head_dim >= 16 (the rotated q is one [rows, head_dim] tile of tl.dot), "
                         f"got {dim}")
    kv_shape, dtype = (batch, k_cache.shape[2], dim), torch.float32 if pending else k_cache.dtype
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != kv_shape or t.dtype != dtype or t.stride(2) != 1 or t.stride(1) != dim \
                or t.device != q.device:
            raise ValueError(f"new_kv's {name} must be {dtype} {list(kv_shape)} with contiguous heads and "
                             f"dims on {q.device}, got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")
    check_rope_inputs("q", q, cos, sin)
    if slots.dtype != torch.int64 or tuple(slots.shape) != (batch,) or slots.device != q.device:
        raise ValueError(f"new_kv's slot_mapping must be int64 [{batch}] on {q.device}, got {slots.dtype} "
                         f"{tuple(slots.shape)} on {slots.device}")


def check_pending_rms(q, k_cache, new_kv, rms) -> None:
    """``paged_decode_attention``'s ``rms`` (sums of squares, width, eps): one row (the norm is the row's) of fp32 q,
    k and v (``new_kv``'s), and the sums as an fp32 vector beside q."""
    if new_kv is None:
        raise ValueError("rms (the 1 / rms qkv_proj's GEMV left to the decode kernel) needs new_kv: the kernel scales "
                         "q, k and v as it loads them for RoPE and the K/V store")
    if q.dtype != torch.float32 or q.shape[0] != 1:
        raise ValueError(f"rms scales one fp32 row of q, k and v (a batch of 1, whose norm it is), rounding them to "
                         f"the cache's dtype; got q {q.dtype} {tuple(q.shape)}")
    squares = rms.squares
    if not holds_squares(squares, q.device) or rms.width <= 0:
        raise ValueError(f"rms needs its sums of squares as a non-empty contiguous fp32 vector on {q.device} and a "
                         f"positive width; got {squares.dtype} {tuple(squares.shape)} on {squares.device}, width "
                         f"{rms.width}")
