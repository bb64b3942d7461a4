"""RoPE and the new token's K/V store done by the paged decode kernel itself: ``paged_attention``'s ``new_kv``.

Why it exists: a batch-1 decode layer ran RoPE and the K/V store (``kv_store.rope_store_kv``) as a kernel of its own
before attention, ~3 us of a ~67 us llama2-7b INT4 layer, most of it the launch and the kernel boundary. In a
decode-only step over an unquantized cache the decode kernel does that work instead (``kv/paged_triton.py`` asks
for it; MINILLM_ROPE_IN_DECODE=0 keeps the two kernels): each program (sequence, KV head, split) rotates its own
query heads with ``fused_layer_ops.rotated_halves``, the arithmetic ``rope_store_kv`` uses, and the one program whose
split holds the new token (position ctx - 1) rotates its KV head's new k and stores k and v at the token's slot,
then synchronises its threads before it reads its tiles. No other program reads that position, so nothing else
waits. The pools get ``rope_store_kv``'s bits; the output can differ in its last bit on a GPU, where the rotated q
reaches the dot from registers rather than from memory (``paged_decode_attention``'s docstring).

Measured on the H200 (figures/h200/sweeps/latency_rope_in_decode.json, engines ABBA ABBA): 1.029x the INT4 batch-1
decode tok/s of llama2-7b, 1.010x bf16's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minillm.kernels.fused_layer_ops import check_rope_inputs, rotated_halves
from minillm.kernels.kv_dequant import NO_QUANT


@triton.jit
def rope_and_store_new_kv(Q, b, kv_head, heads, row_ok, ctx, start, end, stride_qb, stride_qh, K, V, stride_kb,
                          stride_kt, stride_kh, NewK, NewV, Cos, Sin, Slots, stride_nk, stride_nv, stride_c,
                          BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr):
    """``paged_attention._split_kernel``'s NEW_KV work: its query heads' rows of q, rotated -> [GROUP_PAD, HEAD_DIM];
    and if this program's split [start, end) holds the new token (position ctx - 1), its KV head's new k, rotated,
    and v stored at the token's slot, visible to the whole program before it reads its tiles."""
    HALF: tl.constexpr = HEAD_DIM // 2
    half = tl.arange(0, HALF)[None, :]
    cos = tl.load(Cos + b * stride_c + half).to(tl.float32)
    sin = tl.load(Sin + b * stride_c + half).to(tl.float32)
    q1, q2 = rotated_halves(Q + b * stride_qb + heads[:, None] * stride_qh + half, row_ok[:, None], cos, sin, HALF)
    if (ctx - 1 >= start) & (ctx - 1 < end):
        slot = tl.load(Slots + b)
        at = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt + kv_head * stride_kh + half
        k1, k2 = rotated_halves(NewK + b * stride_nk + kv_head * HEAD_DIM + half, half < HALF, cos, sin, HALF)
        tl.store(K + at, k1)
        tl.store(K + at + HALF, k2)
        v_at = NewV + b * stride_nv + kv_head * HEAD_DIM + half
        tl.store(V + at, tl.load(v_at))
        tl.store(V + at + HALF, tl.load(v_at + HALF))
        tl.debug_barrier()  # the stores made before any thread of the program loads the tile that holds the slot
    return tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (GROUP_PAD, HEAD_DIM))  # [halves] -> [head_dim]


def check_new_kv(q, k_cache, quant, new_kv) -> None:
    """``paged_decode_attention``'s ``new_kv`` = (k, v, cos, sin, slot_mapping): what the kernel's NEW_KV reads."""
    if len(new_kv) != 5:
        raise ValueError(f"new_kv must be (k, v, cos, sin, slot_mapping), got {len(new_kv)} items")
    k, v, cos, sin, slots = new_kv
    batch, _, dim = q.shape
    if quant != NO_QUANT:
        raise ValueError(f"new_kv needs an unquantized cache (it stores k and v as they are), got {k_cache.dtype}")
    if dim < 16:
        raise ValueError(f"new_kv needs head_dim >= 16 (the rotated q is one [rows, head_dim] tile of tl.dot), "
                         f"got {dim}")
    kv_shape = (batch, k_cache.shape[2], dim)
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != kv_shape or t.dtype != k_cache.dtype or t.stride(2) != 1 or t.stride(1) != dim \
                or t.device != q.device:
            raise ValueError(f"new_kv's {name} must be {k_cache.dtype} {list(kv_shape)} with contiguous heads and "
                             f"dims on {q.device}, got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")
    check_rope_inputs("q", q, cos, sin)
    if slots.dtype != torch.int64 or tuple(slots.shape) != (batch,) or slots.device != q.device:
        raise ValueError(f"new_kv's slot_mapping must be int64 [{batch}] on {q.device}, got {slots.dtype} "
                         f"{tuple(slots.shape)} on {slots.device}")
