"""ZOO-Prune (Kim et al., CVPR 2026, arXiv 2509.24837): zeroth-order sensitivity + SADS selection.

Sensitivity S_i = mean over m shared unit directions of the raw Eq. 1 response with h = 0.01 (no
robust normalisation, no risk term); SADS weights w = min-max(S) (all ones if S is constant);
diversity 1 - cos on the **post-projector** embeddings; greedy argmax w_j min_{s in S} D(s, j),
ties to the lowest index. No calibration. The official LLaVA-1.5 code casts the perturbed inputs
to fp16 before the projector; here Eq. 1 runs in float32 at least, the second layer's product on the
difference in TF32 on CUDA (docs/design/care.md §Response engines).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from care_core._lazy import torch
from care_core.methods.base import Category, Method, MethodInputs, MethodResult, selection_result, share_one_pass
from care_core.methods.registry import register

if TYPE_CHECKING:
    from care_core.scoring import Projector

#: SADS's guard on the norms of its cosine diversity (the official code's constant)
SADS_EPS = 1e-12


def zoo_sensitivities(
    features: Sequence[torch.Tensor],
    projector: Projector,
    directions: torch.Tensor,
    h: float,
    engine: str = "fd",
    *,
    factor: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """S (N_i,) of every image: the mean over directions of ||M(v + h u) - M(v - h u)|| / 2h (ZOO-Prune's
    estimator, Eq. 1), from passes over several images' rows at once (:func:`~care_core.scoring.joint_responses`:
    each image's values as alone; images of one width, device and compute dtype).
    `factor`: the projector's second-layer triangular factor (:func:`~care_core.scoring.triangular_factor`), for
    a Linear-act-Linear projector: the same Eq. 1 norms for fewer multiply-adds."""
    from care_core.scoring import joint_responses

    responses = joint_responses(features, projector, directions, h=h, engine=engine, factor=factor)
    return [c.mean(dim=0) for c in responses]


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
        return diversity_greedy(sads_weights(importance), embeddings, keep, eps=SADS_EPS)


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

    def memo_key(self, features: torch.Tensor) -> tuple[object, ...]:
        """Memo key of :meth:`scores` for an image with these features: everything the value depends on besides
        the image (h, m, seed, engine and the compute dtype; not the budget), so methods with other
        hyperparameters never share it, and ZOO-anchored ablations with this method's hyperparameters do."""
        from care_core.precision import compute_dtype

        return ("zoo-prune", self.h, self.m, self.seed, self.engine, compute_dtype(features.dtype))

    def order_key(self, features: torch.Tensor, kernel: str = "auto") -> tuple[object, ...]:
        """Memo key of an image's SADS order (:func:`~care_core.care_batch.anchor_orders`): what its weights and
        embeddings depend on (:meth:`memo_key`) and the greedy's kernel setting (SADS's eps is fixed), so
        ZOO-anchored ablations with these hyperparameters and kernel setting share one order per image."""
        return ("sads-order", self.memo_key(features), kernel)

    def scores(self, inputs: MethodInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised sensitivity w, post-projector embeddings), both in compute precision; kept in the inputs'
        memo (one computation per image for every budget and every method with these hyperparameters)."""
        return self.batch_scores([inputs])[0]

    def batch_scores(self, inputs: Sequence[MethodInputs]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`scores` per image: the memo's where it has them, the others' sensitivities from one joint pass
        over their rows (the images share one pass: :func:`~care_core.methods.base.share_one_pass`), each stored
        in its image's memo."""
        missing = [i for i, one in enumerate(inputs) if one.memo is None or self.memo_key(one.features) not in one.memo]
        fresh = dict(zip(missing, self._fresh_scores([inputs[i] for i in missing]), strict=True)) if missing else {}
        return [one.memoized(self.memo_key(one.features), functools.partial(fresh.__getitem__, i))
                for i, one in enumerate(inputs)]  # fmt: skip

    def _fresh_scores(self, inputs: Sequence[MethodInputs]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`scores` of images sharing one projector, computed: the sensitivities jointly, each image's
        embeddings by its own projector call (the product one image's call computes)."""
        from care_core.care import resolve_directions
        from care_core.precision import compute_dtype

        first = inputs[0]
        vs = [one.features.to(compute_dtype(one.features.dtype)) for one in inputs]
        u = resolve_directions(None, self.m, vs[0].shape[1], self.seed, vs[0])
        projector, factor = first.projector, None
        if first.scorer is not None and first.scorer.projector is projector:  # its prepared copy and factor, made once
            projector = first.scorer.prepared(vs[0].dtype, vs[0].device)
            factor = first.scorer.factor(vs[0].dtype, vs[0].device)  # None off CUDA ("auto") or for other projectors
        with torch.no_grad():
            sensitivities = zoo_sensitivities(vs, projector, u, self.h, self.engine, factor=factor)
            embeddings = [one.projector(one.features).to(v.dtype) for one, v in zip(inputs, vs, strict=True)]
        return [(sads_weights(s), e) for s, e in zip(sensitivities, embeddings, strict=True)]

    def reduce(self, inputs: MethodInputs, keep: int) -> MethodResult:
        return self._select([inputs], [keep])[0]

    def reduce_batch(self, inputs: list[MethodInputs], keeps: list[int]) -> list[MethodResult]:
        """Per image, :meth:`reduce`'s result (docs/design/batches.md §Batches); images that cannot share one pass
        (:func:`~care_core.methods.base.share_one_pass`) go one at a time."""
        if not share_one_pass(inputs):
            return super().reduce_batch(inputs, keeps)
        return self._select(inputs, keeps)

    def _select(self, inputs: list[MethodInputs], keeps: list[int]) -> list[MethodResult]:
        """The sensitivity of every image not in its memo from one joint pass over their rows (each stored in its
        image's memo), SADS for all images lacking a long enough memoised order in one padded greedy loop
        (:func:`~care_core.care_batch.anchor_orders`); each stage timed once, on the first image's timer."""
        from care_core.care_batch import anchor_orders
        from care_core.kernels.dispatch import as_gate
        from care_core.precision import matmul_precision

        first = inputs[0]
        with first.stage("scoring"):
            scored = self.batch_scores(inputs)
        weights = [w for w, _ in scored]
        keys = [self.order_key(one.features) for one in inputs]
        with first.stage("anchors"), matmul_precision(allow_tf32=False), torch.no_grad():
            orders = anchor_orders(inputs, keeps, keys, weights, [e for _, e in scored], SADS_EPS, as_gate("auto"))
        return [selection_result(one.features, order, w, selection_order=order)
                for one, order, w in zip(inputs, orders, weights, strict=True)]  # fmt: skip
