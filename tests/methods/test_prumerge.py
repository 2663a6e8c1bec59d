"""PruMerge / PruMerge+: IQR ratio, spatial fill, a hand-checkable merge, the registered methods, golden files."""

from __future__ import annotations

import pytest
import torch

from care_core.errors import MethodError
from care_core.methods import build_method
from care_core.methods.prumerge import (
    PruMergePlus,
    cls_attention_from_qk,
    official_grid,
    outlier_ratio,
    prumerge_reduce,
    spread_fill,
)

from .conftest import GOLDEN_FILES, assert_golden_passes, make_inputs


def test_outlier_ratio() -> None:
    # Q1 = Q3 = 0 -> upper bound 0: only the single 10 is an outlier
    assert outlier_ratio(torch.tensor([0.0] * 7 + [10.0])) == 1 / 8
    assert outlier_ratio(torch.arange(8.0)) == 0.0


def test_grids() -> None:
    assert spread_fill(torch.tensor([0, 5]), 10, 4).tolist() == [1, 3, 6, 8]
    assert spread_fill(torch.tensor([0, 5]), 10, 0).numel() == 0
    grid = official_grid(torch.tensor([3, 4]), 49 / 576, 576)  # step int(int(576 / 49) / 3) = 3
    assert grid[:3].tolist() == [0, 6, 9] and grid.numel() == 191
    with pytest.raises(MethodError):
        official_grid(torch.tensor([0]), 0.0, 576)


def test_hand_case_merge() -> None:
    # N = 5 <= 33 patches: every other patch is among the 32 nearest, so row i = x_i + sum_{j != i} a_j x_j
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    x = torch.randn(5, 4, generator=g)
    out = prumerge_reduce(x, q, k, plus=False, keep=3)
    a = cls_attention_from_qk(q, k, 4)
    assert torch.allclose(a, torch.softmax(q[0] @ k.t() / 2, dim=0)[1:])
    kept = a.topk(2).indices
    assert out.kept.tolist() == kept.tolist()
    total = (a[:, None] * x).sum(0)
    for row, i in enumerate(kept.tolist()):
        assert torch.allclose(out.tokens[row], x[i] + total - a[i] * x[i], atol=1e-6)
    pruned = [j for j in range(5) if j not in kept.tolist()]
    assert torch.allclose(out.tokens[2], (a[pruned, None] * x[pruned]).sum(0), atol=1e-6)


def test_fixed_budget_methods() -> None:
    inputs = make_inputs(seed=7)
    qk = inputs.probes["last_layer_qk"]
    a = cls_attention_from_qk(qk[0], qk[1], inputs.features.shape[1])
    plain = build_method("prumerge")(inputs, 16)
    assert plain.num_tokens == 16 and plain.token_index[-1] == -1
    assert plain.token_index[:-1].tolist() == a.topk(15).indices.tolist()  # descending attention
    plus = build_method("prumerge+")(inputs, 16)
    assert plus.num_tokens == 16 and plus.token_index[:-1].unique().numel() == 15
    n_top = min(int(inputs.num_tokens * plus.info["outlier_ratio"]), 15)
    assert plus.token_index[:n_top].tolist() == a.topk(n_top).indices.tolist()
    pruned = plus.assignment == 15
    assert pruned.sum() == inputs.num_tokens - 15  # every pruned patch goes to the summary row
    assert torch.equal(build_method("prumerge+", plus=False)(inputs, 16).tokens, plain.tokens)


def test_adaptive_mode_count() -> None:
    inputs = make_inputs(seed=8)
    method = PruMergePlus(plus=False, adaptive=True)
    result = method(inputs, 10)
    assert result.num_tokens == int(inputs.num_tokens * result.info["outlier_ratio"]) + 1
    with pytest.raises(MethodError):
        method.output_count(inputs.num_tokens, 10)


@pytest.mark.parametrize("name", GOLDEN_FILES["prumerge"])
def test_golden(name: str) -> None:
    assert_golden_passes(name)
