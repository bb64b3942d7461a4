"""K/V tiles through Hopper's tensor memory accelerator (TMA) for the prefill kernel
(``../flash_attention.py``, the non-paged, unquantized path): the descriptor it loads from, the scratch
memory Triton needs to build one on the device, and the checks a tensor must pass to be described.

Why it exists: with pointer loads, every K/V tile of the main loop is gathered by cp.async (LDGSTS)
instructions whose addresses the warps compute themselves — on sm_90 about a hundred integer
instructions per tile per warp that compete with the softmax for issue slots. A TMA copy moves a
whole [BLOCK_N, HEAD_DIM] box from global to shared memory in one instruction (UTMALDG), from a
128-byte descriptor that holds the tensor's base, shape and strides; the hardware computes the
addresses and fills rows outside the shape with zeros (NVIDIA, CUDA C++ Programming Guide, "Tensor
Memory Access"; Hopper tuning guide). FlashAttention-3 (Shah et al., 2024) builds on the same copies,
with producer warps that only issue TMA while consumer warpgroups run the matrix products and the
softmax. Triton's ``tl.range(..., warp_specialize=True)`` asks its compiler for that split; on the
H200 (Triton 3.6) it failed to compile at 4 warps and was no faster at 8, so the kernel does without
(figures/h200/prefill_tma.json, variant ``tma_ws``).

One descriptor per (sequence, KV head), over that sequence's rows only: a packed varlen batch keeps
working, the tail tile's rows past the sequence's end come back as zeros rather than as the next
sequence's keys, and the loop loads tiles by their position in the sequence. The descriptors are
made on the device (``tl.make_tensor_descriptor``), because their base and row count differ per
program; Triton writes each into global scratch memory that it asks an allocator for at launch.
Q and O stay pointer loads and stores: each program touches them once, outside the loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check

TMA_ALIGN = 16  # bytes: a descriptor's base and its row stride (CUDA driver API, cuTensorMapEncodeTiled)


@triton.jit
def sequence_descriptor(base, row_start, rows, stride_row, BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """A descriptor over ``rows`` rows of one head (``base`` already points at the head), from row
    ``row_start``, loaded [BLOCK_ROWS, HEAD_DIM] at a time; rows past ``rows`` load as zeros."""
    return tl.make_tensor_descriptor(base + row_start.to(tl.int64) * stride_row, shape=[rows, HEAD_DIM],
                                     strides=[stride_row, 1], block_shape=[BLOCK_ROWS, HEAD_DIM])


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the descriptors a launch makes on the device (128 bytes each, per program).
    Allocated on the current stream by torch's caching allocator, so a launch inside a CUDA graph
    capture gets memory from the graph's pool."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def use_scratch_allocator() -> None:
    """Give Triton the allocator for device-side descriptors. Called before each TMA launch rather
    than once at import: Triton keeps the allocator in a ContextVar, which a thread started later
    (a server's worker) would not inherit; setting it is a cheap assignment."""
    triton.set_allocator(_scratch)


def not_describable(name: str, t: torch.Tensor) -> str | None:
    """Why ``t`` [tokens, heads, head_dim] cannot back a descriptor of one head (contiguous channels, base and
    token/head strides on 16-byte boundaries), or None if it can."""
    size = t.element_size()
    if t.stride(-1) != 1:
        return f"{name} has strides {t.stride()}; TMA needs a contiguous last dim"
    if t.data_ptr() % TMA_ALIGN:
        return (f"{name}'s data pointer is {t.data_ptr() % TMA_ALIGN} bytes past a {TMA_ALIGN}-byte boundary; "
                "TMA needs it on one")
    for dim in (0, 1):
        if t.stride(dim) * size % TMA_ALIGN:
            return (f"{name}.stride({dim}) is {t.stride(dim)} elements of {size} bytes; TMA needs a multiple of "
                    f"{TMA_ALIGN} bytes")
    return None


def check_describable(name: str, t: torch.Tensor) -> None:
    """Raise ``not_describable``'s reason, if there is one."""
    reason = not_describable(name, t)
    check(reason is None, reason)
