"""ZOO-Prune (Kim et al., CVPR 2026, arXiv 2509.24837): zeroth-order sensitivity + SADS selection.

Sensitivity S_i = mean over m shared unit directions of the raw Eq. 1 response with h = 0.01 (no
robust normalisation, no risk term); SADS weights w = min-max(S) (all ones if S is constant);
diversity 1 - cos on the **post-projector** embeddings; greedy argmax w_j min_{s in S} D(s, j),
ties to the lowest index. No calibration. The official LLaVA-1.5 code casts the perturbed inputs
to fp16 before the projector; here Eq. 1 runs in float32 at least (docs/design.md §Response engines).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from care_core._lazy import torch
from care_core.methods.base import Category, Method, MethodInputs, MethodResult, selection_result
from care_core.methods.registry import register

if TYPE_CHECKING:
    from care_core.scoring import Projector


def zoo_sensitivity(
    features: torch.Tensor, projector: Projector, directions: torch.Tensor, h: float, engine: str = "fd"
) -> torch.Tensor:
    """S (N,): mean over directions of ||M(v + h u) - M(v - h u)|| / 2h (ZOO-Prune's estimator, Eq. 1)."""
    from care_core.scoring import perturbation_responses

    return perturbation_responses(features, projector, directions, h=h, engine=engine).mean(dim=0)


def sads_weights(sensitivity: torch.Tensor) -> torch.Tensor:
    """w = (S - min S) / (max S - min S + 1e-8), or all ones when S is constant (official branch)."""
    low, high = sensitivity.min(), sensitivity.max()
    if bool(high == low):
        return torch.ones_like(sensitivity)
    return (sensitivity - low) / (high - low + 1e-8)


def sads_select(embeddings: torch.Tensor, importance: torch.Tensor, keep: int) -> torch.Tensor:
    """SADS selection order (keep,) on `embeddings` with raw `importance` (min-max normalised here)."""
    from care_core.anchors import diversity_greedy
    from care_core.precision import matmul_precision

    with matmul_precision(allow_tf32=False):
        return diversity_greedy(sads_weights(importance), embeddings, keep, eps=1e-12)


@register
@dataclass(frozen=True)
class ZooPrune(Method):
    """ZOO-Prune / "sense + diversity": the baseline CaRe's ablations start from (paper Table S5).

    Fields default to the official code (h = 0.01, m = 64); built from a CaReConfig
    (``build_method("zoo-prune", config)``) it reads that config's h, m and seed, like the ablations whose
    anchors it provides. Always the finite-difference estimator (ZOO-Prune's own definition).
    """

    name: ClassVar[str] = "zoo-prune"
    aliases: ClassVar[tuple[str, ...]] = ("sense-diversity",)
    category: ClassVar[Category] = "selection"
    paper: ClassVar[str] = "Kim et al., ZOO-Prune, CVPR 2026 (arXiv 2509.24837)"
    rank: ClassVar[int] = 5
    cost_model: ClassVar[str | None] = "zoo-prune"
    hyperparameters: ClassVar[frozenset[str]] = frozenset({"h", "m", "seed"})

    h: float = 0.01
    m: int = 64
    seed: int = 42
    engine: str = "fd"

    def scores(self, inputs: MethodInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised sensitivity w, post-projector embeddings), both in compute precision."""
        from care_core.care import resolve_directions
        from care_core.precision import compute_dtype

        v = inputs.features.to(compute_dtype(inputs.features.dtype))
        u = resolve_directions(None, self.m, v.shape[1], self.seed, v)
        with torch.no_grad():
            sensitivity = zoo_sensitivity(v, inputs.projector, u, self.h, self.engine)
            embeddings = inputs.projector(inputs.features).to(v.dtype)
        return sads_weights(sensitivity), embeddings

    def reduce(self, inputs: MethodInputs, keep: int) -> MethodResult:
        from care_core.anchors import diversity_greedy
        from care_core.precision import matmul_precision

        with inputs.stage("scoring"):
            weights, embeddings = inputs.memoized(("zoo-prune", self.h, self.m, self.seed, self.engine),
                                                  lambda: self.scores(inputs))  # fmt: skip
        with inputs.stage("anchors"), matmul_precision(allow_tf32=False), torch.no_grad():
            order = diversity_greedy(weights, embeddings, keep, eps=1e-12)
        return selection_result(inputs.features, order, weights, selection_order=order)
