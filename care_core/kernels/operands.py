"""The fused kernels' weight operands, in PyTorch alone: made (and kept by a caller's gate) without Triton."""

from __future__ import annotations

import torch


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 rounded to tf32 (10 mantissa bits), to nearest with ties away from zero (``cvt.rna``)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


def weight_operand(w: torch.Tensor, *, bf16: bool) -> torch.Tensor:
    """A weight as the fused kernels read it (the jvp, norm-first and gemm-norm kernels' one rule): bf16, or float32
    rounded to tf32 to nearest (as ``cvt.rna`` rounds their other operand's tiles). One pass over the weight, which a
    caller that scores often makes once (:meth:`care_core.kernels.dispatch.KernelGate.operand`)."""
    return w.to(torch.bfloat16).contiguous() if bf16 else round_to_tf32(w)


def kernel_operand(w: torch.Tensor, *, bf16: bool, rounded: bool, kernel: str) -> torch.Tensor:
    """The weight operand a fused kernel reads: ``w`` itself where ``rounded`` (already :func:`weight_operand`'s,
    e.g. kept by a scorer's gate; its dtype checked), else made here."""
    if not rounded:
        return weight_operand(w, bf16=bf16)
    want = torch.bfloat16 if bf16 else torch.float32
    if w.dtype != want:
        raise ValueError(f"{kernel}: a rounded weight operand is {want}, got {w.dtype}")
    return w.contiguous()
