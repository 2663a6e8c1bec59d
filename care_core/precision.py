"""Scoped float32-matmul precision: Eq. 1 is destroyed by tf32, whatever the user set globally."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def matmul_precision(allow_tf32: bool) -> Iterator[None]:
    """Set float32 matmul precision ("highest" or "high" = tf32) inside the block, then restore it."""
    saved_global = torch.get_float32_matmul_precision()
    saved_cuda = torch.backends.cuda.matmul.allow_tf32
    saved_cudnn = torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("high" if allow_tf32 else "highest")
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        torch.backends.cudnn.allow_tf32 = allow_tf32
        yield
    finally:
        torch.set_float32_matmul_precision(saved_global)
        torch.backends.cuda.matmul.allow_tf32 = saved_cuda
        torch.backends.cudnn.allow_tf32 = saved_cudnn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (fp32, bf16, fp16) is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
