"""The Qwen vision towers' rotary embedding of queries and keys in one pass (CUDA only), bit for bit transformers' own.

transformers' ``apply_rotary_pos_emb_vision`` (Qwen2.5-VL, Qwen3-VL, Qwen3.5) casts q and k to float32 and computes
``q cos + rotate_half(q) sin`` in separate elementwise passes over float32 copies (cast, product, negation,
concatenation, product, sum, cast back): at a tower's tens of thousands of patch rows these passes took about a fifth
of Qwen2.5-VL-7B's tower on an H200 (docs/design/backbones.md §Vision rotary). :func:`rotate_vision` reads q and k
once and writes them once, computing the same float32 operations on the same values, each rounded as there: the two
products, then their sum (compiled without fused multiply-add, ``enable_fp_fusion=False``, which would skip the
products' rounding), then the cast to the inputs' type (round to nearest even). With ``rotate_half(x) = (-x2, x1)``
for the halves x1, x2 of each head's dims::

    out1 = x1 cos1 + (-x2) sin1        out2 = x2 cos2 + x1 sin2
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_rows(x_ptr, out_ptr, cos_ptr, sin_ptr, row, heads, stride_row, stride_head, stride_cos, stride_sin,
                 HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    head = tl.arange(0, BLOCK_HEADS)[:, None]
    dim = tl.arange(0, BLOCK_HALF)[None, :]
    in_dims = dim < HALF
    mask = (head < heads) & in_dims
    src = x_ptr + row * stride_row + head * stride_head + dim
    first = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    cos = cos_ptr + row * stride_cos + dim
    sin = sin_ptr + row * stride_sin + dim
    cos1 = tl.load(cos, mask=in_dims, other=0.0).to(tl.float32)
    cos2 = tl.load(cos + HALF, mask=in_dims, other=0.0).to(tl.float32)
    sin1 = tl.load(sin, mask=in_dims, other=0.0).to(tl.float32)
    sin2 = tl.load(sin + HALF, mask=in_dims, other=0.0).to(tl.float32)
    out1 = first * cos1 + (-second) * sin1
    out2 = second * cos2 + first * sin2
    dst = out_ptr + row * (heads * 2 * HALF) + head * (2 * HALF) + dim
    kind = out_ptr.dtype.element_ty
    tl.store(dst, out1.to(kind, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(dst + HALF, out2.to(kind, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out, k_out, cos_ptr, sin_ptr, heads, q_stride_row, q_stride_head, k_stride_row,
                   k_stride_head, stride_cos, stride_sin, HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _rotate_rows(q_ptr, q_out, cos_ptr, sin_ptr, row, heads, q_stride_row, q_stride_head, stride_cos, stride_sin,
                     HALF, BLOCK_HEADS, BLOCK_HALF)  # fmt: skip
    else:
        _rotate_rows(k_ptr, k_out, cos_ptr, sin_ptr, row, heads, k_stride_row, k_stride_head, stride_cos, stride_sin,
                     HALF, BLOCK_HEADS, BLOCK_HALF)  # fmt: skip


def rotate_vision(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated q, rotated k), contiguous, of the inputs' type: transformers' ``apply_rotary_pos_emb_vision(q, k, cos,
    sin)`` bit for bit, for inputs :func:`care_core.kernels.dispatch.vision_rotary_applies` takes (which the entry point
    :func:`care_core.kernels.dispatch.rotate_vision` checks)."""
    rows, heads, head_dim = q.shape
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if rows == 0 or heads == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(rows, 2)](q, k, q_out, k_out, cos, sin, heads, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                              cos.stride(0), sin.stride(0), HALF=half, BLOCK_HEADS=triton.next_power_of_2(heads),
                              BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
                              enable_fp_fusion=False)  # fmt: skip
    return q_out, k_out
