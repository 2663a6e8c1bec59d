"""The core helpers every method uses, imported on first call so that method modules load without torch."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """:func:`care_core.precision.compute_dtype` (float32 at least, float64 kept)."""
    from care_core.precision import compute_dtype as impl

    return impl(dtype)


def matmul_precision(allow_tf32: bool) -> AbstractContextManager[None]:
    """:func:`care_core.precision.matmul_precision` (TF32 matmuls on or off inside the block)."""
    from care_core.precision import matmul_precision as impl

    return impl(allow_tf32)
