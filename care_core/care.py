"""care_reduce(): PRCA (Eq. 1–3) then CGTC (Eq. 4–9) on one image's visual tokens."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from care_core.anchors import diversity_greedy
from care_core.budget import resolve_budget
from care_core.calibration import Calibration, calibrate, calibrate_batch
from care_core.config import CaReConfig
from care_core.errors import CareError
from care_core.kernels.dispatch import why_not_fused
from care_core.precision import compute_dtype, matmul_precision
from care_core.scoring import (
    Projector,
    Scorer,
    influence_scores,
    robust_zscores,
    unit_directions,
)

if TYPE_CHECKING:
    from care_core.kernels.dispatch import KernelGate
    from care_core.reduction_graphs import ReductionGraphs

StageTimer = Callable[[str], AbstractContextManager[object]]
STAGES = ("scoring", "anchors", "calibration")


@dataclass(frozen=True)
class Reduction:
    """What CaRe keeps of N visual tokens: K calibrated anchors and the signals that fed them."""

    indices: torch.Tensor  # (K,) long, anchors S in ascending original index (raster order)
    anchor_order: torch.Tensor  # (K,) long, anchors in the order Eq. 3 selected them
    tokens: torch.Tensor  # (K, d_v) calibrated tokens v_hat (Eq. 9); row k belongs to indices[k]
    psi_bar: torch.Tensor  # (N,) normalised robust influence scores
    calibration: Calibration  # R, c_r, R+ (a mask over R) and the anchor each residual feeds most (Eq. 4–9)

    @property
    def num_kept(self) -> int:
        return int(self.indices.shape[0])

    @property
    def residuals(self) -> torch.Tensor:
        """(N - K,) long, residual tokens R, ascending."""
        return self.calibration.residuals

    @property
    def confidence(self) -> torch.Tensor:
        """(N - K,) gate confidence c_r of each residual token."""
        return self.calibration.confidence

    @property
    def signals(self) -> torch.Tensor:
        """(|R+|,) long, accepted calibration signals R+ (Eq. 6), ascending (a wait for the device)."""
        return self.calibration.signals

    @property
    def signal_targets(self) -> torch.Tensor:
        """(|R+|,) long, the anchor each signal mostly feeds (a wait for the device)."""
        return self.calibration.signal_targets


def check_inputs(features: torch.Tensor, positions: torch.Tensor, *, finite: bool = True) -> None:
    """CareError for features that are not a non-empty float (N, d_v) tensor with (N, 2) positions, or (with
    ``finite``: a host synchronisation on a GPU) hold NaN or infinite values."""
    if features.ndim != 2 or features.shape[0] < 1 or features.shape[1] < 1:
        raise CareError(f"features must be a non-empty (N, d_v) tensor, got shape {tuple(features.shape)}")
    if not features.is_floating_point():
        raise CareError(f"features must be a floating-point tensor, got {features.dtype}")
    if positions.shape != (features.shape[0], 2):
        raise CareError(f"positions must have shape (N, 2) = ({features.shape[0]}, 2), got {tuple(positions.shape)}")
    if finite and not torch.isfinite(features).all():
        raise CareError("features contain NaN or infinite values")


def first_not_finite(features: Sequence[torch.Tensor]) -> int | None:
    """The index of the first tensor holding a NaN or an infinite value, or None: one host synchronisation for all.

    A tensor's largest absolute value (its infinity norm, NaN where it holds one) is finite exactly when all its values
    are; the norms of all tensors take a few kernels (``_foreach_norm``) where one check per tensor took three."""
    present = [i for i, v in enumerate(features) if v.numel() > 0]  # an empty tensor holds nothing not finite
    if not present:
        return None
    norms = torch._foreach_norm([features[i] for i in present], math.inf)
    flags = ~torch.isfinite(torch.stack(norms))  # (mixed dtypes promote)
    if not bool(flags.any()):
        return None
    return present[int(torch.nonzero(flags)[0])]


def scorer_for(projector: Projector, scorer: Scorer | None) -> Scorer:
    """`scorer`, checked to be made for `projector`; where none is given, the one kept on the projector."""
    if scorer is not None and scorer.projector is not projector:
        raise CareError("scorer was made for another projector: use Scorer(projector) for this one")
    return scorer if scorer is not None else Scorer.for_projector(projector)


def resolve_directions(
    directions: torch.Tensor | None,
    m: int,
    dim: int,
    seed: int,
    like: torch.Tensor,
    *,
    scorer: Scorer | None = None,
) -> torch.Tensor:
    """The (m, d_v) unit directions: the given ones, or m drawn from `seed` (Eq. 1), kept by `scorer` if any."""
    if directions is None:
        if scorer is not None:
            return scorer.directions(m, dim, seed, device=like.device, dtype=like.dtype)
        return unit_directions(m, dim, seed, device=like.device, dtype=like.dtype)
    if directions.ndim != 2 or directions.shape[1] != dim:
        raise CareError(f"directions must have shape (m, {dim}), got {tuple(directions.shape)}")
    return directions.to(device=like.device, dtype=like.dtype)


def prca_scores(
    features: torch.Tensor,
    projector: Projector,
    directions: torch.Tensor,
    cfg: CaReConfig,
    *,
    scorer: Scorer | None = None,
) -> torch.Tensor:
    """psi_bar (N,) of PRCA: Eq. 1 responses, Eq. 2 robust z-scores, psi = mu - lambda sigma, min-max.

    Scored through `scorer` (made for `projector`), or where none is given through the scorer kept on the
    projector (:meth:`~care_core.scoring.Scorer.for_projector`): its prepared projector, kernel decisions and,
    on CUDA, the second layer's triangular factor. :func:`~care_core.scoring.perturbation_responses` is the
    functional path that keeps nothing.
    """
    scorer = scorer if scorer is not None else Scorer.for_projector(projector)
    responses = scorer.responses(
        features, directions, h=cfg.h, engine=cfg.engine, matmul=cfg.matmul_precision, kernel=cfg.kernel
    )
    return influence_scores(robust_zscores(responses, cfg.eps), cfg.lam, cfg.eps)


def calibrate_with(
    cfg: CaReConfig,
    features: torch.Tensor,
    positions: torch.Tensor,
    anchors: torch.Tensor,
    weights: torch.Tensor,
    *,
    gated: bool,
) -> Calibration:
    """CGTC (Eq. 4–9) with the hyperparameters of `cfg`; `gated=False` injects every residual token."""
    with matmul_precision(allow_tf32=False), torch.no_grad():
        return calibrate(features, positions, anchors, weights, gated=gated, **calibration_options(cfg))


def calibration_options(cfg: CaReConfig) -> dict[str, float]:
    """The CaReConfig fields CGTC (Eq. 4–9) reads, as :func:`~care_core.calibration.calibrate`'s keywords."""
    return {"eta": cfg.eta, "theta_s": cfg.theta_s, "theta_c": cfg.theta_c, "alpha": cfg.alpha, "sigma_p": cfg.sigma_p,
            "tau_g": cfg.tau_g, "tau_c": cfg.tau_c, "tau_s": cfg.tau_s, "eps": cfg.eps}  # fmt: skip


def calibrate_batch_with(
    cfg: CaReConfig,
    features: list[torch.Tensor],
    positions: list[torch.Tensor],
    anchors: list[torch.Tensor],
    weights: list[torch.Tensor],
    *,
    gated: bool,
) -> list[Calibration]:
    """:func:`calibrate_with` for B images in one padded pass (:func:`~care_core.calibration.calibrate_batch`)."""
    with matmul_precision(allow_tf32=False), torch.no_grad():
        return calibrate_batch(features, positions, anchors, weights, gated=gated, **calibration_options(cfg))


def _scores(
    v: torch.Tensor,
    projector: Projector,
    directions: torch.Tensor | None,
    cfg: CaReConfig,
    scorer: Scorer,
    psi_bar: torch.Tensor | None,
    timer: StageTimer,
) -> torch.Tensor:
    """psi_bar for :func:`care_reduce`: the one given (checked), or PRCA's, timed as "scoring"."""
    n = v.shape[0]
    if psi_bar is not None:
        if psi_bar.shape != (n,):
            raise CareError(f"psi_bar must have shape ({n},), got {tuple(psi_bar.shape)}")
        return psi_bar.to(device=v.device, dtype=v.dtype)
    u = resolve_directions(directions, cfg.m, v.shape[1], cfg.seed, v, scorer=scorer)
    with timer("scoring"):
        return prca_scores(v, projector, u, cfg, scorer=scorer)


def _anchor_order(
    psi_bar: torch.Tensor, v: torch.Tensor, k: int, eps: float, gate: KernelGate, given: torch.Tensor | None
) -> torch.Tensor:
    """Eq. 3's order of K anchors for :func:`care_reduce`: the one given (checked), or :func:`diversity_greedy`'s."""
    if given is None:
        return diversity_greedy(psi_bar, v, k, eps, kernel=gate)
    if given.shape != (k,) or given.dtype != torch.long:
        raise CareError(f"anchor_order must be ({k},) long indices, got {tuple(given.shape)} {given.dtype}")
    return given


def care_reduce(
    features: torch.Tensor,
    projector: Projector,
    positions: torch.Tensor,
    ratio: float | None = None,
    keep: int | None = None,
    config: CaReConfig | None = None,
    directions: torch.Tensor | None = None,
    *,
    stage_timer: StageTimer | None = None,
    scorer: Scorer | None = None,
    psi_bar: torch.Tensor | None = None,
    anchor_order: torch.Tensor | None = None,
    graphs: ReductionGraphs | None = None,
) -> Reduction:
    """Reduce N visual tokens to K calibrated tokens with CaRe.

    features: (N, d_v) tokens V before the projector; float64 in gives float64 maths, bf16/fp16
    are computed in float32. projector: the multimodal projector M, (n, d_v) -> (n, d_t).
    positions: (N, 2) normalised patch centres p. Exactly one of `ratio` (K = max(1, floor(ratio N)))
    and `keep` (K). directions: optional (m, d_v) unit directions; by default m are drawn from
    `config.seed`. stage_timer: optional callable returning a context manager per stage name
    ("scoring", "anchors", "calibration"), for timing. scorer: optional :class:`~care_core.scoring.Scorer`
    made for `projector` (prepared projector, directions, kernel decisions, on CUDA the second layer's
    triangular factor); without one, the scorer kept on the projector itself
    (:meth:`Scorer.for_projector <care_core.scoring.Scorer.for_projector>`), so a plain call on CUDA gets the
    fast path and pays the factor's QR (~0.2 s at d_h = 4096) once per projector. CPU results are
    bit-identical either way; ``Scorer`` says what the factor promises on CUDA.
    psi_bar: optional (N,) PRCA scores already computed by :func:`prca_scores` with this config for these
    features (e.g. shared between budgets); scoring is then skipped. anchor_order: optional (K,) Eq. 3 order
    computed with this config from this psi_bar (e.g. the first K of a longer one); Eq. 3 is then skipped.
    graphs: optional :class:`~care_core.reduction_graphs.ReductionGraphs` (owned by the caller): where
    :func:`graph_reason` allows, the reduction is captured when its :func:`graph_key` comes back
    (:data:`~care_core.reduction_graphs.CAPTURE_ON_SIGHTING`) and replayed after (bitwise the eager result on the
    same card); elsewhere, and without, it runs eagerly.

    >>> import torch
    >>> from care_core import CaReConfig, care_reduce
    >>> v = torch.randn(50, 8, dtype=torch.float64)
    >>> p = torch.rand(50, 2, dtype=torch.float64)
    >>> red = care_reduce(v, torch.nn.Linear(8, 4).double(), p, keep=5, config=CaReConfig(m=8))
    >>> red.tokens.shape, red.tokens.dtype
    (torch.Size([5, 8]), torch.float64)
    """
    cfg = config or CaReConfig()
    check_inputs(features, positions)  # before any graph: the finite check is a host sync no capture may hold
    scorer = scorer_for(projector, scorer)
    k = resolve_budget(features.shape[0], ratio, keep)
    if graphs is not None and graph_reason(features.device, stage_timer=stage_timer, psi_bar=psi_bar,
                                           anchor_order=anchor_order) is None:  # fmt: skip
        return _replayed(graphs, features, positions, k, cfg, directions, scorer)
    return _reduction(features, positions, k, cfg, directions, scorer, stage_timer or _untimed, psi_bar, anchor_order)


def _untimed(_stage: str) -> AbstractContextManager[object]:
    return nullcontext()


def _reduction(
    features: torch.Tensor,
    positions: torch.Tensor,
    k: int,
    cfg: CaReConfig,
    directions: torch.Tensor | None,
    scorer: Scorer,
    timer: StageTimer = _untimed,
    psi_bar: torch.Tensor | None = None,
    anchor_order: torch.Tensor | None = None,
) -> Reduction:
    """:func:`care_reduce`'s maths on checked inputs: no host synchronisation on CUDA, which is what lets a CUDA graph
    capture it (:func:`_replayed`)."""
    v = features.to(compute_dtype(features.dtype))
    p = positions.to(device=v.device, dtype=v.dtype)
    psi_bar = _scores(v, scorer.projector, directions, cfg, scorer, psi_bar, timer)
    gate = scorer.gate(cfg.kernel)
    with matmul_precision(allow_tf32=False), torch.no_grad():
        with timer("anchors"):
            order = _anchor_order(psi_bar, v, k, cfg.eps, gate, anchor_order)
            indices = order.sort().values
        with timer("calibration"):
            cal = calibrate_with(cfg, v, p, indices, psi_bar, gated=True)
    return Reduction(indices=indices, anchor_order=order, tokens=cal.tokens.to(features.dtype), psi_bar=psi_bar,
                     calibration=cal)  # fmt: skip


def graph_reason(
    device: torch.device,
    *,
    stage_timer: StageTimer | None = None,
    psi_bar: torch.Tensor | None = None,
    anchor_order: torch.Tensor | None = None,
) -> str | None:
    """Why :func:`care_reduce` given graphs runs eagerly (one line), or None where it replays a CUDA graph: a fresh
    (nothing given from a memo), untimed (a replay is one launch: stage times would mean nothing) reduction on a
    CUDA device, outside any capture of the caller's. Every dtype and kernel setting is captured."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device; the features are on {device.type}"
    if stage_timer is not None:
        return "a stage timer times each stage, which a replay (one launch) cannot"
    if psi_bar is not None or anchor_order is not None:
        return "psi_bar or the anchor order is given (a memo's): only a fresh reduction is captured"
    if torch.cuda.is_current_stream_capturing():
        return "the caller is capturing a CUDA graph"
    return None


def graph_key(
    features: torch.Tensor, k: int, cfg: CaReConfig, directions: torch.Tensor, scorer: Scorer
) -> tuple[object, ...]:
    """Everything a captured reduction's shapes and constants depend on: N, d_v, the features' dtype and device, K,
    the config (hyperparameters, seed, engine, matmul precision, kernel setting), the directions' shape (their
    values are a static input), the scorer (its projector) and its projector's weights (moved, cast, replaced or
    edited in place), the fused kernels that failed on it and whether fused kernels may run on the device."""
    device = features.device
    return ("care", tuple(features.shape), features.dtype, device, k, cfg, tuple(directions.shape), id(scorer),
            scorer.fingerprint(), tuple(sorted(scorer.kernel_failures)), why_not_fused(device))  # fmt: skip


def _replayed(
    graphs: ReductionGraphs,
    features: torch.Tensor,
    positions: torch.Tensor,
    k: int,
    cfg: CaReConfig,
    directions: torch.Tensor | None,
    scorer: Scorer,
) -> Reduction:
    """:func:`_reduction` through ``graphs``: captured per :func:`graph_key`, replayed after. Its static inputs are
    the features, the positions and the directions in compute precision (converted here, outside the graph: a
    capture holds no host-to-device copy)."""
    dtype, device = compute_dtype(features.dtype), features.device
    p = positions.to(device=device, dtype=dtype)
    u = resolve_directions(directions, cfg.m, features.shape[1], cfg.seed, p, scorer=scorer)  # p: dtype and device
    step = functools.partial(_captured_step, k=k, cfg=cfg, scorer=scorer)

    def held() -> object:  # the prepared projector and factor the graph reads, whatever the scorer drops later
        return scorer, scorer.prepared(dtype, device), scorer.factor(dtype, device)

    return graphs.run(graph_key(features, k, cfg, u, scorer), (features, p, u), step, held)


def _captured_step(statics: tuple[torch.Tensor, ...], *, k: int, cfg: CaReConfig, scorer: Scorer) -> Reduction:
    """What a reduction graph runs on its static inputs (features, positions, directions)."""
    features, positions, directions = statics
    return _reduction(features, positions, k, cfg, directions, scorer)
