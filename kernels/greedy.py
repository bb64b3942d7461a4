"""Greedy sampling's argmax over the vocabulary: one program per row.

Why it exists: at batch 1 a decode token's argmax over llama2-7b's 32000 fp32 logits ran torch's generic reduction,
9.9 us of the GPU's time a token on an H200, after the CUDA graph (figures/h200/sweeps/decode_host_gap.json), where
the whole row is 128 KB still in L2 from the LM head. Here one program holds a tile of up to 32768 logits in its
registers (a vocabulary longer than that is walked tile by tile), so the row is read in one or a few waves of loads.

The answer is ``torch.argmax``'s, index for index: the first of equal maxima, and where a row holds NaN the first
NaN (torch orders NaN above every number). Each lane keeps the best value and column it has seen; since the tiles
go left to right, a strict ``>`` keeps a lane's earliest column, and the lanes' bests are then reduced to the
smallest column among the best value's lanes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minillm.kernels.checks import check, check_runnable

MAX_TILE = 32768  # logits a program holds at once (32 a thread at 32 warps)


@triton.jit
def _argmax_kernel(X, Out, stride_x, n_cols, TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, TILE)
    best = tl.full([TILE], float("-inf"), tl.float32)
    best_col = cols  # a lane that never beats -inf keeps its first column: an all -inf row gives 0, as torch
    for start in range(0, n_cols, TILE):
        x = tl.load(X + row * stride_x + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(tl.float32)
        better = (x > best) | ((x != x) & (best == best))  # a NaN beats any number; a later NaN not the first
        best = tl.where(better, x, best)
        best_col = tl.where(better, start + cols, best_col)
    is_nan = best != best
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(is_nan, float("-inf"), best), axis=0)
    winners = tl.where(any_nan, is_nan, best == top)
    tl.store(Out + row, tl.min(tl.where(winners, best_col, n_cols), axis=0).to(tl.int64))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for [rows, vocab] floating logits (the last dim contiguous): [rows] int64."""
    check(logits.dim() == 2 and logits.is_floating_point(),
          f"logits must be [rows, vocab] floating point, got {logits.dtype} {tuple(logits.shape)}")
    check(logits.shape[1] > 0 and (logits.stride(1) == 1 or logits.shape[1] == 1),
          f"logits must have a non-empty, contiguous last dim, got shape {tuple(logits.shape)} "
          f"strides {logits.stride()}")
    check_runnable("logits", logits)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0] == 0:
        return out
    tile = min(triton.next_power_of_2(logits.shape[1]), MAX_TILE)
    _argmax_kernel[(logits.shape[0],)](logits, out, logits.stride(0), logits.shape[1], TILE=tile,
                                       num_warps=max(4, min(32, tile // 1024)))
    return out
