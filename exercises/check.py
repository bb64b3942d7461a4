"""Run one exercise's tests and print a one-line verdict: what a notebook's "Try it" cell calls.

    python exercises/check.py ex02                    # your exercises/ex02_*.py (--impl=mine)
    python exercises/check.py ex02 --impl=solutions   # the reference solution

In a notebook: ``%run ../exercises/check.py ex02``. The tests run in a fresh Python process, so a
file you just edited is the one tested. While your file still raises the stub's NotImplementedError
the verdict is "0/N passed — your turn"; a test that fails for another reason is named with its
message, so you see what to fix without a page of tracebacks.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

EXERCISES = Path(__file__).resolve().parent
SUMMARY = re.compile(r"(\d+) (passed|failed|error|errors|skipped)")
FAILED = re.compile(r"^(?:FAILED|ERROR) \S*?::(\S+)(?: - (.*))?$")
STUB = re.compile(r"NotImplementedError: ex\d\d: ")


def test_file(exercise: str) -> Path:
    """exercises/tests/test_<exercise>*.py, e.g. "ex02" -> test_ex02_block_allocator.py."""
    matches = sorted((EXERCISES / "tests").glob(f"test_{exercise}*.py"))
    if len(matches) != 1:
        raise SystemExit(f"check: expected one test file for {exercise!r}, found {[m.name for m in matches]}")
    return matches[0]


def check(exercise: str, impl: str = "mine") -> int:
    """Run the tests of ``exercise`` against ``impl``; print the verdict; return the number failed."""
    path = test_file(exercise)
    # From exercises/, not the repository root: there the top-level kernels/ folder would shadow
    # Hugging Face's `kernels` package, which transformers imports.
    command = [sys.executable, "-m", "pytest", "-q", "--tb=no", "-rfE", "--color=no", "-p", "no:cacheprovider",
               f"--impl={impl}", str(path.relative_to(EXERCISES))]
    # No plugin autoload: the installed plugins (nbval, schemathesis, xdist, ...) are not used here and
    # importing them took most of a check's time.
    env = dict(os.environ, PYTHONWARNINGS="ignore", COLUMNS="240", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    run = subprocess.run(command, cwd=EXERCISES, capture_output=True, text=True, env=env)
    lines = run.stdout.splitlines()
    counts = {kind: int(n) for line in lines[-1:] for n, kind in SUMMARY.findall(line)}
    passed = counts.get("passed", 0)
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    total = passed + failed
    name = path.stem.removeprefix("test_")
    if total == 0:
        print(f"{name}: the tests did not run (pytest exit code {run.returncode}):")
        print("\n".join((run.stdout + run.stderr).splitlines()[-15:]))
        return 1
    failures = [m.groups() for m in map(FAILED.match, lines) if m]
    if failed == 0:
        print(f"{name}: {passed}/{total} passed — well done")
    elif passed == 0 and failures and all(STUB.search(message or "") for _, message in failures):
        print(f"{name}: 0/{total} passed — your turn: open exercises/{name}.py")
    else:
        print(f"{name}: {passed}/{total} passed; failing:")
        for test, message in failures[:8]:
            print(f"  {test}: {(message or '').strip()[:160]}")
        if len(failures) > 8:
            print(f"  ... and {len(failures) - 8} more")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("exercise", help="the exercise's number, e.g. ex02")
    parser.add_argument("--impl", choices=("mine", "solutions", "exercises"), default="mine")
    args = parser.parse_args(argv)
    return 1 if check(args.exercise, args.impl) else 0


if __name__ == "__main__":
    if "IPython" in sys.modules:  # `%run` in a notebook: print the verdict, raise no SystemExit
        main()
    else:
        sys.exit(main())
