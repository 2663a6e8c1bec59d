"""The gemm-norm kernel (care_core.kernels.gemm_norm: ||R t|| per row, the product never written) on the norm-first
path: which settings take it, its shapes, the kernel in Triton's interpreter, and on CUDA against float64."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLPatchMerger
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionPatchMerger

from care_core import scoring
from care_core.backbones.qwen2_5_vl.adapter import QwenMergerProjector
from care_core.backbones.qwen3_vl.adapter import Qwen3VLMergerProjector
from care_core.errors import CareError
from care_core.kernels import dispatch
from care_core.kernels.dispatch import KernelGate
from care_core.kernels.shapes import gemm_norm_shape_supported
from care_core.norm_first import NormFirstMLP
from care_core.scoring import _gemm_norm_applies, _jvp_norm_mlp, responses_jvp, triangular_factor, unit_directions
from tests._triton_interpreter import run_interpreted
from tests.core._scoring_paths import relative as _relative

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ------------------------------------------------------------------------------------------------ the rules
def test_the_kernel_takes_k_multiples_of_64_out_multiples_of_128_and_no_tall_upper_factor() -> None:
    assert gemm_norm_shape_supported(5120, 3584, upper=True)  # Qwen2.5-VL-7B's merger: R 3584 x 5120
    assert gemm_norm_shape_supported(4608, 4096, upper=True)  # Qwen3-VL-8B's
    assert gemm_norm_shape_supported(4096, 4096, upper=True)  # a square triangle
    assert not gemm_norm_shape_supported(5120, 3600, upper=True)  # 3600 = 28.125 x 128
    assert not gemm_norm_shape_supported(5100, 3584, upper=True)  # 5100 = 79.7 x 64
    assert not gemm_norm_shape_supported(256, 512, upper=True)  # taller than wide: not an upper factor
    assert gemm_norm_shape_supported(256, 512, upper=False)  # ... fine as a plain matrix


def _projector(blocks: int, p: int, d_h: int, d_out: int, seed: int) -> NormFirstMLP:
    """A float32 RMSNorm-first projector (gamma away from 1)."""
    torch.manual_seed(seed)
    gamma = 1 + 0.3 * torch.randn(p)
    return NormFirstMLP("rms", gamma, None, 1e-6, blocks, nn.Linear(blocks * p, d_h), nn.GELU(), nn.Linear(d_h, d_out))


def test_the_kernel_applies_to_float32_rows_through_an_upper_factor_in_tf32_or_bf16() -> None:
    features, trapezoid = torch.zeros(4, 8), torch.zeros(256, 512)
    assert _gemm_norm_applies(features, trapezoid, None, True, upper=True)  # tf32 through R (a Scorer on CUDA)
    assert _gemm_norm_applies(features, trapezoid, torch.bfloat16, False, upper=True)
    assert _gemm_norm_applies(features, torch.zeros(512, 512), None, True, upper=True)  # a triangle
    assert not _gemm_norm_applies(features, trapezoid, None, False, upper=True)  # float32 products: cuBLAS
    assert not _gemm_norm_applies(features, trapezoid, None, True, upper=False)  # dense W2: cuBLAS
    assert not _gemm_norm_applies(features, trapezoid, torch.float16, False, upper=True)
    assert not _gemm_norm_applies(features.double(), trapezoid, None, True, upper=True)  # float64: generic rules
    assert not _gemm_norm_applies(features, torch.zeros(200, 512), None, True, upper=True)  # d_out % 128
    assert not _gemm_norm_applies(features, torch.zeros(512, 256), None, True, upper=True)  # taller than wide


# --------------------------------------------------------------- which path each setting takes (CPU stand-ins)
def _operand(s: torch.Tensor, a: torch.Tensor, v: torch.Tensor, c: torch.Tensor, p: torch.Tensor, start: int,
             stop: int) -> torch.Tensor:  # fmt: skip
    """The operand kernel's output from its formula, s_i ⊙ (Σ_b v_ib a_bx − Σ_b c_bix p_bi), (N, c, d_h)."""
    shared = torch.einsum("ib,bxk->ixk", v, a[:, start:stop])
    fix = torch.einsum("bix,bik->ixk", c[:, :, start:stop], p)
    return s[:, None] * (shared - fix)


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """The gate let through on the CPU, the kernels replaced by PyTorch formulas that record their calls."""
    calls: dict[str, list[Any]] = {"operand": [], "gemm": [], "weight": [], "rounding": []}
    monkeypatch.setattr(dispatch, "why_not_fused", lambda device: None)
    monkeypatch.setattr(scoring, "_chunk_size", lambda m, per_direction: 3)  # several chunks per call

    def operand(*args: Any, tf32_rounded: bool = False) -> torch.Tensor:
        calls["operand"].append(args[-2:])
        calls["rounding"].append(("operand", tf32_rounded))
        return _operand(*args)  # unrounded: the responses are checked against float64 at float32's bound

    def gemm(
        rows: torch.Tensor, r: torch.Tensor, *, bf16: bool, upper: bool, rounded: bool = False, round_t: bool = True
    ) -> torch.Tensor:
        calls["gemm"].append((rows.shape, bf16, upper, rounded))
        calls["rounding"].append(("gemm", round_t))
        return (rows @ r.float().T).norm(dim=-1)

    def weight(r: torch.Tensor, *, bf16: bool) -> torch.Tensor:
        calls["weight"].append(bf16)
        return r.to(torch.bfloat16) if bf16 else r

    monkeypatch.setattr(dispatch, "norm_first_operand", operand)
    monkeypatch.setattr(dispatch, "gemm_norms", gemm)
    monkeypatch.setattr(dispatch, "weight_operand", weight)
    return calls


_N, _M = 37, 7  # chunks of 3 directions: [0, 3), [3, 6), [6, 7)


def _case() -> tuple[torch.Tensor, NormFirstMLP, torch.Tensor, torch.Tensor]:
    """Features, a 4-block projector of the kernel's shapes (d_h 256, d_out 128), directions, its trapezoid R."""
    desc = _projector(4, 8, 256, 128, seed=3)
    features = 3 * torch.randn(_N, 32, generator=torch.Generator().manual_seed(1))
    return features, desc, unit_directions(_M, 32, seed=2), triangular_factor(desc.second.weight.detach())


def test_auto_through_r_takes_the_gemm_norm_kernel_after_the_operand_kernel(stand_ins: dict[str, list[Any]]) -> None:
    features, desc, u, r = _case()
    with torch.no_grad():
        want = _jvp_norm_mlp(features.double(), _double(desc), u.double(), None, r.double(), kernel="torch")
        got = _jvp_norm_mlp(features, desc, u, None, r, tf32=True, kernel="auto")
        assert stand_ins["operand"] == [(0, 3), (3, 6), (6, 7)]
        assert stand_ins["gemm"] == [((_N * 3, 256), False, True, True)] * 2 + [((_N, 256), False, True, True)]
        assert stand_ins["weight"] == [False]  # R converted once for the three chunks
        # tf32: the operand kernel writes its rows rounded to tf32, which the gemm-norm kernel reads as they are
        assert stand_ins["rounding"] == [("operand", True), ("gemm", False)] * 3
        assert got.shape == (_M, _N) and _relative(got.double(), want) < 1e-5  # float32 stand-ins
        for calls in stand_ins.values():
            calls.clear()
        low = _jvp_norm_mlp(features, desc, u, torch.bfloat16, r, kernel="auto")
        assert [call[1] for call in stand_ins["gemm"]] == [True] * 3 and stand_ins["weight"] == [True]
        # bf16: exact float32 rows, converted once by the gemm-norm kernel (tf32 then bf16 would round twice)
        assert [step for step in stand_ins["rounding"] if step[0] == "operand"] == [("operand", False)] * 3
        assert _relative(low.double(), want) < 2e-2  # bf16 operands (the stand-in rounds R only)


def test_auto_through_r_takes_the_gemm_norm_kernel_for_one_block_too(
    stand_ins: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-block projector (InternVL3's form) through R in "auto": the operand kernel then gemm-norm, never the
    fused norm-first kernel (slower there on an H200: benchmarks/results/2026-11-29-195208-gpu-h200-norm-first.json)."""
    fused: list[int] = []

    def norm_first_norms(*args: Any, **kwargs: Any) -> None:
        fused.append(1)

    monkeypatch.setattr(dispatch, "norm_first_norms", norm_first_norms)
    desc = _projector(1, 32, 256, 256, seed=4)
    features = 3 * torch.randn(_N, 32, generator=torch.Generator().manual_seed(5))
    u, r = unit_directions(_M, 32, seed=2), triangular_factor(desc.second.weight.detach())
    with torch.no_grad():
        want = _jvp_norm_mlp(features.double(), _double(desc), u.double(), None, r.double(), kernel="torch")
        got = _jvp_norm_mlp(features, desc, u, None, r, tf32=True, kernel="auto")
    assert fused == [] and stand_ins["operand"] == [(0, 3), (3, 6), (6, 7)]
    assert [call[0] for call in stand_ins["gemm"]] == [(_N * 3, 256)] * 2 + [(_N, 256)]
    assert got.shape == (_M, _N) and _relative(got.double(), want) < 1e-5  # float32 stand-ins


def _double(desc: NormFirstMLP) -> NormFirstMLP:
    first, second = copy.deepcopy(desc.first).double(), copy.deepcopy(desc.second).double()
    gamma = None if desc.gamma is None else desc.gamma.double()
    return dataclasses.replace(desc, gamma=gamma, first=first, second=second)


@pytest.mark.parametrize(
    ("setting", "tf32", "factored", "operand"),
    [("torch", True, True, False), ("auto", False, True, True), ("auto", True, False, True)],
    ids=["kernel-torch", "float32-products", "dense-second-layer"],
)
def test_other_settings_keep_todays_path(
    stand_ins: dict[str, list[Any]], setting: str, tf32: bool, factored: bool, operand: bool
) -> None:
    features, desc, u, r = _case()
    factor = r if factored else None
    with torch.no_grad():
        got = _jvp_norm_mlp(features, desc, u, None, factor, tf32=tf32, kernel=setting)  # type: ignore[arg-type]
        want = _jvp_norm_mlp(features.double(), _double(desc), u.double(), None, None, kernel="torch")
    assert stand_ins["gemm"] == [] and stand_ins["weight"] == []
    assert bool(stand_ins["operand"]) == operand
    assert ("operand", True) not in stand_ins["rounding"]  # cuBLAS rounds its operands itself
    assert _relative(got.double(), want) < 1e-5


def test_a_gemm_norm_kernel_that_cannot_be_built_falls_back_to_cublas_for_the_gates_lifetime(
    stand_ins: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def unbuildable(*args: Any, **kwargs: Any) -> torch.Tensor:
        stand_ins["gemm"].append("tried")
        raise ImportError("no gemm-norm kernel here")

    monkeypatch.setattr(dispatch, "gemm_norms", unbuildable)
    features, desc, u, r = _case()
    gate = KernelGate("auto")
    with torch.no_grad():
        want = _jvp_norm_mlp(features, desc, u, None, r, tf32=True, kernel="torch")
        with pytest.warns(UserWarning, match="fused gemm_norm kernel unavailable"):
            first = _jvp_norm_mlp(features, desc, u, None, r, tf32=True, kernel=gate)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = _jvp_norm_mlp(features, desc, u, None, r, tf32=True, kernel=gate)
        assert stand_ins["gemm"] == ["tried"] and set(gate.failed) == {"gemm_norm"}  # the operand kernel still runs
        # the first chunk's rows were written rounded for the kernel that failed; cuBLAS's retry gets them unrounded
        assert stand_ins["rounding"][:4] == [("operand", True)] + [("operand", False)] * 3
        assert _relative(first, want) < 1e-6 and _relative(again, want) < 1e-6
        three = _projector(3, 8, 256, 128, seed=3)  # 3 blocks: no fused norm-first kernel, so the operand's path
        with pytest.raises(CareError, match="gemm_norm kernel cannot be built"):
            _jvp_norm_mlp(features[:, :24], three, u[:, :24], None, r, tf32=True, kernel="fused")


def test_on_the_cpu_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("a fused kernel ran on the CPU")

    for name in ("norm_first_operand", "gemm_norms", "weight_operand"):
        monkeypatch.setattr(dispatch, name, refuse)
    features, desc, u, r = _case()
    with torch.no_grad():
        got = _jvp_norm_mlp(features, desc, u, None, r, tf32=True, kernel="auto")
        torch_path = _jvp_norm_mlp(features, desc, u, None, r, tf32=True, kernel="torch")
        exact = _jvp_norm_mlp(features.double(), _double(desc), u.double(), None, r.double(), kernel="torch")
    assert torch.equal(got, torch_path)  # "auto" on the CPU is the PyTorch path
    assert _relative(got.double(), exact) < 1e-5


# ------------------------------------------------------------------------------------- Triton's interpreter
# The kernel run by Triton's interpreter on the CPU (a subprocess: TRITON_INTERPRET is read when Triton is imported),
# each autotune candidate pinned in turn (the interpreter cannot time candidates), T's tf32 rounding off (inline PTX
# cannot run there; the interpreter's tensor-core emulation then truncates both operands: error ~1e-4 of the largest
# norm). bf16 is left to the CUDA test: this interpreter's bf16 dot returns garbage even for plain bf16 inputs.
# Through an upper R the kernel reads, for output block [j0, j0 + BN), the columns from j0 on only; given a full
# matrix R it must return the norms of T through R with exactly the columns left of each block zeroed: that checks
# the skip itself, too far (wrong norms) or too short (R's left part read).
_INTERPRETED = """
import torch
from care_core.kernels import gemm_norm

g = torch.Generator().manual_seed(0)
configs = {key: list(kernel.configs) for key, kernel in gemm_norm._KERNELS.items()}
for m_rows, d_h, d_out, upper in ((200, 384, 256, True), (1, 128, 128, True), (130, 192, 128, False)):
    t = torch.randn(m_rows, d_h, generator=g)
    r = torch.randn(d_out, d_h, generator=g, dtype=torch.float64)
    key = (False, gemm_norm._wide(d_out))
    for config in configs[key]:
        gemm_norm._KERNELS[key].configs = [config]
        bn = config.kwargs["BN"]
        cols = torch.arange(d_h)[None, :]
        seen = r * (cols >= (torch.arange(d_out)[:, None] // bn) * bn) if upper else r
        want = (t.double() @ seen.T).norm(dim=1)
        got = gemm_norm.gemm_norms(t, r.float(), bf16=False, upper=upper, round_t=False)
        assert got.shape == (m_rows,) and got.dtype == torch.float32, (got.shape, got.dtype)
        err = float((got.double() - want).abs().max() / want.abs().max())
        assert err < 1e-3, (m_rows, d_h, d_out, upper, str(config), err)
print("equal")
"""


def test_the_gemm_norm_kernel_interpreted() -> None:
    assert run_interpreted(_INTERPRETED) == "equal"


# --------------------------------------------------------------------------------------------------- CUDA
def _upper(d_out: int, d_h: int, seed: int) -> torch.Tensor:
    """A random upper-trapezoidal (d_out < d_h) or triangular R, float64, as triangular_factor makes them."""
    return triangular_factor(
        torch.randn(d_out, d_h, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    )


@cuda_only
@pytest.mark.parametrize(
    ("m_rows", "d_out", "d_h"), [(300, 384, 512), (1000, 512, 1024), (777, 512, 512), (1, 128, 128)]
)
@pytest.mark.parametrize("bf16", [False, True], ids=["tf32", "bf16"])
def test_gemm_norms_against_float64(m_rows: int, d_out: int, d_h: int, bf16: bool) -> None:
    """Random T against float64 norms through a random upper R (trapezoids, one with wide output tiles; a triangle);
    M off the row tile (128). Bounds: tf32 keeps 10 mantissa bits (2^-11 per rounded operand), bf16 7 (2^-8), sums
    in float32; random signs keep the norms' error near that of one operand: 1e-3 and 1e-2 of the largest norm."""
    if not dispatch.triton_enabled(torch.device("cuda")):
        pytest.skip("Triton is not available")
    r64 = _upper(d_out, d_h, seed=d_h)
    t = torch.randn(m_rows, d_h, generator=torch.Generator().manual_seed(m_rows)).cuda()
    want = (t.double().cpu() @ r64.T).norm(dim=1)
    r = r64.float().cuda()
    got = dispatch.gemm_norms(t, r, bf16=bf16, upper=True)
    assert got.shape == (m_rows,) and got.dtype == torch.float32
    assert _relative(got.double().cpu(), want) < (1e-2 if bf16 else 1e-3)
    rounded = dispatch.gemm_norms(t, dispatch.weight_operand(r, bf16=bf16), bf16=bf16, upper=True, rounded=True)
    assert torch.equal(rounded, got)  # R made once outside: the same operand
    dense = dispatch.gemm_norms(t, r, bf16=bf16, upper=False)  # every column read: the same norms
    assert _relative(dense.double().cpu(), want) < (1e-2 if bf16 else 1e-3)
    assert dispatch.gemm_norms(t[:0], r, bf16=bf16, upper=True).shape == (0,)  # no rows: no launch


def _tf32_nearest(x: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to tf32's 11 significant bits, to nearest with ties away from zero, through NumPy's
    frexp (an implementation independent of the kernels' bit arithmetic); finite normal inputs."""
    values = x.double().cpu().numpy()
    mantissa, exponent = np.frexp(values)  # values = mantissa 2^exponent, 0.5 <= |mantissa| < 1
    scaled = mantissa * 2.0**11
    kept = np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)
    return torch.from_numpy(np.ldexp(kept / 2.0**11, exponent)).float()


@cuda_only
@pytest.mark.parametrize("blocks", [1, 4])
def test_the_operand_kernel_rounds_its_rows_to_tf32_when_asked(blocks: int) -> None:
    """tf32_rounded: every value of T is the unrounded kernel's value rounded to nearest tf32; and the coefficients'
    memory layout ((blocks, N, m), or direction-major as the scorer passes them) changes no bit."""
    if not dispatch.triton_enabled(torch.device("cuda")):
        pytest.skip("Triton is not available")
    g = torch.Generator().manual_seed(blocks)
    n, m, d_h = 150, 9, 320
    s, a = torch.randn(n, d_h, generator=g), torch.randn(blocks, m, d_h, generator=g)
    v, c = torch.rand(n, blocks, generator=g) + 0.5, torch.randn(blocks, n, m, generator=g)
    p = torch.randn(blocks, n, d_h, generator=g)
    s, a, v, c, p = (t.cuda() for t in (s, a, v, c, p))
    plain = dispatch.norm_first_operand(s, a, v, c, p, 2, 8)
    rounded = dispatch.norm_first_operand(s, a, v, c, p, 2, 8, tf32_rounded=True)
    assert torch.equal(rounded.cpu(), _tf32_nearest(plain))
    assert not torch.equal(rounded, plain)  # the rounding did something
    direction_major = c.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(dispatch.norm_first_operand(s, a, v, direction_major, p, 2, 8), plain)


@cuda_only
def test_the_gemm_norm_kernel_reads_pre_rounded_rows_as_it_would_round_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """round_t=False on rows already rounded to tf32 gives the norms that in-kernel rounding gives on the unrounded
    rows, bit for bit, under every tf32 tile (each pinned in turn: the two settings are tuned apart)."""
    if not dispatch.triton_enabled(torch.device("cuda")):
        pytest.skip("Triton is not available")
    from care_core.kernels import gemm_norm

    r = _upper(256, 384, seed=7).float().cuda()
    t = torch.randn(300, 384, generator=torch.Generator().manual_seed(8)).cuda()
    t_rounded = _tf32_nearest(t).cuda()
    key = (False, gemm_norm._wide(256))
    for config in list(gemm_norm._KERNELS[key].configs):
        monkeypatch.setattr(gemm_norm._KERNELS[key], "configs", [config])
        in_kernel = gemm_norm.gemm_norms(t, r, bf16=False, upper=True)
        as_read = gemm_norm.gemm_norms(t_rounded, r, bf16=False, upper=True, round_t=False)
        assert torch.equal(as_read, in_kernel), str(config)


def _mergers() -> dict[str, nn.Module]:
    """Qwen-like mergers at small widths: RMSNorm per 2 x 2 patch, 512 -> 512 -> 256 (Qwen2.5-VL's form) and
    LayerNorm, 512 -> 512 -> 384 (Qwen3-VL's); float32, random weights."""
    torch.manual_seed(0)
    config = Qwen3VLVisionConfig(hidden_size=128, out_hidden_size=384, spatial_merge_size=2)
    return {
        "qwen2.5-vl": QwenMergerProjector(Qwen2_5_VLPatchMerger(256, 128, spatial_merge_size=2)),
        "qwen3-vl": Qwen3VLMergerProjector(Qwen3VLVisionPatchMerger(config)),
    }


@cuda_only
@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
@pytest.mark.parametrize("matmul", ["tf32", "bf16"])
def test_auto_responses_through_the_gemm_norm_kernel_equal_the_pytorch_path(
    family: str, matmul: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """responses_jvp on CUDA, kernel "auto" (the operand kernel, then this one) against "torch" (cuBLAS) and both
    against float64, through the trapezoidal factor (what a Scorer runs on CUDA); bounds as the fused norm-first
    kernel's test allows (tf32 2e-3, bf16 2e-2)."""
    if not dispatch.triton_enabled(torch.device("cuda")):
        pytest.skip("Triton is not available")
    projector = _mergers()[family].eval()
    calls: list[bool] = []
    real = dispatch.gemm_norms

    def gemm_norms(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "gemm_norms", gemm_norms)
    features = 3 * torch.randn(300, 512, generator=torch.Generator().manual_seed(4))
    u = unit_directions(12, 512, seed=5)
    with torch.no_grad():
        desc = scoring._as_norm_first(projector)
        assert desc is not None  # the adapters' mergers describe themselves
        r64 = triangular_factor(desc.second.weight.detach().double())
        exact = responses_jvp(features.double(), copy.deepcopy(projector).double(), u.double(), "float32",
                              kernel="torch", factor=r64)  # fmt: skip
        cuda = copy.deepcopy(projector).cuda()
        v, d, r = features.cuda(), u.cuda(), r64.float().cuda()
        got = responses_jvp(v, cuda, d, matmul, kernel="auto", factor=r)
        assert calls  # the gemm-norm kernel ran
        torch_path = responses_jvp(v, cuda, d, matmul, kernel="torch", factor=r)
    bound = 2e-2 if matmul == "bf16" else 2e-3
    assert got.shape == exact.shape and _relative(got.double().cpu(), exact) < bound
    assert _relative(got, torch_path) < bound and _relative(torch_path.double().cpu(), exact) < bound
