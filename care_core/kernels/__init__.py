"""Optional fused GPU kernels (Triton) for the hot spots of CaRe; every one has a pure-PyTorch twin.

Nothing here is imported unless a CUDA tensor reaches the core: ``import care_core`` never imports
Triton, and on the CPU (or without Triton, or with ``CARE_DISABLE_TRITON=1``) the core runs its
PyTorch code unchanged.

- :mod:`care_core.kernels.jvp`: the jvp engine's MLP path, ``||W2 diag(act'(W1 v_i + b1)) W1 u_x||``
  for every token i and direction x, with the elementwise product fused into the matmul's operand load
  and the squared norm into its epilogue: the (m, N, d_out) products never reach device memory. Used
  for bf16 matmuls; for tf32 only with ``care_core.scoring.FUSED_TF32`` (cuBLAS was faster on an H200).
- :mod:`care_core.kernels.greedy`: Eq. 3's K sequential greedy steps in one single-block kernel over a
  precomputed cosine Gram matrix: one launch, no host synchronisation, no per-step launches.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def triton_enabled(device: torch.device) -> bool:
    """True when the fused kernels may run on ``device``: CUDA, Triton importable, not disabled by env."""
    if device.type != "cuda":
        return False
    if os.environ.get("CARE_DISABLE_TRITON", "").strip() not in ("", "0"):
        return False
    return _triton_importable()
