"""care_reduce_batch(): CaRe (PRCA Eq. 1–3, CGTC Eq. 4–9) on several images at once, each image's result
what :func:`~care_core.care.care_reduce` gives for it alone (to a BLAS's rounding, docs/design/batches.md §Batches)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from care_core._chunks import row_groups
from care_core.anchors import diversity_greedy, fused_greedy_applies, fused_orders, unit_rows
from care_core.budget import resolve_budget
from care_core.care import (
    Reduction,
    calibrate_batch_with,
    check_inputs,
    first_not_finite,
    resolve_directions,
    scorer_for,
)
from care_core.config import CaReConfig
from care_core.errors import BudgetError, CareError
from care_core.kernels.dispatch import KernelGate
from care_core.kernels.shapes import GREEDY_GRAM_ELEMENTS
from care_core.methods.base import MethodInputs, memo_orders
from care_core.precision import compute_dtype, matmul_precision
from care_core.scoring import Projector, Scorer, influence_scores, robust_zscores


def _check_batch(features: Sequence[torch.Tensor], positions: Sequence[torch.Tensor]) -> None:
    """Each image as :func:`care_reduce` checks it; all of one width, device and compute dtype (one scoring pass)."""
    if len(features) == 0:
        raise CareError("must hold at least one image", parameter="features")
    if len(positions) != len(features):
        raise CareError(f"must hold one tensor per image: {len(features)} images, got {len(positions)}", "positions")
    for i, (v, p) in enumerate(zip(features, positions, strict=True)):
        try:
            check_inputs(v, p, finite=False)  # finiteness below, once for all images
        except CareError as exc:
            raise CareError(f"image {i}: {exc}") from exc
    first = features[0]
    for i, v in enumerate(features):
        if v.shape[1] != first.shape[1] or v.device != first.device:
            raise CareError(
                f"must all have image 0's width {first.shape[1]} and device {first.device}: image {i} has "
                f"{v.shape[1]} on {v.device}",
                parameter="features",
            )
        if compute_dtype(v.dtype) != compute_dtype(first.dtype):
            raise CareError(f"mix float64 with other dtypes (image 0: {first.dtype}, image {i}: {v.dtype})", "features")
    bad = first_not_finite(features)
    if bad is not None:
        raise CareError(f"image {bad}: features contain NaN or infinite values")


def batch_budgets(
    sizes: Sequence[int], ratio: float | None, keep: int | None, keeps: Sequence[int] | None
) -> list[int]:
    """K_i per image through :mod:`care_core.budget`: from one ratio, one keep, or one keep per image."""
    if sum(x is not None for x in (ratio, keep, keeps)) != 1:
        raise BudgetError("give exactly one of {ratio}, {keep} and {keeps} (one number of tokens kept per image)")
    if keeps is None:
        return [resolve_budget(n, ratio, keep) for n in sizes]
    if isinstance(keeps, (str, bytes)) or not isinstance(keeps, Sequence) or len(keeps) != len(sizes):
        raise BudgetError(f"must be a sequence of one K per image ({len(sizes)} images), got {keeps!r}", "keeps")
    out = []
    for i, (n, k) in enumerate(zip(sizes, keeps, strict=True)):
        try:
            out.append(resolve_budget(n, keep=k))
        except BudgetError as exc:
            raise BudgetError(f"of image {i}: {exc.detail}", parameter="keeps") from exc
    return out


def batch_scores(
    features: Sequence[torch.Tensor],
    projector: Projector,
    directions: torch.Tensor | None,
    cfg: CaReConfig,
    scorer: Scorer,
) -> list[torch.Tensor]:
    """psi_bar per image: Eq. 1 in one pass over the tokens of all images with the same m directions, then
    Eq. 2 (median and MAD over each image's own tokens), mu - lambda sigma and min-max per image.

    A response C[x, i] depends on token i and direction x only, so the joint pass gives each image its own
    responses; the per-image statistics then run on exactly the tensors :func:`prca_scores` sees.
    """
    joined = features[0] if len(features) == 1 else torch.cat(list(features))
    u = resolve_directions(directions, cfg.m, joined.shape[1], cfg.seed, joined, scorer=scorer)
    responses = scorer.responses(joined, u, h=cfg.h, engine=cfg.engine, matmul=cfg.matmul_precision, kernel=cfg.kernel)
    per_image = responses.split([v.shape[0] for v in features], dim=1)
    return [influence_scores(robust_zscores(c.contiguous(), cfg.eps), cfg.lam, cfg.eps) for c in per_image]


def padded_greedy(
    weights: Sequence[torch.Tensor], features: Sequence[torch.Tensor], ks: Sequence[int], eps: float
) -> list[torch.Tensor]:
    """Eq. 3 for B images in one loop of max K_i steps over (B, max N_i): the selection order per image.

    Each image's steps are :func:`~care_core.anchors.diversity_greedy`'s: S starts at argmax psi_bar, then adds
    argmax_{i not in S} psi_bar_i min_{j in S} (1 - cos(v_i, v_j)), ties to the lowest index (argmax returns
    the first maximum). Padded candidates count as already selected (score -inf), so they are never chosen.
    The scores, argmax and running minima run on the whole batch; each step's cosine row is one matrix-vector
    product per image still selecting, on the image's own rows: the product the single-image loop computes,
    so its cosines are bit-identical (one batched product rounds differently on MKL).
    """
    b, n = len(weights), max(w.shape[0] for w in weights)
    sizes, like = [w.shape[0] for w in weights], weights[0]
    w_pad = like.new_zeros(b, n)
    unit = like.new_zeros(b, n, features[0].shape[1])
    selected = torch.ones(b, n, dtype=torch.bool, device=like.device)
    for i, (w, v) in enumerate(zip(weights, features, strict=True)):
        w_pad[i, : sizes[i]] = w
        unit[i, : sizes[i]] = unit_rows(v, eps)
        selected[i, : sizes[i]] = False
    rows = torch.arange(b, device=like.device)
    order = torch.empty(b, max(ks), dtype=torch.long, device=like.device)
    minus_inf = torch.full((), float("-inf"), dtype=like.dtype, device=like.device)
    true = torch.ones((), dtype=torch.bool, device=like.device)  # a device value: `= True` would copy from the host
    min_distance = torch.ones_like(w_pad)  # before the first pick every score is psi_bar itself
    cosines = torch.zeros_like(w_pad)  # padded columns stay 0: distance 1, never read
    for step in range(max(ks)):
        chosen = torch.argmax(torch.where(selected, minus_inf, w_pad * min_distance), dim=1)
        order[:, step] = chosen
        selected[rows, chosen] = true
        picked = unit[rows, chosen]  # (B, d_v): the unit row each image just chose
        for i in (i for i in range(b) if ks[i] > step + 1):  # images that still need a next step
            torch.mv(unit[i, : sizes[i]], picked[i], out=cosines[i, : sizes[i]])
        min_distance = torch.minimum(min_distance, 1 - cosines) if step else 1 - cosines
    return [order[i, :k].clone() for i, k in enumerate(ks)]


def batch_anchors(
    weights: Sequence[torch.Tensor], features: Sequence[torch.Tensor], ks: Sequence[int], eps: float, gate: KernelGate
) -> list[torch.Tensor]:
    """Eq. 3's selection order per image: the images the fused CUDA kernel takes in as few launches as their Gram
    matrices allow (:func:`~care_core.anchors.fused_orders`, each image's order what it gets alone), all other
    images together in :func:`padded_greedy`."""
    device = features[0].device
    orders: list[torch.Tensor | None] = [None] * len(features)
    fused = [
        i
        for i, (w, v) in enumerate(zip(weights, features, strict=True))
        if gate.choose("greedy", device, applies=fused_greedy_applies(w, v)) == "fused"
    ]
    for group in row_groups([int(features[i].shape[0]) ** 2 for i in fused], GREEDY_GRAM_ELEMENTS):
        if gate.choose("greedy", device) != "fused":
            break  # an earlier group's kernel failed to build ("auto" mode): the padded loop takes the rest
        images = [fused[j] for j in group]
        got = fused_orders([weights[i] for i in images], [features[i] for i in images], [ks[i] for i in images], eps,
                           gate)  # fmt: skip
        if got is not None:  # else the padded loop below takes them
            for i, order in zip(images, got, strict=True):
                orders[i] = order
    rest = [i for i, order in enumerate(orders) if order is None]
    if rest:
        joint = padded_greedy([weights[i] for i in rest], [features[i] for i in rest], [ks[i] for i in rest], eps)
        for i, order in zip(rest, joint, strict=True):
            orders[i] = order
    return [o for o in orders if o is not None]


def anchor_orders(
    inputs: Sequence[MethodInputs],
    keeps: Sequence[int],
    keys: Sequence[Hashable],
    weights: Sequence[torch.Tensor],
    rows: Sequence[torch.Tensor],
    eps: float,
    gate: KernelGate,
) -> list[torch.Tensor]:
    """Eq. 3's selection order of ``keeps[i]`` steps per image (weights, the rows its diversity is measured on, its
    eps and kernel gate) through the images' memos under ``keys[i]``
    (:func:`~care_core.methods.base.memo_orders`: the order for K is the first K of any longer one). The images
    lacking a long enough order: one alone by :func:`diversity_greedy`, as one image's call runs it; several by
    :func:`batch_anchors`."""

    def compute(todo: list[int], lengths: list[int]) -> list[torch.Tensor]:
        if len(todo) == 1:
            return [diversity_greedy(weights[todo[0]], rows[todo[0]], lengths[0], eps, kernel=gate)]
        return batch_anchors([weights[i] for i in todo], [rows[i] for i in todo], lengths, eps, gate)

    return memo_orders(inputs, keeps, keys, compute)


def care_reduce_batch(
    features: Sequence[torch.Tensor],
    projector: Projector,
    positions: Sequence[torch.Tensor],
    *,
    ratio: float | None = None,
    keep: int | None = None,
    keeps: Sequence[int] | None = None,
    config: CaReConfig | None = None,
    directions: torch.Tensor | None = None,
    scorer: Scorer | None = None,
) -> list[Reduction]:
    """:func:`~care_core.care.care_reduce` for B images at once: per image, the Reduction it gives alone.

    features: B tensors (N_i, d_v), N_i may differ; one width, device and compute dtype. positions: B tensors
    (N_i, 2). Exactly one budget: `ratio` (K_i = max(1, floor(ratio N_i))), `keep` (the same K for every image)
    or `keeps` (K_i per image). Shared across images: the m directions and one Eq. 1 scoring pass over all
    tokens. Per image: Eq. 2's median and MAD, psi_bar's min-max, Eq. 3 (one padded loop for all images, or
    the fused CUDA kernel per image where care_reduce uses it) and CGTC (Eq. 4–9). The joint scoring pass may
    round an image's responses differently from a pass over that image alone (a taller matrix product; one ulp
    seen in float64 on MKL), so psi_bar, c_r and the tokens agree to rounding and the anchors and signals are
    the same unless a margin of Eq. 3 or of the gate (Eq. 6) is that small (docs/design/batches.md §Batches).

    >>> import torch
    >>> from care_core import CaReConfig
    >>> projector = torch.nn.Linear(8, 4).double()
    >>> v = [torch.randn(n, 8, dtype=torch.float64) for n in (50, 30)]
    >>> p = [torch.rand(n, 2, dtype=torch.float64) for n in (50, 30)]
    >>> [r.num_kept for r in care_reduce_batch(v, projector, p, ratio=0.1, config=CaReConfig(m=8))]
    [5, 3]
    """
    cfg = config or CaReConfig()
    _check_batch(features, positions)
    scorer = scorer_for(projector, scorer)
    ks = batch_budgets([v.shape[0] for v in features], ratio, keep, keeps)
    vs = [v.to(compute_dtype(v.dtype)) for v in features]
    ps = [p.to(device=v.device, dtype=v.dtype) for p, v in zip(positions, vs, strict=True)]
    psi_bars = batch_scores(vs, projector, directions, cfg, scorer)
    with matmul_precision(allow_tf32=False), torch.no_grad():
        orders = batch_anchors(psi_bars, vs, ks, cfg.eps, scorer.gate(cfg.kernel))
        anchors = [order.sort().values for order in orders]
        calibrations = calibrate_batch_with(cfg, vs, ps, anchors, psi_bars, gated=True)
        out = []
        for psi_bar, order, indices, cal, given in zip(psi_bars, orders, anchors, calibrations, features, strict=True):
            out.append(Reduction(indices=indices, anchor_order=order, tokens=cal.tokens.to(given.dtype),
                                 psi_bar=psi_bar, calibration=cal))  # fmt: skip
    return out
