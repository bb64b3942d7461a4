"""Run the exercise tests against one implementation, chosen with ``--impl``:

- ``mine`` (default): your exercises/exNN_*.py, tested normally; this is what you run while working.
- ``solutions``: the reference solutions in exercises/solutions/; every test must pass (CI).
- ``exercises``: the CI check of the committed stubs. A test passes only if it raised the stub's
  ``NotImplementedError("exNN: ...")``; one that passes or fails in another way is a failure.

Tests take the ``impl`` fixture, the module named after the test file (test_ex01_top_p.py ->
ex01_top_p), and so stay ordinary pytest tests; the stub check is a report hook below.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest
import torch

EXERCISES = Path(__file__).resolve().parent.parent
STUB_MESSAGE = re.compile(r"ex\d\d: ")  # what make_stubs.py puts in every stub's NotImplementedError
_stub_passes = pytest.StashKey[dict]()

# Without a GPU the Triton kernels (exercise 04) run under Triton's CPU interpreter. The switch is read
# when a kernel is defined, so it must be set before any test module imports minillm.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--impl", choices=("mine", "solutions", "exercises"), default="mine",
                     help="exercise code to test: mine (your exercises/exNN_*.py), solutions (reference), "
                          "exercises (CI: every test must hit the stub's NotImplementedError)")


def pytest_configure(config):
    config.stash[_stub_passes] = {}


def pytest_report_header(config):
    return f"exercises: --impl={config.getoption('--impl')}"


def load_impl(config: pytest.Config, name: str):
    """Import exercises/<name>.py (mine, exercises) or exercises/solutions/<name>.py (solutions)."""
    impl = config.getoption("--impl")
    path = EXERCISES / "solutions" / f"{name}.py" if impl == "solutions" else EXERCISES / f"{name}.py"
    module_name = f"_exercise_{impl}_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return sys.modules[module_name]


@pytest.fixture
def impl(request):
    """The module under test, named after the test file: test_ex01_top_p.py -> ex01_top_p."""
    return load_impl(request.config, request.path.stem.removeprefix("test_"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when != "call" or report.skipped or item.config.getoption("--impl") != "exercises":
        return report
    error = call.excinfo.value if call.excinfo else None
    if isinstance(error, NotImplementedError) and STUB_MESSAGE.match(str(error)):
        report.outcome, report.longrepr = "passed", None
        item.config.stash[_stub_passes].setdefault(item.path.name, []).append(str(error))
    elif error is None:
        report.outcome = "failed"
        report.longrepr = (f"--impl=exercises: {item.nodeid} passed, but against a stub it should raise "
                           f"NotImplementedError('exNN: ...'). Is the stub implemented? Regenerate it with "
                           f"`python exercises/make_stubs.py`; test your own version with --impl=mine.")
    else:
        report.sections.append(("--impl=exercises", f"expected the stub's NotImplementedError('exNN: ...'), "
                                                    f"got {type(error).__name__}: {error}"))
    return report


def pytest_terminal_summary(terminalreporter, config):
    if config.getoption("--impl") != "exercises":
        return
    passes = config.stash[_stub_passes]
    terminalreporter.section("stub check (--impl=exercises)")
    for file, messages in sorted(passes.items()):
        hints = "; ".join(sorted(set(messages)))
        terminalreporter.write_line(f"{file}: {len(messages)} test(s), stub raised NotImplementedError "
                                    f"as expected ({hints})")
    if not passes:
        terminalreporter.write_line("no test reached a stub's NotImplementedError")
