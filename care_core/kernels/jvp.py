"""Fused Triton kernel for the jvp engine's Linear-act-Linear path (CUDA only).

For token i with slope ``s_i = act'(W1 v_i + b1)`` (d_h,) and lifted direction ``a_x = W1 u_x`` (d_h,),
the response is ``C[x, i] = || W2 (s_i ⊙ a_x) ||``. One program computes (BM tokens) x (BN outputs)
tiles of ``(S ⊙ a_x) @ W2ᵀ`` for DIRS directions at once: each S and W2 tile is loaded once and used
by all DIRS directions (the operand tile of S is scaled by a_x in registers right after it is loaded,
one copy per direction), the products go through the tensor cores (tf32, or bf16 operands), and the
epilogue reduces each tile to its rows' sums of squares. Only those partial sums,
(d_out / BN, m, N) float32, are written; a tiny torch sum + sqrt finishes. The cost is the
m·N·d_h·d_out multiply-adds of the exact derivative; nothing of size m·N·d_out or m·N·d_h reaches
device memory.

Why DIRS: with one direction per program the tiles are re-read from L2 for every direction, about
(1/BM + 1/BN) · 4 bytes per multiply-add, which at the tensor cores' rate is close to the L2's
bandwidth; sharing each tile between DIRS directions divides that traffic. Programs are ordered
direction-block fastest so that neighbours share tiles through L2 as well.

tf32: operands are rounded to nearest (``cvt.rna``, as cuBLAS does) rather than truncated, which
keeps the error at the level of PyTorch's tf32 matmuls (about 1e-4 relative).
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from care_core.kernels.operands import kernel_operand
from care_core.kernels.shapes import JVP_K_MULTIPLE, JVP_OUT_MULTIPLE, jvp_shape_supported, size_class

# (BM, BN, DIRS, stages, warps) of each autotune candidate; bf16 and tf32 differ only in the K tile BK
# (64 vs 32 elements: the same 128 bytes per row of an operand tile). On a cold Triton cache every
# candidate costs its compile (about 0.3 s on an H100) in a process's first call; the (128, 64, 4, ·, 8)
# tiles were dropped after losing every search they were in by 15-30% (N = 576 and 2880, bf16 and tf32,
# H100 and H200: benchmarks/results/2026-11-26-gpu-h100-micro*.json, 2026-11-26-gpu-h200*.json).
Tile = tuple[int, int, int, int, int]  # (BM, BN, DIRS, stages, warps)
_TILES: tuple[Tile, ...] = (
    (128, 256, 1, 3, 8),
    (128, 128, 2, 3, 8),
    (128, 128, 2, 4, 8),
)


def tile_configs(tiles: tuple[Tile, ...], bk: int) -> list[triton.Config]:
    """One autotune candidate per tile, with K tile ``bk`` (the jvp kernels share the meta-parameter names)."""
    return [triton.Config({"BM": bm, "BN": bn, "BK": bk, "DIRS": dirs, "GROUP": 8}, num_stages=stages,
                          num_warps=warps) for bm, bn, dirs, stages, warps in tiles]  # fmt: skip


_BF16_CONFIGS = tile_configs(_TILES, bk=64)
_TF32_CONFIGS = tile_configs(_TILES, bk=32)
#: Every config's tiles divide these (checked by :func:`supported`): rows are padded to ROW_PAD,
#: directions to DIR_PAD.
ROW_PAD = 128
DIR_PAD = 4
K_MULTIPLE = JVP_K_MULTIPLE
OUT_MULTIPLE = JVP_OUT_MULTIPLE


@triton.jit
def _round_tf32(x):
    return tl.inline_asm_elementwise("cvt.rna.tf32.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _operand(t, BF16: tl.constexpr, ROUND: tl.constexpr):
    """A float32 tile as a dot's operand: bf16, or tf32 rounded to nearest (cvt.rna) where ROUND (the jvp,
    norm-first and gemm-norm kernels' one rule)."""
    if BF16:
        t = t.to(tl.bfloat16)
    elif ROUND:
        t = _round_tf32(t)
    return t


@triton.jit
def _scaled(s, a_ptrs, BF16: tl.constexpr, ROUND: tl.constexpr):
    return _operand(s * tl.load(a_ptrs)[None, :], BF16, ROUND)


@triton.jit
def _grouped_tile(tile, n_i, n_j, GROUP: tl.constexpr):
    """(row tile, output block) of program ``tile`` over n_i x n_j tiles, GROUP row tiles at a time with the row tile
    fastest: neighbouring programs share one weight block through L2, and the output blocks run in order (the longest
    K loops of a triangle's first blocks start first). The jvp, norm-first and gemm-norm kernels' one ordering."""
    per_group = GROUP * n_j
    first_i = (tile // per_group) * GROUP
    group_rows = tl.minimum(n_i - first_i, GROUP)
    return first_i + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _dot(t, w, acc, BF16: tl.constexpr):
    if BF16:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        acc = tl.dot(t, w, acc)
    else:
        acc = tl.dot(t, w, acc, input_precision="tf32")
    return acc


@triton.jit
def _sqnorm_kernel(
    s_ptr, a_ptr, w_ptr, p_ptr,
    n_pad, m, d_h, d_out,
    stride_s, stride_a, stride_w, stride_pblk,
    size_class,  # the autotuner's key for N (care_core.kernels.shapes.size_class); not read here
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DIRS: tl.constexpr, GROUP: tl.constexpr,
    BF16: tl.constexpr, ROUND: tl.constexpr, UPPER: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    dir_blocks = m // DIRS
    xb = pid % dir_blocks  # direction block fastest: neighbours share the S and W2 tiles through L2
    tile = pid // dir_blocks
    pid_i, pid_j = _grouped_tile(tile, n_pad // BM, d_out // BN, GROUP)

    offs_i = pid_i * BM + tl.arange(0, BM)
    offs_j = pid_j * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    s_ptrs = s_ptr + offs_i[:, None].to(tl.int64) * stride_s + offs_k[None, :]
    w_ptrs = w_ptr + offs_j[None, :].to(tl.int64) * stride_w + offs_k[:, None]  # (BK, BN) view of W2ᵀ
    x0 = xb * DIRS
    a_ptrs = a_ptr + x0 * stride_a + offs_k
    k_start = 0
    if UPPER:  # W2 is upper triangular (R of a QR): its rows in this block are zero left of the block
        k_start = pid_j * BN
        s_ptrs += k_start
        w_ptrs += k_start
        a_ptrs += k_start

    acc0 = tl.zeros((BM, BN), dtype=tl.float32)
    if DIRS >= 2:
        acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    if DIRS >= 4:
        acc2 = tl.zeros((BM, BN), dtype=tl.float32)
        acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(k_start, d_h, BK):
        s = tl.load(s_ptrs).to(tl.float32)
        w = tl.load(w_ptrs)
        acc0 = _dot(_scaled(s, a_ptrs, BF16, ROUND), w, acc0, BF16)
        if DIRS >= 2:
            acc1 = _dot(_scaled(s, a_ptrs + stride_a, BF16, ROUND), w, acc1, BF16)
        if DIRS >= 4:
            acc2 = _dot(_scaled(s, a_ptrs + 2 * stride_a, BF16, ROUND), w, acc2, BF16)
            acc3 = _dot(_scaled(s, a_ptrs + 3 * stride_a, BF16, ROUND), w, acc3, BF16)
        s_ptrs += BK
        w_ptrs += BK
        a_ptrs += BK
    out = p_ptr + pid_j * stride_pblk + x0 * n_pad + offs_i
    tl.store(out, tl.sum(acc0 * acc0, axis=1))  # (BM,) partial ||.||^2 over this block of outputs
    if DIRS >= 2:
        tl.store(out + n_pad, tl.sum(acc1 * acc1, axis=1))
    if DIRS >= 4:
        tl.store(out + 2 * n_pad, tl.sum(acc2 * acc2, axis=1))
        tl.store(out + 3 * n_pad, tl.sum(acc3 * acc3, axis=1))


def autotuned(kernel, configs, key):  # type: ignore[no-untyped-def]
    """``kernel`` autotuned over ``configs`` by ``key``, its squared-norm buffer ``p_ptr`` zeroed around the search.

    p_ptr is zeroed before each config is tried and after the search: configs with wider output blocks leave the
    buffer's last blocks untouched, and those must read zero. The search takes seconds per size class, and every
    process of a run (and every run) would repeat it: where Triton can (3.2 on), its results are kept in Triton's
    on-disk cache beside the compiled kernels; the variants' flags are in ``key`` so each keeps its own entries."""
    cache = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    return triton.autotune(configs=configs, key=key, reset_to_zero=["p_ptr"], **cache)(kernel)


_KEY = ["size_class", "m", "d_h", "d_out", "BF16", "UPPER"]
_kernel_bf16 = autotuned(_sqnorm_kernel, _BF16_CONFIGS, _KEY)
_kernel_tf32 = autotuned(_sqnorm_kernel, _TF32_CONFIGS, _KEY)
# The triangular variant's best tiles differ (its programs' work varies with the output block): own searches.
_kernel_bf16_upper = autotuned(_sqnorm_kernel, _BF16_CONFIGS, _KEY)
_kernel_tf32_upper = autotuned(_sqnorm_kernel, _TF32_CONFIGS, _KEY)


def supported(hidden: int, out_dim: int) -> bool:
    """Shapes the kernel takes without masks (LLaVA: 4096 -> 4096)."""
    return jvp_shape_supported(hidden, out_dim)


def _kernel(bf16: bool, upper: bool):  # type: ignore[no-untyped-def]
    if upper:
        return _kernel_bf16_upper if bf16 else _kernel_tf32_upper
    return _kernel_bf16 if bf16 else _kernel_tf32


def chosen_config(bf16: bool, upper: bool = False) -> str | None:
    """The autotuner's pick for the last shape it saw (for benchmark reports)."""
    kernel = _kernel(bf16, upper)
    best = getattr(kernel, "best_config", None)
    return None if best is None else str(best)


def jvp_norms(
    slope: torch.Tensor, lifted: torch.Tensor, w2: torch.Tensor, *, bf16: bool, upper: bool = False,
    rounded: bool = False,
) -> torch.Tensor:  # fmt: skip
    """C[x, i] = ||W2 (slope_i ⊙ lifted_x)||, (m, N) float32, on CUDA.

    slope (N, d_h), lifted (m, d_h), w2 (d_out, d_h). ``bf16``: bf16 operands (the product rounded
    once, after the float32 multiply) with float32 accumulation; else tf32 operands (rounded to
    nearest) with float32 accumulation. ``upper``: w2 is upper triangular (the R factor of
    :func:`care_core.scoring.triangular_factor`, d_h x d_h); each output block skips the columns left
    of it, about half the multiply-adds. ``rounded``: w2 is already
    :func:`~care_core.kernels.operands.weight_operand`'s.
    """
    n, hidden = slope.shape
    m = lifted.shape[0]
    out_dim = w2.shape[0]
    if not supported(hidden, out_dim):
        raise ValueError(f"fused jvp kernel needs d_h % {K_MULTIPLE} == 0 and d_out % {OUT_MULTIPLE} == 0")
    n_pad = -(-n // ROW_PAD) * ROW_PAD
    m_pad = -(-m // DIR_PAD) * DIR_PAD
    s = slope.to(torch.bfloat16) if bf16 else slope.float()
    if n_pad != n:
        s = torch.cat([s, s.new_zeros(n_pad - n, hidden)])
    s = s.contiguous()
    a = lifted.float()
    if m_pad != m:
        a = torch.cat([a, a.new_zeros(m_pad - m, hidden)])
    a = a.contiguous()
    w = kernel_operand(w2, bf16=bf16, rounded=rounded, kernel="fused jvp kernel")
    min_bn = min(c.kwargs["BN"] for c in (_BF16_CONFIGS if bf16 else _TF32_CONFIGS))
    partial = torch.zeros(out_dim // min_bn, m_pad, n_pad, dtype=torch.float32, device=slope.device)

    def grid(meta):  # type: ignore[no-untyped-def]
        return ((m_pad // meta["DIRS"]) * (n_pad // meta["BM"]) * (out_dim // meta["BN"]),)

    if upper and out_dim != hidden:
        raise ValueError(f"upper=True needs a square (d_h, d_h) factor, got {tuple(w2.shape)}")
    kernel = _kernel(bf16, upper)
    kernel[grid](
        s, a, w, partial,
        n_pad, m_pad, hidden, out_dim,
        s.stride(0), a.stride(0), w.stride(0), partial.stride(0),
        size_class(n_pad),
        BF16=bf16, ROUND=True, UPPER=upper,
    )  # fmt: skip
    return partial.sum(dim=0)[:m, :n].sqrt()  # blocks past d_out / BN stay zero
