"""Every ``MINILLM_*`` environment variable minillm reads, declared once: name, type, default, meaning.

Why a registry: a setting read deep inside a module is a setting nobody finds. These are the few that
belong to the machine or the run rather than to one engine (engine settings are ``EngineConfig``
fields); each is read when asked for, not at import, so a value set later (a test's monkeypatch, a
benchmark pointing the cache elsewhere for one load) is seen. The kernels (``minillm.kernels``) import
nothing of minillm and read no variable but Triton's own ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Variable(Generic[T]):
    name: str
    type: Callable[[str], T]  # parses the variable's text
    default: T  # when it is unset or empty
    doc: str

    def get(self) -> T:
        text = os.environ.get(self.name, "")
        if not text:
            return self.default
        try:
            return self.type(text)
        except ValueError:
            raise ValueError(f"{self.name}={text!r} is not a valid {self.type.__name__}") from None

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))


CACHE = Variable("MINILLM_CACHE", Path, Path.home() / ".cache" / "minillm",
                 "where GGUF files converted to safetensors are kept, so the next load is fast")
COMMIT = Variable("MINILLM_COMMIT", str, "",
                  "the commit a benchmark result names, for a copy of the tree without .git (a GPU machine)")
CI = Variable("MINILLM_CI", str, "",
              "set (any value) by `make test`: the notebooks run their small CI-sized experiments")
FIGURES = Variable("MINILLM_FIGURES", Path, None,
                   "where the notebooks write the figures they draw (`make test` points it at a temporary folder)")
TEST_THREADS = Variable("MINILLM_TEST_THREADS", int, 1,
                        "torch's CPU threads in the test suite (one is fastest for its tiny shapes)")

VARIABLES = (CACHE, COMMIT, CI, FIGURES, TEST_THREADS)
