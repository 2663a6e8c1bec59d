"""Triton kernel for the norm-first path's second layer (CUDA only): ||R t_r|| for every row t_r, without writing R t.

Paper Eq. 1's jvp responses for a norm-first projector are ||W2 t_ix|| for the second layer's inputs t_ix
(:mod:`care_core.kernels.norm_first_operand` writes them, (N·c, d_h) float32 per chunk of directions). With W2 = Q R
(:func:`care_core.scoring.triangular_factor`, Q with orthonormal columns) ||W2 t|| = ||R t||, and R (d_out, d_h) is
upper triangular or trapezoidal: R[i, k] = 0 for k < i. The PyTorch path multiplies through R in a few column blocks
(cuBLAS, 1.2x the trapezoid's multiply-adds for the Qwen mergers), writes the (N·c, d_out) product and reads it back
for the norm. Here one program computes a (BM rows) x (BN outputs) tile of T Rᵀ on the tensor cores (tf32 operands
rounded to nearest, or bf16; float32 accumulation), its K loop starting at the output block's first column (the
columns left of it are R's zeros: about the trapezoid's own multiply-adds), and reduces the tile to its rows' sums
of squares; only those partial sums, (d_out / BN, M) float32, are written, and a torch sum and square root finish.

Programs are grouped (``GROUP`` row tiles at a time, the output blocks swept within the group, widest K first), so
that the programs reading one T row tile, and those reading one R block, run at about the same time and share it
through L2. Rows past M (the last row tile) re-read row M - 1 rather than being padded with a copy of T: their sums
land in the partial buffer's padding, which the caller never reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from care_core.kernels.jvp import Tile, _dot, _grouped_tile, _operand, autotuned, tile_configs
from care_core.kernels.operands import kernel_operand
from care_core.kernels.shapes import GEMM_NORM_K_MULTIPLE, GEMM_NORM_OUT_MULTIPLE, gemm_norm_shape_supported, size_class

# (BM, BN, DIRS, stages, warps); DIRS is the jvp kernels' tile field, always 1 here (one operand, no directions).
# _TILES' BN divides GEMM_NORM_OUT_MULTIPLE; the wide tiles join the search where d_out is a multiple of their BN
# (both Qwen mergers and InternVL3's projector: 3584 and 4096). Compiled by Triton 3.6 for sm_90 (T's tiles are
# loaded as float32 and converted in registers, R's stay in shared memory for wgmma) every tile uses at most 128 KiB
# of shared memory (H200: 227 KiB), the four-stage wide tile 192 KiB (a card with less skips it in the search). That
# one won on InternVL3-8B's projector (N = 1280, 14 directions a chunk: 1.22x the trapezoid's floor against the
# three-stage tile's 1.37x on an H200, T pre-rounded), the three-stage on the Qwen mergers (1.07x against 1.10-1.17x).
_TILES: tuple[Tile, ...] = (
    (128, 128, 1, 4, 8),
    (64, 128, 1, 4, 4),
)
_WIDE_TILES: tuple[Tile, ...] = ((128, 256, 1, 3, 8), (128, 256, 1, 4, 8))
#: the row tile M is padded to (every tile's BM divides it)
ROW_PAD = 128


@triton.jit
def _gemm_norm_kernel(
    t_ptr, r_ptr, p_ptr,
    m_rows, m_pad, d_h, d_out,
    stride_t, stride_r, stride_pblk,
    size_class,  # the autotuner's key for M (care_core.kernels.shapes.size_class); not read here
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DIRS: tl.constexpr, GROUP: tl.constexpr,
    BF16: tl.constexpr, ROUND: tl.constexpr, UPPER: tl.constexpr,
):  # fmt: skip
    """Partial sums of squares of one (BM, BN) tile of T Rᵀ into p[pid_j, rows] (DIRS: unused, always 1)."""
    pid = tl.program_id(0)
    pid_i, pid_j = _grouped_tile(pid, m_pad // BM, d_out // BN, GROUP)  # neighbours share the R block

    offs_i = pid_i * BM + tl.arange(0, BM)
    rows = tl.minimum(offs_i, m_rows - 1).to(tl.int64)  # rows past M re-read the last one (no mask, no copy of T)
    offs_j = pid_j * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    k_start = 0
    if UPPER:  # R's rows in this output block are zero left of the block
        k_start = pid_j * BN
    t_ptrs = t_ptr + rows[:, None] * stride_t + k_start + offs_k[None, :]
    r_ptrs = r_ptr + offs_j[None, :].to(tl.int64) * stride_r + k_start + offs_k[:, None]  # (BK, BN) view of Rᵀ
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(k_start, d_h, BK):
        acc = _dot(_operand(tl.load(t_ptrs), BF16, ROUND), tl.load(r_ptrs), acc, BF16)
        t_ptrs += BK
        r_ptrs += BK
    tl.store(p_ptr + pid_j * stride_pblk + offs_i, tl.sum(acc * acc, axis=1))  # (BM,) partial ||.||² of the block


_KEY = ["size_class", "d_h", "d_out", "BF16", "ROUND", "UPPER"]  # ROUND: with or without the rounding, own tiles


def _autotuned(bf16: bool, wide: bool):  # type: ignore[no-untyped-def]
    """The kernel autotuned over the tiles for ``wide`` outputs (:func:`_wide`), K tile 64 (bf16) or 32 (tf32):
    128 bytes of an R row either way, as in the jvp kernels."""
    tiles = _TILES + (_WIDE_TILES if wide else ())
    return autotuned(_gemm_norm_kernel, tile_configs(tiles, bk=64 if bf16 else 32), _KEY)


_KERNELS = {(bf16, wide): _autotuned(bf16, wide) for bf16 in (False, True) for wide in (False, True)}


def _wide(out_dim: int) -> bool:
    """Whether the wide tiles divide ``out_dim``."""
    return all(out_dim % bn == 0 for _, bn, *_ in _WIDE_TILES)


def chosen_config(bf16: bool, out_dim: int) -> str | None:
    """The autotuner's pick for the last shape it saw (for benchmark reports)."""
    best = getattr(_KERNELS[bf16, _wide(out_dim)], "best_config", None)
    return None if best is None else str(best)


def gemm_norms(
    rows: torch.Tensor, r: torch.Tensor, *, bf16: bool, upper: bool, rounded: bool = False, round_t: bool = True
) -> torch.Tensor:
    """||R t|| for every row t of ``rows`` (M, d_h) float32, (M,) float32, on CUDA (paper Eq. 1's norms through the
    factor: ||W2 t|| = ||R t||).

    r (d_out, d_h): upper triangular or trapezoidal where ``upper`` (R[i, k] = 0 for k < i: each output block skips
    the columns left of it), any matrix otherwise. ``bf16``: bf16 operands, else tf32 rounded to nearest; float32
    accumulation either way. ``rounded``: r is already :func:`~care_core.kernels.operands.weight_operand`'s (skips a
    pass over R per call).
    ``round_t``: round T's tiles to tf32 in the kernel (inline PTX). Off where T already is tf32-rounded (the operand
    kernel's ``tf32_rounded`` output): its tiles then go to the tensor cores as read, the same bits without the
    conversion; and in Triton's interpreter, which cannot run the PTX (the tensor cores then truncate)."""
    m_rows, hidden = rows.shape
    out_dim = r.shape[0]
    if not gemm_norm_shape_supported(hidden, out_dim, upper=upper) or r.shape[1] != hidden:
        raise ValueError(
            f"gemm-norm kernel: unsupported shapes (rows {tuple(rows.shape)}, R {tuple(r.shape)}; d_h % "
            f"{GEMM_NORM_K_MULTIPLE}, d_out % {GEMM_NORM_OUT_MULTIPLE}, d_out <= d_h where upper)"
        )
    if rows.dtype != torch.float32:
        raise ValueError(f"gemm-norm kernel: float32 rows only, got {rows.dtype}")
    if rounded and r.dtype != (torch.bfloat16 if bf16 else torch.float32):
        raise ValueError(f"gemm-norm kernel: a rounded R is {'bf16' if bf16 else 'float32'}, got {r.dtype}")
    if m_rows == 0:
        return rows.new_zeros(0)
    t = rows if rows.stride(-1) == 1 else rows.contiguous()
    w = kernel_operand(r, bf16=bf16, rounded=rounded, kernel="gemm-norm kernel")
    m_pad = -(-m_rows // ROW_PAD) * ROW_PAD
    min_bn = min(bn for _, bn, *_ in _TILES + _WIDE_TILES)
    partial = torch.zeros(out_dim // min_bn, m_pad, dtype=torch.float32, device=rows.device)

    def grid(meta):  # type: ignore[no-untyped-def]
        return ((m_pad // meta["BM"]) * (out_dim // meta["BN"]),)

    _KERNELS[bf16, _wide(out_dim)][grid](
        t, w, partial,
        m_rows, m_pad, hidden, out_dim,
        t.stride(0), w.stride(0), partial.stride(0),
        size_class(m_pad),
        BF16=bf16, ROUND=round_t, UPPER=upper,
    )  # fmt: skip
    return partial.sum(dim=0)[:m_rows].sqrt()  # blocks past d_out / BN stay zero
