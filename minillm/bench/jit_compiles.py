"""Count the Triton kernel compilations that happen inside a timed run.

Why: Triton compiles a kernel again whenever a launch brings a specialisation it has not met in this
process (new constexprs, an integer argument newly equal to 1 or divisible by 16, a pointer newly
on or off a 16-byte boundary). A compile stalls the run for up to about a second, so one inside a
timed run reads as a slower engine: the prefix-cache run of the open-loop multi-turn benchmark
(`multi-turn-open`, figures/h200/prefix_cache_multi_turn_fcfs.json) lost 24 % of its throughput to a
single one (tests/test_kernel_specialization.py). The throughput harness records the count of every
timed run: anything above 0 means the warm-up missed a variant and the time includes compiling.

Triton calls ``triton.knobs.runtime.jit_cache_hook`` before each compile (Triton >= 3.4; a variant
found in Triton's on-disk cache counts too: it is still loaded mid-run). Older Triton, or none,
gives ``None``: not known.
"""

from __future__ import annotations


class CompileCounter:
    """``with CompileCounter() as compiles: ...``, then ``compiles.count``: Triton compiles inside
    the block, or None where this Triton offers no hook. A hook set before is kept and still called."""

    def __init__(self):
        self.count: int | None = None
        self._runtime = None
        self._previous = None

    def __enter__(self) -> CompileCounter:
        try:
            from triton import knobs
        except ImportError:  # no Triton, or one without knobs (< 3.4)
            return self
        if not hasattr(knobs.runtime, "jit_cache_hook"):
            return self
        self.count = 0
        self._runtime, self._previous = knobs.runtime, knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook
        return self

    def _hook(self, *args, **kwargs):
        self.count += 1
        # A true return value makes Triton skip the compile: only an earlier hook may ask for that.
        return self._previous(*args, **kwargs) if self._previous is not None else None

    def __exit__(self, *exc) -> None:
        if self._runtime is not None:
            self._runtime.jit_cache_hook = self._previous
            self._runtime = None
