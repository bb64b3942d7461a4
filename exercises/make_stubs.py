"""Generate the learner's stubs exercises/exNN_*.py from the reference solutions/exNN_*.py.

Each region between ``# BEGIN SOLUTION: <hint>`` and ``# END SOLUTION`` (markers included) becomes
``raise NotImplementedError("exNN: <hint>")`` at the marker's indentation; everything else
(docstrings, signatures, imports) is copied as it is. The solutions are the single source: edit
them, never the stubs, then run this script. ``--check`` fails if a stub differs (CI).
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOLUTIONS = HERE / "solutions"
BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION(?::\s*(?P<hint>.*?))?\s*$")
END = re.compile(r"^\s*# END SOLUTION\s*$")
HEADER = ("# The exercise: replace each `raise NotImplementedError` with your code.\n"
          "# Generated from exercises/solutions/{name} by exercises/make_stubs.py.\n")


def make_stub(solution: Path) -> str:
    """The stub text for one solution file; ValueError on unbalanced or missing markers."""
    number = solution.name.split("_")[0]  # "ex01"
    out, inside = [HEADER.format(name=solution.name)], None
    for lineno, line in enumerate(solution.read_text().splitlines(keepends=True), 1):
        begin, end = BEGIN.match(line), END.match(line)
        if begin:
            if inside:
                raise ValueError(f"{solution}:{lineno}: BEGIN SOLUTION inside the region opened at line {inside}")
            inside = lineno
            message = json.dumps(f"{number}: {begin['hint'] or 'implement this'}", ensure_ascii=False)
            out.append(f"{begin['indent']}raise NotImplementedError({message})\n")
        elif end:
            if not inside:
                raise ValueError(f"{solution}:{lineno}: END SOLUTION without a BEGIN SOLUTION")
            inside = None
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{solution}:{inside}: BEGIN SOLUTION is never closed")
    if not any("raise NotImplementedError(" in line for line in out[1:]):
        raise ValueError(f"{solution}: no '# BEGIN SOLUTION' region, so its stub would be complete")
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a stub is missing or differs from what would be generated")
    args = parser.parse_args(argv)
    solutions = sorted(SOLUTIONS.glob("ex[0-9][0-9]_*.py"))
    problems = []
    for solution in solutions:
        stub_path = HERE / solution.name
        try:
            stub = make_stub(solution)
        except ValueError as error:
            problems.append(str(error))
            continue
        current = stub_path.read_text() if stub_path.exists() else None
        if current == stub:
            continue
        if not args.check:
            stub_path.write_text(stub)
            print(f"wrote {stub_path.relative_to(HERE.parent)}")
        elif current is None:
            problems.append(f"{stub_path.relative_to(HERE.parent)} is missing")
        else:
            diff = difflib.unified_diff(current.splitlines(keepends=True), stub.splitlines(keepends=True),
                                        f"{stub_path.name} (committed)", f"{stub_path.name} (generated)")
            problems.append(f"{stub_path.relative_to(HERE.parent)} has drifted from its solution:\n"
                            + "".join(list(diff)[:40]))
    for orphan in sorted(set(p.name for p in HERE.glob("ex[0-9][0-9]_*.py")) - {s.name for s in solutions}):
        problems.append(f"exercises/{orphan} has no solutions/{orphan}")
    for problem in problems:
        print(f"make_stubs: {problem}", file=sys.stderr)
    if problems:
        if args.check:
            print("make_stubs: stubs are out of date; edit exercises/solutions/ and run "
                  "`python exercises/make_stubs.py`, then commit the stubs", file=sys.stderr)
        return 1
    print(f"make_stubs: {len(solutions)} stub(s) up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
