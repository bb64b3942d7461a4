"""Split-K with a serial fix-up: the reduction dim of a matmul split over several programs, the last
one to finish summing their partials. Used by the dense GEMV (``gemv.py``) and the quantized matmuls
(``quant_matmul.py``).

Why: a memory-bound matmul at small M is limited by how many bytes are in flight, and N / BLOCK_N
programs alone leave most of the 132 SMs of an H200 idle when N = 4096. So K is also split over
SPLIT_K programs, each writing an fp32 partial; the *last* program of a column tile to finish sums
the partials in split order and writes y (the "serial split-K" or Stream-K fix-up: Osama et al.,
"Stream-K", PPoPP 2023, https://arxiv.org/abs/2301.03598). Compared with a second reduction kernel
this saves a launch (microseconds, on a kernel that should take ~6); compared with atomic adds into
y it needs no zeroed output and stays deterministic. It needs a per-tile arrival counter: a small
int32 buffer per device, zeroed once and reset to zero by the last program, so CUDA-graph replays
find it clean. (Two streams must not run these kernels on one device at once; minillm runs one.)
The paged decode attention kernel (``paged_attention.py``) merges its context splits the same way,
on the same counters (``last_arrival``), and so does the Gluon W4A16 GEMV (``hopper/w4_gemv.py``):
kernels on one stream run one after another, and each leaves every counter at zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check

MAX_TILES = 1 << 16  # arrival counters per device: the tiles of one split-K launch (see each user's check)
COUNTERS: dict[torch.device, torch.Tensor] = {}


@triton.jit
def split_range(rows, BLOCK: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's part [start, end) of the reduction dim: SPLIT_K runs of whole tiles (some may be empty)."""
    per_split = tl.cdiv(tl.cdiv(rows, SPLIT_K), BLOCK) * BLOCK
    start = tl.program_id(1) * per_split
    return start, tl.minimum(start + per_split, rows)


@triton.jit
def last_arrival(Counters, tile, num_programs):
    """Count this program's arrival at ``tile``; true for the last of the tile's ``num_programs``, which
    then sees every global store the others made before arriving (load them with cache_modifier=".cg":
    from L2, as L1 is not coherent between SMs) and has reset the counter to 0 for the next launch or
    CUDA-graph replay. Every program of the tile must arrive, once, even one with nothing to contribute."""
    # Every thread's stores happen before thread 0's release (barrier, then acq_rel atomic), so
    # the program that sees num_programs - 1 earlier arrivals sees every store (CUTLASS's semaphore).
    tl.debug_barrier()
    last = tl.atomic_add(Counters + tile, 1, sem="acq_rel") == num_programs - 1
    if last:
        tl.store(Counters + tile, 0)  # all have arrived: nobody else touches it in this launch
    return last


@triton.jit
def finish(acc, Y, Partials, Counters, m, n, mask, M, N, stride_ym, tile, SPLIT_K: tl.constexpr):
    """Write the [BLOCK_M, BLOCK_N] result; with split-K, the last program of the tile sums the partials."""
    y_ptrs = Y + m[:, None] * stride_ym + n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask)
    else:
        part_ptrs = Partials + m[:, None] * N + n[None, :]  # Partials [SPLIT_K, M, N] fp32
        tl.store(part_ptrs + tl.program_id(1) * M * N, acc, mask=mask)
        if last_arrival(Counters, tile, SPLIT_K):
            total = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT_K):  # in split order, whichever program came last: deterministic
                total += tl.load(part_ptrs + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")  # L2, not L1
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=mask)


def tile_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K arrival counters, zeroed once; the kernels leave them at zero."""
    if device not in COUNTERS:
        check(device.type != "cuda" or not torch.cuda.is_current_stream_capturing(),
              "the first split-K kernel on a device (the dense GEMV, a quantized matmul, paged decode attention "
              "with merge='last_split', or the greedy argmax) allocates its counters; run one before capturing a CUDA "
              "graph (warm-up does)")
        COUNTERS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return COUNTERS[device]
