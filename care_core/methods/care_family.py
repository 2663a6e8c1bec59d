"""CaRe (PRCA + CGTC) and its ablations of paper Table S5, each reachable by name.

| name                | anchors   | calibration                   | CaReConfig fields read                         |
|---------------------|-----------|-------------------------------|------------------------------------------------|
| `care`              | PRCA      | CGTC (gated, Eq. 4–9)         | all                                            |
| `prca-only`         | PRCA      | none                          | h, m, lam, eps, seed, engine, matmul_precision |
| `simple-calib`      | ZOO-Prune | every residual token, c_r = 1 | h, m, seed; alpha, tau_s, eps                  |
| `confidence-calib`  | ZOO-Prune | CGTC                          | h, m, seed; the CGTC fields                    |
| `prca+simple-calib` | PRCA      | every residual token, c_r = 1 | the PRCA fields; alpha, tau_s                  |

PRCA (Eq. 1–3) reads h (``engine="fd"`` only; ``"jvp"`` is the exact h -> 0 limit), m, seed, lam, eps,
engine and matmul_precision (``engine="jvp"`` only). ZOO-Prune anchors read h, m and seed of the same
config (always the finite-difference estimator, as ZOO-Prune defines it) and ignore lam, eps, engine and
matmul_precision (SADS has its own fixed constants). CGTC (Eq. 4–9) reads eta, theta_s, theta_c, alpha,
sigma_p, tau_g, tau_c, tau_s and eps; the ungated injection only alpha, tau_s and eps (no gate: R+ = R,
c_r = 1, w_r = psi_bar_r + eps). Where the anchors come from ZOO-Prune, its normalised sensitivity plays
the role of psi_bar. `care` runs :func:`care_core.care.care_reduce` itself, so the library function and
the registered method are one code path; every calibrated result converts to the method contract in
:func:`reduction_result`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, cast

from care_core._lazy import torch
from care_core.config import CaReConfig
from care_core.methods.base import Method, MethodInputs, MethodResult, selection_result, share_one_pass
from care_core.methods.registry import register
from care_core.methods.zoo_prune import SADS_EPS, ZooPrune

if TYPE_CHECKING:
    from torch import Tensor

    from care_core.care import Reduction
    from care_core.scoring import Scorer

PAPER = "CaRe: Calibrate Before Reason, Sec. 3 (ablations: Table S5)"


def reduction_result(reduction: Reduction) -> MethodResult:
    """A CaRe reduction in the method contract: rows = anchors (ascending), scores = psi_bar, each signal assigned to
    the anchor it mostly feeds (argmax_j q_rj, Eq. 7), residuals and c_r (Eq. 6) in `info`."""
    anchors, cal = reduction.indices, reduction.calibration
    n = reduction.psi_bar.shape[0]
    assignment = torch.full((n,), -1, dtype=torch.long, device=anchors.device)
    assignment[anchors] = torch.arange(anchors.numel(), device=anchors.device)
    # R+ as masks (no wait for the device): a residual outside R+ stays -1
    fed_row = torch.where(cal.accepted, torch.searchsorted(anchors, cal.nearest), -1)
    assignment[cal.residuals] = fed_row
    signal_mask = torch.zeros(n, dtype=torch.bool, device=anchors.device)
    signal_mask[cal.residuals] = cal.accepted
    return MethodResult(
        tokens=reduction.tokens,
        token_index=anchors,
        scores=reduction.psi_bar,
        assignment=assignment,
        signal_mask=signal_mask,
        info={
            "selection_order": reduction.anchor_order,
            "residuals": reduction.residuals,
            "confidence": reduction.confidence,
        },
    )


PRCA_FIELDS = frozenset({"h", "m", "lam", "eps", "seed", "engine", "matmul_precision"})  # Eq. 1–3
ZOO_FIELDS = ZooPrune.hyperparameters  # h, m, seed
GATED_FIELDS = frozenset({"eta", "theta_s", "theta_c", "alpha", "sigma_p", "tau_g", "tau_c", "tau_s", "eps"})  # Eq. 4–9
UNGATED_FIELDS = frozenset({"alpha", "tau_s", "eps"})  # Eq. 7–9 with c_r = 1


def prca_key(config: CaReConfig) -> tuple[object, ...]:
    """Memo key of PRCA's psi_bar: the fields Eq. 1–3 read (not the budget, not the calibration's)."""
    return ("prca", *(getattr(config, name) for name in sorted(PRCA_FIELDS)))


def prca_order_key(config: CaReConfig) -> tuple[object, ...]:
    """Memo key of PRCA's Eq. 3 order (:func:`~care_core.care_batch.anchor_orders`): psi_bar's key (its fields include
    Eq. 3's eps) and the kernel setting; not the budget (the order for K is the first K of any longer one)."""
    return ("prca-order", prca_key(config), config.kernel)


@dataclass(frozen=True)
class _CaReFamily(Method):
    """What CaRe and its ablations share; a variant names itself, its rank, fields, anchors and calibration as
    class keywords, and its category, cost model and score label follow from those."""

    config: CaReConfig = field(default_factory=CaReConfig)
    paper: ClassVar[str] = PAPER
    runtime_options: ClassVar[frozenset[str]] = frozenset({"kernel"})  # the anchor greedy's and PRCA's kernels
    anchors_from: ClassVar[str] = "prca"  # "prca" or "zoo-prune"
    calibration: ClassVar[str] = "gated"  # "gated", "all" or "none"

    def __init_subclass__(
        cls,
        *,
        name: str,
        rank: int,
        hyperparameters: frozenset[str],
        anchors_from: str = "prca",
        calibration: str = "gated",
        **kwargs: object,
    ) -> None:
        super().__init_subclass__(**kwargs)
        cls.name, cls.rank, cls.hyperparameters = name, rank, hyperparameters
        cls.anchors_from, cls.calibration = anchors_from, calibration
        cls.category = "selection" if calibration == "none" else "calibration"
        cls.cost_model = name  # each variant has its own formula in care_core.flops.methods
        # ZOO-Prune anchors are ranked by its normalised sensitivity, not psi_bar
        cls.score_label = "psi_bar" if anchors_from == "prca" else None

    @classmethod
    def from_config(cls, config: CaReConfig) -> Method:
        return cls(config=config)

    def _anchors(self, inputs: MethodInputs, keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(selection order, weights psi_bar, features in compute precision), timing "scoring" and "anchors"."""
        from care_core.care_batch import anchor_orders
        from care_core.kernels.dispatch import as_gate
        from care_core.precision import compute_dtype, matmul_precision

        v = inputs.features.to(compute_dtype(inputs.features.dtype))
        with inputs.stage("scoring"):
            if self.anchors_from == "zoo-prune":
                weights, rows = self._zoo().scores(inputs)  # memoised, shared with zoo-prune itself
                eps = SADS_EPS
            else:
                weights, rows, eps = self._psi_bar(inputs, v), v, self.config.eps
        with inputs.stage("anchors"), matmul_precision(allow_tf32=False), torch.no_grad():
            order = anchor_orders([inputs], [keep], [self._order_key(inputs.features)], [weights], [rows], eps,
                                  as_gate(self.config.kernel))[0]  # fmt: skip
        return order, weights, v.to(weights.dtype) if self.anchors_from == "zoo-prune" else v

    def _order_key(self, features: torch.Tensor) -> tuple[object, ...]:
        """Memo key of an image's Eq. 3 order: ZOO-Prune's SADS key (shared with zoo-prune and the other
        ZOO-anchored ablations), or for PRCA anchors what psi_bar depends on with Eq. 3's eps
        (:func:`prca_order_key`); both with this config's kernel setting."""
        if self.anchors_from == "zoo-prune":
            return self._zoo().order_key(features, self.config.kernel)
        return prca_order_key(self.config)

    def _zoo(self) -> ZooPrune:
        """ZOO-Prune with this config's h, m and seed: what ZOO-Prune anchors come from."""
        return cast(ZooPrune, ZooPrune.from_config(self.config))

    def _psi_bar(self, inputs: MethodInputs, v: torch.Tensor) -> torch.Tensor:
        """PRCA's psi_bar (Eq. 1–2), shared through the inputs' memo by every budget and PRCA-anchored method."""
        from care_core.care import prca_scores, resolve_directions

        def compute() -> torch.Tensor:
            directions = resolve_directions(None, self.config.m, v.shape[1], self.config.seed, v, scorer=inputs.scorer)
            return prca_scores(v, inputs.projector, directions, self.config, scorer=inputs.scorer)

        return inputs.memoized(prca_key(self.config), compute)

    def reduce(self, inputs: MethodInputs, keep: int) -> MethodResult:
        order, weights, v = self._anchors(inputs, keep)
        if self.calibration == "none":
            return selection_result(inputs.features, order, weights, selection_order=order)
        with inputs.stage("calibration"):
            return self._calibrated(inputs, v, order, weights)

    def _calibrated(
        self, inputs: MethodInputs, v: torch.Tensor, order: torch.Tensor, weights: torch.Tensor
    ) -> MethodResult:
        """The variant's calibration (gated or all) of the anchors `order` (selection order) on features `v` in
        compute precision, as the method result."""
        from care_core.care import Reduction, calibrate_with

        anchors = order.sort().values
        positions = inputs.positions.to(device=v.device, dtype=v.dtype)
        cal = calibrate_with(self.config, v, positions, anchors, weights, gated=self.calibration == "gated")
        reduction: Reduction = Reduction(
            indices=anchors,
            anchor_order=order,
            tokens=cal.tokens.to(inputs.features.dtype),
            psi_bar=weights,
            calibration=cal,
        )
        return reduction_result(reduction)

    def reduce_batch(self, inputs: list[MethodInputs], keeps: list[int]) -> list[MethodResult]:
        """CaRe's variants on B images (docs/design/batches.md §Batches): the anchor weights of every image not in its
        memo from one joint Eq. 1 pass (PRCA's psi_bar, or ZOO-Prune's sensitivity for ZOO-Prune anchors; each new one
        stored in its image's memo), Eq. 3 for the images lacking a long enough memoised order in one padded loop
        (:func:`~care_core.care_batch.anchor_orders`), then each image's calibration; each
        stage timed once for the batch on the shared stage timer. Per image, :meth:`reduce`'s result (to the joint
        pass's rounding). Batches that cannot share one pass (:func:`_one_pass`), a batch of one among them, go one
        image at a time through :meth:`reduce` (where CaRe's single-image reduction may replay from a CUDA graph:
        :func:`method_graph_reason`)."""
        if not _one_pass(inputs):
            return super().reduce_batch(inputs, keeps)
        from care_core.care import scorer_for
        from care_core.care_batch import anchor_orders
        from care_core.precision import compute_dtype, matmul_precision

        first = inputs[0]
        scorer = scorer_for(first.projector, first.scorer)
        vs = [one.features.to(compute_dtype(one.features.dtype)) for one in inputs]
        with first.stage("scoring"):
            weights, rows, eps = self._batch_weights(inputs, vs, scorer)
        keys = [self._order_key(one.features) for one in inputs]
        with first.stage("anchors"), matmul_precision(allow_tf32=False), torch.no_grad():
            orders = anchor_orders(inputs, keeps, keys, weights, rows, eps, scorer.gate(self.config.kernel))
        if self.calibration == "none":
            return [selection_result(one.features, order, w, selection_order=order)
                    for one, order, w in zip(inputs, orders, weights, strict=True)]  # fmt: skip
        with first.stage("calibration"):
            return self._calibrated_batch(inputs, vs, orders, weights)

    def _batch_weights(
        self, inputs: list[MethodInputs], vs: list[Tensor], scorer: Scorer
    ) -> tuple[list[Tensor], list[Tensor], float]:
        """(anchor weights, the rows Eq. 3 measures diversity on, its eps) per image: psi_bar on the features for
        PRCA anchors; ZOO-Prune's normalised sensitivity on the post-projector embeddings (SADS's eps) for
        ZOO-Prune anchors, as :meth:`_anchors` takes them for one image."""
        if self.anchors_from == "zoo-prune":
            scored = self._zoo().batch_scores(inputs)
            return [w for w, _ in scored], [e for _, e in scored], SADS_EPS
        return self._batch_psi_bar(inputs, vs, scorer), vs, self.config.eps

    def _calibrated_batch(
        self, inputs: list[MethodInputs], vs: list[Tensor], orders: list[Tensor], weights: list[Tensor]
    ) -> list[MethodResult]:
        """:meth:`_calibrated` for every image of a batch in one padded CGTC pass."""
        from care_core.care import Reduction, calibrate_batch_with

        anchors = [order.sort().values for order in orders]
        positions = [one.positions.to(device=v.device, dtype=v.dtype) for one, v in zip(inputs, vs, strict=True)]
        calibrations = calibrate_batch_with(self.config, vs, positions, anchors, weights,
                                            gated=self.calibration == "gated")  # fmt: skip
        return [reduction_result(Reduction(indices=a, anchor_order=order, tokens=cal.tokens.to(one.features.dtype),
                                           psi_bar=w, calibration=cal))
                for one, order, a, w, cal in zip(inputs, orders, anchors, weights, calibrations,
                                                 strict=True)]  # fmt: skip

    def _batch_psi_bar(self, inputs: list[MethodInputs], vs: list[torch.Tensor], scorer: Scorer) -> list[torch.Tensor]:
        """psi_bar per image: the memo's where it has one, the others from one
        :func:`~care_core.care_batch.batch_scores` pass over their tokens together, each stored in its image's memo
        (as :meth:`_psi_bar` stores it)."""
        from care_core.care_batch import batch_scores

        key = prca_key(self.config)
        missing = [i for i, one in enumerate(inputs) if one.memo is None or key not in one.memo]
        fresh: dict[int, torch.Tensor] = {}
        if missing:
            scores = batch_scores([vs[i] for i in missing], inputs[0].projector, None, self.config, scorer)
            fresh = dict(zip(missing, scores, strict=True))
        weights = [one.memoized(key, functools.partial(fresh.__getitem__, i)) for i, one in enumerate(inputs)]
        return [w.to(device=v.device, dtype=v.dtype) for w, v in zip(weights, vs, strict=True)]


def _one_pass(inputs: list[MethodInputs]) -> bool:
    """Whether B >= 2 images can share one scoring pass and one padded Eq. 3 loop (:func:`share_one_pass`: one
    projector, scorer and stage timer; one width, device and compute dtype) and every image is valid for
    care_reduce. Otherwise the batch goes one image at a time, which also raises each image's own error."""
    from care_core.care import check_inputs, first_not_finite
    from care_core.errors import CareError

    if not share_one_pass(inputs):
        return False
    for one in inputs:
        try:
            check_inputs(one.features, one.positions, finite=False)
        except CareError:
            return False
    return first_not_finite([one.features for one in inputs]) is None  # one host sync for all


@register
@dataclass(frozen=True)
class CaRe(_CaReFamily, name="care", rank=0, hyperparameters=PRCA_FIELDS | GATED_FIELDS):
    """CaRe: perturbation-robust calibration anchors (Eq. 1–3) + confidence-gated calibration (Eq. 4–9)."""

    def reduce(self, inputs: MethodInputs, keep: int) -> MethodResult:
        """:func:`care_core.care.care_reduce` with this config, the inputs' stage timer and scorer (and, where the
        inputs keep a memo, the psi_bar and the prefix of the Eq. 3 order another budget or PRCA-anchored method
        already computed). Where :func:`method_graph_reason` allows, the reduction replays from the inputs' graphs
        instead and leaves its psi_bar and Eq. 3 order in the memo, as the eager path leaves them."""
        from care_core.care import care_reduce

        if method_graph_reason(self.config, inputs, keep) is None:
            return reduction_result(self._from_graphs(inputs, keep))
        psi_bar = order = None
        if inputs.memo is not None:
            order, psi_bar, _ = self._anchors(inputs, keep)
        reduction = care_reduce(
            inputs.features, inputs.projector, inputs.positions, keep=keep, config=self.config,
            stage_timer=inputs.stage_timer, psi_bar=psi_bar, scorer=inputs.scorer, anchor_order=order,
        )  # fmt: skip
        return reduction_result(reduction)

    def _from_graphs(self, inputs: MethodInputs, keep: int) -> Reduction:
        """The fresh reduction through the inputs' graphs; its psi_bar and Eq. 3 order (computed at ``keep``, the
        length :meth:`MethodInputs.order_length` asks for here) stored under the keys :meth:`_psi_bar` and
        :func:`~care_core.care_batch.anchor_orders` use, so that other budgets and methods read them as before."""
        from care_core.care import care_reduce

        reduction = care_reduce(inputs.features, inputs.projector, inputs.positions, keep=keep, config=self.config,
                                scorer=inputs.scorer, graphs=inputs.graphs)  # fmt: skip
        if inputs.memo is not None:
            inputs.memo[prca_key(self.config)] = reduction.psi_bar
            inputs.memo[prca_order_key(self.config)] = reduction.anchor_order.clone()  # never handed out
        return reduction


def method_graph_reason(config: CaReConfig, inputs: MethodInputs, keep: int) -> str | None:
    """Why :class:`CaRe` with ``config`` reduces one image's ``inputs`` to ``keep`` eagerly (one line), or None where
    it replays the reduction from ``inputs.graphs`` (docs/design/generation.md §Reduction graphs): graphs given, a memo
    (if any) that holds neither PRCA's psi_bar nor an Eq. 3 order for this config yet, no larger budget planned (the
    memo's order must be the one the eager path computes: at :meth:`MethodInputs.order_length`), and what
    :func:`care_core.care.graph_reason` asks (CUDA, no stage timer, no capture of the caller's). A batch of several
    images that shares one scoring pass (:meth:`CaRe.reduce_batch`) never asks: it runs eagerly."""
    from care_core.care import graph_reason

    if inputs.graphs is None:
        return "no reduction graphs given (cuda_graph=False, or a caller that keeps none)"
    memo = inputs.memo
    if memo is not None and (prca_key(config) in memo or prca_order_key(config) in memo):
        return "the memo already holds psi_bar or the Eq. 3 order: only a fresh reduction is captured"
    if inputs.order_length(keep) != keep:
        return "a larger budget is planned: the memo's Eq. 3 order is computed at the largest, not at K"
    return graph_reason(inputs.features.device, stage_timer=inputs.stage_timer)


@register
@dataclass(frozen=True)
class PRCAOnly(_CaReFamily, name="prca-only", rank=1, hyperparameters=PRCA_FIELDS, calibration="none"):
    """Ablation "Only Calib-Anchor": PRCA anchors handed over unchanged."""


@register
@dataclass(frozen=True)
class SimpleCalib(
    _CaReFamily,
    name="simple-calib",
    rank=2,
    hyperparameters=ZOO_FIELDS | UNGATED_FIELDS,
    anchors_from="zoo-prune",
    calibration="all",
):
    """Ablation "Only Simple-Calib": ZOO-Prune anchors, every residual token injected (no gate, c_r = 1)."""


@register
@dataclass(frozen=True)
class ConfidenceCalib(
    _CaReFamily, name="confidence-calib", rank=3, hyperparameters=ZOO_FIELDS | GATED_FIELDS, anchors_from="zoo-prune"
):
    """Ablation "Only Confidence-Calib": ZOO-Prune anchors + confidence-gated calibration (CGTC)."""


@register
@dataclass(frozen=True)
class PRCASimpleCalib(
    _CaReFamily, name="prca+simple-calib", rank=4, hyperparameters=PRCA_FIELDS | UNGATED_FIELDS, calibration="all"
):
    """Ablation "Calib-Anchor+Simple-Calib": PRCA anchors, every residual token injected (no gate)."""
