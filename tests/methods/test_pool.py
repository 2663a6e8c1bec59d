"""Pool: exact-K layout rule, hand-checked cells, centres and means."""

from __future__ import annotations

import pytest
import torch

from care_core.errors import MethodError
from care_core.methods import MethodInputs, build_method
from care_core.methods.pool import pool_cells, pool_layout


def _grid_inputs(rows: int, cols: int, grid: tuple[int, int] | None = None) -> MethodInputs:
    """Token p has features (p, 1); `grid` overrides the (rows, cols) handed to the method."""
    n = rows * cols
    features = torch.stack([torch.arange(n, dtype=torch.float32), torch.ones(n)], dim=1)
    return MethodInputs(features, lambda v: v, torch.zeros(n, 2), grid=grid or (rows, cols))


def test_layout_rule() -> None:
    assert pool_layout((24, 24), 64) == [8] * 8
    assert pool_layout((24, 24), 192) == [16] * 12  # 12 x 16: aspect within 1.5 of square
    assert pool_layout((24, 24), 576) == [24] * 24
    banded = pool_layout((24, 24), 128)  # 8 x 16 is 2x off square: 11 bands of 11 or 12
    assert len(banded) == 11 and sum(banded) == 128 and set(banded) == {11, 12}
    assert pool_layout((4, 4), 3) == [1, 2]
    assert pool_layout((3, 5), 1) == [1]
    with pytest.raises(MethodError):
        pool_layout((4, 4), 17)


def test_two_by_two_blocks_by_hand() -> None:
    result = build_method("pool")(_grid_inputs(4, 4), 4)
    # cells: rows {0,1} x cols {0,1} = tokens 0,1,4,5 (mean 2.5), then 2,3,6,7 (4.5), 8,9,12,13 (10.5), 10,11,14,15
    assert result.tokens[:, 0].tolist() == [2.5, 4.5, 10.5, 12.5]
    assert result.tokens[:, 1].tolist() == [1.0] * 4
    assert result.token_index.tolist() == [0, 2, 8, 10]  # nearest the centre, lower index on ties
    assert result.assignment.view(4, 4).tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]]


def test_banded_layout_by_hand() -> None:
    result = build_method("pool")(_grid_inputs(4, 4), 3)
    assert result.assignment.view(4, 4).tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 2, 2], [1, 1, 2, 2]]
    assert result.tokens[:, 0].tolist() == [3.5, 10.5, 12.5]
    assert result.token_index.tolist() == [1, 8, 10]


@pytest.mark.parametrize("grid", [(5, 7), (3, 12), (24, 24)])
def test_every_budget_gives_exactly_k_cells_partitioning_the_grid(grid: tuple[int, int]) -> None:
    rows, cols = grid
    for keep in range(1, rows * cols + 1):
        cell, centre = pool_cells(grid, keep)
        assert centre.numel() == keep
        assert torch.equal(torch.bincount(cell, minlength=keep) > 0, torch.ones(keep, dtype=torch.bool))
        assert torch.equal(centre, centre.unique())  # ascending, distinct
        assert torch.equal(cell[centre], torch.arange(keep))  # every centre lies in its own cell


def test_needs_a_matching_grid() -> None:
    with pytest.raises(MethodError, match="grid"):
        build_method("pool")(MethodInputs(torch.zeros(16, 2), lambda v: v, torch.zeros(16, 2)), 4)
    with pytest.raises(MethodError, match="grid"):
        build_method("pool")(_grid_inputs(4, 4, grid=(3, 4)), 4)
