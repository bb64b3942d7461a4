"""Flash-decoding's second stage: merging the per-split partial outputs of ``paged_attention.py``.

Why a file of its own: stage 1 leaves, for each (sequence, query head) and each split of the context,
the split's normalised output and its log-sum-exp. The exact merge (``merge_attention_partials``, the
torch reference, says how; exercise ex04 writes it) can run in two places, and both call the one
``merge_splits`` below, so they agree bit for bit:

- a second kernel, ``merge_by_kernel``: one program per (sequence, query head), launched after stage 1
  (``merge="kernel"``);
- the last stage-1 program of each (sequence, KV head) to finish, inside stage 1, found with an
  arrival counter as ``split_k.py`` does for the quantized matmuls (``merge="last_split"``): one
  launch fewer per layer and token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minillm.kernels.pdl import let_next_start, supported as pdl_supported

# Who merges the splits (the MERGE constexpr of paged_attention._split_kernel): nobody (one split writes
# the output), a second kernel (_merge_kernel), or the last split program of each (sequence, KV head).
NO_MERGE, MERGE_KERNEL, MERGE_LAST_SPLIT = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
MERGES = {"kernel": MERGE_KERNEL, "last_split": MERGE_LAST_SPLIT}


@triton.jit
def merge_splits(part_ptrs, lse_ptrs, num_splits, stride_ps, row_ok, mask, MAX_SPLITS: tl.constexpr):
    """Merge ``num_splits`` partials of R query heads (``merge_attention_partials``'s arithmetic; the outputs
    are summed in split order): ``part_ptrs`` [R, BLOCK_D] point at split 0's outputs, split s at
    + s * stride_ps; ``lse_ptrs`` [R] at split 0's log-sum-exps, split s at + s. ``MAX_SPLITS``: a power
    of two >= num_splits. Returns the merged outputs, fp32.

    Every load is issued before any result is needed: the log-sum-exps as one [R, MAX_SPLITS] tile and
    the partials in an unrolled loop whose loads do not depend on each other. A loop over a run-time
    split count issued them one after another instead, each waiting ~a microsecond for L2, which made the
    merge kernel of a batch-1 decode step take 3-4 us (16 splits: ``figures/h200/tp_timeline_*.json``).
    Loads bypass L1 (".cg"): the last split program reads partials that programs on other SMs wrote
    during the same launch."""
    splits = tl.arange(0, MAX_SPLITS)
    present = row_ok[:, None] & (splits < num_splits)[None, :]
    lse = tl.load(lse_ptrs[:, None] + splits[None, :], mask=present, other=float("-inf"), cache_modifier=".cg")
    # Split 0 always holds token 0 (context_lens >= 1), so a row's largest lse is finite; absent rows get 0.
    top = tl.where(row_ok, tl.max(lse, axis=1), 0.0)
    weights = tl.exp(lse - top[:, None])  # empty or absent splits: exp(-inf) = 0
    total = tl.sum(weights, axis=1)
    acc = tl.zeros(part_ptrs.shape, tl.float32)
    for s in tl.static_range(MAX_SPLITS):
        weight = tl.sum(tl.where(splits[None, :] == s, weights, 0.0), axis=1)  # column s of weights
        live = tl.full(mask.shape, s, tl.int32) < num_splits  # splits past num_splits are not in the workspace
        acc += weight[:, None] * tl.load(part_ptrs + s * stride_ps, mask=mask & live, other=0.0, cache_modifier=".cg")
    return acc / total[:, None]


@triton.jit(do_not_specialize=["num_splits", "stride_pb", "stride_ph", "stride_ps", "stride_lb", "stride_lh",
                               "stride_ob", "stride_oh"])
def _merge_kernel(O_part, Lse, Out, num_splits,
                  stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MAX_SPLITS: tl.constexpr, PDL: tl.constexpr):
    """Stage 2 (merge="kernel"): program (b, h) merges the num_splits partials of one query head."""
    let_next_start(PDL)  # o_proj's GEMV may start warming L2 now (pdl.py)
    b = tl.program_id(0)
    row = tl.arange(0, 1)  # one row, for merge_splits's [rows, BLOCK_D] tiles; its mask folds to true
    head = tl.program_id(1) + row
    dims = tl.arange(0, BLOCK_D)
    mask = (row < 1)[:, None] & (dims < HEAD_DIM)[None, :]
    merged = merge_splits(O_part + b * stride_pb + head[:, None] * stride_ph + dims[None, :],
                          Lse + b * stride_lb + head * stride_lh, num_splits, stride_ps, row < 1, mask, MAX_SPLITS)
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
        HEAD_DIM=head_dim, BLOCK_D=block_d, MAX_SPLITS=triton.next_power_of_2(num_splits),
        PDL=pdl_supported(out.device), **({"num_warps": 1} if out.is_cuda else {}))
