"""Warm the L2 cache with the next matmul's weights while a small kernel leaves HBM idle.

Why: at batch 1 a decode step alternates weight GEMVs, which stream HBM, with small kernels during
which HBM idles: the RMSNorm before qkv_proj and gate_up_proj (2.3 us on an H200), and with tensor
parallelism the all-reduce fused into it (4.9 us, most of it waiting for the peer GPU:
``figures/h200/latency_tp_fused.json``). An H200's L2 holds 50 MB; at 4 TB/s a 5 us window could
bring in 20 MB of the weights the next GEMV will read. Hopper's bulk prefetch
(``cp.async.bulk.prefetch.L2.global [addr], size``, PTX ISA 8.0, sm_90) asks for a whole range with
one instruction, no registers and no wait, so the small kernel issues it first and goes on.

Which bytes: the first ``bytes_per_row`` of every row of the weight W [N, K] (``nn.Linear``'s
row-major layout). A GEMV at M=1 gives each thread block a block of rows and walks K from the start
(cuBLAS's M=1 kernels, like the split-K-free tiles of the W4A16 GEMV), so every block finds the start
of its rows in L2, instead of a few blocks finding all of theirs and the rest none (the slowest block
sets the GEMV's time). Under the interpreter (no PTX) nothing is prefetched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minillm.kernels.checks import check
from minillm.kernels.int_float import ASM

ROWS = tl.constexpr(128)  # row starts a program prefetches at a time (one per thread at 4 warps)


@triton.jit
def prefetch_row_starts(W, n_rows, row_bytes, bytes_per_row, p, programs):
    """Program ``p`` of ``programs``: prefetch the first ``bytes_per_row`` of its share of W's rows into L2."""
    if ASM:
        base = W.to(tl.int64)  # the address
        for start in range(p * ROWS, n_rows, programs * ROWS):
            rows = tl.minimum(start + tl.arange(0, ROWS), n_rows - 1)  # (past the end: the last row again)
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                      [base + rows.to(tl.int64) * row_bytes, bytes_per_row + rows * 0],
                                      dtype=tl.int32, is_pure=False, pack=1)


def prefetch_plan(weight: torch.Tensor, total_bytes: int) -> tuple[torch.Tensor, int]:
    """(weight, bytes_per_row): about ``total_bytes`` of ``weight`` [N, K], spread as the first bytes of every
    row, in the 16-byte multiples the bulk prefetch takes."""
    check(weight.dim() == 2 and weight.is_contiguous(), f"weight is {tuple(weight.shape)} with strides "
          f"{weight.stride()}; expected a contiguous [N, K] matrix")
    row_bytes = weight.shape[1] * weight.element_size()
    check(row_bytes % 16 == 0, f"rows of {row_bytes} bytes are not 16-byte aligned")
    return weight, min(row_bytes, total_bytes // weight.shape[0] // 16 * 16)


def prefetch_args(plan: tuple[torch.Tensor, int] | None, like: torch.Tensor) -> dict:
    """A kernel's prefetch arguments for ``plan`` (or none: then ``like`` stands in and nothing is fetched)."""
    if plan is None or plan[1] == 0:
        return dict(P=like, p_rows=0, p_row_bytes=0, p_bytes=0, PREFETCH=False)
    weight, bytes_per_row = plan
    return dict(P=weight, p_rows=weight.shape[0], p_row_bytes=weight.shape[1] * weight.element_size(),
                p_bytes=bytes_per_row, PREFETCH=True)

