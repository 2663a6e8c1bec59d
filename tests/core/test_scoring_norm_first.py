"""The jvp engine's norm-first path (Eq. 1, ||J_M(v) u|| through a LayerNorm or RMSNorm, per patch or per row, then
Linear-act-Linear): the norm's derivative against forward-mode AD, which projector takes which path, the responses
and care_reduce's result against the generic torch.func.jvp path on every family's demo projector, and the second
layer's trapezoidal factor (d_out < d_h)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLPatchMerger
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchMerger

from care_core import CaReConfig, care_reduce, norm_first, scoring
from care_core.backbones import load_backbone
from care_core.backbones.qwen2_5_vl.adapter import QwenMergerProjector
from care_core.backbones.qwen3_vl.adapter import Qwen3VLMergerProjector
from care_core.kernels import dispatch
from care_core.norm_first import NormFirstMLP, first_layer, first_layer_tangents, from_modules
from care_core.precision import matmul_precision
from care_core.scoring import (
    Scorer,
    _as_mlp,
    _as_norm_first,
    _fused_jvp_applies,
    _fused_norm_first_applies,
    _jvp_norm_mlp,
    _upper_products,
    responses_jvp,
    triangular_factor,
    unit_directions,
)
from tests._triton_interpreter import run_interpreted
from tests.core._problems import scene_image
from tests.core._scoring_paths import fast_only as _fast_only
from tests.core._scoring_paths import generic as _generic
from tests.core._scoring_paths import relative as _relative

MLP_DEMOS = ("tiny-llava", "tiny-llava-next", "tiny-llava-onevision")
# demo -> (norm kind, blocks normalised apart, statistics upcast, an image size that gives a small N)
NORM_FIRST_DEMOS = {
    "tiny-qwen2.5-vl": ("rms", 4, True, (224, 168)),
    "tiny-qwen3-vl": ("layer", 4, False, (256, 192)),
    "tiny-qwen3.5-random": ("layer", 4, False, (256, 192)),  # Qwen3-VL's merger (no DeepStack)
    "tiny-internvl3": ("layer", 1, False, (448, 448)),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("norm_first_home")


@pytest.fixture(scope="module")
def demo_tokens(home: Path) -> dict[str, tuple[nn.Module, torch.Tensor, torch.Tensor]]:
    """Per norm-first demo: its projector, and one image's features and positions (the demo's real geometry)."""
    out = {}
    for name, (*_, size) in NORM_FIRST_DEMOS.items():
        adapter: Any = load_backbone(name, home=home)
        tokens = adapter.encode_image(scene_image(size))
        out[name] = (adapter.projector, tokens.features.cpu(), tokens.positions.cpu())
    return out


# ------------------------------------------------------------------------------ the norm's exact derivative
def _blockwise(kind: str, p: int, blocks: int, eps: float, seed: int) -> tuple[NormFirstMLP, Callable[..., Any]]:
    """A norm-first projector over `blocks` blocks of p, as a description and as a forward written here with
    F.layer_norm / F.rms_norm per block (the route forward-mode AD differentiates)."""
    g = torch.Generator().manual_seed(seed)
    gamma = 1 + 0.5 * torch.randn(p, generator=g, dtype=torch.float64)
    beta = torch.randn(p, generator=g, dtype=torch.float64) if kind == "layer" else None
    torch.manual_seed(seed)
    first, second = nn.Linear(blocks * p, 24).double(), nn.Linear(24, 10).double()
    desc = NormFirstMLP(kind, gamma, beta, eps, blocks, first, nn.GELU(), second)  # type: ignore[arg-type]

    def normed_first(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, p)
        y = F.layer_norm(rows, (p,), gamma, beta, eps) if kind == "layer" else F.rms_norm(rows, (p,), gamma, eps)
        return first(y.reshape(x.shape[0], -1))

    return desc, normed_first


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("blocks", [1, 3])
@pytest.mark.parametrize("eps", [1e-6, 1e-1])
def test_first_layer_tangent_through_the_norm_equals_forward_mode_ad(kind: str, blocks: int, eps: float) -> None:
    desc, normed_first = _blockwise(kind, 8, blocks, eps, seed=blocks)
    g = torch.Generator().manual_seed(7)
    x = 0.3 * torch.randn(20, 8 * blocks, generator=g, dtype=torch.float64) + 0.2  # small rows: eps matters
    u = unit_directions(6, 8 * blocks, seed=3, dtype=torch.float64)
    with torch.no_grad():
        prepared = first_layer(desc, x, u)
        got = first_layer_tangents(prepared, 0, 6)  # (N, m, d_h)
        want = torch.stack([torch.func.jvp(normed_first, (x,), (d.expand_as(x),))[1] for d in u], dim=1)
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13 * float(want.abs().max()))
        torch.testing.assert_close(prepared.pre, normed_first(x), rtol=1e-13, atol=1e-13)  # the forward too
        if eps == 1e-1:  # the same formula without eps is visibly off: eps is in it, not negligible here
            without = first_layer_tangents(first_layer(dataclasses.replace(desc, eps=0.0), x, u), 0, 6)
            assert _relative(without, want) > 1e-3


def test_rms_norm_without_eps_uses_the_dtypes_machine_epsilon() -> None:
    torch.manual_seed(0)
    projector = nn.Sequential(nn.RMSNorm(6), nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5)).double()  # eps=None
    x = 1e-8 * torch.randn(15, 6, dtype=torch.float64)  # mean(x²) ~ 1e-16: machine epsilon (2.2e-16) matters
    u = unit_directions(4, 6, seed=1, dtype=torch.float64)
    with torch.no_grad():
        want = responses_jvp(x, _generic(projector), u, "float32")
        assert _relative(responses_jvp(x, projector, u, "float32"), want) < 1e-12


# ------------------------------------------------------------------------------------------ recognition
def _mlp_after(norm: nn.Module, act: nn.Module | None = None) -> nn.Sequential:
    return nn.Sequential(norm, nn.Linear(12, 16), act if act is not None else nn.GELU(), nn.Linear(16, 8))


def test_recogniser_reads_plain_norm_first_sequentials_and_nothing_else() -> None:
    layer = _as_norm_first(_mlp_after(nn.LayerNorm(12, eps=1e-3)))
    assert layer is not None and (layer.kind, layer.blocks, layer.eps, layer.width) == ("layer", 1, 1e-3, 12)
    rms = _as_norm_first(_mlp_after(nn.RMSNorm(12, elementwise_affine=False)))
    assert rms is not None and (rms.kind, rms.gamma, rms.beta, rms.eps) == ("rms", None, None, None)

    class ScaledNorm(nn.LayerNorm):  # a subclass may compute anything: not read as a LayerNorm
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    assert _as_norm_first(_mlp_after(ScaledNorm(12))) is None
    assert _as_norm_first(_mlp_after(nn.LayerNorm(12), nn.Softmax(dim=-1))) is None  # not elementwise
    assert _as_norm_first(nn.Sequential(nn.LayerNorm((3, 4)), nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 8))) is None
    assert _as_norm_first(_mlp_after(nn.Identity())) is None
    assert from_modules(nn.LayerNorm(10), nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 8)) is None  # widths differ
    assert _as_norm_first(lambda v: v) is None and _as_mlp(_mlp_after(nn.LayerNorm(12))) is None


def test_a_qwen_merger_subclass_with_its_own_forward_takes_the_generic_path(demo_tokens: dict[str, Any]) -> None:
    projector = demo_tokens["tiny-qwen2.5-vl"][0]

    class Doubled(QwenMergerProjector):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    assert _as_norm_first(projector) is not None
    assert _as_norm_first(Doubled(projector.merger)) is None


class _ScaledLinear(nn.Module):
    """Twice a Linear: the widths of one (what the shape check reads), not its maths."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.inner, self.in_features, self.out_features = linear, linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.inner(x)


def test_a_qwen_merger_whose_layers_are_not_linear_takes_the_generic_path() -> None:
    merger25 = Qwen2_5_VLPatchMerger(dim=8, context_dim=4, spatial_merge_size=2)
    merger3 = Qwen3VLVisionPatchMerger(Qwen3VLVisionConfig(hidden_size=4, out_hidden_size=8, spatial_merge_size=2))
    projectors = (QwenMergerProjector(merger25), Qwen3VLMergerProjector(merger3))
    assert all(norm_first.describe(p) is not None for p in projectors)  # the model's own layers: the fast path
    merger25.mlp[0] = _ScaledLinear(merger25.mlp[0])
    merger3.linear_fc1 = _ScaledLinear(merger3.linear_fc1)
    for projector in projectors:
        assert norm_first.describe(projector) is None, type(projector).__name__
        assert projector(torch.randn(3, 16)).shape == (3, 8)  # the forward runs the replaced layer


def test_each_demo_projector_takes_its_path(home: Path, demo_tokens: dict[str, Any]) -> None:
    for name in MLP_DEMOS:  # Linear-GELU-Linear: the MLP path (and its fused kernel on CUDA), unchanged
        projector = load_backbone(name, home=home).projector
        assert _as_mlp(projector) is not None and _as_norm_first(projector) is None, name
    for name, (kind, blocks, upcast, _) in NORM_FIRST_DEMOS.items():
        projector = demo_tokens[name][0]
        desc = _as_norm_first(projector)
        assert _as_mlp(projector) is None and desc is not None, name
        assert (desc.kind, desc.blocks, desc.upcast) == (kind, blocks, upcast), name
        params = dict(projector.named_parameters())
        assert any(desc.gamma is t for t in params.values()) and any(desc.first.weight is t for t in params.values())


# ------------------------------------------------------------------------ the demos: fast against generic
def _second_weight(projector: nn.Module) -> torch.Tensor:
    desc = _as_norm_first(projector)
    assert desc is not None
    return desc.second.weight


@pytest.mark.parametrize("name", list(NORM_FIRST_DEMOS))
def test_fast_responses_equal_the_generic_path_on_the_demo_projector(
    name: str, demo_tokens: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    projector, features, _ = demo_tokens[name]
    double = copy.deepcopy(projector).double()
    v = features.double()
    u = unit_directions(12, v.shape[1], seed=5, dtype=torch.float64)
    with torch.no_grad():
        generic = responses_jvp(v, _generic(double), u, "float32")
        single = responses_jvp(v.float(), _generic(projector), u.float(), "float32")
        _fast_only(monkeypatch)
        fast = responses_jvp(v, double, u, "float32")
        through_r = responses_jvp(v, double, u, "float32", factor=triangular_factor(_second_weight(double)))
        fast_single = responses_jvp(v.float(), projector, u.float(), "float32")
    assert _relative(fast, generic) < 1e-10  # observed: below 1e-15
    assert _relative(through_r, generic) < 1e-10
    # float32: both paths round alike (observed: up to 3e-7 of the largest response, fast and generic)
    assert _relative(fast_single.double(), generic) < 2e-6 and _relative(single.double(), generic) < 2e-6


@pytest.mark.parametrize("name", list(NORM_FIRST_DEMOS))
def test_care_reduce_through_the_fast_path_keeps_anchors_signals_and_tokens(
    name: str, demo_tokens: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    projector, features, positions = demo_tokens[name]
    double = copy.deepcopy(projector).double()
    v, p = features.double(), positions.double()
    config = CaReConfig(m=16)
    keep = max(4, v.shape[0] // 4)
    generic = care_reduce(v, _generic(double), p, keep=keep, config=config)
    _fast_only(monkeypatch)
    fast = care_reduce(v, double, p, keep=keep, config=config)
    assert torch.equal(fast.indices, generic.indices) and torch.equal(fast.anchor_order, generic.anchor_order)
    assert torch.equal(fast.signals, generic.signals) and fast.signals.numel() > 0
    torch.testing.assert_close(fast.tokens, generic.tokens, rtol=1e-9, atol=1e-9)


def test_bf16_second_layer_stays_within_bf16_rounding(demo_tokens: dict[str, Any]) -> None:
    projector, features, _ = demo_tokens["tiny-qwen3-vl"]
    u = unit_directions(8, features.shape[1], seed=4)
    with torch.no_grad():
        full = responses_jvp(features, projector, u, "float32")
        low = responses_jvp(features, projector, u, "bf16")
    assert low.dtype == torch.float32 and 0 < _relative(low, full) < 2e-2  # bf16 keeps 8 bits: ~4e-3 each


def test_a_scorer_keeps_the_trapezoidal_factor_of_a_norm_first_projector(demo_tokens: dict[str, Any]) -> None:
    projector, features, _ = demo_tokens["tiny-qwen3-vl"]  # W2 (128, 512): d_out < d_h
    scorer = Scorer(projector, second_layer="triangular")
    r = scorer.factor(torch.float64, "cpu")
    w2 = projector.merger.linear_fc2.weight
    assert r is not None and r.shape == w2.shape and scorer.factor(torch.float64, "cpu") is r  # made once
    v = features.double()
    u = unit_directions(8, v.shape[1], seed=2, dtype=torch.float64)
    dense = Scorer(projector, second_layer="dense").responses(v, u, h=1e-3)
    assert _relative(scorer.responses(v, u, h=1e-3), dense) < 1e-12


# ------------------------------------------------------------------------------ the trapezoidal factor
def test_trapezoidal_factor_keeps_every_norm_and_its_blocks_skip_only_zeros() -> None:
    g = torch.Generator().manual_seed(0)
    w2 = torch.randn(10, 24, generator=g, dtype=torch.float64)  # d_out < d_h
    r = triangular_factor(w2)
    assert r.shape == (10, 24)
    assert torch.equal(r.tril(-1), torch.zeros_like(r))  # the zero part: R[i, j] = 0 for j < i
    assert bool((r.diagonal().abs() > 1e-3).all())  # and nothing more is zero (a full-rank W2)
    t = torch.randn(30, 24, generator=g, dtype=torch.float64)
    torch.testing.assert_close((t @ r.T).norm(dim=1), (t @ w2.T).norm(dim=1), rtol=1e-12, atol=0)
    torch.testing.assert_close(_upper_products(t, r), t @ r.T, rtol=1e-12, atol=1e-12)


def test_the_fused_kernel_takes_square_factors_only() -> None:
    features = torch.zeros(4, 8)
    assert _fused_jvp_applies(features, torch.zeros(256, 256), None, True, "auto", upper=True)
    assert not _fused_jvp_applies(features, torch.zeros(256, 512), None, True, "auto", upper=True)  # a trapezoid


# ------------------------------------------------------------------------------ the fused norm-first kernel
def _projector(kind: str, blocks: int, p: int, d_h: int, d_out: int, seed: int) -> NormFirstMLP:
    """A float32 norm-first projector of the kernel's shapes (gamma away from 1, a shift for LayerNorm)."""
    g = torch.Generator().manual_seed(seed)
    gamma = 1 + 0.3 * torch.randn(p, generator=g)
    beta = 0.3 * torch.randn(p, generator=g) if kind == "layer" else None
    torch.manual_seed(seed)
    return NormFirstMLP(kind, gamma, beta, 1e-6, blocks, nn.Linear(blocks * p, d_h), nn.GELU(), nn.Linear(d_h, d_out))


def _moved(desc: NormFirstMLP, dtype: torch.dtype, device: str) -> NormFirstMLP:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype=dtype, device=device)

    first, second = (copy.deepcopy(layer).to(dtype=dtype, device=device) for layer in (desc.first, desc.second))
    return dataclasses.replace(desc, gamma=move(desc.gamma), beta=move(desc.beta), first=first, second=second)


def test_the_fused_norm_first_kernel_takes_its_blocks_precisions_and_factors() -> None:
    features, qwen, internvl = (
        torch.zeros(4, 8),
        _projector("rms", 4, 8, 512, 256, 0),
        _projector("layer", 1, 8, 256, 256, 0),
    )
    trapezoid, square = torch.zeros(256, 512), torch.zeros(256, 256)
    assert _fused_norm_first_applies(features, qwen, trapezoid, None, True, "fused", upper=True)  # d_out < d_h
    assert not _fused_norm_first_applies(features, qwen, trapezoid, None, True, "auto", upper=True)  # 4 blocks: torch
    assert not _fused_norm_first_applies(features, internvl, square, None, True, "auto", upper=True)  # gemm-norm
    assert _fused_norm_first_applies(features, internvl, square, None, True, "fused", upper=True)
    assert _fused_norm_first_applies(features, internvl, square, torch.bfloat16, False, "auto", upper=False)
    assert not _fused_norm_first_applies(features, internvl, square, None, True, "auto", upper=False)  # dense tf32
    assert _fused_norm_first_applies(features, internvl, square, None, True, "fused", upper=False)  # ... if asked
    assert not _fused_norm_first_applies(features, internvl, square, None, False, "auto", upper=True)  # float32
    assert not _fused_norm_first_applies(features.double(), internvl, square, None, True, "auto", upper=True)
    three = _projector("rms", 3, 8, 256, 256, 0)
    assert not _fused_norm_first_applies(features, three, square, None, True, "auto", upper=True)  # 3 blocks
    assert not _fused_norm_first_applies(features, internvl, torch.zeros(200, 256), None, True, "auto", upper=False)


@cuda_only
@pytest.mark.parametrize(
    ("kind", "blocks", "p", "d_h", "d_out"),
    [("rms", 4, 64, 512, 384), ("layer", 4, 32, 256, 512), ("layer", 1, 256, 384, 384)],
)
@pytest.mark.parametrize("matmul", ["tf32", "bf16"])
@pytest.mark.parametrize("factored", [True, False])
def test_the_fused_norm_first_kernel_against_float64(
    kind: str, blocks: int, p: int, d_h: int, d_out: int, matmul: str, factored: bool, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    if not dispatch.triton_enabled(torch.device("cuda")):
        pytest.skip("Triton is not available")
    desc = _projector(kind, blocks, p, d_h, d_out, seed=d_h + blocks)
    g = torch.Generator().manual_seed(blocks)
    features = 3 * torch.randn(300, blocks * p, generator=g)
    u = unit_directions(12, blocks * p, seed=5)
    exact = _moved(desc, torch.float64, "cpu")
    factor64 = triangular_factor(exact.second.weight) if factored else None
    with torch.no_grad():
        ref = _jvp_norm_mlp(features.double(), exact, u.double(), None, factor64)
        cuda = _moved(desc, torch.float32, "cuda")
        factor = None if factor64 is None else factor64.float().cuda()
        calls: list[bool] = []
        real = dispatch.norm_first_norms
        monkeypatch.setattr(dispatch, "norm_first_norms", lambda *a, **kw: calls.append(True) or real(*a, **kw))
        low = torch.bfloat16 if matmul == "bf16" else None
        with matmul_precision(allow_tf32=matmul == "tf32"):
            got = _jvp_norm_mlp(features.cuda(), cuda, u.cuda(), low, factor, tf32=matmul == "tf32", kernel="fused")
    assert calls == [True] and got.shape == ref.shape
    assert _relative(got.double().cpu(), ref) < (2e-2 if matmul == "bf16" else 2e-3)


@pytest.mark.parametrize("matmul", ["tf32", "bf16"])
def test_the_fused_norm_first_kernel_gets_the_gates_operand_made_once(
    matmul: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """Through a kept gate (a scorer's), W2's kernel operand is made on the first call only and handed over as the
    kernel's (rounded=True): bf16, or float32 rounded to tf32."""
    made: list[tuple[int, ...]] = []
    real_operand = dispatch.weight_operand

    def weight_operand(w: torch.Tensor, *, bf16: bool) -> torch.Tensor:
        made.append(tuple(w.shape))
        return real_operand(w, bf16=bf16)

    handed: list[torch.Tensor] = []

    def norm_first_norms(slope: torch.Tensor, lifted: torch.Tensor, *args: Any, rounded: bool, **kw: Any) -> Any:
        assert rounded
        handed.append(args[-1])
        return torch.zeros(lifted.shape[1], slope.shape[0])

    monkeypatch.setattr(dispatch, "why_not_fused", lambda device: None)
    monkeypatch.setattr(dispatch, "weight_operand", weight_operand)
    monkeypatch.setattr(dispatch, "norm_first_norms", norm_first_norms)
    desc = _projector("layer", 1, 16, 64, 128, seed=3)
    features, u = torch.randn(20, 16, generator=torch.Generator().manual_seed(4)), unit_directions(6, 16, seed=2)
    gate, low = dispatch.KernelGate("fused"), torch.bfloat16 if matmul == "bf16" else None
    with torch.no_grad():
        for _ in range(3):
            _jvp_norm_mlp(features, desc, u, low, None, tf32=matmul == "tf32", kernel=gate)
    assert made == [(128, 64)] and len(handed) == 3 and all(w is handed[0] for w in handed)
    w2 = desc.second.weight.detach()
    if matmul == "bf16":
        assert handed[0].dtype == torch.bfloat16 and torch.equal(handed[0], w2.to(torch.bfloat16))
    else:  # tf32: 10 mantissa bits (the low 13 of float32's 23 cleared), within half a tf32 step of W2
        assert handed[0].dtype == torch.float32 and bool((handed[0].view(torch.int32) & 0x1FFF == 0).all())
        assert bool(((handed[0] - w2).abs() <= w2.abs() * 2.0**-11).all()) and not torch.equal(handed[0], w2)


# ------------------------------------------------------------------ the one-pass operand kernel (any block count)
def test_the_operand_kernel_takes_float32_features_and_one_to_four_blocks() -> None:
    features = torch.zeros(4, 8)
    for blocks in (1, 2, 3, 4):
        assert scoring._norm_first_operand_applies(features, _projector("rms", blocks, 8, 80, 48, 0)), blocks
    assert not scoring._norm_first_operand_applies(features, _projector("rms", 5, 8, 80, 48, 0))  # not unrolled
    qwen = _projector("layer", 4, 8, 80, 48, 0)
    assert not scoring._norm_first_operand_applies(features.double(), qwen)  # float64: the PyTorch path
    assert not scoring._norm_first_operand_applies(features.bfloat16(), qwen)


# The kernel (care_core.kernels.norm_first_operand) run by Triton's interpreter on the CPU, in a subprocess
# (TRITON_INTERPRET is read when Triton is imported); the compiled kernel's test is the CUDA one below.
# 1. Alone, against float64 sums of the same float32 inputs. Each output is s ⊙ (Σ_b v a − Σ_b c p):
#    each term passes through at most B + 2 roundings (its product, B - 1 additions, the subtraction, the scaling by
#    s), so in float32 the result lies within γ_(B+2) ≈ (B + 2) u (u = 2^-24) of |s| (Σ_b |v a| + Σ_b |c p|) from
#    the exact value, in any order of the sums, FMAs or not (observed: up to 2.6 u; the test allows (2B + 2) u).
#    Shapes off the tiles (N = 37, d_h = 80: masked edges), a chunk [2, 6) of 7 directions.
# 2. In _jvp_norm_mlp with the gate let through on the CPU, in chunks of 3 directions (so chunk offsets matter),
#    dense and through a trapezoidal factor: the same responses as the PyTorch path. The GEMM and the norm are the
#    same CPU code on operands within the bound above of each other, so the responses agree to float32 rounding.
_INTERPRETED = """
import torch
from torch import nn
from care_core import scoring
from care_core.kernels import dispatch
from care_core.kernels.norm_first_operand import norm_first_operand
from care_core.norm_first import NormFirstMLP

g = torch.Generator().manual_seed(0)
for blocks in (1, 2, 3, 4):
    n, m, d_h = 37, 7, 80
    s, a = torch.randn(n, d_h, generator=g), torch.randn(blocks, m, d_h, generator=g)
    v, c = torch.rand(n, blocks, generator=g) + 0.5, torch.randn(blocks, n, m, generator=g)
    p = torch.randn(blocks, n, d_h, generator=g)
    got = norm_first_operand(s, a, v, c, p, 2, 6).double()
    s64, a64, v64, c64, p64 = (t.double() for t in (s, a[:, 2:6], v, c[:, :, 2:6], p))
    shared, fix = torch.einsum("ib,bxk->ixk", v64, a64), torch.einsum("bix,bik->ixk", c64, p64)
    exact = s64[:, None] * (shared - fix)
    scale = s64.abs()[:, None] * (torch.einsum("ib,bxk->ixk", v64.abs(), a64.abs())
                                  + torch.einsum("bix,bik->ixk", c64.abs(), p64.abs()))
    assert got.shape == (n, 4, d_h), got.shape
    assert bool(((got - exact).abs() <= (2 * blocks + 2) * 2.0**-24 * scale).all()), blocks

dispatch.why_not_fused = lambda device: None  # let the gate choose the kernel on the CPU (interpreted)
scoring._chunk_size = lambda m, per_direction: 3
calls = []
real = dispatch.norm_first_operand
dispatch.norm_first_operand = lambda *args: calls.append(args[-2:]) or real(*args)
torch.manual_seed(1)
desc = NormFirstMLP("rms", 1 + 0.3 * torch.randn(8), None, 1e-6, 4, nn.Linear(32, 80), nn.GELU(), nn.Linear(80, 48))
features, u = 3 * torch.randn(37, 32), scoring.unit_directions(7, 32, seed=2)
with torch.no_grad():
    for factor in (None, scoring.triangular_factor(desc.second.weight)):
        want = scoring._jvp_norm_mlp(features, desc, u, None, factor, kernel="torch")
        got = scoring._jvp_norm_mlp(features, desc, u, None, factor, kernel="fused")
        assert calls == [(0, 3), (3, 6), (6, 7)], calls
        calls.clear()
        assert float((got - want).abs().max() / want.abs().max()) < 1e-6
print("equal")
"""


def test_the_operand_kernel_writes_the_second_layers_input_interpreted() -> None:
    assert run_interpreted(_INTERPRETED) == "equal"


@cuda_only
@pytest.mark.parametrize(("kind", "p", "d_h", "d_out"), [("rms", 64, 512, 384), ("layer", 48, 320, 448)])
@pytest.mark.parametrize("matmul", ["tf32", "float32", "bf16"])
@pytest.mark.parametrize("factored", [True, False])
def test_the_one_pass_operand_path_against_float64(
    kind: str, p: int, d_h: int, d_out: int, matmul: str, factored: bool, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """In "auto" mode on CUDA, four blocks (the Qwen mergers): the operand kernel, then cuBLAS, against the float64
    PyTorch path. Bounds: tf32 keeps 10 mantissa bits (u = 2^-11 per rounded operand), bf16 7 (2^-8), accumulated in
    float32; the norms' largest relative error then stays near u (random signs: the errors of a sum of d_h products
    grow as its sqrt, not d_h), so 2e-3 (tf32) and 2e-2 (bf16), as the fused kernel's test allows; float32 matmuls
    (tf32 off): the operand's rounding only, 1e-5. And the PyTorch path on the same CUDA inputs within the same."""
    if not dispatch.triton_enabled(torch.device("cuda")):
        pytest.skip("Triton is not available")
    desc = _projector(kind, 4, p, d_h, d_out, seed=d_h)
    features = 3 * torch.randn(300, 4 * p, generator=torch.Generator().manual_seed(4))
    u = unit_directions(12, 4 * p, seed=5)
    exact = _moved(desc, torch.float64, "cpu")
    factor64 = triangular_factor(exact.second.weight) if factored else None
    calls: list[bool] = []
    real = dispatch.norm_first_operand
    monkeypatch.setattr(dispatch, "norm_first_operand", lambda *a, **kw: calls.append(True) or real(*a, **kw))
    with torch.no_grad():
        ref = _jvp_norm_mlp(features.double(), exact, u.double(), None, factor64)
        cuda = _moved(desc, torch.float32, "cuda")
        factor = None if factor64 is None else factor64.float().cuda()
        low = torch.bfloat16 if matmul == "bf16" else None
        v, d = features.cuda(), u.cuda()
        with matmul_precision(allow_tf32=matmul == "tf32"):
            got = _jvp_norm_mlp(v, cuda, d, low, factor, tf32=matmul == "tf32", kernel="auto")
            assert calls and all(calls)  # the one-pass kernel ran (not the fused norm-first kernel: four blocks)
            torch_path = _jvp_norm_mlp(v, cuda, d, low, factor, tf32=matmul == "tf32", kernel="torch")
    bound = {"tf32": 2e-3, "float32": 1e-5, "bf16": 2e-2}[matmul]
    assert got.shape == ref.shape and _relative(got.double().cpu(), ref) < bound
    assert _relative(torch_path.double().cpu(), ref) < bound
