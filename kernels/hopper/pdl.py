"""Programmatic dependent launch (PDL, Hopper and later): a kernel may start before the one ahead of it
on the stream has finished.

Why it exists: a batch-1 decode step is a chain of short kernels, and a GEMV spends its first
microsecond or two getting its programs onto the SMs and its first weight bytes on their way, while
the kernel before it (an RMSNorm on one SM, or the all-reduce + norm waiting for its peer over
NVLink) leaves the rest of the GPU idle. With PDL the GEMV's programs start as soon as the kernel
ahead of it says they may (``let_next_start``), ask for the first bytes of their weight rows (which
no kernel writes) into L2, and then wait (``wait_for_previous``) until that kernel has finished and
its writes are visible, before they read x. CUDA graphs keep these launches' overlap
(https://docs.nvidia.com/cuda/cuda-c-programming-guide/#programmatic-dependent-launch-and-synchronization;
CUTLASS's example 63 prefetches a GEMM's weights the same way).

The rules that keep it correct: a kernel launched with PDL reads and writes nothing that a kernel
before it touches until after ``wait_for_previous`` (weights aside, which no kernel of a step writes;
with CPU offload, ``minillm/offload.py`` refills a layer's staging buffers only after that layer's last
GEMV has finished, and the copy in is joined before the layer's first kernel, a norm launched as usual),
and every such kernel waits before it ends, so completion still follows stream order. ``let_next_start`` in
the kernel ahead changes only when the next one may be scheduled, never what it sees.

Only the GEMVs are launched early, the dense one (``../gemv.py``) and W4A16's (``../quant_matmul.py``, the Gluon
GEMVs): they are the kernels with work to do before their wait. Launching every kernel of the chain early (each
letting the next start, then waiting) makes batch-1 decode slower (``figures/h200/sweeps/pdl_chain.json``).

Under Triton's interpreter, and on GPUs before Hopper, the flag is off and these calls do nothing. ``ENABLED =
False`` (set before the first launch, e.g. by minillm's configuration) turns it off too, to measure what it buys.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..checks import interpreter_on

# Whether kernels launch with PDL where the device has it; a caller may set it False before the first launch.
ENABLED = True
# What a GEMV's programs ask L2 for before they wait for x, in all: dense (gemv.py) and W4A16 (quant_matmul.py).
# Beyond L2's share, lines would evict each other before they are read.
PREFETCH_BYTES = 8 * 2**20


def prefetch_pieces(count: int, piece_bytes: int, most: int) -> int:
    """How many pieces of ``piece_bytes`` each of ``count`` programs (or rows) may prefetch within PREFETCH_BYTES:
    a power of two, at most ``most``; 0 if not even one fits."""
    pieces = min(PREFETCH_BYTES // max(1, count * piece_bytes), most)
    return 0 if pieces < 1 else 1 << (pieces.bit_length() - 1)


def supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` use PDL: CUDA with compute capability 9.0 or later, not under the
    interpreter, and ENABLED."""
    return ENABLED and device.type == "cuda" and not interpreter_on() and _hopper_or_later(device)


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def let_next_start(PDL: tl.constexpr):
    """Allow the next kernel, if it was launched with PDL, to be scheduled now."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Block until the kernels ahead on the stream have finished and their writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_to_l2(ptrs):
    """Ask for the 128-byte lines at ``ptrs`` to be brought into L2 (no register is written; nothing waits)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0 unused", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
