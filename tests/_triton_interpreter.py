"""Running a test script in Triton's interpreter (CPU tensors, ``TRITON_INTERPRET=1``), for the kernels' tests."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_interpreted(script: str) -> str:
    """``script``'s stdout (stripped) from a fresh Python with Triton's interpreter on; skipped where Triton is not
    installed or its interpreter cannot run loops (Triton 3.6 hands a loop bound to range() as a 1-element array,
    which NumPy 2.5 refuses: seen on the GPU host, triton 3.6.0 and numpy 2.5.2, where each kernel's CUDA test covers
    it); a failing script fails the test with its stderr's tail."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CARE_DISABLE_TRITON": ""}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and "only 0-dimensional arrays can be converted" in done.stderr:
        pytest.skip("this Triton's interpreter cannot run its loops under this NumPy")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()
