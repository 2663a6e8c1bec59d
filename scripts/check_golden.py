#!/usr/bin/env python
"""Check our ports of peer methods against golden outputs of their official code.

    python -m scripts.check_golden                          # every tests/data/golden/*.npz
    python -m scripts.check_golden tests/data/golden/tome_*.npz

Run from the repository root (as a module: it imports care_core and scripts.golden_checks from there).

The method is chosen by the file-name prefix (tests/data/golden/README.md describes every file; tolerances in
docs/design/conventions.md §Golden tolerances). Prints one line per case, PASS or FAIL with the largest difference; exit
status 1 if any case fails, or if no file is given and the default folder holds none.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import numpy as np

from scripts.golden_checks import PREFIXES, CaseResult

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "golden"


def default_files(folder: Path | None = None) -> list[Path]:
    """The golden files checked when none are named: every ``*.npz`` of tests/data/golden/, sorted."""
    return sorted((folder or DEFAULT_DIR).glob("*.npz"))


def check_file(path: Path) -> list[CaseResult]:
    prefix = next((p for p in PREFIXES if path.name.startswith(p)), None)
    if prefix is None:
        return [
            CaseResult(path.name, False, float("nan"), f"no checker for this prefix (known: {', '.join(PREFIXES)})")
        ]
    module = importlib.import_module(f"scripts.golden_checks.{PREFIXES[prefix]}")
    with np.load(path) as npz:
        data = {k: npz[k] for k in npz.files}
    return module.check(data, path.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="golden .npz files (default: tests/data/golden/*.npz)")
    args = parser.parse_args(argv)
    files = args.files or default_files()
    if not files:
        print(f"FAIL no golden files in {DEFAULT_DIR}")
        return 1
    failed = 0
    for path in files:
        if not path.is_file():
            print(f"FAIL {path}: no such file")
            failed += 1
            continue
        for result in check_file(path):
            status = "PASS" if result.passed else "FAIL"
            note = f"  ({result.note})" if result.note else ""
            print(f"{status} {path.name} {result.case}: max diff {result.max_diff:.3g}{note}")
            failed += not result.passed
    print(f"{'all cases passed' if failed == 0 else f'{failed} case(s) failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
