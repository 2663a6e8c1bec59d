"""Golden-file checkers, one module per file-name prefix of tests/data/golden/ (see its README).

Each module defines ``check(data: dict[str, np.ndarray], filename: str) -> list[CaseResult]``: run our port of
the method on the stored inputs and compare with the stored official outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# file-name prefix -> checker module (in this package)
PREFIXES = {
    "visionzip_": "visionzip",
    "divprune_": "divprune",
    "tome_": "tome",
    "prumerge_": "prumerge",
    "ficoco_v_": "ficoco_v",
    "sparsevlm_": "sparsevlm",
    "zooprune_": "zooprune",
}


@dataclass(frozen=True)
class CaseResult:
    case: str  # e.g. "k64 out_tokens"
    passed: bool
    max_diff: float  # largest absolute difference (0 for exact integer matches; nan if shapes differ)
    note: str = ""


def compare(case: str, ours: object, expected: np.ndarray, atol: float = 0.0, note: str = "") -> CaseResult:
    """Exact comparison for integer arrays, `atol` for floating ones; shape mismatch fails."""
    got = np.asarray(ours)
    if got.shape != expected.shape:
        return CaseResult(case, False, float("nan"), f"shape {got.shape} != {expected.shape} {note}".strip())
    if got.size == 0:
        return CaseResult(case, True, 0.0, note)
    diff = float(np.max(np.abs(got.astype(np.float64) - expected.astype(np.float64))))
    return CaseResult(case, diff <= atol, diff, note)


def compare_relative(case: str, ours: object, expected: np.ndarray, rtol: float, atol: float = 0.0) -> CaseResult:
    """Pass when ``max |ours - expected| <= atol + rtol * max |expected|`` (one bound per array).

    For outputs of a deep float32 computation, whose rounding error scales with the array's magnitude rather than
    with each element's: docs/design/conventions.md §Golden tolerances."""
    got = np.asarray(ours)
    if got.shape != expected.shape:
        return CaseResult(case, False, float("nan"), f"shape {got.shape} != {expected.shape}")
    if got.size == 0:
        return CaseResult(case, True, 0.0)
    reference = expected.astype(np.float64)
    bound = atol + rtol * float(np.max(np.abs(reference)))
    diff = float(np.max(np.abs(got.astype(np.float64) - reference)))
    return CaseResult(case, diff <= bound, diff, f"bound {bound:.3g}")
