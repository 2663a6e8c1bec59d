"""PRCA scoring, paper Eq. 1–2: perturbation responses of the projector and robust z-scores.

Two engines compute the response matrix C (m, N):
- ``fd``: Eq. 1, ``||M(v + h u) - M(v - h u)|| / 2h``, in float32 or float64, tf32 off. For a Linear-act-Linear
  projector the first layer is shared by linearity (``a +- h d``, a per token, d per direction) and the
  difference is taken before the second layer (one product instead of two, through W2's triangular factor
  where given; that product, on the difference, follows ``matmul``: "auto" is tf32 on CUDA); any other
  projector runs literally, two passes per direction;
- ``jvp``: its h -> 0 limit ``||J_M(v) u||``, exact. For a Linear-act-Linear projector (LLaVA's)
  the first layer is applied once to the m directions and shared by all tokens, so the cost is
  about m N d_hidden d_out multiply-adds; a norm-first projector (LayerNorm or RMSNorm, per patch or per
  row, then Linear-act-Linear: the Qwen mergers, InternVL3's; :mod:`care_core.norm_first`) shares W1 u the
  same way through the norm's exact derivative; a norm-then-linear projector (Gemma 3's) is that first layer alone,
  its tangents formed from one product per token and one per direction; any other projector goes through
  ``torch.func.jvp``.
  On CUDA with bf16 matmuls that MLP path is one fused Triton kernel (``care_core.kernels``; also
  for tf32 with ``kernel="fused"``); the norm-first path has a fused kernel of its own and a one-pass writer of its
  second layer's input, followed where it runs by a kernel for the norms through R (``care_core.kernels``); the CPU
  path is plain PyTorch.

The functions are pure: every call computes what it needs (directions, a converted projector) and
decides its kernel afresh. :class:`Scorer` is the user-owned object that keeps those between calls.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from care_core import norm_first
from care_core._chunks import SECOND_LAYERS, TRIANGULAR_BLOCKS, block_bounds, row_groups, two_pass_chunk, two_pass_rows
from care_core._chunks import chunk_size as _chunk_size
from care_core._memo import TensorState, recall, tensor_state
from care_core.kernels import dispatch
from care_core.kernels.dispatch import Kernel, KernelGate, as_gate
from care_core.kernels.shapes import (
    gemm_norm_shape_supported,
    jvp_shape_supported,
    norm_first_operand_supported,
    norm_first_shape_supported,
)
from care_core.norm_first import NormFirstMLP, NormLinear
from care_core.precision import matmul_precision

Projector = Callable[[torch.Tensor], torch.Tensor]

# Elementwise activations whose derivative can be taken with a unit tangent.
_ELEMENTWISE_ACTIVATIONS = (
    "GELU",
    "GELUActivation",
    "NewGELUActivation",
    "QuickGELUActivation",
    "FastGELUActivation",
    "PytorchGELUTanh",
    "GELUTanh",
    "ReLU",
    "SiLU",
    "SiLUActivation",
    "Tanh",
    "Sigmoid",
    "Identity",
    "LeakyReLU",
    "Mish",
    "ELU",
)
_MLP_PROJECTORS = ("LlavaMultiModalProjector", "LlavaNextMultiModalProjector", "LlavaOnevisionMultiModalProjector")


def unit_directions(
    m: int, dim: int, seed: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """m unit directions u_x = g_x / ||g_x||, g_x ~ N(0, I) (Eq. 1), drawn on the CPU in float64.

    Drawing on the CPU from a seeded ``torch.Generator`` gives the same directions on every device.
    Drawn afresh on every call (about a millisecond with the copy to a GPU); a :class:`Scorer` keeps them.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    g = torch.randn(m, dim, generator=generator, dtype=torch.float64)
    return (g / g.norm(dim=1, keepdim=True)).to(device=device, dtype=dtype)


@dataclass(frozen=True)
class _MLP:
    first: nn.Linear
    act: Callable[[torch.Tensor], torch.Tensor]
    second: nn.Linear


def _as_mlp(projector: Projector) -> _MLP | None:
    """Recognise a Linear -> elementwise activation -> Linear projector, else None."""
    if isinstance(projector, nn.Sequential) and len(projector) == 3:
        first, act, second = projector
    elif type(projector).__name__ in _MLP_PROJECTORS:
        first, act, second = projector.linear_1, projector.act, projector.linear_2  # type: ignore[attr-defined]
    else:
        return None
    if not (isinstance(first, nn.Linear) and isinstance(second, nn.Linear)):
        return None
    if type(act).__name__ not in _ELEMENTWISE_ACTIVATIONS:
        return None
    return _MLP(first, act, second)


def _as_norm_first(projector: Projector) -> NormFirstMLP | None:
    """Recognise a norm-first projector (:func:`care_core.norm_first.describe`) with an elementwise activation,
    else None."""
    found = norm_first.describe(projector)
    if found is None or type(found.act).__name__ not in _ELEMENTWISE_ACTIVATIONS:
        return None
    return found


def _as_norm_linear(projector: Projector) -> NormLinear | None:
    """Recognise a norm-then-linear projector (:func:`care_core.norm_first.describe_linear`), else None."""
    return norm_first.describe_linear(projector)


def _second_linear(projector: Projector) -> nn.Linear | None:
    """The second Linear of a projector the jvp engine scores on a fast path (Linear-act-Linear or norm-first)."""
    mlp = _as_mlp(projector)
    if mlp is not None:
        return mlp.second
    found = _as_norm_first(projector)
    return None if found is None else found.second


def prepare_projector(projector: Projector, dtype: torch.dtype, device: torch.device) -> Projector:
    """The projector with its floating-point parameters in `dtype` on `device`.

    A module whose parameters already are is returned as is; otherwise a converted copy is made, on
    every call (a :class:`Scorer` makes it once). Plain callables are returned as is.
    """
    if not isinstance(projector, nn.Module):
        return projector
    params = [p for p in projector.parameters() if p.is_floating_point()]
    if all(p.dtype == dtype and p.device == device for p in params):
        return projector
    return copy.deepcopy(projector).to(device=device, dtype=dtype)


def _out_features(projector: Projector, features: torch.Tensor) -> int:
    """The projector's output width: its ``out_features`` where it says, else from one row through it."""
    width = getattr(projector, "out_features", None)
    return width if isinstance(width, int) else int(projector(features[:1]).shape[-1])


@torch.no_grad()
def triangular_factor(weight: torch.Tensor) -> torch.Tensor:
    """R of W2 = Q R (reduced QR, in float64), in W2's dtype and device: (d_h, d_h) upper triangular where W2
    (d_out, d_h) has d_out >= d_h, (d_out, d_h) upper trapezoidal where d_out < d_h.

    Q has orthonormal columns (square and orthogonal in the trapezoidal case), so ||W2 t|| = ||Q R t|| = ||R t||
    for every t: the jvp's norms can go through R and skip its zero part, R[i, j] = 0 for j < i
    (:data:`~care_core._chunks.TRIANGULAR_BLOCKS`). A float64 QR of a 4096 x 4096 W2 takes about 0.2 s on an
    H200: a :class:`Scorer` makes it once.
    """
    r = torch.linalg.qr(weight.detach().double(), mode="r").R
    return r.to(weight.dtype).contiguous()


def _upper_products(tangent: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """tangent @ R^T for R (rows, d_h) upper triangular or trapezoidal, block column by block column: block
    [lo, hi) of the output needs only hidden units lo.. (R[lo:hi, :lo] = 0); for a triangle (B + 1) / 2B of the
    dense multiply-adds (:func:`~care_core._chunks.upper_macs`)."""
    out = tangent.new_empty(tangent.shape[0], r.shape[0])
    for lo, hi in block_bounds(r.shape[0], TRIANGULAR_BLOCKS):
        torch.mm(tangent[:, lo:], r[lo:hi, lo:].T, out=out[:, lo:hi])
    return out


def allows_tf32(matmul: str, features: torch.Tensor) -> bool:
    """Whether a ``matmul`` setting lets the products on ``features`` run in tf32: "tf32", or "auto" on CUDA;
    never for float64 features (the engines' one rule)."""
    if features.dtype == torch.float64:
        return False
    return matmul == "tf32" or (matmul == "auto" and features.device.type == "cuda")


@torch.no_grad()
def responses_fd(
    features: torch.Tensor,
    projector: Projector,
    directions: torch.Tensor,
    h: float,
    *,
    factor: torch.Tensor | None = None,
    matmul: str = "float32",
) -> torch.Tensor:
    """C[x, i] = ||M(v_i + h u_x) - M(v_i - h u_x)||_2 / (2h)  (Eq. 1); (m, N).

    A Linear-act-Linear projector goes through :func:`_fd_mlp` (the same Eq. 1 value, a fraction of the work;
    `factor`: its second layer's triangular factor, :func:`triangular_factor`); any other projector takes
    :func:`_fd_literal`, which ignores `factor`. Every product that forms the two nearly equal terms runs with
    tf32 off; `matmul` ("float32", "tf32", or "auto": tf32 on CUDA) sets only the MLP path's second-layer
    product, which acts on their difference (float64 inputs: never tf32).
    """
    second_tf32 = allows_tf32(matmul, features)
    with matmul_precision(allow_tf32=False):  # tf32 would turn the nearly equal terms' difference into noise
        mlp = _as_mlp(projector)
        if mlp is not None:
            return _fd_mlp(features, mlp, directions, h, factor, second_tf32=second_tf32)
        return _fd_literal(features, projector, directions, h)


def _fd_literal(features: torch.Tensor, projector: Projector, directions: torch.Tensor, h: float) -> torch.Tensor:
    """Eq. 1 literally, for any projector: two passes over the N perturbed tokens per direction, in chunks."""
    n, dim = features.shape
    m = directions.shape[0]
    step = two_pass_chunk(m, n, dim, _out_features(projector, features))
    rows = []
    for start in range(0, m, step):
        u = directions[start : start + step]
        plus = (features[None] + h * u[:, None]).reshape(-1, dim)
        minus = (features[None] - h * u[:, None]).reshape(-1, dim)
        diff = projector(plus) - projector(minus)
        rows.append(diff.reshape(u.shape[0], n, -1).norm(dim=-1) / (2 * h))
    return torch.cat(rows)


def _fd_mlp(
    features: torch.Tensor,
    mlp: _MLP,
    directions: torch.Tensor,
    h: float,
    factor: torch.Tensor | None,
    *,
    second_tf32: bool = False,
) -> torch.Tensor:
    """Eq. 1 for M(v) = W2 act(W1 v + b1) + b2: ||W2 [act(a_i + h d_x) - act(a_i - h d_x)]|| / 2h with
    a_i = W1 v_i + b1 and d_x = W1 u_x; through ``factor`` R (W2 = QR, ||W2 t|| = ||R t||) where given.

    The same value as :func:`_fd_literal` in exact arithmetic (only rounding differs). Multiply-adds: the first
    layer N d d_h + m d d_h instead of 2 m N d d_h; the second m N d_h d_out instead of twice that (through R:
    (B + 1) / 2B of it, :func:`_upper_products`).
    """
    # The first layer is linear: W1 (v +- h u) + b1 = a +- h d, so it runs on the N tokens and the m directions
    # once, not on 2 m N perturbed points. b2 cancels, and the two activations are subtracted *before* W2:
    # one second-layer product per (direction, token) instead of two, and W2 never amplifies the rounding of
    # two large, nearly equal outputs whose difference is the signal.
    pre = mlp.first(features)  # a (N, d_h), once per token
    lifted = directions @ mlp.first.weight.T  # d (m, d_h), once per direction, shared by all tokens
    second = mlp.second.weight if factor is None else factor
    n, hidden = pre.shape
    m = directions.shape[0]
    step = two_pass_chunk(m, n, hidden, second.shape[0])  # a chunk holds (c, N, d_h) pairs and (c, N, d_out)
    rows = []
    for start in range(0, m, step):
        shift = h * lifted[start : start + step, None]  # (c, 1, d_h)
        diff = mlp.act(pre + shift)
        diff -= mlp.act(pre - shift)  # (c, N, d_h)
        flat = diff.reshape(-1, hidden)
        # the difference is already formed in float32, so tf32 here rounds it relative to itself (about 1e-3),
        # not relative to the two large terms: far below the literal float32 path's cancellation error
        with matmul_precision(allow_tf32=second_tf32):
            out = flat @ second.T if factor is None else _upper_products(flat, factor)
        rows.append(out.reshape(shift.shape[0], n, -1).norm(dim=-1) / (2 * h))
    return torch.cat(rows)


def _jvp_mlp(
    features: torch.Tensor,
    mlp: _MLP,
    directions: torch.Tensor,
    low: torch.dtype | None,
    *,
    tf32: bool = False,
    kernel: Kernel | KernelGate = "auto",
    factor: torch.Tensor | None = None,
) -> torch.Tensor:
    """||W2 diag(act'(W1 v + b1)) W1 u|| for every token and direction, sharing W1 u across tokens.

    ``factor``: W2's factor R (:func:`triangular_factor`) in W2's place; the norms are the same and through a
    triangle the second layer costs (B + 1) / 2B of its multiply-adds (the fused kernel: about half; a
    trapezoid, d_out < d_h, runs on the PyTorch path).

    The product, the matmul and the norm run fused in one Triton kernel (:mod:`care_core.kernels.jvp`)
    where :func:`_fused_jvp_applies` and the ``kernel`` setting allow it; otherwise (CPU, float32/float64
    matmuls, tf32 unless ``kernel="fused"``, odd shapes, a kernel that cannot be built) in chunks of
    directions with PyTorch.
    """
    gate = as_gate(kernel)
    pre = mlp.first(features)  # (N, d_hidden)
    slope = _activation_slope(mlp.act, pre)  # act'(W1 v + b1)
    lifted = directions @ mlp.first.weight.T  # (m, d_hidden): W1 u_x, shared by all tokens
    w2 = mlp.second.weight
    upper = factor is not None
    if factor is not None:
        w2 = factor
    applies = _fused_jvp_applies(features, w2, low, tf32, gate.kernel, upper=upper)
    if gate.choose("jvp", features.device, applies=applies) == "fused":
        triangle = {"upper": True} if upper else {}  # the dense call keeps the kernel's plain signature
        bf16 = low is not None
        fused = gate.attempt("jvp", lambda: dispatch.jvp_norms(slope, lifted, gate.operand(w2, bf16=bf16), bf16=bf16,
                                                               rounded=True, **triangle))  # fmt: skip
        if fused is not None:
            return fused.to(features.dtype)
    if low is not None:  # W2 in bf16 is the fused kernel's operand too: a scorer's gate keeps it
        slope, lifted, w2 = slope.to(low), lifted.to(low), gate.operand(w2, bf16=True)
    n, hidden = pre.shape
    m = directions.shape[0]
    step = _chunk_size(m, n * max(hidden, w2.shape[0]))
    rows = []
    for start in range(0, m, step):
        tangent = slope[None] * lifted[start : start + step, None]  # (c, N, d_hidden)
        if upper:
            out = _upper_products(tangent.reshape(-1, hidden), w2).reshape(tangent.shape[0], n, -1)
        else:
            out = tangent @ w2.T
        if low is not None:
            out = out.float()  # norms of bf16 products are accumulated in float32
        rows.append(out.norm(dim=-1).to(features.dtype))
    return torch.cat(rows)


def _activation_slope(act: Callable[[torch.Tensor], torch.Tensor], pre: torch.Tensor) -> torch.Tensor:
    """act'(pre), elementwise: forward-mode AD with a unit tangent.

    GELU (``nn.GELU``, transformers' ``GELUActivation``) calls the op forward-mode AD itself runs for it,
    ``gelu_backward(ones, pre)`` (the same values, bit for bit), without ``torch.func``'s per-call setup
    (about 0.2 ms of host time, which at N = 576 is on the GPU's critical path).
    """
    approximate = None
    if isinstance(act, nn.GELU):
        approximate = act.approximate
    elif type(act).__name__ == "GELUActivation" and getattr(act, "act", None) is nn.functional.gelu:
        approximate = "none"
    if approximate is not None:
        return torch.ops.aten.gelu_backward(torch.ones_like(pre), pre, approximate=approximate)
    return torch.func.jvp(act, (pre,), (torch.ones_like(pre),))[1]


def _fused_jvp_applies(
    features: torch.Tensor, w2: torch.Tensor, low: torch.dtype | None, tf32: bool, kernel: str, *, upper: bool = False
) -> bool:
    """What the fused kernel computes: float32 features, bf16 matmuls, tf32 through a triangular factor (or with
    kernel="fused"), its shapes.

    Dense tf32 stays on cuBLAS in "auto" mode: on an H200 (N = 2880, benchmarks/results/2026-11-26-gpu-h200.json)
    its tf32 matmuls over chunks of materialised tangents took 20.0 ms against the fused kernel's 21.6 ms (floor
    15.1). Through the triangular factor the fused kernel skips R's zero triangle tile by tile and took 10.6 ms
    against cuBLAS's 14.9 ms over blocks of columns (same card, 2026-11-26). In bf16 the fused kernel wins
    either way. Device and Triton are checked by the gate.
    """
    if features.dtype != torch.float32:
        return False
    if low is None and not (tf32 and (kernel == "fused" or upper)):
        return False  # full float32 matmuls (or dense tf32 outside "fused" mode): PyTorch (cuBLAS) path
    if low is not None and low != torch.bfloat16:
        return False
    if upper and w2.shape[0] != w2.shape[1]:
        return False  # the kernel skips a square triangle only; a trapezoid stays on the PyTorch path
    return jvp_shape_supported(w2.shape[1], w2.shape[0])


def _fused_norm_first_applies(
    features: torch.Tensor, desc: NormFirstMLP, second: torch.Tensor, low: torch.dtype | None, tf32: bool,
    kernel: str, upper: bool,
) -> bool:  # fmt: skip
    """What the fused norm-first kernel computes: the MLP kernel's precisions (tf32 through a factor or with
    kernel="fused", bf16), a factor no taller than d_h, its shapes.

    In "auto" mode one block only (InternVL3's projector), and only where the gemm-norm kernel cannot take the
    product through R (:func:`_gemm_norm_applies`). On one H200 (m = 64, tf32 through R,
    benchmarks/results/2026-11-29-195208-gpu-h200-norm-first.json) the operand kernel then gemm-norm took 5.02 ms
    on InternVL3-8B's projector (N = 1280) against this kernel's 6.00, and 7.90 / 5.94 ms on the Qwen mergers' four
    blocks (Qwen2.5-VL-7B, Qwen3-VL-8B) against its 12.43 / 8.51, whose operand it builds from four lifted rows per
    direction. ``kernel="fused"`` runs it wherever its shapes allow.
    """
    if features.dtype != torch.float32 or (low is not None and low != torch.bfloat16):
        return False
    if kernel == "auto" and (desc.blocks != 1 or _gemm_norm_applies(features, second, low, tf32, upper)):
        return False
    if low is None and not (tf32 and (kernel == "fused" or upper)):
        return False
    if upper and second.shape[0] > second.shape[1]:
        return False
    return norm_first_shape_supported(desc.blocks, second.shape[1], second.shape[0])


def _fused_norm_first(
    prepared: norm_first.FirstLayer, slope: torch.Tensor, second: torch.Tensor, low: torch.dtype | None, upper: bool,
    gate: KernelGate,
) -> torch.Tensor:  # fmt: skip
    """:func:`care_core.kernels.dispatch.norm_first_norms` on the first layer's products: the per-block corrections
    W2 (slope_i ⊙ p_bi) made here (blocks / m of the kernel's work), at the kernel's precision. W2's kernel operand
    comes from ``gate`` (:meth:`~care_core.kernels.dispatch.KernelGate.operand`: made once where a scorer keeps it);
    in bf16 it is also the corrections' weight (W2 in bf16, as the kernel reads it)."""
    blocks, n, hidden = prepared.partial.shape
    bf16 = low is not None
    operand = gate.operand(second, bf16=bf16)
    weight = operand if bf16 else second
    flat = (slope[None] * prepared.partial).reshape(-1, hidden)
    flat = flat.to(low) if bf16 else flat
    corrections = (_upper_products(flat, weight) if upper else flat @ weight.T).float().view(blocks, n, -1)
    return dispatch.norm_first_norms(slope, prepared.lifted, prepared.inverse, prepared.coef, corrections, operand,
                                    bf16=bf16, upper=upper, rounded=True)  # fmt: skip


def _norm_first_operand_applies(features: torch.Tensor, desc: NormFirstMLP) -> bool:
    """What the norm-first operand kernel writes: float32 operands (from float32 features; the GEMM after it runs at
    any precision), for the blocks per row it unrolls. Device and Triton are checked by the gate.

    "auto" runs it wherever the fused norm-first kernel does not: on an H200 (Qwen2.5-VL-7B's merger, N = 1296,
    m = 64, tf32 through R) the PyTorch path's ~12.5 ms spent ~4 ms writing the GEMM's input in several passes over
    (N, c, d_h) float32 tensors (first_layer_tangents, then the slope), which this kernel writes in one.
    """
    return features.dtype == torch.float32 and norm_first_operand_supported(desc.blocks)


def _second_layer_input(prepared: norm_first.FirstLayer, slope: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """act'(pre_i) ⊙ W1 J(v_i) u_x for directions start..stop-1, (N, c, d_h): the PyTorch path (three passes)."""
    tangent = norm_first.first_layer_tangents(prepared, start, stop)
    tangent *= slope[:, None]
    return tangent


def _gemm_norm_applies(
    features: torch.Tensor, second: torch.Tensor, low: torch.dtype | None, tf32: bool, upper: bool
) -> bool:
    """What the gemm-norm kernel computes after the operand kernel: ||R t|| per row through the upper factor
    (triangle or trapezoid; a dense W2 stays on cuBLAS), float32 rows, tf32 or bf16 products (float32 products and
    float64 stay on the PyTorch path), its shapes. Device and Triton are checked by the gate.

    "auto" runs it wherever the operand kernel runs and this applies (the Qwen mergers through R on CUDA): the
    operand kernel's rows, then this kernel, instead of cuBLAS's products through R's column blocks (1.2x the
    trapezoid's multiply-adds, the (N·c, d_out) product written and read back for the norm): on an H200 the path
    went from 1.81x to 1.59x its floor on Qwen2.5-VL-7B's merger, from 1.90x to 1.75x on Qwen3-VL-8B's
    (benchmarks/results/2026-11-29-182208-gpu-h200-norm-first.json).
    """
    if features.dtype != torch.float32 or not upper:
        return False
    if low is None and not tf32:
        return False  # float32 products: cuBLAS
    if low is not None and low != torch.bfloat16:
        return False
    return gemm_norm_shape_supported(second.shape[1], second.shape[0], upper=True)


def _product_norms(flat: torch.Tensor, second: torch.Tensor, low: torch.dtype | None, upper: bool) -> torch.Tensor:
    """||second t|| for every row t of ``flat`` (M, d_h): cuBLAS's product (bf16 operands where ``low``, norms
    accumulated in float32; through the upper factor's column blocks where ``upper``), then the norm."""
    flat = flat if low is None else flat.to(low)
    out = _upper_products(flat, second) if upper else flat @ second.T
    if low is not None:
        out = out.float()
    return out.norm(dim=-1)


def _gemm_row_norms(
    second: torch.Tensor, low: torch.dtype | None, gate: KernelGate, *, rows_rounded: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`care_core.kernels.dispatch.gemm_norms` through the upper factor ``second`` (float32), as the kernel's
    operand (bf16, or rounded to tf32) made once for all chunks, and once for all calls where ``gate`` is a scorer's
    (:meth:`~care_core.kernels.dispatch.KernelGate.operand`). ``rows_rounded``: the rows come already rounded to tf32
    (:func:`_one_pass_rows`) and are read as they are; else the kernel converts them."""
    bf16 = low is not None
    weight = gate.operand(second, bf16=bf16)
    return partial(dispatch.gemm_norms, r=weight, bf16=bf16, upper=True, rounded=True, round_t=not rows_rounded)


def _norm_first_rows(
    operand: Callable[[int, int], torch.Tensor], row_norms: Callable[[torch.Tensor], torch.Tensor],
    second: torch.Tensor, n: int, m: int, dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """||second t_ix||, (m, N) in ``dtype``, from the second layer's inputs t (N, c, d_h) that ``operand(start, stop)``
    writes per chunk of directions; ``row_norms`` takes a chunk's (N·c, d_h) rows to their (N·c,) norms
    (:func:`_product_norms`, or the gemm-norm kernel)."""
    hidden = second.shape[1]
    step = _chunk_size(m, n * max(hidden, second.shape[0]))  # a chunk holds (N, c, d_h) inputs, (N c, d_out) out
    rows = []
    for start in range(0, m, step):
        flat = operand(start, min(m, start + step)).reshape(-1, hidden)
        rows.append(row_norms(flat).view(n, -1).T.to(dtype))
    return torch.cat(rows)


def _jvp_norm_mlp(
    features: torch.Tensor,
    desc: NormFirstMLP,
    directions: torch.Tensor,
    low: torch.dtype | None,
    factor: torch.Tensor | None = None,
    *,
    tf32: bool = False,
    kernel: Kernel | KernelGate = "auto",
) -> torch.Tensor:
    """||J_M(v_i) u_x|| (Eq. 1, h -> 0) for a norm-first projector: the first layer's tangent through the norm's
    exact derivative (:func:`care_core.norm_first.first_layer_tangents`: W1 on the m directions once, shared by all
    tokens), then act'(pre) and the second layer, through ``factor`` R (:func:`triangular_factor`: triangular or
    trapezoidal, same norms) where given.

    Multiply-adds: N d_in d_h (the forward's per-block products) + m d_in d_h + N m d_in + 2 m N blocks d_h, then
    m N d_h d_out (through R: :func:`~care_core._chunks.upper_macs`), against the generic path's (m + 2 chunks)
    F_M(N). ``low``: bf16 operands for the second-layer product (norms accumulated in float32). Where the gate
    allows, the act', second-layer and norm steps run fused (:mod:`care_core.kernels.jvp_norm_first`); else the
    second layer's input is written in one pass (:mod:`care_core.kernels.norm_first_operand`) or by PyTorch, and
    the product through R and the norms run in one kernel where :func:`_gemm_norm_applies`
    (:mod:`care_core.kernels.gemm_norm`; after the one-pass writer only), else by cuBLAS then a norm.
    """
    prepared = norm_first.first_layer(desc, features, directions)
    slope = _activation_slope(desc.act, prepared.pre)  # act'(W1 norm(v) + b1), (N, d_h)
    second = desc.second.weight if factor is None else factor
    gate, upper = as_gate(kernel), factor is not None
    applies = _fused_norm_first_applies(features, desc, second, low, tf32, gate.kernel, upper)
    if gate.choose("jvp_norm_first", features.device, applies=applies) == "fused":
        fused = gate.attempt("jvp_norm_first", lambda: _fused_norm_first(prepared, slope, second, low, upper, gate))
        if fused is not None:
            return fused.to(features.dtype)
    source, second = second, second if low is None else gate.operand(second, bf16=True)  # kept by a scorer's gate
    rows = partial(_norm_first_rows, second=second, n=features.shape[0], m=directions.shape[0], dtype=features.dtype)
    by_product = partial(_product_norms, second=second, low=low, upper=upper)
    device = features.device
    if gate.choose("norm_first_operand", device, applies=_norm_first_operand_applies(features, desc)) == "fused":
        gemm_applies = _gemm_norm_applies(features, second, low, tf32, upper)
        gemm = gate.choose("gemm_norm", device, applies=gemm_applies) == "fused"
        tf32_rows = low is None  # tf32 products: rows rounded once, by the operand kernel (the one rounding rule)
        maker = partial(_gemm_row_norms, source, low, gate, rows_rounded=tf32_rows) if gemm else None
        one_pass = _one_pass_rows(prepared, slope, gate, rows, by_product, maker, tf32_rows=tf32_rows)
        if one_pass is not None:
            return one_pass
    return rows(partial(_second_layer_input, prepared, slope), by_product)


def _one_pass_rows(
    prepared: norm_first.FirstLayer, slope: torch.Tensor, gate: KernelGate,
    rows: Callable[..., torch.Tensor], by_product: Callable[[torch.Tensor], torch.Tensor],
    gemm: Callable[[], Callable[[torch.Tensor], torch.Tensor]] | None, *, tf32_rows: bool,
) -> torch.Tensor | None:  # fmt: skip
    """The responses from the operand kernel's rows (:func:`_norm_first_rows`), through the gemm-norm kernel where
    ``gemm`` (its row norms' maker) is given, else ``by_product``; None where the kernels cannot be built ("auto").
    ``tf32_rows``: the gemm-norm kernel's products are tf32, so the operand kernel writes its rows rounded to tf32,
    which that kernel reads as they are (the same bits it would round them to); cuBLAS gets them unrounded.

    The operand kernel's first build runs inside the gemm-norm attempt: its failure there is booked to "gemm_norm"
    as well as (on the retry by product) to "norm_first_operand". In "auto" that costs nothing (the gemm-norm kernel
    runs only after the operand kernel); in "fused" the error names the gemm-norm kernel and quotes the operand's."""
    p = prepared
    coef = p.coef.transpose(1, 2).contiguous().transpose(1, 2)  # direction-major: the kernel's coalesced reads
    operand = partial(dispatch.norm_first_operand, slope, p.lifted, p.inverse, coef, p.partial)
    if gemm is not None:
        rounded = partial(operand, tf32_rounded=tf32_rows)
        through = gate.attempt("gemm_norm", lambda: rows(rounded, gemm()))
        if through is not None:
            return through
    return gate.attempt("norm_first_operand", lambda: rows(operand, by_product))


def _jvp_norm_linear(
    features: torch.Tensor, desc: NormLinear, directions: torch.Tensor, low: torch.dtype | None
) -> torch.Tensor:
    """||W J_norm(v_i) u_x|| (Eq. 1, h -> 0) for a norm-then-linear projector, M(v) = W norm(v) + b:
    W J(v_i) u_x = (1 / s_i) [a_x - c_ix p_i] with a_x = W (g ⊙ ũ_x) once per direction (shared by all tokens),
    p_i = W (g ⊙ x̂_i) once per token and c_ix = <x̂_i, ũ_x> / d (:func:`care_core.norm_first.first_layer`), the
    tangents formed in chunks of directions (:func:`care_core.norm_first.first_layer_tangents`) and normed.

    Multiply-adds: N d_in d_out + m d_in d_out + m N d_in for the shared products, 2 m N d_out for the combination and
    its norm, against the generic path's about (m + 2 chunks) N d_in d_out. ``low``: the tangents formed and held in
    bf16 (the combination, memory-bound, moves half the bytes), norms accumulated in float32.
    """
    prepared = norm_first.first_layer(desc, features, directions)
    if low is not None:
        parts = ("partial", "lifted", "coef", "inverse")
        prepared = dataclasses.replace(prepared, **{name: getattr(prepared, name).to(low) for name in parts})
    n, d_out = prepared.pre.shape
    m = directions.shape[0]
    step = _chunk_size(m, n * d_out)  # a chunk holds (N, c, d_out) tangents
    rows = []
    for start in range(0, m, step):
        # The tangent is formed before its norm is taken. The Gram expansion ||a||² - 2c<a, p> + c²||p||² would skip
        # that tensor, but its terms can far exceed the result: J x̂ ∝ eps, so along x̂_i they nearly cancel and the
        # expansion's rounding, eps times its largest term, swamps the response (float32: 0.16 of a typical response
        # along x_i, against 1.5e-7 formed; tests/core/test_scoring_norm_linear.py)
        tangent = norm_first.first_layer_tangents(prepared, start, start + step)  # (N, c, d_out)
        norms = torch.linalg.vector_norm(tangent, dim=-1, dtype=torch.promote_types(tangent.dtype, torch.float32))
        rows.append(norms.T.to(features.dtype))
    return torch.cat(rows)


def _jvp_generic(features: torch.Tensor, projector: Projector, directions: torch.Tensor) -> torch.Tensor:
    """||J_M(v) u|| for any projector: ``torch.func.jvp`` at the N tokens, vmapped over chunks of directions.

    The primal pass does not depend on the direction, so under ``vmap`` it runs once per chunk of c directions
    instead of once per direction: a chunk costs F_M(N) (primal) + c F_M(N) (tangents) + F_M(N) (forward-mode
    AD's product rule also multiplies the tokens by the weights' zero tangent, once, unbatched).
    """
    n, dim = features.shape
    m = directions.shape[0]
    step = two_pass_chunk(m, n, dim, _out_features(projector, features))

    def along(u: torch.Tensor) -> torch.Tensor:
        _, jv = torch.func.jvp(projector, (features,), (u.expand(n, dim),))  # type: ignore[misc]
        return jv.norm(dim=-1)

    try:
        rows = [torch.func.vmap(along)(directions[start : start + step]) for start in range(0, m, step)]
    except (RuntimeError, NotImplementedError):  # a projector vmap cannot batch: one row per (direction, token)
        return _jvp_rows(features, projector, directions, step)
    return torch.cat(rows)


def _jvp_rows(features: torch.Tensor, projector: Projector, directions: torch.Tensor, step: int) -> torch.Tensor:
    """The generic jvp without vmap: the projector on all (direction, token) rows of a chunk (3 m F_M(N))."""
    n, dim = features.shape
    rows = []
    for start in range(0, directions.shape[0], step):
        u = directions[start : start + step]
        c = u.shape[0]
        points = features.expand(c, n, dim).reshape(-1, dim)
        tangents = u[:, None].expand(c, n, dim).reshape(-1, dim)
        _, jv = torch.func.jvp(projector, (points,), (tangents,))  # type: ignore[misc]  # (primal, tangent) out
        rows.append(jv.reshape(c, n, -1).norm(dim=-1))
    return torch.cat(rows)


@torch.no_grad()
def responses_jvp(
    features: torch.Tensor,
    projector: Projector,
    directions: torch.Tensor,
    matmul: str = "auto",
    *,
    kernel: Kernel | KernelGate = "auto",
    factor: torch.Tensor | None = None,
) -> torch.Tensor:
    """C[x, i] = ||J_M(v_i) u_x||_2, the exact h -> 0 limit of Eq. 1; (m, N).

    Four paths: Linear-act-Linear (:func:`_jvp_mlp`), norm-first (:func:`_jvp_norm_mlp`), norm-then-linear
    (:func:`_jvp_norm_linear`), any other projector ``torch.func.jvp`` (:func:`_jvp_generic`); all exact, only
    rounding differs. `matmul`: "auto" (float32 on CPU, tf32 on CUDA), "float32", "tf32" or "bf16" (the second
    layer of the MLP and norm-first paths, the tangents of the norm-then-linear path; the generic path runs float32
    there).
    `kernel`: "auto", "fused" or "torch" (see :mod:`care_core.kernels`; MLP path), or a caller-owned gate.
    `factor`: the triangular (or trapezoidal) factor of the projector's second layer (:func:`triangular_factor`),
    for a Linear-act-Linear or norm-first projector; ignored by any other.
    """
    allow_tf32 = allows_tf32(matmul, features)
    low = torch.bfloat16 if matmul == "bf16" and features.dtype != torch.float64 else None
    with matmul_precision(allow_tf32=allow_tf32):
        mlp = _as_mlp(projector)
        if mlp is not None:
            return _jvp_mlp(features, mlp, directions, low, tf32=allow_tf32, kernel=kernel, factor=factor)
        norm_mlp = _as_norm_first(projector)
        if norm_mlp is not None:
            return _jvp_norm_mlp(features, norm_mlp, directions, low, factor, tf32=allow_tf32, kernel=kernel)
        norm_linear = _as_norm_linear(projector)
        if norm_linear is not None:
            return _jvp_norm_linear(features, norm_linear, directions, low)
        return _jvp_generic(features, projector, directions)


def perturbation_responses(
    features: torch.Tensor,
    projector: Projector,
    directions: torch.Tensor,
    *,
    h: float,
    engine: str = "jvp",
    matmul: str = "auto",
    kernel: Kernel | KernelGate = "auto",
    factor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Response matrix C (m, N) of Eq. 1 with the chosen engine; features already in compute dtype.

    A pure function: the projector is converted to the features' dtype and device on every call where
    it differs (see :class:`Scorer` to do that once). `factor` (the second layer's triangular or trapezoidal
    factor of the projector as converted, see :func:`triangular_factor`) applies to both engines' MLP paths
    and the jvp engine's norm-first path, `kernel` to the jvp engine's MLP path; `matmul` to the jvp engine's
    products and the fd engine's second-layer product on the difference (:func:`responses_fd`).
    """
    projector = prepare_projector(projector, features.dtype, features.device)
    if engine == "fd":
        return responses_fd(features, projector, directions, h, factor=factor, matmul=matmul)
    if engine == "jvp":
        return responses_jvp(features, projector, directions, matmul, kernel=kernel, factor=factor)
    raise ValueError(f"unknown engine {engine!r} (expected 'jvp' or 'fd')")


def joint_responses(
    features: Sequence[torch.Tensor],
    projector: Projector,
    directions: torch.Tensor,
    *,
    h: float,
    engine: str = "fd",
    max_rows: int | None = None,
    factor: torch.Tensor | None = None,
    matmul: str = "auto",
) -> list[torch.Tensor]:
    """:func:`perturbation_responses` (m, N_i) of every image, from passes over several images' rows at once.

    A response depends only on its token and direction (the projector acts row by row), so a pass over the rows
    of several images gives each image its own. Consecutive images share a pass up to ``max_rows`` rows (default
    :func:`~care_core._chunks.two_pass_rows`: one direction's intermediates then stay within the bound one
    image's chunks keep); an image with more rows goes alone, chunked as alone. Features of one width, device and
    compute dtype; the projector is prepared for them once for all passes. `factor` and `matmul`: as for
    :func:`perturbation_responses`.
    """
    first = features[0]
    projector = prepare_projector(projector, first.dtype, first.device)
    second = _second_linear(projector)  # a fast path's passes hold (rows, d_h) intermediates: bound those too
    width = first.shape[1] if second is None else max(first.shape[1], second.in_features)
    limit = max_rows if max_rows is not None else two_pass_rows(width, _out_features(projector, first))
    if engine == "jvp" and (_as_norm_first(projector) is not None or _as_norm_linear(projector) is not None):
        # each image alone: the norm paths' cuBLAS products then see the rows of one image, as a call for that
        # image alone does (joined rows changed the products' shapes, and with them tf32 rounding, on CUDA); its
        # chunks of (N, c, d_h) tangents already fill the GPU at one image's N
        limit = 1
    out: list[torch.Tensor] = []
    for group in row_groups([v.shape[0] for v in features], limit):
        joined = features[group[0]] if len(group) == 1 else torch.cat([features[i] for i in group])
        responses = perturbation_responses(joined, projector, directions, h=h, engine=engine, factor=factor,
                                           matmul=matmul)  # fmt: skip
        out.extend(c.contiguous() for c in responses.split([features[i].shape[0] for i in group], dim=1))
    return out


def median(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Median along `dim`; for an even count the mean of the two middle values (as numpy does)."""
    ordered = values.sort(dim=dim).values
    n = values.shape[dim]
    low = ordered.narrow(dim, (n - 1) // 2, 1)
    high = ordered.narrow(dim, n // 2, 1)
    return ((low + high) / 2).squeeze(dim)


def robust_zscores(responses: torch.Tensor, eps: float) -> torch.Tensor:
    """Z[x, i] = (C[x, i] - med_j C[x, j]) / (MAD_x + eps), per direction over tokens (Eq. 2)."""
    med = median(responses, dim=1)[:, None]
    mad = median((responses - med).abs(), dim=1)[:, None]
    return (responses - med) / (mad + eps)


def influence_scores(zscores: torch.Tensor, lam: float, eps: float) -> torch.Tensor:
    """psi_bar: min-max normalised psi = mu - lambda sigma over directions (Sec. 3.2, after Eq. 2)."""
    mu = zscores.mean(dim=0)
    sigma = ((zscores - mu) ** 2).mean(dim=0).sqrt()  # population std over directions
    psi = mu - lam * sigma
    return (psi - psi.min()) / (psi.max() - psi.min() + eps)


def _fingerprint(projector: Projector) -> tuple[TensorState, ...]:
    """:func:`~care_core._memo.tensor_state` of every parameter and buffer: what a moved, cast, replaced or in-place
    edited weight changes. A few microseconds for a projector's handful of tensors."""
    if not isinstance(projector, nn.Module):
        return ()
    return tuple(tensor_state(t) for t in (*projector.parameters(), *projector.buffers()))


class Scorer:
    """User-owned PRCA scoring state for one projector: the functional core's results, kept.

    The pure functions above recompute on every call what this object keeps between calls:

    - the projector prepared for the compute dtype and device (e.g. the float32 copy of a bf16
      projector), made once per (dtype, device) by :func:`prepare_projector`;
    - the unit directions per (m, dim, seed, device, dtype), drawn once by :func:`unit_directions`
      (the 16 most recent keys);
    - the kernel decision: a fused kernel that failed to build here (Triton missing, a compilation
      error) is not tried again by this scorer in "auto" mode (:attr:`kernel_failures`);
    - for a Linear-act-Linear or norm-first projector, the factor R of its second layer
      (:func:`triangular_factor`: triangular, or trapezoidal where d_out < d_h), per (dtype, device), where
      ``second_layer`` asks for it: the jvp engine's norms (and the fd engine's on its MLP path) then go
      through R, the same norms for (B + 1) / 2B of the multiply-adds (a triangle; a trapezoid skips less).

    ``second_layer``: "auto" (through R on CUDA, W2 itself elsewhere), "dense" (always W2) or
    "triangular" (through R wherever the projector has one).

    What a scorer promises. With a dense second layer (always on the CPU in "auto" mode) its results are
    bit-identical to the functional path. Through R the responses are the dense ones to float rounding:
    float64 about 1e-14 relative, float32 about 1e-6; in tf32 or bf16 each path carries its precision's
    own error against float64 (about 1e-4 and 1e-2 relative) and R's is no larger than W2's. psi_bar
    inherits that error (amplified by the robust z-scores' 1 / MAD), so anchors and signals are the
    dense path's wherever the greedy's margins exceed it -- always in float64 on well-separated tokens;
    in tf32/bf16 near-ties may swap as they do between any two dispatch.

    Staleness: the prepared copy and the factor are tied to the projector's weights. Every call
    compares a fingerprint of its parameters (data pointer, dtype, device and version counter, which
    in-place edits, ``load_state_dict`` and optimiser steps bump) and rebuilds them when it changed.
    Edits through ``param.data`` bypass the version counter: call :meth:`clear` after those. Where the
    projector already is in the compute dtype on the features' device no copy is made and the
    projector itself is used. One scorer per thread. :meth:`for_projector` is the scorer kept on the
    projector itself, which ``care_reduce`` and ``prca_scores`` use when given none.

    >>> import torch
    >>> from care_core import CaReConfig, care_reduce
    >>> from care_core.scoring import Scorer
    >>> projector = torch.nn.Linear(8, 4).bfloat16()
    >>> scorer = Scorer(projector)
    >>> v, p = torch.randn(50, 8), torch.rand(50, 2)
    >>> red = care_reduce(v, projector, p, keep=5, config=CaReConfig(m=8), scorer=scorer)
    >>> red.indices.shape
    torch.Size([5])
    """

    _MAX_DIRECTIONS = 16
    SECOND_LAYERS = ("auto", *SECOND_LAYERS)
    KEPT_AS = "_care_scorer"  # the attribute under which for_projector keeps a scorer on its projector

    def __init__(self, projector: Projector, *, second_layer: str = "auto") -> None:
        if second_layer not in self.SECOND_LAYERS:
            raise ValueError(f"second_layer must be one of {self.SECOND_LAYERS}, got {second_layer!r}")
        self._projector = projector
        self.second_layer = second_layer
        self._factors: dict[tuple[torch.dtype, torch.device], torch.Tensor | None] = {}
        self._prepared: dict[tuple[torch.dtype, torch.device], Projector] = {}
        self._directions: dict[tuple[int, int, int, torch.device, torch.dtype], torch.Tensor] = {}
        self._failed: dict[str, str] = {}
        self._operands: dict[Hashable, torch.Tensor] = {}  # the fused kernels' weight operands (KernelGate.operand)
        self._weights: tuple[TensorState, ...] | None = _fingerprint(projector)

    @classmethod
    def for_projector(cls, projector: Projector) -> Scorer:
        """The scorer kept on ``projector`` itself ("auto" second layer): made on first use and stored as the
        module's attribute ``_care_scorer`` (not a parameter or buffer: no state dict, ``.to`` or ``parameters()``
        sees it), so it lives and dies with the projector and no module-level cache exists. This is what a plain
        ``care_reduce(features, projector, ...)`` scores through: on CUDA the triangular factor (a ~0.2 s QR at
        d_h = 4096) is made on the first call and reused by every later one. A projector that is not an
        ``nn.Module`` gets a new scorer per call. Copies and pickles of the projector carry an empty scorer."""
        if not isinstance(projector, nn.Module):
            return cls(projector)
        kept = projector.__dict__.get(cls.KEPT_AS)
        if isinstance(kept, Scorer) and kept.projector is projector:
            return kept
        kept = cls(projector)
        setattr(projector, cls.KEPT_AS, kept)
        return kept

    def __getstate__(self) -> dict[str, object]:
        """Copies and pickles keep the projector and the setting; the caches are rebuilt on first use."""
        return {"projector": self._projector, "second_layer": self.second_layer}

    def __setstate__(self, state: dict[str, object]) -> None:
        self._projector = state["projector"]  # type: ignore[assignment]
        self.second_layer = str(state["second_layer"])
        self._factors, self._prepared, self._directions, self._failed, self._operands = {}, {}, {}, {}, {}
        self._weights = None  # the projector may still be half-built (a deepcopy in progress): read on first use

    def _check_weights(self) -> None:
        """Drop the prepared copies and factors when the projector's weights changed since they were made."""
        now = _fingerprint(self._projector)
        if now != self._weights:
            self._prepared.clear()
            self._factors.clear()
            self._operands.clear()
            self._weights = now

    @property
    def projector(self) -> Projector:
        """The projector this scorer was made for (``care_reduce`` checks it is the one given)."""
        return self._projector

    def fingerprint(self) -> tuple[TensorState, ...]:
        """(data pointer, version counter, dtype, device) of each of the projector's parameters and buffers: what a
        moved, cast, replaced or in-place edited weight changes (the staleness rule above; a reduction graph's key)."""
        return _fingerprint(self._projector)

    @property
    def kernel_failures(self) -> dict[str, str]:
        """Fused kernels that failed to build for this scorer (name -> error); "auto" skips them."""
        return dict(self._failed)

    def clear(self) -> None:
        """Drop every prepared copy, triangular factor, kernel operand, cached direction set and recorded kernel
        failure."""
        self._prepared.clear()
        self._factors.clear()
        self._operands.clear()
        self._directions.clear()
        self._failed.clear()
        self._weights = _fingerprint(self._projector)

    def gate(self, kernel: Kernel = "auto") -> KernelGate:
        """A kernel gate with `kernel` as setting that records failures and keeps kernel operands in this scorer."""
        return KernelGate(kernel, self._failed, self._operands)

    def prepared(self, dtype: torch.dtype, device: torch.device | str) -> Projector:
        """The projector in `dtype` on `device`, converted on the first request (see :func:`prepare_projector`)."""
        self._check_weights()
        return self._prepared_for((dtype, torch.device(device)))

    def _prepared_for(self, key: tuple[torch.dtype, torch.device]) -> Projector:
        """:meth:`prepared` for a (dtype, device) key, the weights already checked."""
        found = self._prepared.get(key)
        if found is None:
            found = prepare_projector(self._projector, *key)
            self._prepared[key] = found
        return found

    def factor(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor | None:
        """The triangular (d_out >= d_h) or trapezoidal (d_out < d_h) factor of the prepared projector's second
        layer where ``second_layer`` uses one on `device` and the projector is Linear-act-Linear or norm-first,
        else None; made once. "auto" takes a trapezoid for a norm-first projector only: a wide Linear-act-Linear
        keeps its dense W2, whose path (cuBLAS, or the fused kernel in bf16) gives each image the same responses
        alone and in a batch, where the trapezoid's column blocks did not on CUDA (one anchor in 64 swapped)."""
        self._check_weights()
        return self._factor_for((dtype, torch.device(device)))

    def _factor_for(self, key: tuple[torch.dtype, torch.device]) -> torch.Tensor | None:
        """:meth:`factor` for a (dtype, device) key, the weights already checked."""
        if self.second_layer == "dense" or (self.second_layer == "auto" and key[1].type != "cuda"):
            return None
        if key not in self._factors:
            prepared = self._prepared_for(key)
            second = _second_linear(prepared)
            wide_mlp = second is not None and second.out_features < second.in_features and _as_mlp(prepared) is not None
            if second is None or (wide_mlp and self.second_layer == "auto"):
                self._factors[key] = None
            else:
                self._factors[key] = triangular_factor(second.weight)
        return self._factors[key]

    def directions(
        self, m: int, dim: int, seed: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """:func:`unit_directions`, drawn once per key; each call gets its own copy."""
        key = (m, dim, seed, torch.device(device), dtype)
        found = recall(self._directions, key, lambda: unit_directions(m, dim, seed, device=device, dtype=dtype),
                       self._MAX_DIRECTIONS)  # fmt: skip
        return found.clone()  # callers may change theirs; a device-side clone costs microseconds

    def responses(
        self,
        features: torch.Tensor,
        directions: torch.Tensor,
        *,
        h: float,
        engine: str = "jvp",
        matmul: str = "auto",
        kernel: Kernel = "auto",
    ) -> torch.Tensor:
        """:func:`perturbation_responses` with the prepared projector and this scorer's kernel gate (the weights
        checked once per call: their fingerprint walks the projector's modules, host time before the first kernel)."""
        self._check_weights()
        key = (features.dtype, features.device)
        projector, factor = self._prepared_for(key), self._factor_for(key)
        return perturbation_responses(
            features, projector, directions, h=h, engine=engine, matmul=matmul, kernel=self.gate(kernel), factor=factor
        )
