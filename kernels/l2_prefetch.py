"""Ask L2 for a tensor's bytes ahead of the kernel that will read them: ``prefetch_l2(t, nbytes)``.

Why it exists: at batch-1 decode the GPU streams weights only while a GEMV runs. Between two GEMVs (RoPE and
the KV store, attention's split and merge, a norm) the HBM is nearly idle for microseconds, and the next GEMV
then starts its stream from cold. ``minillm/weight_prefetch.py`` fills those gaps: it launches this kernel on a
side stream as a GEMV ends, and the lines it asks for are in L2 when the next GEMV's copies arrive (the idea
of prefetching weights into L2 while other work runs is PRESERVE's, Yüzügüler et al. 2025, arXiv:2501.08192,
there across a collective).

The kernel is nothing but ``prefetch.global.L2`` instructions (``pdl.prefetch_to_l2``), one per 128-byte line,
spread over enough programs that they are issued within a microsecond or two: a prefetch writes no register
and nothing waits for it, so each program ends as soon as its instructions are issued, and the lines land
while the kernels on the main stream run.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from minillm.kernels.pdl import prefetch_to_l2

LINE = 128  # bytes: L2's line
BLOCK = 256  # lines a program asks for at a time (two a thread at 4 warps)
MAX_PROGRAMS = 264  # two an SM on an H100/H200: enough issuing threads without crowding the main stream's kernels


@triton.jit
def _prefetch_kernel(base, num_lines, per_program, BLOCK: tl.constexpr, LINE: tl.constexpr, MODE: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * per_program
    bytes_ptr = base.to(tl.pointer_type(tl.int8))
    for start in range(0, per_program, BLOCK):
        lines = first + start + tl.arange(0, BLOCK)
        lines = tl.where(lines < num_lines, lines, 0)  # past the end: line 0 again, which is harmless
        ptrs = bytes_ptr + lines * LINE
        if MODE == 0:
            prefetch_to_l2(ptrs)
        elif MODE == 1:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; // $0 unused", "=r,l", [ptrs],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(f"cp.async.bulk.prefetch.L2.global [$1], {LINE}; // $0 unused", "=r,l",
                                      [ptrs], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(t: torch.Tensor, nbytes: int | None = None, mode: int | None = None) -> None:
    """Ask L2 for the first ``nbytes`` (default: all) of contiguous CUDA tensor ``t``; returns at once."""
    if not t.is_cuda or not t.is_contiguous():
        raise ValueError(f"prefetch_l2 takes a contiguous CUDA tensor, got one on {t.device} with strides {t.stride()}")
    total = t.numel() * t.element_size()
    nbytes = total if nbytes is None else nbytes
    if not 0 <= nbytes <= total:
        raise ValueError(f"nbytes must be 0..{total} (the tensor's bytes), got {nbytes}")
    mode = int(os.environ.get("MINILLM_L2_MODE", "0")) if mode is None else mode
    line = LINE if mode < 2 else 4096
    num_lines = nbytes // line if mode == 2 else -(-nbytes // line)
    if num_lines == 0:
        return
    programs = min(MAX_PROGRAMS, -(-num_lines // BLOCK))
    per_program = -(-num_lines // programs)
    _prefetch_kernel[(programs,)](t, num_lines, per_program, BLOCK=BLOCK, LINE=line, MODE=mode, num_warps=4)
