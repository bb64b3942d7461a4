"""What every Gluon kernel of this package shares: Gluon itself where this Triton has it, and the few calls whose
names moved between Triton releases, under one name each.

Gluon (``triton.experimental.gluon``) is Triton's explicit-layout dialect: its programs name shared-memory buffers,
mbarriers, TMA copies and warpgroup matrix products. The kernels here are written for Triton >= MIN_TRITON (Gluon's
API moved between releases: ``warp_specialize``'s arguments in 3.6, the TMA load's name in 3.9); with an older
Triton, or none of Gluon, GLUON_USABLE is False and every operation keeps its portable Triton kernel.
"""

from __future__ import annotations

import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma
except ImportError:  # a Triton without Gluon (before 3.4)
    gluon = None

MIN_TRITON = (3, 6)
GLUON_USABLE = gluon is not None and tuple(int(part) for part in triton.__version__.split(".")[:2]) >= MIN_TRITON

if gluon is not None:
    # Triton 3.6 names the TMA load async_copy_global_to_shared; later versions call it async_load.
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    # And the barrier of a partition's (or a program's) warps thread_barrier; later versions barrier.
    _THREAD_BARRIER = gl.constexpr(hasattr(gl, "thread_barrier"))

    @gluon.jit
    def warps_barrier():
        if _THREAD_BARRIER:
            gl.thread_barrier()
        else:
            gl.barrier()

    # And the reinterpreting view of shared memory _reinterpret; later versions reinterpret.
    _PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

    @gluon.jit
    def reinterpret(view, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
        """``view``'s bytes as a [shape] tensor of ``dtype`` laid out by ``layout``."""
        if _PUBLIC_REINTERPRET:
            return view.reinterpret(dtype, shape, layout)
        else:
            return view._reinterpret(dtype, shape, layout)
