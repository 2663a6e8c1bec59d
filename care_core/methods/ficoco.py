"""FiCoCo-V (Han et al., "Filter, Correlate, Compress: Training-Free Token Reduction for MLLM Acceleration", AAAI 2026).

Official code: kawhiiiileo/FiCoCo @ 8995e93, ``llava/model/multimodal_encoder/FiCoCo_V.py`` (``Filter``,
``Correlate``, ``Compress``, ``merge_ficoco_v``), wired into CLIP by ``clip_encoder.py``: in each of the layers
12-23 the head-mean **pre-softmax** attention logits ``L`` (T, T) of the layer rank the tokens and ``r = 42`` of
them are merged after the attention residual, before the MLP. One step (:func:`ficoco_step`):

* **Filter** (the paper's redundancy score): ``c = L[0, 1:]``, ``p_i = mean_j L[i, j]``
  over patches, each L2-normalised over tokens, ``s = 0.35 c - 0.65 p``; local penalty in 2x2 windows of the
  patch grid (the minimum of each window is halved if positive, doubled if negative: more mergeable); token 0 gets
  ``+inf``; the ``r`` lowest scores (ascending ``argsort``) are merged, the rest remain;
* **Correlate**: ``k = max`` over merged rows of ``#{L[i, :] > quantile_0.998(L[i, :])}``; each merged token's
  targets are its top-``k`` entries of ``softmax(L)``, weights = those probabilities normalised per row;
* **Compress**: the weighted merged tokens are scatter-added to their targets' rows and every row divided by its
  accumulated weight (``size`` starts at 1; the official encoder layer always passes ``size=None``).

Released behaviour vs. the paper (both selectable; the released one is the default):

* ``row_order="released"``: output row i is input token ``remain[i]`` (ascending score order, so the CLS token
  ends up **last** and the next layer treats whichever token sits in row 0 as "CLS"), while Compress addresses
  target rows by *original* token index (targets ``>= T - r`` shifted down by ``r``), so the weight lands on rows
  that hold other tokens. ``row_order="paper"``: rows stay in token order (CLS first), targets are restricted to
  the remaining tokens and added to the rows that hold them (our reading of the paper's description).
* ``local_penalty="released"``: the 2x2 windows are taken on a score map over the N patch slots that the released
  code keeps as **module-level state** across layers and images: each call writes the scores into the slots not
  yet retired (in ascending slot order, without regard to which token a slot held), penalises the window minima of
  the map by *slot index used as token index*, and retires those slots (``inf``). Here the map is explicit state
  (:func:`fresh_score_map` is the freshly imported map, all ``1e9``), passed in and returned by every step; the
  registered method starts every image from a fresh map (the official code would carry it over from the previous
  image) and returns the final map in ``info["score_map"]``. ``local_penalty="paper"``: the windows are taken per
  step on the original patch positions of the tokens still present (no state).

The registered method ``ficoco-v``: the official code merges inside CLIP layers 12-23 (each step sees that
layer's own attention); we apply the steps to the feature-layer tokens instead: start from ``hidden_with_cls``
(1 + N rows) and the feature layer's ``attention_logits``, run steps of ``min(r, T - 1 - keep, (T - 1) // 2)`` tokens
(default ``r = 42``; the last step smaller; the ``(T - 1) // 2`` cap only binds below 85 tokens and keeps the
released target addressing defined — beyond it the official ``Compress`` scatters to negative rows and fails) until
``1 + keep`` rows remain, with the logits of every later step = the rows/columns of the remaining tokens
(re-ordered like the rows), then drop row 0 as LLaVA's ``patch`` feature select does: ``keep`` rows. (Official
LLaVA-1.5 setting: 11 steps, 577 -> 115 -> 114 tokens.) ``token_index`` is the patch of each row's own token (-1
for the CLS token, which in the released row order moves to the end and can itself be merged), ``assignment`` is
the row each patch ended in (merged tokens follow their top-1 target's row; tokens that end in the dropped row 0
are -1). The map has the patch grid's shape (``inputs.grid``, else a square N; the released code hard-codes
576 = 24 x 24 slots and the first 144 window minima, i.e. all windows of that grid); without a grid there is no
local penalty. Deviations: the sorts are stable (ties broken by position; the official ``argsort`` is unspecified).

Batches (``FiCoCoV.reduce_batch``): images with the same N, ``keep`` and grid take the same steps (r depends only on
T and ``keep``), so they run stacked with no padding (a group may be one image); every row-wise operation sees the
numbers it sees for one image, and the data-dependent sets (live map slots, penalised windows, top-k columns) are
masks. What a step merges and keeps (Filter, and so the next step's logits, rows and map) does not depend on the
adaptive k, only where the merged tokens go does (Correlate, Compress): so every group's Filter steps run first
(:func:`_batch_filter`), one host sync reads every step's k of every image, then every group's Correlate and
Compress run (:func:`_batch_merge`) with no further sync.

Budgets (an image's ``MethodInputs.memo`` and ``planned_keeps``): a budget's chain is its step sizes
(:func:`step_sizes`), so two budgets of one image take the same steps on the same numbers until the larger one's last,
partial step. With a memo, a call starts from the state after the longest prefix of its step sizes the memo holds, and
keeps a copy of its state after the last step it shares with each other planned budget (rows, logits, origins,
owners, map, first scores) under the step sizes that led there: K = 640, 320, 160 take the steps of K = 160 and one
more each, in any order of calls, each bit-identical to the budget alone. Without a memo every call runs its own.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

from care_core._lazy import F, torch
from care_core.errors import MethodError
from care_core.methods.base import Category, Method, MethodInputs, MethodResult
from care_core.methods.lazy_precision import compute_dtype
from care_core.methods.registry import register
from care_core.vocabulary import Trait

BETA = 0.35  # weight of the CLS similarity in the redundancy score
QUANTILE = 0.998  # Correlate's per-row threshold for the adaptive top-k
UNWRITTEN = 1e9  # initial value of every slot of the released score map

RowOrder = Literal["released", "paper"]
Penalty = Literal["released", "paper"]


def fresh_score_map(num_patches: int, device: torch.device | None = None) -> torch.Tensor:
    """The released code's score map as freshly imported: (N,) all 1e9 (no slot written or retired)."""
    return torch.full((num_patches,), UNWRITTEN, dtype=torch.float32, device=device)


def redundancy_scores(logits: torch.Tensor) -> torch.Tensor:
    """(..., T - 1) ``0.35 * normalize(L[0, 1:]) - 0.65 * normalize(mean_j L[1:, 1:])`` (lower = more redundant) of
    logits (..., T, T)."""
    cls_sim = F.normalize(logits[..., 0, 1:], p=2, dim=-1)
    patch_sim = F.normalize(logits[..., 1:, 1:].mean(dim=-1), p=2, dim=-1)
    return BETA * cls_sim - (1 - BETA) * patch_sim


def window_minima(values: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
    """Raster positions of the minimum of every 2x2 window of `values` (M,) or (B, M) laid out on `grid` (first on
    ties): (W,) or (B, W)."""
    lead = values.shape[:-1]
    if grid is None or grid[0] // 2 == 0 or grid[1] // 2 == 0:
        return torch.empty(*lead, 0, dtype=torch.long, device=values.device)
    rows, cols = grid
    h, w = rows // 2, cols // 2
    blocks = values.reshape(-1, rows, cols)[:, : 2 * h, : 2 * w].reshape(-1, h, 2, w, 2).permute(0, 1, 3, 2, 4)
    arg = blocks.reshape(-1, h, w, 4).argmin(dim=-1)  # 0..3 = (dy, dx) in (0,0), (0,1), (1,0), (1,1)
    wy = torch.arange(h, device=values.device)[:, None]
    wx = torch.arange(w, device=values.device)[None, :]
    return ((2 * wy + arg // 2) * cols + 2 * wx + arg % 2).reshape(*lead, h * w)


def row_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(values, q, dim=-1, keepdim=True)`` (linear interpolation), from each row's top
    ``T - floor(q (T - 1))`` values instead of a sort of the whole row: the same two order statistics, the same
    rank arithmetic (in the values' dtype) and the same ``lerp``, so the same numbers (a small top-k and a lerp
    instead of a sort and the NaN bookkeeping; a row with NaN gives NaN, as torch's does)."""
    t = values.shape[-1]
    rank = _rank(q, t - 1, values.dtype)
    below, above = math.floor(rank), math.ceil(rank)
    top = values.topk(t - below, dim=-1).values  # descending: sorted position p is top[..., t - 1 - p]
    low, high = top[..., t - 1 - below : t - below], top[..., t - 1 - above : t - above]
    return low.lerp(high, rank - below)  # the fraction is exact in float32 as in float64


def _rank(q: float, last: int, dtype: torch.dtype) -> float:
    """``q * last`` as torch.quantile computes it in ``dtype``: in float32, q rounded to float32, times the index
    (exact in a double: 24 + 24 bits), rounded once to float32; else in double."""
    if dtype != torch.float32:
        return q * last
    return _to_float32(_to_float32(q) * last)


def _to_float32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def _penalise(scores: torch.Tensor, where: torch.Tensor) -> None:
    """In place: halve positive, double non-positive scores at `where` (makes them more mergeable)."""
    chosen = scores[where]
    scores[where] = torch.where(chosen > 0, chosen / 2, chosen * 2)


@dataclass(frozen=True)
class FiCoCoStep:
    """One Filter / Correlate / Compress step on T tokens (indices are input rows, 0 = the protected row)."""

    hidden: torch.Tensor  # (T - r, d) merged hidden states
    size: torch.Tensor  # (T - r,) accumulated weight (the normaliser)
    order: torch.Tensor  # (T,) ascending score order, row 0 last (+inf)
    merge: torch.Tensor  # (r,) rows merged away
    remain: torch.Tensor  # (T - r,) rows kept
    rows: torch.Tensor  # (T - r,) input row of every output row
    targets: torch.Tensor  # (r, k) target rows of every merged row (official indices)
    target_rows: torch.Tensor  # (r, k) output rows that receive the weight
    top_values: torch.Tensor  # (T, k) softmax top-k values of every row
    scores: torch.Tensor  # (T - 1,) penalised redundancy scores of rows 1..T-1
    score_map: torch.Tensor | None  # released map after the step (None for the paper penalty)


def _released_penalty(
    scores: torch.Tensor, score_map: torch.Tensor | None, grid: tuple[int, int] | None, t: int
) -> torch.Tensor:
    """The released local penalty on T tokens, in place on `scores` (T - 1,); returns the score map after the step.

    The scores go into the map's live slots in slot order; the window minima of the map are penalised by slot
    index used as token (row - 1) index, and those slots retire (``inf``).
    """
    if score_map is None:
        raise MethodError("ficoco-v: the released local penalty needs the score map state")
    new_map = score_map.clone()
    if grid is None:
        side = math.isqrt(new_map.numel())
        grid = (side, side) if side * side == new_map.numel() else None
    live = (new_map != torch.inf).nonzero().flatten()
    count = min(live.numel(), t - 1)
    new_map[live[:count]] = scores[:count].to(new_map.dtype)
    slots = window_minima(new_map, grid)
    slots = slots[slots < t - 1]  # slot index used as token (row - 1) index
    _penalise(scores, slots)
    new_map[slots] = torch.inf
    return new_map


def _paper_penalty(scores: torch.Tensor, origin: torch.Tensor | None, grid: tuple[int, int] | None) -> None:
    """The paper's local penalty, in place on `scores`: 2x2 windows over the patch positions still present."""
    if origin is None or grid is None:
        return
    patch = origin[1:] - 1
    present = patch >= 0
    board = torch.full((grid[0] * grid[1],), torch.inf, dtype=scores.dtype, device=scores.device)
    board[patch[present]] = scores[present]
    slot_row = torch.full_like(board, -1, dtype=torch.long)
    slot_row[patch[present]] = present.nonzero().flatten()
    mins = window_minima(board, grid)
    mins = mins[torch.isfinite(board[mins])]
    _penalise(scores, slot_row[mins])


def _penalised_scores(
    logits: torch.Tensor,
    t: int,
    local_penalty: Penalty,
    score_map: torch.Tensor | None,
    grid: tuple[int, int] | None,
    origin: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(redundancy scores (T - 1,) after the local penalty, the released score map after the step or None)."""
    scores = redundancy_scores(logits)
    if local_penalty == "released":
        return scores, _released_penalty(scores, score_map, grid, t)
    if local_penalty == "paper":
        _paper_penalty(scores, origin, grid)
        return scores, None
    raise MethodError(f"ficoco-v: unknown local_penalty {local_penalty!r}")


@dataclass(frozen=True)
class _Targets:
    """Correlate's result: where each merged row's weight goes."""

    targets: torch.Tensor  # (r, k) target rows of every merged row (official indices)
    rows: torch.Tensor  # (T - r,) input row of every output row
    target_rows: torch.Tensor  # (r, k) output rows that receive the weight
    top_values: torch.Tensor  # (T, k) softmax top-k values of every row
    weights: torch.Tensor  # (r, k) weights of the merged rows, normalised per row


def _released_targets(
    probs: torch.Tensor, merge: torch.Tensor, remain: torch.Tensor, k: int, t: int, r: int
) -> _Targets:
    """Rows in ascending score order; targets by original token index (those >= T - r shifted down by r)."""
    top_values, top_index = probs.topk(k, dim=-1)
    targets = top_index[merge]
    target_rows = torch.where(targets >= t - r, targets - r, targets)
    if bool((target_rows < 0).any()):  # only possible for r > (t - 1) // 2; the official scatter fails too
        raise MethodError(f"ficoco-v: released target addressing is undefined for r={r} of {t} tokens")
    weights = (top_values / top_values.sum(dim=-1, keepdim=True))[merge]
    return _Targets(targets, remain, target_rows, top_values, weights)


def _paper_targets(probs: torch.Tensor, merge: torch.Tensor, remain: torch.Tensor, k: int, t: int) -> _Targets:
    """Rows in token order; targets restricted to the remaining tokens, added to the rows that hold them."""
    allowed = torch.ones(t, dtype=torch.bool, device=probs.device)
    allowed[merge] = False
    masked = probs[merge].masked_fill(~allowed, -1.0)  # only remaining tokens can be targets
    values, targets = masked.topk(k, dim=-1)
    top_values = probs.topk(k, dim=-1).values  # recorded like the official (all rows)
    rows = remain.sort().values
    return _Targets(
        targets, rows, torch.searchsorted(rows, targets), top_values, values / values.sum(dim=-1, keepdim=True)
    )


def _compress(hidden: torch.Tensor, merge: torch.Tensor, found: _Targets) -> tuple[torch.Tensor, torch.Tensor]:
    """(merged hidden states, accumulated weight (T - r, 1)): merge_ficoco_v with size=None, which scatter-adds
    the weighted merged rows and divides every row by its accumulated weight."""
    out = hidden[found.rows].clone()
    size = torch.ones(found.rows.numel(), 1, dtype=hidden.dtype, device=hidden.device)
    if found.targets.shape[1] > 0:
        source = hidden[merge]
        flat = found.target_rows.reshape(-1)
        w = found.weights.to(hidden.dtype)
        out.scatter_add_(0, flat[:, None].expand(-1, out.shape[1]), (source[:, None, :] * w[..., None]).flatten(0, 1))
        size.scatter_add_(0, flat[:, None], w.reshape(-1, 1))
    return out / size, size


def ficoco_step(
    hidden: torch.Tensor,
    logits: torch.Tensor,
    r: int,
    *,
    score_map: torch.Tensor | None = None,
    grid: tuple[int, int] | None = None,
    row_order: RowOrder = "released",
    local_penalty: Penalty = "released",
    origin: torch.Tensor | None = None,
) -> FiCoCoStep:
    """One FiCoCo-V step on `hidden` (T, d) with head-mean logits `logits` (T, T), merging `r` tokens.

    Released penalty: `score_map` (M,) is the state before the call (``fresh_score_map(M)`` for a fresh module) on
    `grid` (rows * cols = M; a square M when None); the returned ``score_map`` is the state after. Paper penalty:
    `origin` (T,) gives the token index (0 = CLS, p + 1 = patch p) of every row and `grid` the patch grid.
    """
    t = hidden.shape[0]
    if not 0 < r <= t - 1:
        raise MethodError(f"ficoco-v: cannot merge {r} of {t} tokens (row 0 is protected)")
    # Filter: penalised redundancy scores, row 0 protected (+inf), the r lowest merged
    scores, new_map = _penalised_scores(logits, t, local_penalty, score_map, grid, origin)
    ranked = torch.cat([torch.full((1,), torch.inf, dtype=scores.dtype, device=hidden.device), scores])
    order = torch.sort(ranked, stable=True).indices
    merge, remain = order[:r], order[r:]

    # Correlate: adaptive k from the 0.998-quantile of each merged row's logits, targets from softmax(L)
    merged_logits = logits[merge]
    threshold = row_quantile(merged_logits, QUANTILE)
    k = int((merged_logits > threshold).sum(dim=-1).max())
    probs = torch.softmax(logits, dim=-1)
    if row_order == "released":
        found = _released_targets(probs, merge, remain, k, t, r)
    elif row_order == "paper":
        found = _paper_targets(probs, merge, remain, k, t)
    else:
        raise MethodError(f"ficoco-v: unknown row_order {row_order!r}")

    merged, size = _compress(hidden, merge, found)
    return FiCoCoStep(
        hidden=merged,
        size=size[:, 0],
        order=order,
        merge=merge,
        remain=remain,
        rows=found.rows,
        targets=found.targets,
        target_rows=found.target_rows,
        top_values=found.top_values,
        scores=scores,
        score_map=new_map,
    )


def _patch_grid(inputs: MethodInputs) -> tuple[int, int] | None:
    n = inputs.num_tokens
    if inputs.grid is not None and inputs.grid[0] * inputs.grid[1] == n:
        return inputs.grid
    side = math.isqrt(n)
    return (side, side) if side * side == n else None


# ---------------------------------------------------------------------------- B images of one shape in one loop
# Images with the same N, keep and grid take the same steps (r depends only on T and keep): their rows stack into
# (B, T, ...) without padding, so every row-wise operation (norms, means, quantile, softmax, top-k, sort) runs on the
# same numbers as for one image. Data-dependent sets (the map's live slots, the windows a step penalises, the top-k
# columns) become masks; positions a mask leaves out are sent to one extra scratch column, sliced off after.


def _penalise_at(scores: torch.Tensor, where: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
    """:func:`_penalise` per image: scores (B, S) penalised at `where` (B, W) where `use` (B, W) holds."""
    scratch = scores.shape[1]
    padded = torch.cat([scores, scores.new_zeros(scores.shape[0], 1)], dim=1)
    at = torch.where(use, where, scratch)
    chosen = padded.gather(1, at)
    return padded.scatter(1, at, torch.where(chosen > 0, chosen / 2, chosen * 2))[:, :scratch]


def _released_penalty_batch(
    scores: torch.Tensor, score_map: torch.Tensor, grid: tuple[int, int] | None, t: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_released_penalty` per image on scores (B, T - 1) and maps (B, M): (penalised scores, maps after).

    The i-th live slot (ascending) takes score i while i < T - 1, as ``map[live[:count]] = scores[:count]``."""
    slots_total = score_map.shape[1]
    if grid is None:
        side = math.isqrt(slots_total)
        grid = (side, side) if side * side == slots_total else None
    live = score_map != torch.inf
    rank = live.cumsum(dim=1) - 1
    written = scores.gather(1, rank.clamp(0, t - 2)).to(score_map.dtype)
    new_map = torch.where(live & (rank < t - 1), written, score_map)
    slots = window_minima(new_map, grid)
    use = slots < t - 1  # slot index used as token (row - 1) index
    scores = _penalise_at(scores, slots, use)
    padded = torch.cat([new_map, new_map.new_zeros(new_map.shape[0], 1)], dim=1)
    new_map = padded.scatter(1, torch.where(use, slots, slots_total), torch.inf)[:, :slots_total]
    return scores, new_map


def _paper_penalty_batch(scores: torch.Tensor, origin: torch.Tensor, grid: tuple[int, int] | None) -> torch.Tensor:
    """:func:`_paper_penalty` per image on scores (B, T - 1) with origins (B, T)."""
    if grid is None:
        return scores
    b, slots_total = scores.shape[0], grid[0] * grid[1]
    patch = origin[:, 1:] - 1
    slot = torch.where(patch >= 0, patch, slots_total)  # the CLS row goes to the scratch slot
    board = torch.full((b, slots_total + 1), torch.inf, dtype=scores.dtype, device=scores.device)
    board = board.scatter(1, slot, scores)[:, :slots_total]
    rows = torch.arange(scores.shape[1], device=scores.device).expand(b, -1)
    slot_row = torch.full((b, slots_total + 1), -1, dtype=torch.long, device=scores.device).scatter(1, slot, rows)
    mins = window_minima(board, grid)
    return _penalise_at(scores, slot_row.gather(1, mins), torch.isfinite(board.gather(1, mins)))


@dataclass(frozen=True)
class _Filtered:
    """One step's Filter for B images, and what Correlate and Compress need once the images' k is read."""

    merge: torch.Tensor  # (B, r) rows merged away
    rows: torch.Tensor  # (B, T - r) input row of every output row
    merged_logits: torch.Tensor  # (B, r, T) the merged rows of the step's logits
    k: torch.Tensor  # (B,) long: each image's adaptive k (on the device until the chain reads them all)


@dataclass(frozen=True)
class _BatchTargets:
    """Correlate for B images: each merged row's top-k targets, padded to the largest k with zero weight."""

    rows: torch.Tensor  # (B, T - r) input row of every output row
    target_rows: torch.Tensor  # (B, r, k_max) output rows that receive the weight
    weights: torch.Tensor  # (B, r, k_max) normalised per row over the image's own k columns, 0 beyond
    k: torch.Tensor  # (B,) long: each image's adaptive k


def _top_k_per_image(candidates: torch.Tensor, ks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, columns) (B, r, max k): image i's ``topk(ks[i])`` of `candidates` (B, r, T), its values normalised
    per row; one ``topk`` for all images when they share k (usually: k is the count above a fixed quantile), else
    one per image on its own rows (views: no index tensor to copy to the device)."""
    b, r, _ = candidates.shape
    k_max = max(ks)
    if len(set(ks)) == 1:
        values, columns = candidates.topk(k_max, dim=-1)
        return values / values.sum(dim=-1, keepdim=True), columns
    weights = candidates.new_zeros(b, r, k_max)
    columns = torch.zeros(b, r, k_max, dtype=torch.long, device=candidates.device)
    for i, k in enumerate(ks):
        if k > 0:
            values, index = candidates[i].topk(k, dim=-1)
            weights[i, :, :k] = values / values.sum(dim=-1, keepdim=True)
            columns[i, :, :k] = index
    return weights, columns


def _batch_targets(step: _Filtered, ks: list[int], row_order: RowOrder) -> _BatchTargets:
    """Correlate (:func:`_released_targets` / :func:`_paper_targets`) for B images whose k (`ks`) the chain has
    read: targets from the softmax of the merged rows (only remaining tokens in the paper's row order)."""
    b, r, t = step.merged_logits.shape
    probs = torch.softmax(step.merged_logits, dim=-1)  # the merged rows of softmax(L)
    if row_order == "paper":
        merged = torch.zeros(b, 1, t, dtype=torch.bool, device=probs.device).scatter(2, step.merge[:, None, :], True)
        probs = probs.masked_fill(merged, -1.0)  # only remaining tokens can be targets
    if max(ks) == 0:
        empty = torch.empty(b, r, 0, dtype=torch.long, device=probs.device)
        return _BatchTargets(step.rows, empty, empty.to(probs.dtype), step.k)
    weights, targets = _top_k_per_image(probs, ks)
    if row_order == "released":  # r <= (T - 1) // 2, so no target row is negative (see _released_targets)
        target_rows = torch.where(targets >= t - r, targets - r, targets)
    else:
        target_rows = torch.searchsorted(step.rows, targets.reshape(b, -1)).view_as(targets)
    return _BatchTargets(step.rows, target_rows, weights, step.k)


def _batch_compress(hidden: torch.Tensor, merge: torch.Tensor, found: _BatchTargets) -> torch.Tensor:
    """:func:`_compress` for B images: one scatter-add over the flattened output rows, each image's sources in
    its own (merged row, column) order, so every row sums in the order one image's call does."""
    b, _, d = hidden.shape
    n_out = found.rows.shape[1]
    out = hidden.gather(1, found.rows[..., None].expand(-1, -1, d))
    size = hidden.new_ones(b, n_out, 1)
    k_max = found.weights.shape[2]
    if k_max == 0:
        return out
    source = hidden.gather(1, merge[..., None].expand(-1, -1, d))
    used = torch.arange(k_max, device=hidden.device) < found.k[:, None, None]
    image = torch.arange(b, device=hidden.device)[:, None, None]
    flat = torch.where(used, image * n_out + found.target_rows, b * n_out).reshape(-1)
    w = found.weights.to(hidden.dtype)
    values = (source[:, :, None, :] * w[..., None]).reshape(-1, d)
    out = torch.cat([out.reshape(b * n_out, d), hidden.new_zeros(1, d)])
    out.scatter_add_(0, flat[:, None].expand(-1, d), values)
    size = torch.cat([size.reshape(b * n_out, 1), hidden.new_zeros(1, 1)])
    size.scatter_add_(0, flat[:, None], w.reshape(-1, 1))
    return (out[:-1] / size[:-1]).view(b, n_out, d)


@dataclass
class _BatchChain:
    """The state of B images' FiCoCo-V steps (rows 0..T-1 of every image; row 0 protected), or of one image's
    (the same without the leading dimension: :meth:`image`, what the memo keeps)."""

    hidden: torch.Tensor  # (B, T, d)
    logits: torch.Tensor  # (B, T, T)
    origin: torch.Tensor  # (B, T) token index of every row's own token
    owner: torch.Tensor  # (B, 1 + N) current row of every input token (-1 = merged with no target)
    score_map: torch.Tensor | None  # (B, N) released map state
    first_scores: torch.Tensor | None = None  # (B, N) penalised scores of the first step

    def image(self, i: int) -> _BatchChain:
        """Image i's state (one image: no leading dimension)."""
        first, score_map = self.first_scores, self.score_map
        return _BatchChain(
            self.hidden[i],
            self.logits[i],
            self.origin[i],
            self.owner[i],
            None if score_map is None else score_map[i],
            None if first is None else first[i],
        )

    def clone(self) -> _BatchChain:
        """A copy that shares no tensor with this state (what an image's memo keeps and what it hands out)."""
        first, score_map = self.first_scores, self.score_map
        return _BatchChain(
            self.hidden.clone(),
            self.logits.clone(),
            self.origin.clone(),
            self.owner.clone(),
            None if score_map is None else score_map.clone(),
            None if first is None else first.clone(),
        )

    @staticmethod
    def stack(images: list[_BatchChain]) -> _BatchChain:
        """One state of B images from their own states (no leading dimension; all of one T and kind)."""
        return _BatchChain(
            torch.stack([one.hidden for one in images]),
            torch.stack([one.logits for one in images]),
            torch.stack([one.origin for one in images]),
            torch.stack([one.owner for one in images]),
            _stack_present([one.score_map for one in images]),
            _stack_present([one.first_scores for one in images]),
        )


def _stack_present(values: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The tensors stacked, or None where the images have none."""
    present = [value for value in values if value is not None]
    return torch.stack(present) if present else None


# --------------------------------------------------------------------------- budgets of one image share steps
# A budget's chain is its step sizes (step_sizes): two budgets of one image take the same steps, on the same numbers,
# until the larger one's last (partial) step. With a memo, the state after the last step a budget shares with another
# planned budget is kept under the step sizes that led to it; a call resumes from the longest such prefix of its own.


def step_sizes(n: int, keep: int, r: int) -> tuple[int, ...]:
    """T before and after every step of budget `keep` on N tokens: steps of ``min(r, T - 1 - keep, (T - 1) // 2)``
    from ``N + 1`` rows until ``keep + 1`` remain."""
    sizes = [n + 1]
    while (t := sizes[-1]) > keep + 1:
        sizes.append(t - min(r, t - keep - 1, (t - 1) // 2))
    return tuple(sizes)


def _shared_steps(sizes: tuple[int, ...], other: tuple[int, ...]) -> int:
    """How many steps two step sequences from one start share (their common prefix, less the start)."""
    same = 0
    for a, b in zip(sizes, other, strict=False):
        if a != b:
            break
        same += 1
    return same - 1


@dataclass(frozen=True)
class _Plan:
    """Where one budget's chain starts, and after which of its steps the image's memo keeps the state (the last
    step another planned budget shares with it)."""

    sizes: tuple[int, ...]  # T before and after every step (step_sizes)
    done: int  # steps the start state has taken (0: the probes)
    start: _BatchChain | None  # a copy of the memoised state after `done` steps; None: from the probes
    store: frozenset[int]  # s: the state after step s goes to the memo
    states: dict[tuple[int, ...], _BatchChain] | None  # the image's memo entry (states by step sizes); None: no memo

    def keep_state(self, done: int, chain: _BatchChain) -> None:
        """Memoise a copy of one image's `chain` after `done` steps where another planned budget resumes from it."""
        if self.states is not None and done in self.store:
            self.states[self.sizes[: done + 1]] = chain.clone()


def _merge_group(
    chain: _BatchChain,
    steps: list[_Filtered],
    saved: dict[int, _BatchChain],
    plans: list[_Plan],
    ks: Iterator[list[int]],
    row_order: RowOrder,
) -> None:
    """Correlate and Compress of a group's Filter steps (each step's k of its images next in `ks`); after a step
    whose Filter state is `saved`, the images that keep their state there memoise it."""
    for s, step in enumerate(steps, start=plans[0].done + 1):
        _batch_merge(chain, step, next(ks), row_order)
        if s in saved:
            state = replace(saved[s], hidden=chain.hidden, owner=chain.owner)
            for j, plan in enumerate(plans):
                plan.keep_state(s, state.image(j))


def _batch_filter(chain: _BatchChain, r: int, method: FiCoCoV, grid: tuple[int, int] | None) -> _Filtered:
    """Filter of one :func:`ficoco_step` for every image of `chain` (same T), and the images' adaptive k (on the
    device): what the step merges and keeps does not depend on k, only its Compress does."""
    b, t, _ = chain.logits.shape
    scores = redundancy_scores(chain.logits)
    score_map = chain.score_map
    if method.local_penalty == "released":
        if score_map is None:
            raise MethodError("ficoco-v: the released local penalty needs the score map state")
        scores, score_map = _released_penalty_batch(scores, score_map, grid, t)
    elif method.local_penalty == "paper":
        scores = _paper_penalty_batch(scores, chain.origin, grid)
    else:
        raise MethodError(f"ficoco-v: unknown local_penalty {method.local_penalty!r}")
    if method.row_order not in ("released", "paper"):
        raise MethodError(f"ficoco-v: unknown row_order {method.row_order!r}")
    ranked = torch.cat([torch.full((b, 1), torch.inf, dtype=scores.dtype, device=scores.device), scores], dim=1)
    order = torch.sort(ranked, dim=1, stable=True).indices
    merge, remain = order[:, :r], order[:, r:]
    rows = remain if method.row_order == "released" else remain.sort(dim=-1).values
    merged_logits = chain.logits.gather(1, merge[..., None].expand(-1, -1, t))
    threshold = row_quantile(merged_logits, QUANTILE)
    k = (merged_logits > threshold).sum(dim=-1).amax(dim=-1)
    n_out = rows.shape[1]
    logits = chain.logits.gather(1, rows[..., None].expand(-1, -1, t))
    chain.logits = logits.gather(2, rows[:, None, :].expand(-1, n_out, -1))
    chain.origin, chain.score_map = chain.origin.gather(1, rows), score_map
    if chain.first_scores is None:
        chain.first_scores = scores
    return _Filtered(merge, rows, merged_logits, k)


def _batch_merge(chain: _BatchChain, step: _Filtered, ks: list[int], row_order: RowOrder) -> None:
    """Correlate and Compress of one step for every image of `chain`, its images' k read (`ks`): in place on the
    chain's hidden states and owner rows, with :meth:`FiCoCoV.reduce`'s bookkeeping."""
    b, t = chain.hidden.shape[:2]
    device = chain.hidden.device
    found = _batch_targets(step, ks, row_order)
    chain.hidden = _batch_compress(chain.hidden, step.merge, found)
    n_out = found.rows.shape[1]
    row_map = torch.empty(b, t, dtype=torch.long, device=device)
    row_map.scatter_(1, found.rows, torch.arange(n_out, device=device).expand(b, -1))
    if found.target_rows.shape[2] > 0:  # a merged token follows its top-1 target (none where its image's k = 0)
        follows = torch.where(found.k[:, None] > 0, found.target_rows[:, :, 0], -1)
    else:
        follows = torch.full_like(step.merge, -1)
    row_map.scatter_(1, step.merge, follows)
    chain.owner = torch.where(chain.owner >= 0, row_map.gather(1, chain.owner.clamp_min(0)), chain.owner)


@register
@dataclass(frozen=True)
class FiCoCoV(Method):
    """FiCoCo-V (Han et al., AAAI 2026): Filter (redundancy score + local penalty), Correlate (adaptive top-k
    attention targets), Compress (weighted scatter-merge), repeated on the feature-layer tokens until ``keep``.

    Steps of ``r`` tokens (last one smaller) on [CLS, patches] with the feature layer's attention logits, then row 0
    is dropped (LLaVA's ``patch`` select): ``keep`` rows. Released row order and persistent score map by default
    (the map starts fresh per image); ``row_order="paper"`` / ``local_penalty="paper"`` for the paper's reading.
    With a memo, the budgets of one image share the steps they have in common (:meth:`_plan`: each resumes from the
    last state it shares with a budget run before; ``planned_keeps`` say which states to keep).
    """

    name: ClassVar[str] = "ficoco-v"
    category: ClassVar[Category] = "merging"
    needs: ClassVar[frozenset[str]] = frozenset({"attention_logits", "hidden_with_cls"})
    paper: ClassVar[str] = "Han et al., Filter, Correlate, Compress: Training-Free Token Reduction for MLLMs, AAAI 2026"
    rank: ClassVar[int] = 11
    cost_model: ClassVar[str | None] = "ficoco-v"
    requires: ClassVar[frozenset[Trait]] = frozenset({"cls_token"})  # reads CLS-based probes

    r: int = 42  # tokens merged per step (official: 42 per CLIP layer 12-23)
    row_order: RowOrder = "released"
    local_penalty: Penalty = "released"

    def _probes(self, inputs: MethodInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden_with_cls, attention_logits) in their compute dtypes, checked to cover 1 + N tokens."""
        n = inputs.num_tokens
        if self.r < 1:
            raise MethodError(f"ficoco-v: r must be >= 1, got {self.r}")
        hidden = inputs.probe("hidden_with_cls", self.name)
        logits = inputs.probe("attention_logits", self.name)
        if hidden.shape[0] != n + 1 or tuple(logits.shape) != (n + 1, n + 1):
            raise MethodError(
                f"ficoco-v: hidden_with_cls {tuple(hidden.shape)} / attention_logits {tuple(logits.shape)} "
                f"must cover 1 + N = {n + 1} tokens"
            )
        return hidden.to(compute_dtype(hidden.dtype)), logits.to(compute_dtype(logits.dtype))

    def reduce(self, inputs: MethodInputs, keep: int) -> MethodResult:
        x, logits = self._probes(inputs)
        plan = self._plan(inputs, keep, x, logits)
        chain = self._fresh(inputs, x, logits) if plan.start is None else plan.start
        grid, sizes = _patch_grid(inputs), plan.sizes
        with torch.no_grad():
            for s in range(plan.done, len(sizes) - 1):
                chain = self._step(chain, sizes[s] - sizes[s + 1], grid)
                plan.keep_state(s + 1, chain)
        return _result(inputs, chain, sizes)

    def _fresh(self, inputs: MethodInputs, hidden: torch.Tensor, logits: torch.Tensor) -> _BatchChain:
        """One image's state before its first step: row i holds token i (0 = CLS), a fresh score map."""
        n, device = inputs.num_tokens, hidden.device
        rows = torch.arange(n + 1, device=device)
        return _BatchChain(
            hidden, logits, rows, rows, fresh_score_map(n, device) if self.local_penalty == "released" else None
        )

    def _step(self, chain: _BatchChain, r: int, grid: tuple[int, int] | None) -> _BatchChain:
        """One image's state after one :func:`ficoco_step` of `r` tokens (a new state; `chain` is left as it is)."""
        t, device = chain.hidden.shape[0], chain.hidden.device
        step = ficoco_step(
            chain.hidden,
            chain.logits,
            r,
            score_map=chain.score_map,
            grid=grid,
            row_order=self.row_order,
            local_penalty=self.local_penalty,
            origin=chain.origin,
        )
        row_map = torch.empty(t, dtype=torch.long, device=device)
        row_map[step.rows] = torch.arange(step.rows.numel(), device=device)
        if step.targets.shape[1] > 0:
            row_map[step.merge] = step.target_rows[:, 0]  # follows its top-1 target
        else:
            row_map[step.merge] = -1
        owner = torch.where(chain.owner >= 0, row_map[chain.owner.clamp_min(0)], chain.owner)
        first = step.scores if chain.first_scores is None else chain.first_scores
        logits = chain.logits[step.rows][:, step.rows]
        return _BatchChain(step.hidden, logits, chain.origin[step.rows], owner, step.score_map, first)

    def _plan(self, inputs: MethodInputs, keep: int, hidden: torch.Tensor, logits: torch.Tensor) -> _Plan:
        """Budget `keep`'s chain on this image. With a memo: from the state after the longest prefix of its step
        sizes that the memo holds, keeping on the way the state after the last step it shares with each other
        planned budget (``inputs.planned_keeps``). The step sizes are all the chain reads of r and the budget, so
        the key names the rest: the orders, the grid, the compute dtypes."""
        n = inputs.num_tokens
        sizes = step_sizes(n, keep, self.r)
        if inputs.memo is None:
            return _Plan(sizes, 0, None, frozenset(), None)
        key = (self.name, "chain", self.row_order, self.local_penalty, _patch_grid(inputs), hidden.dtype, logits.dtype)
        states: dict[tuple[int, ...], _BatchChain] = inputs.memoized(key, dict)
        done = next((s for s in range(len(sizes) - 1, 0, -1) if sizes[: s + 1] in states), 0)
        start = states[sizes[: done + 1]].clone() if done else None
        planned = {k for k in inputs.planned_keeps if 1 <= k <= n and k != keep}
        shared = {_shared_steps(sizes, step_sizes(n, k, self.r)) for k in planned}
        return _Plan(sizes, done, start, frozenset(s for s in shared if s > done), states)

    def reduce_batch(self, inputs: list[MethodInputs], keeps: list[int]) -> list[MethodResult]:
        """Images of one N, budget, grid, device and dtypes that start from the same step (the probes, or a state
        their memos hold: :meth:`_plan`) take their steps together (:func:`_batch_filter`, :func:`_batch_merge`; a
        group may be one image). Every group's Filter steps run first, then one host sync reads every step's
        adaptive k of every group, then every group's Correlate and Compress; one more sync reads the token each
        image ends with in row 0."""
        groups: dict[tuple[object, ...], list[int]] = {}
        plans, starts = [], []
        for i, (one, keep) in enumerate(zip(inputs, keeps, strict=True)):
            hidden, logits = self._probes(one)
            plans.append(plan := self._plan(one, keep, hidden, logits))
            starts.append(self._fresh(one, hidden, logits) if plan.start is None else plan.start)
            key = (keep, plan.done, _patch_grid(one), hidden.shape, hidden.device, hidden.dtype, logits.dtype)
            groups.setdefault(key, []).append(i)
        with torch.no_grad():
            chains = [
                self._filter_group([starts[i] for i in m], [plans[i] for i in m], _patch_grid(inputs[m[0]]))
                for m in groups.values()
            ]
            ks = _read_ks([step.k for _, steps, _ in chains for step in steps])
            for members, (chain, steps, saved) in zip(groups.values(), chains, strict=True):
                _merge_group(chain, steps, saved, [plans[i] for i in members], ks, self.row_order)
            row_tokens = iter(torch.cat([chain.origin[:, 0] for chain, _, _ in chains]).tolist())  # one more sync
        results: dict[int, MethodResult] = {}
        for members, (chain, _, _) in zip(groups.values(), chains, strict=True):
            for j, i in enumerate(members):
                results[i] = _result(inputs[i], chain.image(j), plans[i].sizes, next(row_tokens))
        return [results[i] for i in range(len(inputs))]

    def _filter_group(
        self, starts: list[_BatchChain], plans: list[_Plan], grid: tuple[int, int] | None
    ) -> tuple[_BatchChain, list[_Filtered], dict[int, _BatchChain]]:
        """(the chain after every Filter step, the steps, the chain's Filter state after each step s after which an
        image memoises its state) for images of one N, budget, grid and start, stacked (no padding: every step has
        one T); hidden states and owners are still the start's."""
        chain = _BatchChain.stack(starts)
        sizes, done = plans[0].sizes, plans[0].done
        steps, saved = [], {}
        for s in range(done, len(sizes) - 1):
            steps.append(_batch_filter(chain, sizes[s] - sizes[s + 1], self, grid))
            if any(s + 1 in plan.store for plan in plans):
                saved[s + 1] = replace(chain)  # the step's merge gives its hidden states and owners
        return chain, steps, saved


def _read_ks(ks: list[torch.Tensor]) -> Iterator[list[int]]:
    """Every step's images' k (B,) as lists, in order, read from the device in one host sync."""
    if not ks:
        return iter(())
    sizes = [k.numel() for k in ks]
    flat = torch.cat(ks).tolist()
    bounds = list(itertools.accumulate(sizes, initial=0))
    return iter([flat[lo:hi] for lo, hi in itertools.pairwise(bounds)])


def _result(
    inputs: MethodInputs, chain: _BatchChain, steps: tuple[int, ...], row_token: int | None = None
) -> MethodResult:
    """The method's result from one image's final state (row 0 dropped, as LLaVA's ``patch`` select does);
    `row_token`: the token in row 0 (``origin[0]``) where the caller has read it already."""
    dropped = int(chain.origin[0]) if row_token is None else row_token
    assignment = chain.owner[1:] - 1  # output row = current row - 1 (row 0 is dropped -> -1)
    return MethodResult(
        tokens=chain.hidden[1:].to(inputs.features.dtype),
        token_index=chain.origin[1:] - 1,
        scores=chain.first_scores,
        assignment=assignment.clamp_min(-1),
        info={"steps": steps, "score_map": chain.score_map, "dropped_row_token": dropped - 1},
    )
