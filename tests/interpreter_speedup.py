"""Triton's CPU interpreter, without its repeated patching of ``triton.language`` (tests only).

To run a kernel, the interpreter swaps ``triton.language``'s builtins for NumPy versions (``_patch_lang``,
undone when the launch ends). It does that again at every call of a ``@triton.jit`` helper inside the
kernel, with ``inspect.getmembers`` over four modules each time, although the launch has patched the same
modules already: a kernel whose ``tl.static_range`` loops call small helpers thousands of times spends a
third of its time there. Here a helper called inside a launch skips the patching when every language module
it sees is one the launch has patched; anything else goes through Triton's own code. What a kernel computes
does not change: the helper runs under the same patches either way.
"""

from __future__ import annotations

import inspect


def patch_language_once_per_launch() -> bool:
    """Install the shortcut; False (and nothing changed) where this Triton's interpreter lacks the internals
    it relies on (``GridExecutor``, ``InterpretedFunction``, ``_patch_lang``)."""
    import triton.language as tl
    from triton.runtime import interpreter

    grid_executor = getattr(interpreter, "GridExecutor", None)
    function = getattr(interpreter, "InterpretedFunction", None)
    if grid_executor is None or function is None or not hasattr(interpreter, "_patch_lang"):
        return False
    launches: list[set[int]] = []  # the language modules each launch in progress has patched
    seen: dict[int, set[int]] = {}  # a module's globals -> the language modules among them

    def languages(fn) -> set[int]:
        names = fn.__globals__
        if id(names) not in seen:
            seen[id(names)] = {id(value) for value in names.values()
                               if inspect.ismodule(value) and value in (tl, tl.core)}
        return seen[id(names)]

    launch = grid_executor.__call__

    def launch_with_patches(self, *args, **kwargs):
        launches.append(languages(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def call_helper(self, *args, **kwargs):  # InterpretedFunction.__call__, minus the redundant patching
        if not launches or not languages(self.fn) <= launches[-1]:
            interpreter._patch_lang(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    grid_executor.__call__ = launch_with_patches
    function.__call__ = call_helper
    return True
