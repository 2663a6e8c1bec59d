"""CLIP's QuickGELU activation in one pass (CUDA only), bit for bit transformers' own.

transformers' ``QuickGELUActivation`` (the activation of the CLIP towers of LLaVA-1.5 and LLaVA-NeXT) computes
``x * sigmoid(1.702 * x)`` as three elementwise kernels, each reading and writing the MLP's whole hidden layer (4,096
values a patch row), a large share of a CLIP tower's time on a GPU (docs/design/backbones.md §Vision encoder).
:func:`quick_gelu` reads x once and writes the result once, computing what PyTorch's three CUDA kernels compute, each
step rounded to the input's type as there (round to nearest even):

    scaled = round(1.702f * x)       sigmoid = round(1 / (1 + exp(-scaled)))       out = round(x * sigmoid)

each product and the quotient in float32 (PyTorch's ``opmath``), the scalar 1.702 as a float32, the exponential by
the CUDA math library's ``expf`` (libdevice, as PyTorch's ``std::exp`` compiles), the quotient correctly rounded
(``div_rn``; Triton's ``/`` is an approximate division) and no fused multiply-add (``enable_fp_fusion=False``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

#: elements one program computes (memory-bound: large enough for full-width loads, small enough for many programs)
BLOCK = 2048


@triton.jit
def _quick_gelu_kernel(x_ptr, out_ptr, count, BLOCK: tl.constexpr):  # fmt: skip
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < count
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    kind = out_ptr.dtype.element_ty
    wide = x.to(tl.float32)
    scaled = (wide * 1.702).to(kind, fp_downcast_rounding="rtne").to(tl.float32)
    sigmoid = tl.math.div_rn(1.0, 1.0 + libdevice.exp(-scaled)).to(kind, fp_downcast_rounding="rtne")
    out = wide * sigmoid.to(tl.float32)
    tl.store(out_ptr + offsets, out.to(kind, fp_downcast_rounding="rtne"), mask=mask)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 * x)`` as transformers' ``QuickGELUActivation`` computes it on CUDA, bit for bit, contiguous,
    of x's type, for inputs :func:`care_core.kernels.dispatch.quick_gelu_applies` takes (which the entry point
    :func:`care_core.kernels.dispatch.quick_gelu` checks)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    count = x.numel()
    if count == 0:
        return out
    _quick_gelu_kernel[(triton.cdiv(count, BLOCK),)](x, out, count, BLOCK=BLOCK, num_warps=8,
                                                      enable_fp_fusion=False)  # fmt: skip
    return out
