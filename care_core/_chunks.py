"""How the scoring engines split the m directions into chunks (torch-free: ``care flops`` counts with it too)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal, get_args

# Elements of the largest intermediate per chunk (~256 MB in float32).
CHUNK_ELEMENTS = 1 << 26


def chunk_size(m: int, per_direction: int) -> int:
    """Directions per chunk, where one direction's largest intermediate has ``per_direction`` elements."""
    return max(1, min(m, CHUNK_ELEMENTS // max(1, per_direction)))


def two_pass_chunk(m: int, n: int, dim: int, out_dim: int) -> int:
    """Directions per chunk where each direction holds two (N, max(dim, out_dim)) intermediates: the fd engine's
    +h / -h points, the generic jvp path's primal and tangent (any projector that is not Linear-act-Linear)."""
    return chunk_size(m, n * max(dim, out_dim) * 2)


def two_pass_rows(dim: int, out_dim: int) -> int:
    """Token rows one pass may hold so that a single direction's two (rows, max(dim, out_dim)) intermediates stay
    within :data:`CHUNK_ELEMENTS`: the most rows :func:`two_pass_chunk` keeps within the bound."""
    return max(1, CHUNK_ELEMENTS // (2 * max(dim, out_dim)))


def row_groups(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive images (by index) packed into groups of at most `limit` rows in all, for joint passes over their
    rows; an image larger than `limit` goes alone (its own pass chunks as one image's does)."""
    groups: list[list[int]] = []
    rows = 0
    for i, n in enumerate(sizes):
        if groups and rows + n <= limit:
            groups[-1].append(i)
            rows += n
        else:
            groups.append([i])
            rows = n
    return groups


# Column blocks of the block-triangular second layer (care_core.scoring.triangular_factor): block b of the
# output needs only the hidden units from the block's first column on, so B blocks cost (B + 1) / 2B of a
# dense layer's multiply-adds (5/8 at B = 4; a trapezoid, d_out < d_h, skips less). More blocks skip more of
# the triangle but give narrower matmuls (B = 8 and 16 were slower than 4 on an H200 at N = 2880).
TRIANGULAR_BLOCKS = 4
#: How the jvp engine applies a Linear-act-Linear projector's second layer: "dense" (W2 itself) or "triangular"
#: (through W2's triangular factor R in column blocks); care_core.scoring.Scorer adds "auto" (triangular on CUDA).
SecondLayer = Literal["dense", "triangular"]
SECOND_LAYERS: tuple[SecondLayer, ...] = get_args(SecondLayer)


def block_bounds(width: int, blocks: int = TRIANGULAR_BLOCKS) -> list[tuple[int, int]]:
    """[lo, hi) column ranges of `blocks` near-equal blocks of `width` (fewer when width < blocks)."""
    blocks = max(1, min(blocks, width))
    edges = [width * b // blocks for b in range(blocks + 1)]
    return [(lo, hi) for lo, hi in itertools.pairwise(edges) if hi > lo]


def upper_macs(rows: int, cols: int, blocks: int = TRIANGULAR_BLOCKS) -> int:
    """Multiply-adds per row of t R^T through the blocks, R (rows, cols) upper triangular (rows = cols) or
    trapezoidal (rows < cols): output block [lo, hi) reads the hidden units lo.. only."""
    return sum((cols - lo) * (hi - lo) for lo, hi in block_bounds(rows, blocks))
