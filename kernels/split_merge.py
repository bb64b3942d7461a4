"""Flash-decoding's second stage: merging the per-split partial outputs of ``paged_attention.py``; and, at the end,
the first stage's plain-torch reference split by split (``split_partials_ref``), which the kernel tests compare the
kernel's own partials with.

Why a file of its own: stage 1 leaves, for each (sequence, query head) and each split of the context,
the split's normalised output and its log-sum-exp. The exact merge (``merge_attention_partials``, the
torch reference, says how; exercise ex04 writes it) can run in two places, and both call the one
``merge_splits`` below, so they agree bit for bit:

- a second kernel, ``merge_by_kernel``: one program per (sequence, query head), launched after stage 1
  (``merge="kernel"``);
- the last stage-1 program of each (sequence, KV head) to finish, inside stage 1, found with an
  arrival counter as ``split_k.py`` does for the quantized matmuls (``merge="last_split"``): one
  launch fewer per layer and token.

How many splits (``choose_num_splits``) and where their partials live between the stages
(``PagedAttentionWorkspace``) are decided here too: both decode kernels, ``paged_attention.py``'s and
``hopper/paged_decode.py``'s, write into the one workspace and are merged by ``merge_by_kernel``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .hopper.pdl import let_next_start, supported as pdl_supported
from .kv_dequant import dequantize_as_kernels_do

# Who merges the splits (the MERGE constexpr of paged_attention._split_kernel): nobody (one split writes
# the output), a second kernel (_merge_kernel), or the last split program of each (sequence, KV head).
NO_MERGE, MERGE_KERNEL, MERGE_LAST_SPLIT = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
MERGES = {"kernel": MERGE_KERNEL, "last_split": MERGE_LAST_SPLIT}


# Splits whose loads merge_splits issues together: one compiled kernel for any split count, and
# ceil(num_splits / 16) waits for L2 a pass (one for Llama-2-7B's batch-1 decode on an H200: 9 splits, 16 at TP=2).
MERGE_CHUNK = tl.constexpr(16)


@triton.jit
def merge_splits(part_ptrs, lse_ptrs, num_splits, stride_ps, row_ok, mask):
    """Merge ``num_splits`` partials of R query heads (``merge_attention_partials``'s arithmetic, summed in
    split order): ``part_ptrs`` [R, BLOCK_D] point at split 0's outputs, split s at + s * stride_ps;
    ``lse_ptrs`` [R] at split 0's log-sum-exps, split s at + s. Returns the merged outputs, fp32 (rows
    where ``row_ok`` is false: zeros).

    The loads of MERGE_CHUNK splits are issued before any of them is needed (an unrolled inner loop), so a
    pass waits for L2 once a chunk, not once a split (``figures/h200/latency_tp_launches.json``, its timelines). Loads bypass L1 (".cg"): the last split
    program reads partials that programs on other SMs wrote during the same launch."""
    chunk = tl.arange(0, MERGE_CHUNK)
    top = tl.full(row_ok.shape, float("-inf"), tl.float32)
    for base in range(0, num_splits, MERGE_CHUNK):
        present = row_ok[:, None] & (base + chunk < num_splits)[None, :]
        lse = tl.load(lse_ptrs[:, None] + base + chunk[None, :], mask=present, other=float("-inf"),
                      cache_modifier=".cg")
        top = tl.maximum(top, tl.max(lse, axis=1))
    # Split 0 always holds token 0 (context_lens >= 1), so a row's largest lse is finite; absent rows get 0.
    top = tl.where(row_ok, top, 0.0)
    total = tl.zeros(row_ok.shape, tl.float32)
    acc = tl.zeros(part_ptrs.shape, tl.float32)
    for base in range(0, num_splits, MERGE_CHUNK):
        for s in tl.static_range(MERGE_CHUNK):
            live = row_ok & (tl.full(row_ok.shape, s, tl.int32) + base < num_splits)
            weight = tl.exp(tl.load(lse_ptrs + base + s, mask=live, other=float("-inf"), cache_modifier=".cg")
                            - top)  # empty or absent splits: exp(-inf) = 0
            total += weight
            acc += weight[:, None] * tl.load(part_ptrs + (base + s) * stride_ps, mask=mask & live[:, None],
                                             other=0.0, cache_modifier=".cg")
    return acc / tl.where(row_ok, total, 1.0)[:, None]


@triton.jit(do_not_specialize=["num_splits", "stride_pb", "stride_ph", "stride_ps", "stride_lb", "stride_lh",
                               "stride_ob", "stride_oh"])
def _merge_kernel(O_part, Lse, Out, num_splits,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Stage 2 (merge="kernel"): program (b, h) merges the num_splits partials of one query head."""
    let_next_start(PDL)  # o_proj's GEMV may start warming L2 now (hopper/pdl.py)
    b = tl.program_id(0)
    row = tl.arange(0, 1)  # one row, for merge_splits's [rows, BLOCK_D] tiles; its mask folds to true
    head = tl.program_id(1) + row
    dims = tl.arange(0, BLOCK_D)
    mask = (row < 1)[:, None] & (dims < HEAD_DIM)[None, :]
    merged = merge_splits(O_part + b * stride_pb + head[:, None] * stride_ph + dims[None, :],
                          Lse + b * stride_lb + head * stride_lh, num_splits, stride_ps, row < 1, mask)
    tl.store(Out + b * stride_ob + head[:, None] * stride_oh + dims[None, :], merged.to(Out.dtype.element_ty),
             mask=mask)


def merge_by_kernel(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, num_splits: int,
                    partial_strides: tuple[int, int, int], lse_strides: tuple[int, int], head_dim: int,
                    block_d: int) -> None:
    """Launch stage 2 over ``out`` [B, H, D]: ``partial`` (strides per batch, head, split) and ``lse``
    (per batch, head; splits contiguous) hold stage 1's results."""
    batch, heads = out.shape[:2]
    _merge_kernel[(batch, heads)](
        partial, lse, out, num_splits, *partial_strides, *lse_strides, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, PDL=pdl_supported(out.device), **({"num_warps": 1} if out.is_cuda else {}))


@dataclass
class PagedAttentionWorkspace:
    """Stage 1's partial results: ``out`` [max_batch, H, max_splits, D] fp32 (each split's normalised
    output) and ``lse`` [max_batch, H, max_splits] fp32 (natural-log softmax denominators). A call
    with batch B and S splits uses the views [:B, :, :S], so one workspace serves every smaller shape."""

    out: torch.Tensor
    lse: torch.Tensor

    @classmethod
    def allocate(cls, max_batch: int, num_heads: int, head_dim: int, max_splits: int,
                 device: torch.device | str) -> PagedAttentionWorkspace:
        return cls(torch.empty(max_batch, num_heads, max_splits, head_dim, dtype=torch.float32, device=device),
                   torch.empty(max_batch, num_heads, max_splits, dtype=torch.float32, device=device))


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int,
                      min_split_tokens: int = 128) -> int:
    """How many splits per sequence: enough stage-1 programs for about two waves over the SMs, but
    no split shorter than ``min_split_tokens`` (two 64-token tiles: shorter splits spend more on
    their partial's write and merge than they gain). ``max_context`` is the table's capacity
    (max_blocks * block_size), not an actual length, so the choice depends on shapes only.

    Both numbers come from a sweep of split counts (8..128) on the H200 at batch 1, 2k-32k tokens."""
    programs = batch * num_kv_heads
    wanted = triton.cdiv(2 * num_sms, programs)
    return max(1, min(wanted, max_context // min_split_tokens))


# ----------------------------------------------------------------------------- stage 1's reference
# The paged decode kernel's first stage in plain torch: each split's attention over its part of the context.
# ``paged_attention.paged_decode_attention_ref`` merges its partials with ``paged_attention.merge_attention_partials``
# (exercise 04 swaps that one in), and the kernel tests compare the kernel's own partials with it.


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
