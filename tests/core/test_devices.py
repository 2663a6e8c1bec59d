"""Same inputs and seed, same outputs on CPU and CUDA (skipped where no GPU is present); which kernel
path each device gets (CPU and ROCm: PyTorch; NVIDIA CUDA with Triton: the fused kernels)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from care_core import CaReConfig, care_reduce
from care_core.errors import CareError
from care_core.kernels.dispatch import KernelGate, choose_kernel, why_not_fused
from care_core.scoring import unit_directions

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _problem(n: int = 300, d: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.nn.Module, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(6, d, generator=g, dtype=torch.float64) * 3
    features = centres[torch.randint(0, 6, (n,), generator=g)] + torch.randn(n, d, generator=g, dtype=torch.float64)
    projector = torch.nn.Sequential(torch.nn.Linear(d, 64), torch.nn.GELU(), torch.nn.Linear(64, 48)).double()
    return features, projector, torch.rand(n, 2, generator=g, dtype=torch.float64)


def test_directions_do_not_depend_on_device_or_dtype() -> None:
    a = unit_directions(8, 16, seed=3, dtype=torch.float64)
    b = unit_directions(8, 16, seed=3, dtype=torch.float32)
    assert torch.allclose(a.float(), b) and torch.allclose(a.norm(dim=1), torch.ones(8, dtype=torch.float64))


def _stand_in_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import triton`` and ``import triton.language`` succeed (a stand-in where none is installed)."""
    try:
        import triton.language
    except ImportError:
        triton = types.ModuleType("triton")
        language = types.ModuleType("triton.language")
        triton.language = language  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "triton", triton)
        monkeypatch.setitem(sys.modules, "triton.language", language)


def test_dispatch_gives_torch_on_the_cpu() -> None:
    cpu = torch.device("cpu")
    assert choose_kernel("auto", cpu) == "torch" and choose_kernel("torch", cpu) == "torch"
    assert "CUDA device" in (why_not_fused(cpu) or "")
    with pytest.raises(CareError, match="kernel='fused' cannot run here"):
        choose_kernel("fused", cpu)
    with pytest.raises(CareError, match="kernel must be"):
        choose_kernel("triton", cpu)


def test_dispatch_on_nvidia_cuda_and_on_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    _stand_in_triton(monkeypatch)
    monkeypatch.delenv("CARE_DISABLE_TRITON", raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    cuda = torch.device("cuda", 0)
    assert why_not_fused(cuda) is None
    assert choose_kernel("auto", cuda) == "fused" and choose_kernel("fused", cuda) == "fused"
    assert choose_kernel("auto", cuda, applies=False) == "torch" and choose_kernel("torch", cuda) == "torch"
    gate = KernelGate("auto", {"greedy": "CompilationError()"})  # a caller-owned record of a failed build
    assert gate.choose("greedy", cuda) == "torch" and gate.choose("jvp", cuda) == "fused"
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")  # a ROCm build reports its devices as "cuda"
    assert "ROCm" in (why_not_fused(cuda) or "")
    assert choose_kernel("auto", cuda) == "torch"
    with pytest.raises(CareError, match="ROCm"):
        choose_kernel("fused", cuda)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("CARE_DISABLE_TRITON", "1")
    assert choose_kernel("auto", cuda) == "torch"


def test_global_tf32_setting_is_restored() -> None:
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        features, projector, positions = _problem(n=40)
        care_reduce(features.float(), projector.float(), positions, keep=5, config=CaReConfig(engine="fd", m=8))
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(saved)


@cuda
@pytest.mark.parametrize("engine", ["fd", "jvp"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cuda_matches_cpu(engine: str, dtype: torch.dtype) -> None:
    features, projector, positions = _problem()
    cfg = CaReConfig(engine=engine, matmul_precision="float32")  # type: ignore[arg-type]
    cpu = care_reduce(features.to(dtype), projector.to(dtype), positions, keep=40, config=cfg)
    gpu = care_reduce(features.to(dtype).cuda(), projector.to(dtype).cuda(), positions.cuda(), keep=40, config=cfg)
    assert gpu.tokens.device.type == "cuda" and gpu.tokens.dtype == dtype
    tol = 1e-9 if dtype == torch.float64 else 2e-3
    score_tol = 1e-2 if (engine == "fd" and dtype == torch.float32) else tol  # float32 Eq. 1: ~0.5-1% cancellation
    assert torch.allclose(gpu.psi_bar.cpu(), cpu.psi_bar, atol=score_tol)
    if engine == "fd" and dtype == torch.float32:
        # float32 Eq. 1 loses ~0.5% to cancellation (docs/design/care.md §Response engines):
        # scores agree, near-ties may not
        return
    assert torch.equal(gpu.indices.cpu(), cpu.indices)
    assert torch.equal(gpu.signals.cpu(), cpu.signals)
    assert torch.allclose(gpu.tokens.cpu(), cpu.tokens, atol=tol * 10, rtol=tol)


@cuda
def test_cuda_bf16_inputs_are_scored_in_float32() -> None:
    features, projector, positions = _problem()
    red = care_reduce(features.bfloat16().cuda(), projector.bfloat16().cuda(), positions.cuda(), keep=40)
    assert red.tokens.dtype == torch.bfloat16 and red.psi_bar.dtype == torch.float32
    assert torch.isfinite(red.psi_bar).all() and red.indices.numel() == 40


def test_process_device_gives_each_process_its_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from care_core.runs import process_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert process_device("auto", world_size=4, local_rank=2) == "cuda:2"
    assert process_device("cuda", world_size=2, local_rank=1) == "cuda:1"
    for device in ("cpu", "cuda:0"):  # what the user named stays
        assert process_device(device, world_size=4, local_rank=3) == device
    assert process_device("auto", world_size=1, local_rank=3) == "auto"  # one process: resolve_device decides
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert process_device("auto") == "cuda:5"  # torchrun's / accelerate's environment by default
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert process_device("auto") == "cuda:1"  # more processes than GPUs: they share them in turn
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert process_device("auto") == "auto"  # no CUDA: nothing to pick


def test_a_stand_ins_gate_runs_the_kernel_until_it_fails_then_the_original() -> None:
    gate, calls = KernelGate("auto"), []

    def fused(value: int | None) -> int | None:
        calls.append("fused")
        return value

    def broken() -> int:
        calls.append("broken")
        raise ImportError("no Triton here")

    assert gate.fused_or("k", lambda: fused(1), lambda: 2) == 1
    assert gate.fused_or("k", lambda: fused(None), lambda: 2) == 2  # inputs the kernel does not take
    with pytest.warns(UserWarning, match="fused k kernel unavailable"):
        assert gate.fused_or("k", broken, lambda: 3) == 3
    assert gate.fused_or("k", lambda: fused(1), lambda: 4) == 4  # failed once: not tried again on this gate
    assert calls == ["fused", "fused", "broken"] and "no Triton here" in gate.failed["k"]
    with pytest.raises(CareError, match="kernel='fused'"):
        KernelGate("fused").fused_or("k", broken, lambda: 5)
