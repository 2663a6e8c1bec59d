"""Fused Triton kernel for the jvp engine's norm-first path (CUDA only): Qwen mergers, InternVL3's projector.

For token i and direction x the second layer's input is (``care_core.norm_first``)

    t_ix = s_i ⊙ (Σ_b v_ib a_bx − Σ_b c_bxi p_bi),

with s_i = act'(pre_i), v_ib = 1/σ_ib, a_bx = W1_b (g ⊙ t̃_bx) (shared by all tokens), c_bxi the per-block inner
products and p_bi = W1_b (g ⊙ x̂_ib). The response is ||R t_ix|| (R: the second layer's triangular or trapezoidal
factor, or W2 itself). Split by linearity,

    R t_ix = R (s_i ⊙ Σ_b v_ib a_bx) − Σ_b c_bxi q_bi,   q_bi = R (s_i ⊙ p_bi),

the second term needs only blocks·N products (the caller makes them, ``blocks / m`` of the first term's work), and
the first is the MLP kernel's form (:mod:`care_core.kernels.jvp`) with the operand s_i ⊙ Σ_b v_ib a_bx built in
registers from the s tile, the row scales and each direction's ``blocks`` lifted rows. The epilogue subtracts
Σ_b c_bxi q_bi from each accumulator and reduces the tile to its rows' sums of squares, so nothing of size
m·N·d_h or m·N·d_out reaches device memory. Through an upper factor each output block skips the columns left of
it (R[r, c] = 0 for c < r, in a trapezoid as in a triangle).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from care_core.kernels.jvp import Tile, _dot, _grouped_tile, _operand, autotuned, tile_configs
from care_core.kernels.operands import kernel_operand
from care_core.kernels.shapes import norm_first_shape_supported, size_class

# (BM, BN, DIRS, stages, warps): accumulators and the epilogue's correction tiles share the registers, so the tiles
# are narrower than the MLP kernel's
_TILES: tuple[Tile, ...] = (
    (128, 128, 2, 3, 8),
    (128, 128, 1, 3, 8),
    (64, 128, 2, 3, 4),
)
ROW_PAD = 128
DIR_PAD = 2


@triton.jit
def _lifted_operand(
    s, v0, v1, v2, v3, a_ptrs, stride_ab, BLOCKS: tl.constexpr, BF16: tl.constexpr, ROUND: tl.constexpr
):  # fmt: skip
    """s ⊙ Σ_b v_b a_b for one direction's k tile: (BM, BK), rounded for the dot."""
    g = v0[:, None] * tl.load(a_ptrs)[None, :]
    if BLOCKS == 4:
        g += v1[:, None] * tl.load(a_ptrs + stride_ab)[None, :]
        g += v2[:, None] * tl.load(a_ptrs + 2 * stride_ab)[None, :]
        g += v3[:, None] * tl.load(a_ptrs + 3 * stride_ab)[None, :]
    return _operand(s * g, BF16, ROUND)


@triton.jit
def _norm_first_kernel(
    s_ptr, a_ptr, v_ptr, w_ptr, q_ptr, c_ptr, p_ptr,
    n_pad, m, d_h, d_out,
    stride_s, stride_ab, stride_a, stride_w, stride_qb, stride_q, stride_cb, stride_pblk,
    size_class,  # the autotuner's key for N (care_core.kernels.shapes.size_class); not read here
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DIRS: tl.constexpr, GROUP: tl.constexpr,
    BLOCKS: tl.constexpr, BF16: tl.constexpr, ROUND: tl.constexpr, UPPER: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    dir_blocks = m // DIRS
    xb = pid % dir_blocks  # direction block fastest: neighbours share the s and R tiles through L2
    tile = pid // dir_blocks
    pid_i, pid_j = _grouped_tile(tile, n_pad // BM, d_out // BN, GROUP)

    offs_i = pid_i * BM + tl.arange(0, BM)
    offs_j = pid_j * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    k_start = 0
    if UPPER:  # R's rows in this output block are zero left of the block
        k_start = pid_j * BN
    s_ptrs = s_ptr + offs_i[:, None].to(tl.int64) * stride_s + k_start + offs_k[None, :]
    w_ptrs = w_ptr + offs_j[None, :].to(tl.int64) * stride_w + k_start + offs_k[:, None]  # (BK, BN) view of Rᵀ
    x0 = xb * DIRS
    a_ptrs = a_ptr + x0 * stride_a + k_start + offs_k
    v_rows = v_ptr + offs_i * BLOCKS
    v0 = tl.load(v_rows)
    v1 = v0
    v2 = v0
    v3 = v0
    if BLOCKS == 4:
        v1 = tl.load(v_rows + 1)
        v2 = tl.load(v_rows + 2)
        v3 = tl.load(v_rows + 3)

    acc0 = tl.zeros((BM, BN), dtype=tl.float32)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(k_start, d_h, BK):
        s = tl.load(s_ptrs).to(tl.float32)
        w = tl.load(w_ptrs)
        acc0 = _dot(_lifted_operand(s, v0, v1, v2, v3, a_ptrs, stride_ab, BLOCKS, BF16, ROUND), w, acc0, BF16)
        if DIRS >= 2:
            t1 = _lifted_operand(s, v0, v1, v2, v3, a_ptrs + stride_a, stride_ab, BLOCKS, BF16, ROUND)
            acc1 = _dot(t1, w, acc1, BF16)
        s_ptrs += BK
        w_ptrs += BK
        a_ptrs += BK

    q_ptrs = q_ptr + offs_i[:, None].to(tl.int64) * stride_q + offs_j[None, :]
    c_rows = c_ptr + x0 * n_pad + offs_i
    for b in tl.static_range(BLOCKS):  # minus Σ_b c_bxi q_bi, each q tile shared by the directions
        q = tl.load(q_ptrs + b * stride_qb)
        acc0 -= tl.load(c_rows + b * stride_cb)[:, None] * q
        if DIRS >= 2:
            acc1 -= tl.load(c_rows + b * stride_cb + n_pad)[:, None] * q
    out = p_ptr + pid_j * stride_pblk + x0 * n_pad + offs_i
    tl.store(out, tl.sum(acc0 * acc0, axis=1))  # (BM,) partial ||.||² over this block of outputs
    if DIRS >= 2:
        tl.store(out + n_pad, tl.sum(acc1 * acc1, axis=1))


_KEY = ["size_class", "m", "d_h", "d_out", "BLOCKS", "BF16", "UPPER"]
_kernel_bf16 = autotuned(_norm_first_kernel, tile_configs(_TILES, bk=64), _KEY)
_kernel_tf32 = autotuned(_norm_first_kernel, tile_configs(_TILES, bk=32), _KEY)


def norm_first_norms(
    slope: torch.Tensor,
    lifted: torch.Tensor,
    inverse: torch.Tensor,
    coef: torch.Tensor,
    corrections: torch.Tensor,
    w2: torch.Tensor,
    *,
    bf16: bool,
    upper: bool,
    rounded: bool = False,
) -> torch.Tensor:
    """C[x, i] = ||W2 (slope_i ⊙ Σ_b inverse_ib lifted_bx) − Σ_b coef_bix corrections_bi||, (m, N) float32, on CUDA.

    slope (N, d_h); lifted (blocks, m, d_h); inverse (N, blocks); coef (blocks, N, m); corrections (blocks, N,
    d_out): W2 (slope_i ⊙ p_bi), made by the caller at the same precision; w2 (d_out, d_h), upper triangular or
    trapezoidal where ``upper``. ``bf16``: bf16 operands with float32 accumulation, else tf32 (rounded to nearest).
    ``rounded``: w2 is already :func:`~care_core.kernels.operands.weight_operand`'s.
    """
    n, hidden = slope.shape
    blocks, m, _ = lifted.shape
    out_dim = w2.shape[0]
    if not norm_first_shape_supported(blocks, hidden, out_dim) or (upper and out_dim > hidden):
        raise ValueError(f"fused norm-first jvp kernel: unsupported shapes (blocks {blocks}, W2 {tuple(w2.shape)})")
    n_pad, m_pad = -(-n // ROW_PAD) * ROW_PAD, -(-m // DIR_PAD) * DIR_PAD
    device, f32 = slope.device, torch.float32
    s = torch.zeros(n_pad, hidden, dtype=torch.bfloat16 if bf16 else f32, device=device)
    s[:n] = slope
    a = torch.zeros(blocks, m_pad, hidden, dtype=f32, device=device)
    a[:, :m] = lifted
    v = torch.zeros(n_pad, blocks, dtype=f32, device=device)
    v[:n] = inverse
    c = torch.zeros(blocks, m_pad, n_pad, dtype=f32, device=device)
    c[:, :m, :n] = coef.transpose(1, 2)
    q = torch.zeros(blocks, n_pad, out_dim, dtype=f32, device=device)
    q[:, :n] = corrections
    w = kernel_operand(w2, bf16=bf16, rounded=rounded, kernel="fused norm-first jvp kernel")
    min_bn = min(bn for _, bn, _, _, _ in _TILES)
    partial = torch.zeros(out_dim // min_bn, m_pad, n_pad, dtype=f32, device=device)

    def grid(meta):  # type: ignore[no-untyped-def]
        return ((m_pad // meta["DIRS"]) * (n_pad // meta["BM"]) * (out_dim // meta["BN"]),)

    kernel = _kernel_bf16 if bf16 else _kernel_tf32
    kernel[grid](
        s, a, v, w, q, c, partial,
        n_pad, m_pad, hidden, out_dim,
        s.stride(0), a.stride(0), a.stride(1), w.stride(0), q.stride(0), q.stride(1), c.stride(0),
        partial.stride(0), size_class(n_pad),
        BLOCKS=blocks, BF16=bf16, ROUND=True, UPPER=upper,
    )  # fmt: skip
    return partial.sum(dim=0)[:m, :n].sqrt()  # blocks past d_out / BN stay zero
