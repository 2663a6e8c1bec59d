"""CaRe (PRCA + CGTC) and its ablations of paper Table S5, each reachable by name.

| name                | anchors   | calibration                         |
|---------------------|-----------|-------------------------------------|
| `care`              | PRCA      | CGTC (confidence-gated, Eq. 4–9)    |
| `prca-only`         | PRCA      | none                                |
| `simple-calib`      | ZOO-Prune | every residual token, c_r = 1        |
| `confidence-calib`  | ZOO-Prune | CGTC                                |
| `prca+simple-calib` | PRCA      | every residual token, c_r = 1        |

Where the anchors come from ZOO-Prune, its normalised sensitivity plays the role of psi_bar.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from care_core.anchors import diversity_greedy
from care_core.care import calibrate_with, prca_scores, resolve_directions
from care_core.config import CaReConfig
from care_core.methods.base import Category, Method, MethodInputs, MethodResult, selection_result
from care_core.methods.registry import register
from care_core.methods.zoo_prune import ZooPrune
from care_core.precision import compute_dtype, matmul_precision

PAPER = "CaRe: Calibrate Before Reason, Sec. 3 (ablations: Table S5)"


@dataclass(frozen=True)
class _CaReFamily(Method):
    config: CaReConfig = field(default_factory=CaReConfig)
    paper: ClassVar[str] = PAPER
    anchors_from: ClassVar[str] = "prca"  # "prca" or "zoo-prune"
    calibration: ClassVar[str] = "gated"  # "gated", "all" or "none"

    def _anchors(self, inputs: MethodInputs, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(selection order, weights psi_bar) of the anchors."""
        v = inputs.features.to(compute_dtype(inputs.features.dtype))
        if self.anchors_from == "zoo-prune":
            zoo = ZooPrune(seed=self.config.seed)
            weights, embeddings = zoo.scores(inputs)
            with matmul_precision(allow_tf32=False), torch.no_grad():
                return diversity_greedy(weights, embeddings, keep, eps=1e-12), weights
        u = resolve_directions(None, self.config.m, v.shape[1], self.config.seed, v)
        psi_bar = prca_scores(v, inputs.projector, u, self.config)
        with matmul_precision(allow_tf32=False), torch.no_grad():
            return diversity_greedy(psi_bar, v, keep, self.config.eps), psi_bar

    def __call__(self, inputs: MethodInputs, keep: int) -> MethodResult:
        order, weights = self._anchors(inputs, keep)
        if self.calibration == "none":
            return selection_result(inputs.features, order, weights, selection_order=order)
        v = inputs.features.to(weights.dtype)
        anchors = order.sort().values
        positions = inputs.positions.to(device=v.device, dtype=v.dtype)
        cal = calibrate_with(self.config, v, positions, anchors, weights, gated=self.calibration == "gated")
        n = v.shape[0]
        assignment = torch.full((n,), -1, dtype=torch.long, device=v.device)
        assignment[anchors] = torch.arange(anchors.numel(), device=v.device)
        assignment[cal.signals] = torch.searchsorted(anchors, cal.signal_targets)
        return MethodResult(
            tokens=cal.tokens.to(inputs.features.dtype),
            token_index=anchors,
            scores=weights,
            assignment=assignment,
            signals=cal.signals,
            info={"selection_order": order, "residuals": cal.residuals, "confidence": cal.confidence},
        )


@register
@dataclass(frozen=True)
class CaRe(_CaReFamily):
    """CaRe: perturbation-robust calibration anchors (Eq. 1–3) + confidence-gated calibration (Eq. 4–9)."""

    name: ClassVar[str] = "care"
    category: ClassVar[Category] = "calibration"


@register
@dataclass(frozen=True)
class PRCAOnly(_CaReFamily):
    """Ablation "Only Calib-Anchor": PRCA anchors handed over unchanged."""

    name: ClassVar[str] = "prca-only"
    category: ClassVar[Category] = "selection"
    calibration: ClassVar[str] = "none"


@register
@dataclass(frozen=True)
class SimpleCalib(_CaReFamily):
    """Ablation: ZOO-Prune anchors, every residual token injected (no gate, c_r = 1)."""

    name: ClassVar[str] = "simple-calib"
    category: ClassVar[Category] = "calibration"
    anchors_from: ClassVar[str] = "zoo-prune"
    calibration: ClassVar[str] = "all"


@register
@dataclass(frozen=True)
class ConfidenceCalib(_CaReFamily):
    """Ablation: ZOO-Prune anchors + confidence-gated calibration (CGTC)."""

    name: ClassVar[str] = "confidence-calib"
    category: ClassVar[Category] = "calibration"
    anchors_from: ClassVar[str] = "zoo-prune"


@register
@dataclass(frozen=True)
class PRCASimpleCalib(_CaReFamily):
    """Ablation: PRCA anchors, every residual token injected (no gate)."""

    name: ClassVar[str] = "prca+simple-calib"
    category: ClassVar[Category] = "calibration"
    calibration: ClassVar[str] = "all"
