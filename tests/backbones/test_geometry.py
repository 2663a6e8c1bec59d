"""Grid token geometry (care_core/backbones/geometry.py): the adapter's memo of it, and what it returns."""

from __future__ import annotations

from typing import Any

import torch

from care_core._memo import Memos
from care_core.backbones.geometry import GEOMETRY_CACHE_SIZE, CropGeometry, grid_image_tokens

# a 280 x 280 image seen whole as a 2 x 2 grid of 140 px cells
GEOM = CropGeometry(280, 280, 280, 280, 0, 0, 280, 280)


def _tokens(cache: Memos | None, geom: CropGeometry = GEOM) -> Any:
    return grid_image_tokens(torch.zeros(4, 3), geom, 2, 2, 140, {}, cache=cache)


def test_grid_tokens_have_hand_computed_boxes_and_positions() -> None:
    tokens = _tokens(None)
    # raster order, [x0, y0, x1, y1] in original pixels; positions are (row, col) centres on [0, 1]
    boxes = [[0, 0, 140, 140], [140, 0, 280, 140], [0, 140, 140, 280], [140, 140, 280, 280]]
    assert tokens.boxes.tolist() == boxes
    assert tokens.positions.tolist() == [[0.25, 0.25], [0.25, 0.75], [0.75, 0.25], [0.75, 0.75]]
    assert tokens.boxes.dtype == torch.float32 and tokens.positions.dtype == torch.float32
    assert tokens.grid == (2, 2) and tokens.image_size == (280, 280) and tokens.seen_box == (0, 0, 280, 280)


def test_memoised_geometry_equals_the_fresh_one_and_is_each_image_own() -> None:
    cache = Memos(GEOMETRY_CACHE_SIZE)
    fresh, first, second = _tokens(None), _tokens(cache), _tokens(cache)
    assert cache.sizes() == {"grid": 1}
    for one in (first, second):
        assert torch.equal(one.boxes, fresh.boxes) and torch.equal(one.positions, fresh.positions)
        assert one.seen_box == fresh.seen_box
    first.boxes += 1  # a caller writing into its image's tensors must not change the next image's
    first.positions += 1
    third = _tokens(cache)
    assert torch.equal(third.boxes, fresh.boxes) and torch.equal(third.positions, fresh.positions)


def test_geometry_memo_stays_bounded() -> None:
    cache = Memos(GEOMETRY_CACHE_SIZE)
    for size in range(GEOMETRY_CACHE_SIZE + 5):
        _tokens(cache, CropGeometry(280 + size, 280, 280, 280, 0, 0, 280, 280))
    assert cache.sizes() == {"grid": GEOMETRY_CACHE_SIZE}
