"""The paged decode kernel's first stage in plain torch: each split's attention over its part of the context.

Why it exists apart from ``paged_attention.py``: it is that kernel's reference, split by split, and nothing else
(one mechanism a file). ``paged_attention.paged_decode_attention_ref`` merges its partials with
``paged_attention.merge_attention_partials`` (exercise 04 swaps that one in), and the kernel tests compare the
kernel's own partials with it.
"""

from __future__ import annotations

import torch
import triton

from minillm.kernels.kv_dequant import dequantize_as_kernels_do


def _gather_sequence(cache: torch.Tensor, table: torch.Tensor, length: int, scales: torch.Tensor | None,
                     dtype: torch.dtype) -> torch.Tensor:
    """One sequence's first ``length`` tokens, [length, Hkv, D] in fp32, from the block pool
    (dequantized with ``scales`` as the kernel does for queries of ``dtype``, if quantized)."""
    blocks = table[: triton.cdiv(length, cache.shape[1])].long()
    values = dequantize_as_kernels_do(cache[blocks], None if scales is None else scales[blocks], dtype)
    return values.flatten(0, 1)[:length]


def split_partials_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, num_splits: int, scale: float | None = None,
                       tile: int = 1, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query over each split of its context, in fp32.

    Split s of a sequence of ``ctx`` tokens covers tokens [s * L, min((s + 1) * L, ctx)) with
    L = ceil(ceil(ctx / num_splits) / tile) * tile; the kernel rounds to its tile, BLOCK_N, so pass
    that as ``tile`` to compare its partials split by split. Returns ``out`` [B, H, num_splits, D], each split's
    softmax-normalised output, and ``lse`` [B, H, num_splits], the natural log of its softmax
    denominator (the log-sum-exp of its scores); an empty split has out 0 and lse -inf. A quantized
    cache is dequantized with ``k_scale`` / ``v_scale`` first, as the kernel does
    (``kv_dequant.dequantize_as_kernels_do``).
    """
    batch, heads, dim = q.shape
    group = heads // k_cache.shape[2]
    scale = dim ** -0.5 if scale is None else scale
    out = q.new_zeros(batch, heads, num_splits, dim, dtype=torch.float32)
    lse = q.new_full((batch, heads, num_splits), float("-inf"), dtype=torch.float32)
    for b in range(batch):
        ctx = int(context_lens[b])
        keys = _gather_sequence(k_cache, block_tables[b], ctx, k_scale, q.dtype).repeat_interleave(group, dim=1)
        values = _gather_sequence(v_cache, block_tables[b], ctx, v_scale, q.dtype).repeat_interleave(group, dim=1)
        length = triton.cdiv(triton.cdiv(ctx, num_splits), tile) * tile
        for s in range(num_splits):
            lo, hi = s * length, min((s + 1) * length, ctx)
            if lo >= hi:
                continue
            scores = torch.einsum("hd,nhd->hn", q[b].float(), keys[lo:hi]) * scale
            lse[b, :, s] = torch.logsumexp(scores, dim=-1)
            out[b, :, s] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), values[lo:hi])
    return out, lse
