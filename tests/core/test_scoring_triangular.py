"""The jvp engine's second layer through W2's triangular factor (W2 = QR, ||W2 t|| = ||R t||), the GELU slope
shortcut and the sync-free residual set: same results as the dense path, checked against independent values."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from care_core import CaReConfig, care_reduce
from care_core._chunks import block_bounds, upper_macs
from care_core.calibration import residual_indices
from care_core.kernels import dispatch
from care_core.scoring import (
    Scorer,
    _activation_slope,
    _upper_products,
    perturbation_responses,
    triangular_factor,
    unit_directions,
)


def _mlp(d_v: int, d_h: int, d_out: int, seed: int, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_v, d_h), nn.GELU(), nn.Linear(d_h, d_out)).to(dtype).eval()


def _inputs(n: int, d: int, seed: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype), torch.rand(n, 2, generator=g).to(dtype)


def test_block_bounds_and_their_cost_by_hand() -> None:
    assert block_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert block_bounds(3, 4) == [(0, 1), (1, 2), (2, 3)]  # never an empty block
    # rows of t R^T: block b needs the hidden units from its first column on: 8·2 + 6·2 + 4·2 + 2·2
    assert upper_macs(8, 8, 4) == 40 == 8 * 8 * 5 // 8  # (B + 1) / 2B of dense at B = 4
    assert upper_macs(4096, 4096, 16) == 4096 * 4096 * 17 // 32  # the fused kernel's 256-column tiles
    assert upper_macs(5, 5, 1) == 25  # one block: dense
    # a trapezoid R (4, 8): blocks of output rows [0, 2), [2, 4) read hidden units 0.. and 2..: 8·2 + 6·2
    assert upper_macs(4, 8, 2) == 28


def test_factor_is_upper_triangular_and_keeps_every_norm() -> None:
    g = torch.Generator().manual_seed(0)
    w2 = torch.randn(40, 24, generator=g, dtype=torch.float64)  # d_out >= d_h
    r = triangular_factor(w2)
    assert r is not None and r.shape == (24, 24) and torch.equal(r, r.triu())
    t = torch.randn(30, 24, generator=g, dtype=torch.float64)
    torch.testing.assert_close((t @ r.T).norm(dim=1), (t @ w2.T).norm(dim=1), rtol=1e-12, atol=0)
    torch.testing.assert_close(_upper_products(t, r), t @ r.T, rtol=1e-12, atol=1e-12)  # the blocks skip zeros only


@pytest.mark.parametrize(("d_h", "d_out"), [(32, 32), (32, 48), (32, 20)])  # the last: a trapezoidal R (20, 32)
def test_triangular_scorer_gives_the_dense_responses(d_h: int, d_out: int) -> None:
    mlp = _mlp(12, d_h, d_out, seed=1)
    features, _ = _inputs(70, 12, seed=2)
    u = unit_directions(9, 12, 3, dtype=torch.float64)
    dense = perturbation_responses(features, mlp, u, h=1e-3)
    scorer = Scorer(mlp, second_layer="triangular")
    torch.testing.assert_close(scorer.responses(features, u, h=1e-3), dense, rtol=1e-11, atol=0)
    mlp32 = _mlp(12, d_h, d_out, seed=1, dtype=torch.float32)
    got32 = Scorer(mlp32, second_layer="triangular").responses(features.float(), u.float(), h=1e-3)
    torch.testing.assert_close(got32.double(), dense, rtol=2e-5, atol=0)


def test_auto_scorer_is_dense_off_cuda_and_bit_identical() -> None:
    mlp = _mlp(12, 32, 32, seed=4, dtype=torch.float32)
    features, _ = _inputs(50, 12, seed=5, dtype=torch.float32)
    u = unit_directions(6, 12, 0)
    scorer = Scorer(mlp)
    assert scorer.second_layer == "auto" and scorer.factor(torch.float32, "cpu") is None
    assert torch.equal(scorer.responses(features, u, h=1e-3), perturbation_responses(features, mlp, u, h=1e-3))
    assert Scorer(mlp, second_layer="dense").factor(torch.float32, "cuda") is None
    assert Scorer(nn.Linear(12, 4), second_layer="triangular").factor(torch.float32, "cpu") is None  # no MLP
    with pytest.raises(ValueError, match="second_layer"):
        Scorer(mlp, second_layer="qr")


def test_care_reduce_through_the_factor_keeps_anchors_signals_and_tokens() -> None:
    mlp = _mlp(16, 48, 48, seed=6)
    features, positions = _inputs(120, 16, seed=7)
    cfg = CaReConfig(m=16)
    dense = care_reduce(features, mlp, positions, keep=20, config=cfg)
    tri = care_reduce(features, mlp, positions, keep=20, config=cfg, scorer=Scorer(mlp, second_layer="triangular"))
    assert torch.equal(tri.indices, dense.indices) and torch.equal(tri.signals, dense.signals)
    torch.testing.assert_close(tri.tokens, dense.tokens, rtol=0, atol=1e-9)
    torch.testing.assert_close(tri.psi_bar, dense.psi_bar, rtol=0, atol=1e-9)


def test_fused_kernel_gets_the_factor_for_tf32_in_auto_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the factor the fused kernel is the tf32 default (dense tf32 stays on cuBLAS): dispatch only."""
    mlp = _mlp(16, 256, 256, seed=8, dtype=torch.float32)  # R (256, 256): shapes the kernel tiles
    features, _ = _inputs(90, 16, seed=9, dtype=torch.float32)
    u = unit_directions(8, 16, 0)
    calls: list[dict[str, Any]] = []

    def fake(slope: torch.Tensor, lifted: torch.Tensor, w2: torch.Tensor, **kw: Any) -> torch.Tensor:
        calls.append({"shape": tuple(w2.shape), "triu": bool(torch.equal(w2, w2.triu())), **kw})
        return torch.zeros(lifted.shape[0], slope.shape[0])

    monkeypatch.setattr(dispatch, "why_not_fused", lambda device: None)
    monkeypatch.setattr(dispatch, "jvp_norms", fake)
    factor = triangular_factor(mlp[2].weight)
    assert factor is not None
    out = perturbation_responses(features, mlp, u, h=1e-3, matmul="tf32", factor=factor)
    assert torch.equal(out, torch.zeros(8, 90))
    assert calls == [{"shape": (256, 256), "triu": True, "bf16": False, "rounded": True, "upper": True}]
    perturbation_responses(features, mlp, u, h=1e-3, matmul="tf32", factor=factor, kernel="torch")
    assert len(calls) == 1  # kernel="torch": the PyTorch column blocks


@pytest.mark.parametrize("act", [nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU(), nn.Tanh()])
def test_activation_slope_equals_forward_mode_ad(act: nn.Module) -> None:
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    expected = torch.func.jvp(act, (x,), (torch.ones_like(x),))[1]
    assert torch.equal(_activation_slope(act, x), expected)
    if isinstance(act, nn.GELU) and act.approximate == "none":  # and against d/dx x Φ(x) = Φ(x) + x φ(x)
        phi = torch.exp(-(x**2) / 2) / (2 * torch.pi) ** 0.5
        torch.testing.assert_close(_activation_slope(act, x), 0.5 * (1 + torch.erf(x / 2**0.5)) + x * phi)


def test_sync_free_residuals_equal_nonzero() -> None:
    g = torch.Generator().manual_seed(10)
    for n, k in [(1, 1), (10, 3), (200, 64), (50, 50)]:
        anchors = torch.randperm(n, generator=g)[:k]
        mask = torch.zeros(n, dtype=torch.bool)
        mask[anchors] = True
        expected = torch.tensor([i for i in range(n) if i not in set(anchors.tolist())], dtype=torch.long)
        assert torch.equal(residual_indices(mask, k, sync_free=True), expected)
        assert torch.equal(residual_indices(mask, k, sync_free=False), expected)


def test_the_factor_follows_the_weights() -> None:
    mlp = _mlp(12, 24, 32, seed=11)
    scorer = Scorer(mlp, second_layer="triangular")
    r = scorer.factor(torch.float64, "cpu")
    assert r is not None and scorer.factor(torch.float64, "cpu") is r  # made once
    with torch.no_grad():
        mlp[2].weight.mul_(3)  # in place: the version counter moves, the factor is made again
    r3 = scorer.factor(torch.float64, "cpu")
    assert r3 is not None and r3 is not r
    t = torch.randn(10, 24, generator=torch.Generator().manual_seed(12), dtype=torch.float64)
    torch.testing.assert_close((t @ r3.T).norm(dim=1), 3 * (t @ r.T).norm(dim=1), rtol=1e-12, atol=0)
