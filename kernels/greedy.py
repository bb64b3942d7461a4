"""Greedy sampling's argmax over the vocabulary, split over many programs.

Why it exists: at batch 1 a decode token's argmax over llama2-7b's 32000 fp32 logits ran torch's generic reduction,
9.9 us of the GPU's time a token on an H200, after the CUDA graph (figures/h200/sweeps/decode_host_gap.json), where
the whole row is 128 KB still in L2 from the LM head. One program holding the row took as long (10.6 us,
decode_host_gap_cuda.json): one SM's loads and a 32768-wide reduction. Here each program takes CHUNK logits of a
row, writes its best (value, column), and the row's last program to arrive (``split_k.last_arrival``, the split-K
fix-up's counters) reduces those few partials and writes the token: 2.7-2.9 us a call on one row of 32000, torch's
argmax 8.7-8.9 in the same run (figures/h200/sweeps/latency_greedy.json, 20 calls in a CUDA graph, best of 5).

The answer is ``torch.argmax``'s, index for index: the first of equal maxima, and where a row holds NaN the first
NaN (torch orders NaN above every number). A chunk's best is the smallest column among its best value's lanes (its
NaN lanes', if any), and the partials are reduced by the same rule, so the order in which programs finish does not
matter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check, check_runnable
from .split_k import MAX_TILES, last_arrival, tile_counters

CHUNK = 1024  # logits a program reads: 32 programs for llama2-7b's vocabulary


@triton.jit
def _best(values, cols, n_cols):
    """(best value, its first column) of a 1-d block: NaN above all, ties to the smallest column. ``cols`` of
    lanes past the row are >= n_cols with value -inf, so a real column always wins a tie with them."""
    is_nan = values != values
    any_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(is_nan, float("-inf"), values), axis=0)
    col = tl.min(tl.where(tl.where(any_nan, is_nan, values == top), cols, n_cols), axis=0)
    return tl.where(any_nan, float("nan"), top), col


@triton.jit
def _argmax_kernel(X, Out, PartValue, PartCol, Counters, stride_x, n_cols,
                   CHUNK: tl.constexpr, PARTS: tl.constexpr):
    row, chunk, chunks = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    value, col = _best(x, cols, n_cols)
    tl.store(PartValue + row * PARTS + chunk, value)
    tl.store(PartCol + row * PARTS + chunk, col)
    if last_arrival(Counters, row, chunks):
        parts = tl.arange(0, PARTS)
        mine = parts < chunks
        values = tl.load(PartValue + row * PARTS + parts, mask=mine, other=float("-inf"), cache_modifier=".cg")
        part_cols = tl.load(PartCol + row * PARTS + parts, mask=mine, other=n_cols, cache_modifier=".cg")
        tl.store(Out + row, _best(values, part_cols, n_cols)[1].to(tl.int64))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for [rows, vocab] floating logits (the last dim contiguous): [rows] int64."""
    check(logits.dim() == 2 and logits.dtype in FLOAT_DTYPES,
          f"logits must be [rows, vocab] of one of {FLOAT_DTYPES} (compared in fp32), got {logits.dtype} "
          f"{tuple(logits.shape)}")
    rows, vocab = logits.shape
    check(vocab > 0 and (logits.stride(1) == 1 or vocab == 1),
          f"logits must have a non-empty, contiguous last dim, got shape {tuple(logits.shape)} "
          f"strides {logits.stride()}")
    check(rows <= MAX_TILES, f"{rows} rows; the kernel's arrival counters hold {MAX_TILES}")
    check_runnable("logits", logits)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    parts = triton.next_power_of_2(chunks)
    part_value = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
    part_col = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
    _argmax_kernel[(rows, chunks)](logits, out, part_value, part_col, tile_counters(logits.device), logits.stride(0),
                                   vocab, CHUNK=CHUNK, PARTS=parts, num_warps=4)
    return out
