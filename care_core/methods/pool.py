"""Spatial average pooling baseline: the token grid averaged down to exactly K cells.

Rule (always exactly K output rows, every input token in exactly one cell):

1. Output layout. If K = h * w for some h <= rows, w <= cols whose aspect h / w is within a factor
   :data:`RATIO_TOLERANCE` of the input's rows / cols, use the closest such h x w grid (ties: smaller h).
   Otherwise use h = round(sqrt(K * rows / cols)) horizontal bands (clamped to [ceil(K / cols), min(rows, K)]);
   with K = h * q + r, r of the bands (spread evenly, ``floor((i + 1) r / h) > floor(i r / h)``) get q + 1 cells and
   the others q. A regular grid is the case r = 0.
2. Bins. Band i covers rows [floor(i * rows / h), floor((i + 1) * rows / h)); a band with w cells splits the columns
   the same way. The bins partition the grid (unlike ``adaptive_avg_pool2d``, whose bins overlap when the sizes do
   not divide); where they divide evenly this is plain ``avg_pool2d`` with stride = kernel.
3. Each output row is the mean of its cell's (pre-projector) tokens, in raster order of the cells (band by band, left
   to right). ``token_index`` = the token nearest the cell's centre (the lower-index one of equidistant tokens,
   always inside the cell), which is ascending in that order; ``assignment`` = the cell each input token falls in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from care_core._lazy import torch
from care_core.errors import MethodError
from care_core.methods.base import Category, Method, MethodInputs, MethodResult
from care_core.methods.lazy_precision import compute_dtype
from care_core.methods.registry import register
from care_core.vocabulary import Trait

RATIO_TOLERANCE = 1.5  # an exact h x w factorisation is used if its aspect is within this factor of the input's


def pool_layout(grid: tuple[int, int], keep: int) -> list[int]:
    """Cells per band (len = number of bands, sum = keep) for pooling a rows x cols grid to `keep` cells."""
    rows, cols = grid
    if not 1 <= keep <= rows * cols:
        raise MethodError(f"pool: keep must be between 1 and {rows * cols}, got {keep}")
    target = math.log(rows / cols)
    best: tuple[float, int] | None = None
    for h in range(1, min(rows, keep) + 1):
        if keep % h == 0 and keep // h <= cols:
            distortion = abs(math.log(h / (keep // h)) - target)
            if best is None or distortion < best[0] - 1e-12:
                best = (distortion, h)
    if best is not None and best[0] <= math.log(RATIO_TOLERANCE) + 1e-12:
        h = best[1]
        return [keep // h] * h
    h = round(math.sqrt(keep * rows / cols))
    h = max(-(-keep // cols), min(h, rows, keep))
    q, r = divmod(keep, h)
    return [q + ((i + 1) * r // h - i * r // h) for i in range(h)]


def _bounds(length: int, parts: int) -> list[int]:
    return [i * length // parts for i in range(parts + 1)]


def pool_cells(grid: tuple[int, int], keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cell of each token (N,), centre token of each cell (keep,)) for the layout of :func:`pool_layout`."""
    rows, cols = grid
    layout = pool_layout(grid, keep)
    cell = torch.empty(rows, cols, dtype=torch.long)
    centre = torch.empty(keep, dtype=torch.long)
    row_bounds = _bounds(rows, len(layout))
    index = 0
    for band, width in enumerate(layout):
        r0, r1 = row_bounds[band], row_bounds[band + 1]
        col_bounds = _bounds(cols, width)
        for j in range(width):
            c0, c1 = col_bounds[j], col_bounds[j + 1]
            cell[r0:r1, c0:c1] = index
            centre[index] = (r0 + r1 - 1) // 2 * cols + (c0 + c1 - 1) // 2
            index += 1
    return cell.flatten(), centre


@register
@dataclass(frozen=True)
class Pool(Method):
    """2-D average pooling of the visual token grid to exactly ``keep`` tokens (a spatial-merging baseline).

    Needs ``inputs.grid``; the output layout rule (regular grid when K factors with a similar aspect, otherwise
    evenly sized horizontal bands) is documented in the module docstring.
    """

    name: ClassVar[str] = "pool"
    category: ClassVar[Category] = "merging"
    paper: ClassVar[str] = "spatial average pooling baseline (no paper; a standard control for token reduction)"
    rank: ClassVar[int] = 15
    cost_model: ClassVar[str | None] = "pool"
    requires: ClassVar[frozenset[Trait]] = frozenset({"single_grid"})  # not LLaVA-NeXT (two views)

    def reduce(self, inputs: MethodInputs, keep: int) -> MethodResult:
        if inputs.grid is None:
            raise MethodError("pool needs the visual tokens to form one raster grid, and these do not")
        rows, cols = inputs.grid
        n = inputs.num_tokens
        if rows * cols != n:
            raise MethodError(f"pool: grid {rows}x{cols} does not hold the N = {n} tokens")
        features = inputs.features
        cell, centre = pool_cells((rows, cols), keep)
        cell, centre = cell.to(features.device), centre.to(features.device)
        x = features.to(compute_dtype(features.dtype))
        sums = x.new_zeros(keep, x.shape[1]).index_add_(0, cell, x)
        counts = torch.bincount(cell, minlength=keep).to(x.dtype)
        tokens = (sums / counts[:, None]).to(features.dtype)
        return MethodResult(tokens, centre, None, cell, info={"layout": pool_layout((rows, cols), keep)})
