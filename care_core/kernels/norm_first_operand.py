"""Triton kernel for the norm-first path's second-layer input (CUDA; any Triton device): one pass, no GEMM.

For token i and direction x the second layer's input is (``care_core.norm_first``)

    T[i, x, :] = s_i ⊙ (Σ_b v_ib a_bx − Σ_b c_bxi p_bi),

s_i = act'(pre_i), v_ib = 1/σ_ib, a_bx the lifted direction (shared by all tokens), c_bxi the per-block
coefficient, p_bi the forward's per-block product. The PyTorch path writes it in several passes over (N, c, d_h)
float32 tensors (the shared product, the batched correction read and rewritten in place, the slope's scaling);
this kernel writes it once. One program holds a (BM tokens) x (BK hidden units) tile of s and of each block's p,
and v for its rows, and loops over the chunk's directions: s, p and v are read once per chunk, each direction costs
its ``blocks`` lifted rows (BK each) and coefficients (BM each), and T is written once. The GEMM through the second
layer (cuBLAS) and the norm follow in the caller, as on the PyTorch path, on a tensor of the same shape and layout.

The coefficients are read at any strides: stored direction-major ((blocks, m, N) in memory, a transposed view),
each direction's BM coefficients are one contiguous read instead of BM scattered ones (on an H200, Qwen2.5-VL-7B's
merger, 10 directions: 126 against 147 µs; Qwen3-VL-8B's, 14: 113 against 142).

Rounding (``tf32_rounded``): where the gemm-norm kernel follows in tf32, T is written rounded to tf32 (to nearest,
``cvt.rna``, as that kernel rounds its operand tiles), and that kernel then reads T as is: the same bits reach the
tensor cores, with no conversion in its K loop (on an H200, 6-8% off its time on the Qwen mergers). Otherwise none:
cuBLAS (and the bf16 conversion) round T themselves, as they do the PyTorch path's, so the two paths hand them
operands that differ only by float32 rounding of the same sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from care_core.kernels.jvp import _round_tf32
from care_core.kernels.shapes import NORM_FIRST_OPERAND_MAX_BLOCKS, norm_first_operand_supported

#: token rows and hidden units per program: 5 float32 (BM, BK) tiles (s and four p) stay in registers at 4 warps
BM = 32
BK = 64
WARPS = 4


@triton.jit
def _block(v_ptr, p_ptr, rows, offs_k, row_ok, tile_ok, stride_v, stride_pb, stride_p, b: tl.constexpr):
    """Block b's row scales v (BM,) and products p (BM, BK) for this program's tile (zeros outside)."""
    v = tl.load(v_ptr + rows * stride_v + b, mask=row_ok, other=0.0)
    p = tl.load(p_ptr + b * stride_pb + rows[:, None] * stride_p + offs_k[None, :], mask=tile_ok, other=0.0)
    return v, p


@triton.jit
def _operand_kernel(
    s_ptr, a_ptr, v_ptr, c_ptr, p_ptr, t_ptr,
    n, d_h, x0, dirs,
    stride_s, stride_ab, stride_a, stride_v, stride_cb, stride_ci, stride_cx, stride_pb, stride_p,
    stride_t, stride_tx,
    BM: tl.constexpr, BK: tl.constexpr, BLOCKS: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    offs_i = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_k = tl.program_id(1) * BK + tl.arange(0, BK)
    row_ok, col_ok = offs_i < n, offs_k < d_h
    tile_ok = row_ok[:, None] & col_ok[None, :]
    rows = offs_i.to(tl.int64)
    s = tl.load(s_ptr + rows[:, None] * stride_s + offs_k[None, :], mask=tile_ok, other=0.0)
    v0, p0 = _block(v_ptr, p_ptr, rows, offs_k, row_ok, tile_ok, stride_v, stride_pb, stride_p, 0)
    v1, p1 = v0, p0  # placeholders where BLOCKS < 4 (never read: the branches below are constexpr)
    v2, p2 = v0, p0
    v3, p3 = v0, p0
    if BLOCKS >= 2:
        v1, p1 = _block(v_ptr, p_ptr, rows, offs_k, row_ok, tile_ok, stride_v, stride_pb, stride_p, 1)
    if BLOCKS >= 3:
        v2, p2 = _block(v_ptr, p_ptr, rows, offs_k, row_ok, tile_ok, stride_v, stride_pb, stride_p, 2)
    if BLOCKS >= 4:
        v3, p3 = _block(v_ptr, p_ptr, rows, offs_k, row_ok, tile_ok, stride_v, stride_pb, stride_p, 3)
    a_ptrs = a_ptr + x0 * stride_a + offs_k
    c_ptrs = c_ptr + rows * stride_ci + x0 * stride_cx
    t_ptrs = t_ptr + rows[:, None] * stride_t + offs_k[None, :]
    for _ in range(0, dirs):  # the chunk's directions: s, v and p stay in registers
        shared = v0[:, None] * tl.load(a_ptrs, mask=col_ok, other=0.0)[None, :]  # Σ_b v_ib a_bx
        fix = tl.load(c_ptrs, mask=row_ok, other=0.0)[:, None] * p0  # Σ_b c_bxi p_bi
        if BLOCKS >= 2:
            shared += v1[:, None] * tl.load(a_ptrs + stride_ab, mask=col_ok, other=0.0)[None, :]
            fix += tl.load(c_ptrs + stride_cb, mask=row_ok, other=0.0)[:, None] * p1
        if BLOCKS >= 3:
            shared += v2[:, None] * tl.load(a_ptrs + 2 * stride_ab, mask=col_ok, other=0.0)[None, :]
            fix += tl.load(c_ptrs + 2 * stride_cb, mask=row_ok, other=0.0)[:, None] * p2
        if BLOCKS >= 4:
            shared += v3[:, None] * tl.load(a_ptrs + 3 * stride_ab, mask=col_ok, other=0.0)[None, :]
            fix += tl.load(c_ptrs + 3 * stride_cb, mask=row_ok, other=0.0)[:, None] * p3
        value = s * (shared - fix)
        if ROUND:
            value = _round_tf32(value)
        tl.store(t_ptrs, value, mask=tile_ok)
        a_ptrs += stride_a
        c_ptrs += stride_cx
        t_ptrs += stride_tx


def norm_first_operand(
    slope: torch.Tensor,
    lifted: torch.Tensor,
    inverse: torch.Tensor,
    coef: torch.Tensor,
    partial: torch.Tensor,
    start: int,
    stop: int,
    *,
    tf32_rounded: bool = False,
) -> torch.Tensor:
    """T (N, stop - start, d_h) float32, token-major: slope_i ⊙ (Σ_b inverse_ib lifted_bx − Σ_b coef_bix
    partial_bi) for directions x in [start, stop), the PyTorch path's ``first_layer_tangents(...) * slope``;
    each value rounded to tf32 (to nearest) where ``tf32_rounded``.

    slope (N, d_h); lifted (blocks, m, d_h); inverse (N, blocks); coef (blocks, N, m), any strides (fastest read
    direction-major: a transposed view of a (blocks, m, N) tensor); partial (blocks, N, d_h): the fields of
    :class:`care_core.norm_first.FirstLayer`, all float32 on one Triton device (a CUDA one where ``tf32_rounded``).
    """
    blocks, m, d_h = lifted.shape
    n = slope.shape[0]
    if not norm_first_operand_supported(blocks):
        raise ValueError(f"norm-first operand kernel: 1 to {NORM_FIRST_OPERAND_MAX_BLOCKS} blocks, got {blocks}")
    if not 0 <= start < stop <= m:
        raise ValueError(f"norm-first operand kernel: directions [{start}, {stop}) outside [0, {m})")
    tensors = (slope, lifted, inverse, coef, partial)
    if any(t.dtype != torch.float32 for t in tensors):
        raise ValueError("norm-first operand kernel: float32 inputs only")
    s, a, v, p = (t if t.stride(-1) == 1 else t.contiguous() for t in (slope, lifted, inverse, partial))
    c = coef  # read through its three strides
    out = torch.empty(n, stop - start, d_h, dtype=torch.float32, device=slope.device)
    grid = (triton.cdiv(n, BM), triton.cdiv(d_h, BK))
    _operand_kernel[grid](
        s, a, v, c, p, out,
        n, d_h, start, stop - start,
        s.stride(0), a.stride(0), a.stride(1), v.stride(0), c.stride(0), c.stride(1), c.stride(2), p.stride(0),
        p.stride(1), out.stride(0), out.stride(1),
        BM=BM, BK=BK, BLOCKS=blocks, ROUND=tf32_rounded, num_warps=WARPS,
    )  # fmt: skip
    return out
