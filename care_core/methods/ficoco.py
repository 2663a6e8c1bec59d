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
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal

from care_core._lazy import F, torch
from care_core.backbones.families import Trait
from care_core.errors import MethodError
from care_core.methods._core import compute_dtype
from care_core.methods.base import Category, Method, MethodInputs, MethodResult
from care_core.methods.registry import register

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
    threshold = torch.quantile(merged_logits, QUANTILE, dim=-1, keepdim=True)
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
    """The state of B images' FiCoCo-V steps (rows 0..T-1 of every image; row 0 protected)."""

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
    threshold = torch.quantile(merged_logits, QUANTILE, dim=-1, keepdim=True)
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
        n = inputs.num_tokens
        x, logits = self._probes(inputs)
        device = x.device
        grid = _patch_grid(inputs)
        score_map = fresh_score_map(n, device) if self.local_penalty == "released" else None
        origin = torch.arange(n + 1, device=device)  # token index of every row's own token
        owner = torch.arange(n + 1, device=device)  # current row of every input token
        first_scores = None
        steps = [n + 1]
        with torch.no_grad():
            while x.shape[0] > keep + 1:
                t = x.shape[0]
                step = ficoco_step(
                    x,
                    logits,
                    min(self.r, t - keep - 1, (t - 1) // 2),
                    score_map=score_map,
                    grid=grid,
                    row_order=self.row_order,
                    local_penalty=self.local_penalty,
                    origin=origin,
                )
                if first_scores is None:
                    first_scores = step.scores
                row_map = torch.empty(t, dtype=torch.long, device=device)
                row_map[step.rows] = torch.arange(step.rows.numel(), device=device)
                if step.targets.shape[1] > 0:
                    row_map[step.merge] = step.target_rows[:, 0]  # follows its top-1 target
                else:
                    row_map[step.merge] = -1
                owner = torch.where(owner >= 0, row_map[owner.clamp_min(0)], owner)
                origin = origin[step.rows]
                logits = logits[step.rows][:, step.rows]
                x, score_map = step.hidden, step.score_map
                steps.append(x.shape[0])
        return _result(inputs, _BatchChain(x, logits, origin, owner, score_map, first_scores), tuple(steps))

    def reduce_batch(self, inputs: list[MethodInputs], keeps: list[int]) -> list[MethodResult]:
        """Images of one N, budget, grid, device and dtypes take their steps together (:func:`_batch_filter`,
        :func:`_batch_merge`; a group may be one image). Every group's Filter steps run first, then one host sync
        reads every step's adaptive k of every group, then every group's Correlate and Compress; one more sync reads
        the token each image ends with in row 0."""
        groups: dict[tuple[object, ...], list[int]] = {}
        for i, (one, keep) in enumerate(zip(inputs, keeps, strict=True)):
            hidden, logits = self._probes(one)
            key = (one.num_tokens, keep, _patch_grid(one), hidden.device, hidden.dtype, logits.dtype, hidden.shape[1])
            groups.setdefault(key, []).append(i)
        with torch.no_grad():
            chains = [
                self._filter_group([inputs[i] for i in members], keeps[members[0]]) for members in groups.values()
            ]
            ks = _read_ks([step.k for _, steps, _ in chains for step in steps])
            for chain, steps, _ in chains:
                for step in steps:
                    _batch_merge(chain, step, next(ks), self.row_order)
            row_tokens = iter(torch.cat([chain.origin[:, 0] for chain, _, _ in chains]).tolist())  # one more sync
        results: dict[int, MethodResult] = {}
        for members, (chain, _, sizes) in zip(groups.values(), chains, strict=True):
            for j, i in enumerate(members):
                results[i] = _result(inputs[i], chain.image(j), sizes, next(row_tokens))
        return [results[i] for i in range(len(inputs))]

    def _filter_group(
        self, inputs: list[MethodInputs], keep: int
    ) -> tuple[_BatchChain, list[_Filtered], tuple[int, ...]]:
        """(the chain after every Filter step, the steps, T before and after each) for images of one N, budget and
        grid, stacked (no padding: every step has one T); hidden states and owners are still the inputs'."""
        probes = [self._probes(one) for one in inputs]
        hidden = torch.stack([h for h, _ in probes])
        b, n = len(inputs), inputs[0].num_tokens
        rows = torch.arange(n + 1, device=hidden.device).expand(b, -1)
        fresh = fresh_score_map(n, hidden.device).expand(b, -1) if self.local_penalty == "released" else None
        chain = _BatchChain(hidden, torch.stack([lg for _, lg in probes]), rows, rows, fresh)
        grid = _patch_grid(inputs[0])
        sizes, steps = [n + 1], []
        while (t := sizes[-1]) > keep + 1:
            steps.append(_batch_filter(chain, min(self.r, t - keep - 1, (t - 1) // 2), self, grid))
            sizes.append(chain.logits.shape[1])
        return chain, steps, tuple(sizes)


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
