"""The jvp engine's norm-then-linear path (Eq. 1, ||W J_norm(v) u|| for M(v) = W norm(v) + b, Gemma 3's projector):
the tangent against forward-mode AD, which projector takes the path, the float32 tangent where the response is
near zero, and the responses and care_reduce's result against the generic torch.func.jvp path on the demo."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from care_core import CaReConfig, care_reduce, norm_first, scoring
from care_core.backbones import load_backbone
from care_core.backbones.gemma3.adapter import Gemma3TokenProjector
from care_core.norm_first import NormLinear, first_layer, first_layer_tangents
from care_core.scoring import _as_mlp, _as_norm_first, _as_norm_linear, joint_responses, responses_jvp, unit_directions
from tests.core._problems import scene_image
from tests.core._scoring_paths import fast_only as _fast_only
from tests.core._scoring_paths import generic as _generic
from tests.core._scoring_paths import relative as _relative

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("norm_linear_home")


@pytest.fixture(scope="module")
def gemma(home: Path) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The tiny-gemma3-random demo's projector, and one image's 256 pooled features and positions."""
    adapter: Any = load_backbone("tiny-gemma3-random", home=home)
    tokens = adapter.encode_image(scene_image((320, 240)))
    return adapter.projector, tokens.features.cpu(), tokens.positions.cpu()


# ------------------------------------------------------------------------------ the exact tangent
def _norm_linear(kind: str, d_in: int, d_out: int, eps: float, bias: bool, seed: int) -> tuple[NormLinear, Any]:
    """A random norm-then-linear projector in float64, as a description and as a forward written here with
    F.layer_norm / F.rms_norm and F.linear (the route forward-mode AD differentiates)."""
    g = torch.Generator().manual_seed(seed)
    gamma = 1 + 0.5 * torch.randn(d_in, generator=g, dtype=torch.float64)
    beta = torch.randn(d_in, generator=g, dtype=torch.float64) if kind == "layer" else None
    weight = torch.randn(d_out, d_in, generator=g, dtype=torch.float64) / d_in**0.5
    b = torch.randn(d_out, generator=g, dtype=torch.float64) if bias else None
    desc = NormLinear(kind, gamma, beta, eps, weight, b)  # type: ignore[arg-type]

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x, (d_in,), gamma, beta, eps) if kind == "layer" else F.rms_norm(x, (d_in,), gamma, eps)
        return F.linear(y, weight, b)

    return desc, forward


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("eps", [1e-6, 1e-1])
@pytest.mark.parametrize("bias", [False, True])
def test_norm_linear_tangent_equals_forward_mode_ad(kind: str, eps: float, bias: bool) -> None:
    desc, forward = _norm_linear(kind, 16, 24, eps, bias, seed=int(bias))
    g = torch.Generator().manual_seed(7)
    x = 0.3 * torch.randn(20, 16, generator=g, dtype=torch.float64) + 0.2  # small rows: eps matters
    u = unit_directions(6, 16, seed=3, dtype=torch.float64)
    want = torch.stack([torch.func.jvp(forward, (x,), (d.expand_as(x),))[1] for d in u])  # (m, N, d_out)
    with torch.no_grad():
        prepared = first_layer(desc, x, u)
        got = first_layer_tangents(prepared, 0, 6).transpose(0, 1)  # (m, N, d_out)
        responses = scoring._jvp_norm_linear(x, desc, u, None)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))
    torch.testing.assert_close(prepared.pre, forward(x), rtol=1e-12, atol=1e-12)  # the forward, shift and bias too
    torch.testing.assert_close(responses, want.norm(dim=-1), rtol=1e-12, atol=0)


def test_plain_sequential_takes_the_path_and_equals_forward_mode_ad(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    projector = nn.Sequential(nn.LayerNorm(12), nn.Linear(12, 20)).double()
    with torch.no_grad():
        projector[0].weight.uniform_(0.5, 1.5)
        projector[0].bias.normal_()
    x = torch.randn(30, 12, dtype=torch.float64)
    u = unit_directions(5, 12, seed=1, dtype=torch.float64)
    want = torch.stack([torch.func.jvp(projector, (x,), (d.expand_as(x),))[1].norm(dim=-1) for d in u])
    _fast_only(monkeypatch)
    with torch.no_grad():
        got = responses_jvp(x, projector, u, "float32")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------------ recognition
def test_recogniser_reads_norm_then_linear_sequentials_and_nothing_else() -> None:
    layer = _as_norm_linear(nn.Sequential(nn.LayerNorm(12, eps=1e-3), nn.Linear(12, 8)))
    assert layer is not None and (layer.kind, layer.eps, layer.width, layer.out_features) == ("layer", 1e-3, 12, 8)
    rms = _as_norm_linear(nn.Sequential(nn.RMSNorm(12, elementwise_affine=False), nn.Linear(12, 8, bias=False)))
    assert rms is not None and (rms.kind, rms.gamma, rms.beta, rms.bias) == ("rms", None, None, None)

    class ScaledNorm(nn.RMSNorm):  # a subclass may compute anything: not read as an RMSNorm
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    assert _as_norm_linear(nn.Sequential(ScaledNorm(12), nn.Linear(12, 8))) is None
    assert _as_norm_linear(nn.Sequential(nn.LayerNorm(10), nn.Linear(12, 8))) is None  # widths differ
    assert _as_norm_linear(nn.Sequential(nn.Identity(), nn.Linear(12, 8))) is None
    assert _as_norm_linear(nn.Sequential(nn.Linear(12, 8), nn.LayerNorm(8))) is None  # linear then norm
    mlp = nn.Sequential(nn.LayerNorm(12), nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 8))
    assert _as_norm_linear(mlp) is None and _as_norm_first(mlp) is not None
    assert _as_norm_linear(lambda v: v) is None
    wrong = NormLinear("rms", torch.ones(5), None, 1e-6, torch.zeros(8, 12))  # gamma of 5 for 12 features
    assert not wrong.consistent() and NormLinear("rms", torch.ones(12), None, 1e-6, torch.zeros(8, 12)).consistent()


def test_gemma3_projector_describes_itself_with_its_own_weight(gemma: Any) -> None:
    projector = gemma[0]
    desc = _as_norm_linear(projector)
    assert desc is not None and _as_mlp(projector) is None and _as_norm_first(projector) is None
    assert (desc.kind, desc.blocks, desc.upcast, desc.beta, desc.bias) == ("rms", 1, True, None, None)
    assert desc.weight.data_ptr() == projector.weight.data_ptr() and desc.weight.shape == projector.weight.T.shape
    torch.testing.assert_close(desc.gamma, 1 + projector.norm.weight, rtol=0, atol=0)
    assert desc.eps == projector.norm.eps

    class Doubled(Gemma3TokenProjector):
        def forward(self, features: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(features)

    doubled = copy.copy(projector)
    doubled.__class__ = Doubled
    assert norm_first.describe_linear(doubled) is None  # its own forward: the generic path


# ------------------------------------------------------------------------------ float32 near a zero response
def test_float32_responses_stay_accurate_where_the_tangent_nearly_vanishes() -> None:
    """Along x_i itself RMSNorm's derivative is (g / s) x_i eps / (mean x_i² + eps): the response is ~1e-6 of the
    others. The formed tangent keeps float32's error at the rounding of every response (observed: 1.5e-7 of the
    others); the Gram expansion ||a||² - 2c<a, p> + c²||p||², whose terms nearly cancel there, was off by 0.16 of
    them (measured on this problem)."""
    desc, _ = _norm_linear("rms", 64, 96, 1e-6, False, seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(10, 64, generator=g, dtype=torch.float64)
    u = torch.cat([x[:1] / x[0].norm(), unit_directions(3, 64, seed=2, dtype=torch.float64)])
    single = NormLinear("rms", desc.gamma.float(), None, desc.eps, desc.weight.float())  # type: ignore[union-attr]
    with torch.no_grad():
        exact = scoring._jvp_norm_linear(x, desc, u, None)
        got = scoring._jvp_norm_linear(x.float(), single, u.float(), None).double()
    typical = float(exact[1:].max())
    assert float(exact[0, 0]) < 1e-5 * typical  # the direction along x_0 barely moves token 0
    assert float((got - exact).abs().max()) < 1e-6 * typical


# ------------------------------------------------------------------------ the demo: fast against generic
def test_fast_responses_equal_the_generic_path_on_the_gemma3_demo(gemma: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    projector, features, _ = gemma
    double = copy.deepcopy(projector).double()
    v = features.double()
    u = unit_directions(12, v.shape[1], seed=5, dtype=torch.float64)
    with torch.no_grad():
        generic = responses_jvp(v, _generic(double), u, "float32")
        generic_single = responses_jvp(v.float(), _generic(projector), u.float(), "float32")
        _fast_only(monkeypatch)
        fast = responses_jvp(v, double, u, "float32")
        single = responses_jvp(v.float(), projector, u.float(), "float32")
        low = responses_jvp(v.float(), projector, u.float(), "bf16")
    assert _relative(fast, generic) < 1e-10  # observed: ~1e-16
    # float32: sums of d_in = 64 products and a norm over d_out = 64, each step rounding at 6e-8 relative, so a
    # bound of about 1e-6 with a margin; observed 1.4e-7 of the largest response (the generic path's own: 1.6e-7)
    assert _relative(single.double(), generic) < 2e-6 and _relative(generic_single.double(), generic) < 2e-6
    assert (
        low.dtype == torch.float32 and 0 < _relative(low.double(), generic) < 2e-2
    )  # bf16 keeps 8 bits: observed 3e-3


def test_care_reduce_through_the_norm_linear_path_keeps_anchors_signals_and_tokens(
    gemma: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    projector, features, positions = gemma
    double = copy.deepcopy(projector).double()
    v, p = features.double(), positions.double()
    config = CaReConfig(m=16)
    generic = care_reduce(v, _generic(double), p, keep=64, config=config)
    _fast_only(monkeypatch)
    fast = care_reduce(v, double, p, keep=64, config=config)
    assert torch.equal(fast.indices, generic.indices) and torch.equal(fast.anchor_order, generic.anchor_order)
    assert torch.equal(fast.signals, generic.signals) and fast.signals.numel() > 0
    torch.testing.assert_close(fast.tokens, generic.tokens, rtol=1e-9, atol=1e-9)


def test_joint_responses_score_each_image_alone_on_the_norm_linear_path(
    gemma: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    projector, features, _ = gemma
    u = unit_directions(4, features.shape[1], seed=1)
    rows: list[int] = []
    real = scoring.perturbation_responses
    monkeypatch.setattr(
        scoring, "perturbation_responses", lambda v, *a, **kw: rows.append(v.shape[0]) or real(v, *a, **kw)
    )
    out = joint_responses([features, features[:100]], projector, u, h=1e-3, engine="jvp")
    assert rows == [256, 100] and [c.shape for c in out] == [(4, 256), (4, 100)]
