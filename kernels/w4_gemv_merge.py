"""Flash-decoding's merge folded into the GEMV behind it: at batch 1, o_proj's W4A16 GEMV builds its input from the
decode attention's per-split partials instead of reading a merged row.

Why: a batch-1 decode step's attention is two kernels a layer, the split kernel (each split of the context's
normalised output and log-sum-exp, ``paged_attention.py``) and the merge kernel (``split_merge.py``): 32 programs that
do almost nothing, but a kernel boundary on the token's critical path, 3.7 us a layer of Llama-2-7B's 53
(figures/h200/sweeps/decode_graph_step_order.json). o_proj's GEMV needs only its own slice of the merged row: with a
tile a program (``w4_gemv_hopper.choose_tiles`` gives o_proj one), 128 inputs, one head. So each program merges the
inputs it reads as it builds its x tables (``merged_words``): the head's log-sum-exps and its partials for those
inputs, one round trip to L2 where the merged row's words were one too, then ``merge_splits``'s arithmetic.

Numerics: each input is ``merge_attention_partials``'s exact merge, rounded to bf16 as the merge kernel rounds it;
its sums over the splits are warp shuffles, another order than the merge kernel's, so an input may differ from that
kernel's in its last bit (tests/kernels/test_w4_gemv_merge.py bounds it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minillm.kernels.flash_attention_hopper import GLUON_USABLE, gluon

MAX_SPLITS = 64  # splits a row's merge holds: 32 lanes of a warp, two each


class Merge(NamedTuple):
    """The decode attention's unmerged output for one token, the GEMV's input once merged: ``partial`` [1, H, S, D]
    fp32 (each split's normalised output) and ``lse`` [1, H, S] fp32 (its natural-log softmax denominators), S
    splits, as ``PagedAttentionWorkspace`` holds them. The row it stands for is the heads' outputs, H * D inputs."""
    partial: torch.Tensor
    lse: torch.Tensor


def merge_unsupported(merge: Merge, k: int, device: torch.device) -> str | None:
    """Why the GEMV cannot merge ``merge`` into its K inputs, or None."""
    partial, lse = merge.partial, merge.lse
    if partial.dim() != 4 or lse.dim() != 3 or partial.shape[:3] != lse.shape or partial.shape[0] != 1:
        return f"it merges partials [1, H, S, D] with lse [1, H, S], not {tuple(partial.shape)} and {tuple(lse.shape)}"
    _, heads, splits, dim = partial.shape
    if heads * dim != k or dim % 8:
        return f"it merges H x D = K = {k} inputs, D a multiple of 8 (a packed row in one head), not {heads} x {dim}"
    if not 1 <= splits <= MAX_SPLITS:
        return f"it merges 1 to {MAX_SPLITS} splits, not {splits}"
    if partial.dtype != torch.float32 or lse.dtype != torch.float32:
        return f"it merges fp32 partials and lse, not {partial.dtype} and {lse.dtype}"
    if partial.device != device or lse.device != device:
        return f"its partials must be on {device}, not {partial.device}"
    if partial.stride(-1) != 1 or lse.stride(-1) != 1:
        return f"it reads partials and lse with unit last strides, not {partial.stride()} and {lse.stride()}"
    return None


if GLUON_USABLE:
    from triton.experimental.gluon import language as gl

    from minillm.kernels.w4_gemv_norms import bf16_words

    @gluon.jit
    def merged_words(Parts, Lse, r, ok, num_splits, stride_ph, stride_ps, stride_lh, HEAD_DIM: gl.constexpr,
                     SPLITS: gl.constexpr, SPLIT_LANES: gl.constexpr, WARPS_: gl.constexpr):
        """The merged row's int32 words (two bf16 each) of packed rows r ([ROWS], rows_l as ``_x_tables`` lays
        them; zeros where not ok): inputs 8r .. 8r + 7 of head 8r // HEAD_DIM, each the weighted mean of its
        num_splits partials (``split_merge.merge_splits``'s arithmetic: weights exp(lse - max lse)). A row's SPLITS
        (a power of two >= num_splits) splits lie across SPLIT_LANES lanes of a warp (SPLITS // SPLIT_LANES each), so
        each thread loads a few values and the sums over splits are warp shuffles; absent splits weigh 0."""
        rows_l: gl.constexpr = r.type.layout
        splits_l: gl.constexpr = gl.BlockedLayout([1, SPLITS // SPLIT_LANES], [32 // SPLIT_LANES, SPLIT_LANES],
                                                  [WARPS_, 1], [1, 0])
        row_ok = gl.convert_layout(ok, gl.SliceLayout(1, splits_l))
        r2 = gl.convert_layout(r, gl.SliceLayout(1, splits_l))[:, None]
        s = gl.arange(0, SPLITS, layout=gl.SliceLayout(0, splits_l))[None, :]
        present = row_ok[:, None] & (s < num_splits)
        head = (8 * r2) // HEAD_DIM
        lse = gl.load(Lse + head * stride_lh + s, mask=present, other=float("-inf"))
        first = Parts + head * stride_ph + s * stride_ps + (8 * r2) % HEAD_DIM
        # All eight inputs' partials in flight before the first is needed: one round trip.
        p0 = gl.load(first, mask=present, other=0.0)
        p1 = gl.load(first + 1, mask=present, other=0.0)
        p2 = gl.load(first + 2, mask=present, other=0.0)
        p3 = gl.load(first + 3, mask=present, other=0.0)
        p4 = gl.load(first + 4, mask=present, other=0.0)
        p5 = gl.load(first + 5, mask=present, other=0.0)
        p6 = gl.load(first + 6, mask=present, other=0.0)
        p7 = gl.load(first + 7, mask=present, other=0.0)
        top = gl.where(row_ok, gl.max(lse, axis=1), 0.0)  # finite where ok: split 0 holds token 0
        weight = gl.exp(lse - top[:, None])  # absent splits: exp(-inf) = 0
        total = gl.where(row_ok, gl.sum(weight, axis=1), 1.0)
        w0 = bf16_words(_mean(weight, p0, total), _mean(weight, p1, total))
        w1 = bf16_words(_mean(weight, p2, total), _mean(weight, p3, total))
        w2 = bf16_words(_mean(weight, p4, total), _mean(weight, p5, total))
        w3 = bf16_words(_mean(weight, p6, total), _mean(weight, p7, total))
        return (gl.convert_layout(w0, rows_l), gl.convert_layout(w1, rows_l), gl.convert_layout(w2, rows_l),
                gl.convert_layout(w3, rows_l))

    @gluon.jit
    def _mean(weight, parts, total):
        """sum_s weight_s parts_s / total, rounded to bf16 as the merge kernel stores it."""
        return (gl.sum(weight * parts, axis=1) / total).to(gl.bfloat16)
