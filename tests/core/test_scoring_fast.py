"""The fast code paths of issue #7 give the reference path's results.

CPU: the CPU scoring path is the reference code unchanged; the Gram-matrix greedy (the fused GPU
kernel's PyTorch twin) picks the same anchors as the reference loop; the converted-projector cache is
invalidated by weight changes; cached directions are handed out as copies. CUDA (skipped elsewhere):
the fused Triton kernels against float64 and against the PyTorch paths, and no host synchronisation
in anchor selection (neither the fused kernel nor the PyTorch loop).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from care_core import CaReConfig, care_reduce
from care_core.anchors import diversity_greedy, diversity_greedy_gram, unit_rows
from care_core.kernels import triton_enabled
from care_core.scoring import (
    _projector_in,
    perturbation_responses,
    responses_jvp,
    unit_directions,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _mlp(d_v: int, d_h: int, d_out: int, seed: int, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_v, d_h), nn.GELU(), nn.Linear(d_h, d_out)).to(dtype).eval()


def _clustered(n: int, d: int, seed: int, clusters: int = 8, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Well-separated inputs: tight clusters around distant centres."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, d, generator=g, dtype=torch.float64) * 4
    labels = torch.randint(0, clusters, (n,), generator=g)
    return (centres[labels] + torch.randn(n, d, generator=g, dtype=torch.float64)).to(dtype)


def _reference_jvp_mlp(features: torch.Tensor, mlp: nn.Sequential, directions: torch.Tensor) -> torch.Tensor:
    """The jvp engine's MLP path exactly as it was before issue #7 (CPU reference)."""
    first, act, second = mlp
    pre = first(features)
    slope = torch.func.jvp(act, (pre,), (torch.ones_like(pre),))[1]
    lifted = directions @ first.weight.T
    rows = []
    for start in range(0, directions.shape[0], 7):
        tangent = slope[None] * lifted[start : start + 7, None]
        rows.append((tangent @ second.weight.T).norm(dim=-1))
    return torch.cat(rows)


# ------------------------------------------------------------------------------------------ CPU
def test_triton_is_never_used_on_the_cpu() -> None:
    assert not triton_enabled(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_jvp_path_is_the_reference_code(dtype: torch.dtype) -> None:
    features = _clustered(120, 24, seed=1, dtype=dtype)
    mlp = _mlp(24, 64, 40, seed=2, dtype=dtype)
    u = unit_directions(16, 24, seed=3, dtype=dtype)
    with torch.no_grad():
        got = responses_jvp(features, mlp, u, "float32")
        ref = _reference_jvp_mlp(features, mlp, u)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("n", "k", "seed"), [(300, 40, 0), (64, 64, 1), (500, 120, 2), (37, 5, 3)])
def test_gram_greedy_matches_the_reference_loop(n: int, k: int, seed: int, dtype: torch.dtype) -> None:
    features = _clustered(n, 16, seed=seed, dtype=dtype)
    weights = torch.rand(n, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64).to(dtype)
    unit = unit_rows(features, 1e-8)
    gram = unit @ unit.T
    assert torch.equal(diversity_greedy_gram(weights, gram, k), diversity_greedy(weights, features, k, 1e-8))


def test_gram_greedy_breaks_ties_at_the_lowest_index() -> None:
    features = torch.eye(6, dtype=torch.float64).repeat(2, 1)  # every token has an identical twin
    weights = torch.ones(12, dtype=torch.float64)
    gram = unit_rows(features, 1e-8) @ unit_rows(features, 1e-8).T
    order = diversity_greedy_gram(weights, gram, 8)
    assert torch.equal(order, diversity_greedy(weights, features, 8, 1e-8))
    assert order[:6].tolist() == [0, 1, 2, 3, 4, 5]


def test_converted_projector_is_cached_until_its_weights_change() -> None:
    mlp = _mlp(8, 16, 12, seed=0, dtype=torch.float64)
    a = _projector_in(mlp, torch.float32, torch.device("cpu"))
    b = _projector_in(mlp, torch.float32, torch.device("cpu"))
    assert a is b and a is not mlp and next(a.parameters()).dtype == torch.float32
    with torch.no_grad():
        mlp[2].weight.mul_(2)
    c = _projector_in(mlp, torch.float32, torch.device("cpu"))
    assert c is not a
    torch.testing.assert_close(c[2].weight, mlp[2].weight.float())
    assert _projector_in(mlp, torch.float64, torch.device("cpu")) is mlp


def test_unit_directions_cache_hands_out_copies() -> None:
    a = unit_directions(8, 16, seed=5)
    a.mul_(0)
    b = unit_directions(8, 16, seed=5)
    torch.testing.assert_close(b.norm(dim=1), torch.ones(8))
    assert torch.equal(b, unit_directions(8, 16, seed=5))
    assert not torch.equal(b, unit_directions(8, 16, seed=6))


def test_unknown_engine_is_an_error() -> None:
    features = _clustered(20, 8, seed=4)
    with pytest.raises(ValueError, match="unknown engine"):
        perturbation_responses(features, _mlp(8, 16, 8, seed=5), unit_directions(4, 8, seed=6), h=5e-4, engine="nope")


def test_disabling_triton_changes_nothing_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    features = _clustered(150, 16, seed=7)
    mlp = _mlp(16, 32, 24, seed=8)
    positions = torch.rand(150, 2, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    cfg = CaReConfig(m=16)
    a = care_reduce(features, mlp, positions, keep=20, config=cfg)
    monkeypatch.setenv("CARE_DISABLE_TRITON", "1")
    b = care_reduce(features, mlp, positions, keep=20, config=cfg)
    assert torch.equal(a.indices, b.indices) and torch.equal(a.tokens, b.tokens)


# ------------------------------------------------------------------------------------------ CUDA
@cuda
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize(("n", "m", "d_h", "d_out"), [(300, 16, 256, 512), (576, 64, 1024, 1024), (129, 7, 64, 256)])
def test_fused_jvp_kernel_against_float64(bf16: bool, n: int, m: int, d_h: int, d_out: int) -> None:
    if not triton_enabled(torch.device("cuda")):
        pytest.skip("Triton is not available")
    from care_core.kernels.jvp import jvp_norms

    g = torch.Generator().manual_seed(n + d_h)
    slope = torch.rand(n, d_h, generator=g, dtype=torch.float64) * 1.2 - 0.1
    lifted = torch.randn(m, d_h, generator=g, dtype=torch.float64)
    w2 = torch.randn(d_out, d_h, generator=g, dtype=torch.float64) / d_h**0.5
    ref = torch.stack([((slope * a) @ w2.T).norm(dim=1) for a in lifted])
    out = jvp_norms(slope.float().cuda(), lifted.float().cuda(), w2.float().cuda(), bf16=bf16)
    assert out.shape == (m, n) and torch.isfinite(out).all()
    err = ((out.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert err < (1e-2 if bf16 else 5e-4), err  # tf32 rounded to nearest: ~1e-4, like cuBLAS


@cuda
@pytest.mark.parametrize("matmul", ["tf32", "bf16"])
def test_fused_and_pytorch_jvp_paths_agree(matmul: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("care_core.scoring.FUSED_TF32", True)
    features = _clustered(700, 64, seed=10, dtype=torch.float32).cuda()
    mlp = _mlp(64, 256, 512, seed=11, dtype=torch.float32).cuda()
    u = unit_directions(64, 64, seed=12, device="cuda")
    ref = responses_jvp(features.double(), copy.deepcopy(mlp).double(), u.double())
    fused = responses_jvp(features, mlp, u, matmul)
    monkeypatch.setenv("CARE_DISABLE_TRITON", "1")
    plain = responses_jvp(features, mlp, u, matmul)
    tol = 1e-2 if matmul == "bf16" else 2e-3
    for got in (fused, plain):
        assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < tol


@cuda
@pytest.mark.parametrize(("n", "k"), [(576, 64), (576, 192), (2880, 160), (2880, 640), (100, 100)])
def test_fused_greedy_matches_its_twin_and_the_loop_without_host_syncs(
    n: int, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not triton_enabled(torch.device("cuda")):
        pytest.skip("Triton is not available")
    from care_core.kernels.greedy import greedy_order

    features = _clustered(n, 128, seed=n + k, clusters=32, dtype=torch.float32).cuda()
    weights = torch.rand(n, generator=torch.Generator().manual_seed(k)).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused = diversity_greedy(weights, features, k, 1e-8)
        monkeypatch.setenv("CARE_DISABLE_TRITON", "1")
        loop = diversity_greedy(weights, features, k, 1e-8)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    unit = unit_rows(features, 1e-8)
    gram = unit @ unit.T
    # the kernel and its PyTorch twin read the same cosines: the same order, bit for bit
    assert torch.equal(greedy_order(weights, gram, k).cpu(), diversity_greedy_gram(weights, gram, k).cpu())
    assert fused.unique().numel() == k
    # the loop computes each cosine row by a matvec instead of reading the Gram matrix: rounding may
    # swap a near-tie (~1e-7) somewhere in K steps, so compare the sets
    shared = len(set(fused.tolist()) & set(loop.tolist()))
    assert shared >= 0.97 * k, (shared, k)


@cuda
def test_care_reduce_on_cuda_matches_the_cpu_with_fused_kernels() -> None:
    features = _clustered(400, 32, seed=13)
    mlp = _mlp(32, 256, 256, seed=14)
    positions = torch.rand(400, 2, generator=torch.Generator().manual_seed(15), dtype=torch.float64)
    cfg = CaReConfig()
    cpu = care_reduce(features.float(), mlp.float(), positions.float(), keep=40, config=cfg)
    gpu = care_reduce(features.float().cuda(), mlp.float().cuda(), positions.float().cuda(), keep=40, config=cfg)
    torch.testing.assert_close(gpu.psi_bar.cpu(), cpu.psi_bar, atol=5e-3, rtol=0)
    overlap = len(set(gpu.indices.tolist()) & set(cpu.indices.tolist()))
    assert overlap >= 36  # tf32 scores on the GPU vs float32 on the CPU: near-ties may swap
