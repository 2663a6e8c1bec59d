"""PRCA scoring, paper Eq. 1–2: perturbation responses of the projector and robust z-scores.

Two engines compute the response matrix C (m, N):
- ``fd``: Eq. 1 literally, ``||M(v + h u) - M(v - h u)|| / 2h``, in float32 or float64, tf32 off;
- ``jvp``: its h -> 0 limit ``||J_M(v) u||``, exact. For a Linear-act-Linear projector (LLaVA's)
  the first layer is applied once to the m directions and shared by all tokens, so the cost is
  about m N d_hidden d_out multiply-adds; any other projector goes through ``torch.func.jvp``.
  On CUDA with bf16 matmuls that MLP path is one fused Triton kernel (``care_core.kernels``; also
  for tf32 when ``FUSED_TF32`` is set); the CPU path is plain PyTorch.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

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
_MLP_PROJECTORS = ("LlavaMultiModalProjector", "LlavaNextMultiModalProjector")

# Use the fused kernel for tf32 matmuls too (bf16 uses it wherever it applies). Off: on an H200
# (benchmarks/gpu.py, N = 2880, benchmarks/results/2026-11-26-gpu-h200.json) cuBLAS's tf32 matmuls over
# chunks of materialised tangents took 20.0 ms against the fused kernel's 21.6 ms (floor 15.1), with the
# same error; in bf16 the fused kernel wins (12.3 against 13.5 ms, floor 7.8).
FUSED_TF32 = False

# unit_directions() results by (m, dim, seed, device, dtype), oldest dropped first.
_DIRECTIONS: dict[tuple[object, ...], torch.Tensor] = {}

# Set when the fused kernel failed once in this process (then the PyTorch path is used).
_FUSED_FAILED: list[str] = []

# Elements of the largest intermediate per chunk (~256 MB in float32).
_CHUNK_ELEMENTS = 1 << 26


def unit_directions(
    m: int, dim: int, seed: int, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """m unit directions u_x = g_x / ||g_x||, g_x ~ N(0, I) (Eq. 1), drawn on the CPU in float64.

    Drawing on the CPU from a seeded ``torch.Generator`` gives the same directions on every device.
    The last few (m, dim, seed, device, dtype) are cached: drawing and copying them to a GPU costs
    about a millisecond per call, a host synchronisation included.
    """
    key = (m, dim, seed, str(torch.device(device)), dtype)
    cached = _DIRECTIONS.get(key)
    if cached is None:
        generator = torch.Generator(device="cpu").manual_seed(seed)
        g = torch.randn(m, dim, generator=generator, dtype=torch.float64)
        cached = (g / g.norm(dim=1, keepdim=True)).to(device=device, dtype=dtype)
        if len(_DIRECTIONS) >= 16:
            _DIRECTIONS.pop(next(iter(_DIRECTIONS)))
        _DIRECTIONS[key] = cached
    return cached.clone()  # callers own their copy; a device-side clone costs microseconds


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
        first, act, second = projector.linear_1, projector.act, projector.linear_2  # type: ignore[union-attr]
    else:
        return None
    if not (isinstance(first, nn.Linear) and isinstance(second, nn.Linear)):
        return None
    if type(act).__name__ not in _ELEMENTWISE_ACTIVATIONS:
        return None
    return _MLP(first, act, second)


# Converted copies of projectors (e.g. a bf16 model's projector in float32), reused while the source's
# parameters are unchanged: same objects, storage and in-place version counters.
_CONVERTED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[object, ...], nn.Module]] = weakref.WeakKeyDictionary()


def _projector_in(projector: Projector, dtype: torch.dtype, device: torch.device) -> Projector:
    """The projector with its parameters in `dtype` (a copy if they differ); plain callables as is."""
    if not isinstance(projector, nn.Module):
        return projector
    params = [p for p in projector.parameters() if p.is_floating_point()]
    if all(p.dtype == dtype and p.device == device for p in params):
        return projector
    try:
        key = (dtype, device, *((id(p), p.data_ptr(), p._version) for p in projector.parameters()))
    except RuntimeError:  # inference tensors have no version counter: no caching
        return copy.deepcopy(projector).to(device=device, dtype=dtype)
    cached = _CONVERTED.get(projector)
    if cached is not None and cached[0] == key:
        return cached[1]
    converted = copy.deepcopy(projector).to(device=device, dtype=dtype)
    _CONVERTED[projector] = (key, converted)
    return converted


def _chunk_size(m: int, per_direction: int) -> int:
    return max(1, min(m, _CHUNK_ELEMENTS // max(1, per_direction)))


@torch.no_grad()
def responses_fd(features: torch.Tensor, projector: Projector, directions: torch.Tensor, h: float) -> torch.Tensor:
    """C[x, i] = ||M(v_i + h u_x) - M(v_i - h u_x)||_2 / (2h)  (Eq. 1), literally; (m, N)."""
    n, dim = features.shape
    m = directions.shape[0]
    out_dim = projector(features[:1]).shape[-1]
    step = _chunk_size(m, n * max(dim, out_dim) * 2)
    rows = []
    with matmul_precision(allow_tf32=False):
        for start in range(0, m, step):
            u = directions[start : start + step]
            plus = (features[None] + h * u[:, None]).reshape(-1, dim)
            minus = (features[None] - h * u[:, None]).reshape(-1, dim)
            diff = projector(plus) - projector(minus)
            rows.append(diff.reshape(u.shape[0], n, -1).norm(dim=-1) / (2 * h))
    return torch.cat(rows)


def _jvp_mlp(
    features: torch.Tensor,
    mlp: _MLP,
    directions: torch.Tensor,
    low: torch.dtype | None,
    *,
    tf32: bool = False,
    second_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """||W2 diag(act'(W1 v + b1)) W1 u|| for every token and direction, sharing W1 u across tokens.

    On CUDA with bf16 matmuls (and tf32 when ``FUSED_TF32`` is set) the product, the matmul and the
    norm run fused in one Triton kernel (:mod:`care_core.kernels.jvp`); otherwise (CPU, float32/float64
    matmuls, tf32 by default, odd shapes) in chunks of directions with PyTorch. ``second_weight``
    replaces W2 (``benchmarks/gpu.py`` uses it to measure a random-sketch approximation, which is not
    offered: it keeps too few of the exact anchors).
    """
    pre = mlp.first(features)  # (N, d_hidden)
    slope = torch.func.jvp(mlp.act, (pre,), (torch.ones_like(pre),))[1]  # act'(W1 v + b1)
    lifted = directions @ mlp.first.weight.T  # (m, d_hidden): W1 u_x, shared by all tokens
    w2 = mlp.second.weight if second_weight is None else second_weight
    if _fused_jvp_applies(features, w2, low, tf32):
        from care_core.kernels.jvp import jvp_norms

        try:
            return jvp_norms(slope, lifted, w2, bf16=low is not None).to(features.dtype)
        except Exception as exc:  # a Triton build problem must not break scoring: fall back, say so once
            _FUSED_FAILED.append(repr(exc))
            warnings.warn(f"care: fused jvp kernel unavailable ({exc!r}); using the PyTorch path", stacklevel=2)
    if low is not None:
        slope, lifted, w2 = slope.to(low), lifted.to(low), w2.to(low)
    n, hidden = pre.shape
    m = directions.shape[0]
    step = _chunk_size(m, n * max(hidden, w2.shape[0]))
    rows = []
    for start in range(0, m, step):
        tangent = slope[None] * lifted[start : start + step, None]  # (c, N, d_hidden)
        out = tangent @ w2.T
        if low is not None:
            out = out.float()  # norms of bf16 products are accumulated in float32
        rows.append(out.norm(dim=-1).to(features.dtype))
    return torch.cat(rows)


def _fused_jvp_applies(features: torch.Tensor, w2: torch.Tensor, low: torch.dtype | None, tf32: bool) -> bool:
    """Fused kernel: float32 features on CUDA, bf16 mode (tf32 too with FUSED_TF32), shapes it tiles."""
    if features.device.type != "cuda" or features.dtype != torch.float32 or _FUSED_FAILED:
        return False
    if low is None and not (tf32 and FUSED_TF32):
        return False  # full float32 matmuls (or tf32 with FUSED_TF32 off): PyTorch (cuBLAS) path
    if low is not None and low != torch.bfloat16:
        return False
    from care_core.kernels import triton_enabled

    if not triton_enabled(features.device):
        return False
    from care_core.kernels.jvp import supported

    return supported(w2.shape[1], w2.shape[0])


def _jvp_generic(features: torch.Tensor, projector: Projector, directions: torch.Tensor) -> torch.Tensor:
    n, dim = features.shape
    m = directions.shape[0]
    out_dim = projector(features[:1]).shape[-1]
    step = _chunk_size(m, n * max(dim, out_dim) * 2)
    rows = []
    for start in range(0, m, step):
        u = directions[start : start + step]
        c = u.shape[0]
        points = features.expand(c, n, dim).reshape(-1, dim)
        tangents = u[:, None].expand(c, n, dim).reshape(-1, dim)
        _, jv = torch.func.jvp(projector, (points,), (tangents,))
        rows.append(jv.reshape(c, n, -1).norm(dim=-1))
    return torch.cat(rows)


@torch.no_grad()
def responses_jvp(
    features: torch.Tensor, projector: Projector, directions: torch.Tensor, matmul: str = "auto"
) -> torch.Tensor:
    """C[x, i] = ||J_M(v_i) u_x||_2, the exact h -> 0 limit of Eq. 1; (m, N).

    `matmul`: "auto" (float32 on CPU, tf32 on CUDA), "float32", "tf32" or "bf16" (MLP path only).
    """
    on_cuda = features.device.type == "cuda"
    allow_tf32 = matmul == "tf32" or (matmul == "auto" and on_cuda)
    if features.dtype == torch.float64:
        allow_tf32 = False
    low = torch.bfloat16 if matmul == "bf16" and features.dtype != torch.float64 else None
    with matmul_precision(allow_tf32=allow_tf32):
        mlp = _as_mlp(projector)
        if mlp is not None:
            return _jvp_mlp(features, mlp, directions, low, tf32=allow_tf32)
        return _jvp_generic(features, projector, directions)


def perturbation_responses(
    features: torch.Tensor,
    projector: Projector,
    directions: torch.Tensor,
    *,
    h: float,
    engine: str = "jvp",
    matmul: str = "auto",
) -> torch.Tensor:
    """Response matrix C (m, N) of Eq. 1 with the chosen engine; features already in compute dtype."""
    projector = _projector_in(projector, features.dtype, features.device)
    if engine == "fd":
        return responses_fd(features, projector, directions, h)
    if engine == "jvp":
        return responses_jvp(features, projector, directions, matmul)
    raise ValueError(f"unknown engine {engine!r} (expected 'jvp' or 'fd')")


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
