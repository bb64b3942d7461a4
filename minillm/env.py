"""Every ``MINILLM_*`` environment variable minillm reads, declared once: name, type, default, meaning.

Why a registry: a setting read deep inside a module is a setting nobody finds. These are the few that
belong to the machine or the run rather than to one engine (engine settings are ``EngineConfig``
fields); each is read when asked for, not at import, so a value set later (a test's monkeypatch, a
benchmark pointing the cache elsewhere for one load) is seen. The kernels' own variables live with
the kernels (``minillm.kernels``), which import nothing of minillm.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    doc: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))


CACHE = Variable("MINILLM_CACHE", str(Path.home() / ".cache" / "minillm"),
                 "where GGUF files converted to safetensors are kept, so the next load is fast")
COMMIT = Variable("MINILLM_COMMIT", "",
                  "the commit a benchmark result names, for a copy of the tree without .git (a GPU machine)")
CI = Variable("MINILLM_CI", "",
              "set (any value) by `make test`: the notebooks run their small CI-sized experiments")
FIGURES = Variable("MINILLM_FIGURES", "",
                   "where the notebooks write the figures they draw (`make test` points it at a temporary folder)")
TEST_THREADS = Variable("MINILLM_TEST_THREADS", "1",
                        "torch's CPU threads in the test suite (one is fastest for its tiny shapes)")

VARIABLES = (CACHE, COMMIT, CI, FIGURES, TEST_THREADS)


def cache_dir() -> Path:
    """``MINILLM_CACHE`` as a path."""
    return Path(CACHE.get())
