"""Writing a step's new K and V into the paged KV cache, both in one kernel.

Why it exists: the torch path stores K and V with two ``index_put`` kernels per layer. At batch 1
a llama2-7b decode step is ~4.5 ms of GPU time, and each of those 64 small launches costs ~3 µs
inside a CUDA graph (figures/h200/profile_b1.json) — writing both from one program per token
halves them. vLLM does the same with its ``reshape_and_cache`` kernel.

Layout: ``k``/``v`` [tokens, kv_heads, head_dim] (any row stride, contiguous heads and dims, as
the slices of the fused qkv projection are); pools [num_blocks, block_size, kv_heads, head_dim],
contiguous, so slot s = block * block_size + offset is row s of the pool viewed as
[slots, kv_heads * head_dim]; ``slot_mapping`` int64 [tokens].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minillm.kernels.checks import FLOAT_DTYPES
from minillm.kernels.checks import check as _check
from minillm.kernels.checks import check_runnable


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """What ``store_kv`` does: token t's K and V go to slot ``slot_mapping[t]`` of the pools."""
    heads, dim = k_pool.shape[-2:]
    k_pool.view(-1, heads, dim)[slot_mapping] = k
    v_pool.view(-1, heads, dim)[slot_mapping] = v


@triton.jit
def _store_kv_kernel(K, V, KPool, VPool, Slots, stride_k, stride_v, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t)
    cols = tl.arange(0, BLOCK)
    mask = cols < ROW
    tl.store(KPool + slot * ROW + cols, tl.load(K + t * stride_k + cols, mask=mask), mask=mask)
    tl.store(VPool + slot * ROW + cols, tl.load(V + t * stride_v + cols, mask=mask), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store token t's ``k[t]`` and ``v[t]`` at pool slot ``slot_mapping[t]``, one program per token."""
    for name, t in (("k", k), ("v", v)):
        _check(t.dim() == 3, f"{name} must be [tokens, kv_heads, head_dim], got shape {tuple(t.shape)}")
        _check(t.shape == k.shape, f"{name} has shape {tuple(t.shape)} but k has {tuple(k.shape)}")
        _check(t.stride(2) == 1 and t.stride(1) == t.shape[2],
               f"{name} needs contiguous heads and dims, got strides {t.stride()}")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        _check(pool.dim() == 4 and pool.shape[-2:] == k.shape[-2:] and pool.is_contiguous(),
               f"{name} must be a contiguous [blocks, block_size, {k.shape[1]}, {k.shape[2]}] pool, "
               f"got shape {tuple(pool.shape)}")
        _check(pool.dtype == k.dtype == v.dtype and pool.dtype in FLOAT_DTYPES,
               f"k, v and the pools must share one of {FLOAT_DTYPES}; got {k.dtype}, {v.dtype}, {pool.dtype}")
        check_runnable(name, pool)
    _check(slot_mapping.dtype == torch.int64 and slot_mapping.shape == (k.shape[0],),
           f"slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if k.shape[0] == 0:
        return
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(k.shape[0],)](k, v, k_pool, v_pool, slot_mapping, k.stride(0), v.stride(0),
                                    ROW=row, BLOCK=triton.next_power_of_2(row))
