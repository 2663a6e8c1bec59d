"""The fast code paths give the reference path's results; the core keeps no state.

CPU: the CPU scoring path is the reference code unchanged; the Gram-matrix greedy (the fused GPU
kernel's PyTorch twin) picks the same anchors as the reference loop; the pure functions convert and
draw afresh on every call while a user-owned Scorer keeps its copies (bit-identical results); a fused
kernel that fails to build falls back for that call only (a Scorer remembers), out-of-memory errors
propagate; no module-level container of care_core changes during a call. CUDA (skipped elsewhere):
the fused Triton kernels against float64 and against the PyTorch paths, which path each ``kernel``
setting runs, and no host synchronisation in anchor selection (neither the fused kernel nor the loop).
"""

from __future__ import annotations

import copy
import sys
import types
import warnings
from collections.abc import MutableMapping, MutableSequence, MutableSet
from typing import Any

import pytest
import torch
from torch import nn

from care_core import CaReConfig, Reduction, care_reduce
from care_core.anchors import diversity_greedy, diversity_greedy_gram, unit_rows
from care_core.errors import CareError
from care_core.kernels import dispatch
from care_core.kernels.dispatch import triton_enabled
from care_core.scoring import (
    Scorer,
    perturbation_responses,
    prepare_projector,
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


def _jacobian_norms(features: torch.Tensor, projector: nn.Module, directions: torch.Tensor) -> torch.Tensor:
    """||J_M(v_i) u_x|| from each token's full Jacobian (torch.func.jacrev, reverse mode): the definition, computed
    by a different route than the engine's (forward mode, shared first layer, chunks)."""
    jacobians = torch.stack([torch.func.jacrev(projector)(v) for v in features])  # (N, d_out, d_v)
    return torch.einsum("nov,xv->xno", jacobians, directions).norm(dim=-1)


# ------------------------------------------------------------------------------------------ CPU
def test_triton_is_never_used_on_the_cpu() -> None:
    assert not triton_enabled(torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_jvp_mlp_path_gives_the_jacobian_norms(dtype: torch.dtype) -> None:
    features = _clustered(120, 24, seed=1, dtype=dtype)
    mlp = _mlp(24, 64, 40, seed=2, dtype=dtype)
    u = unit_directions(16, 24, seed=3, dtype=dtype)
    with torch.no_grad():
        got = responses_jvp(features, mlp, u, "float32")
    want = _jacobian_norms(features.double(), _mlp(24, 64, 40, seed=2), u.double())
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


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


def test_prepare_projector_is_pure_and_the_scorer_follows_the_weights() -> None:
    mlp = _mlp(8, 16, 12, seed=0, dtype=torch.float64)
    cpu = torch.device("cpu")
    a = prepare_projector(mlp, torch.float32, cpu)
    b = prepare_projector(mlp, torch.float32, cpu)
    assert a is not b and a is not mlp and next(a.parameters()).dtype == torch.float32  # a copy per call
    assert prepare_projector(mlp, torch.float64, cpu) is mlp
    scorer = Scorer(mlp)
    kept = scorer.prepared(torch.float32, cpu)
    assert scorer.prepared(torch.float32, "cpu") is kept and kept is not mlp
    with torch.no_grad():
        mlp[2].weight.mul_(2)  # an in-place edit bumps the version counter: the copy is made again
    fresh = scorer.prepared(torch.float32, cpu)
    assert fresh is not kept
    torch.testing.assert_close(fresh[2].weight, mlp[2].weight.float())
    mlp[0].weight = nn.Parameter(torch.zeros_like(mlp[0].weight))  # a replaced parameter: made again
    assert torch.equal(scorer.prepared(torch.float32, cpu)[0].weight, torch.zeros(16, 8))
    with torch.no_grad():
        mlp[0].weight.data.fill_(1)  # through .data no counter moves: the documented case for clear()
    assert torch.equal(scorer.prepared(torch.float32, cpu)[0].weight, torch.zeros(16, 8))
    scorer.clear()
    assert torch.equal(scorer.prepared(torch.float32, cpu)[0].weight, torch.ones(16, 8))


def test_the_projector_keeps_its_own_scorer_and_plain_calls_use_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc
    import weakref

    from care_core import scoring

    mlp = _mlp(16, 32, 24, seed=60, dtype=torch.bfloat16)  # scoring needs a float32 copy
    kept = Scorer.for_projector(mlp)
    assert Scorer.for_projector(mlp) is kept and kept.projector is mlp and kept.second_layer == "auto"
    assert "_care_scorer" not in mlp.state_dict() and all(t.dtype == torch.bfloat16 for t in mlp.parameters())
    conversions: list[int] = []
    real = scoring.prepare_projector

    def counted(projector: Any, *args: Any) -> Any:
        out = real(projector, *args)
        conversions.extend([1] if out is not projector else [])  # a converted copy was made
        return out

    monkeypatch.setattr(scoring, "prepare_projector", counted)
    features = _clustered(80, 16, seed=61, dtype=torch.float32)
    positions = torch.rand(80, 2, generator=torch.Generator().manual_seed(62))
    first = care_reduce(features, mlp, positions, keep=10, config=CaReConfig(m=8))
    again = care_reduce(features, mlp, positions, keep=10, config=CaReConfig(m=8))
    assert conversions == [1]  # the second plain call reused the projector's float32 copy
    assert torch.equal(first.psi_bar, again.psi_bar) and torch.equal(first.indices, again.indices)
    copied = copy.deepcopy(mlp)  # a copy gets its own, empty scorer, tied to the copy
    assert Scorer.for_projector(copied) is not kept and Scorer.for_projector(copied).projector is copied
    assert len(conversions) == 1  # copying made no conversion
    gone = weakref.ref(kept)
    del mlp, kept, copied
    gc.collect()
    assert gone() is None  # the scorer lives and dies with its projector
    assert callable(Scorer.for_projector(torch.tanh).projector)  # no module to keep it on: a scorer per call


def test_directions_are_drawn_per_call_and_the_scorer_hands_out_copies() -> None:
    a = unit_directions(8, 16, seed=5)
    a.mul_(0)
    b = unit_directions(8, 16, seed=5)
    torch.testing.assert_close(b.norm(dim=1), torch.ones(8))
    scorer = Scorer(nn.Identity())
    c = scorer.directions(8, 16, seed=5)
    c.mul_(0)
    d = scorer.directions(8, 16, seed=5)
    assert torch.equal(d, b) and not torch.equal(d, scorer.directions(8, 16, seed=6))


@pytest.mark.parametrize(
    ("features_dtype", "projector_dtype", "engine"),
    [
        (torch.float32, torch.bfloat16, "jvp"),
        (torch.float64, torch.float64, "jvp"),
        (torch.float32, torch.float32, "fd"),
    ],
)
def test_scorer_gives_bit_identical_results(
    features_dtype: torch.dtype, projector_dtype: torch.dtype, engine: str
) -> None:
    features = _clustered(150, 16, seed=7, dtype=features_dtype)
    mlp = _mlp(16, 32, 24, seed=8, dtype=projector_dtype)
    positions = torch.rand(150, 2, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    cfg = CaReConfig(m=16, engine=engine)  # type: ignore[arg-type]
    plain = care_reduce(features, mlp, positions, keep=20, config=cfg)
    scorer = Scorer(mlp)
    for _ in range(2):  # the second call reuses the prepared projector and directions
        kept = care_reduce(features, mlp, positions, keep=20, config=cfg, scorer=scorer)
        for name in ("indices", "anchor_order", "tokens", "signals", "psi_bar", "confidence"):
            assert torch.equal(getattr(plain, name), getattr(kept, name)), name


def test_scorer_for_another_projector_is_refused() -> None:
    features = _clustered(30, 8, seed=1)
    positions = torch.rand(30, 2, dtype=torch.float64)
    with pytest.raises(CareError, match="another projector"):
        care_reduce(features, _mlp(8, 16, 8, seed=2), positions, keep=5, scorer=Scorer(_mlp(8, 16, 8, seed=2)))


def test_kernel_setting_is_validated_and_fused_on_the_cpu_is_a_clear_error() -> None:
    with pytest.raises(CareError, match="kernel"):
        CaReConfig(kernel="cuda")  # type: ignore[arg-type]
    features = _clustered(40, 8, seed=3)
    positions = torch.rand(40, 2, dtype=torch.float64)
    with pytest.raises(CareError, match=r"kernel='fused' cannot run here.*CUDA"):
        care_reduce(features, _mlp(8, 16, 8, seed=4), positions, keep=5, config=CaReConfig(m=4, kernel="fused"))
    with pytest.raises(CareError, match="kernel='fused'"):
        diversity_greedy(torch.rand(40), features.float(), 5, 1e-8, kernel="fused")


def _compile_error(monkeypatch: pytest.MonkeyPatch) -> Exception:
    """An instance of (a subclass of) Triton's CompilationError; a stand-in Triton where none is installed."""
    try:
        from triton.compiler.errors import CompilationError
    except ImportError:
        triton = types.ModuleType("triton")
        compiler = types.ModuleType("triton.compiler")
        errors = types.ModuleType("triton.compiler.errors")
        errors.CompilationError = type("CompilationError", (Exception,), {})  # type: ignore[attr-defined]
        compiler.errors = errors  # type: ignore[attr-defined]
        triton.compiler = compiler  # type: ignore[attr-defined]
        for name, module in (("triton", triton), ("triton.compiler", compiler), ("triton.compiler.errors", errors)):
            monkeypatch.setitem(sys.modules, name, module)
        CompilationError = errors.CompilationError  # type: ignore[attr-defined]

    class FakeCompilationError(CompilationError):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            Exception.__init__(self, "inline asm cannot be compiled")

        def __str__(self) -> str:
            return "inline asm cannot be compiled"

    assert issubclass(FakeCompilationError, dispatch.kernel_errors())
    return FakeCompilationError()


def _failing(monkeypatch: pytest.MonkeyPatch, name: str, error: BaseException) -> list[int]:
    """Make the fused kernels "available" on this machine and kernel `name` raise `error`; counts calls."""
    calls: list[int] = []

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        raise error

    monkeypatch.setattr(dispatch, "why_not_fused", lambda device: None)
    monkeypatch.setattr(dispatch, name, broken)
    return calls


def _jvp_problem() -> tuple[torch.Tensor, nn.Module, torch.Tensor]:
    """float32, shapes the fused jvp kernel tiles (d_h % 64 == 0, d_out % 256 == 0)."""
    features = _clustered(90, 16, seed=20, dtype=torch.float32)
    return features, _mlp(16, 64, 256, 21, torch.float32), unit_directions(8, 16, 22)


def test_jvp_dispatch_uses_the_fused_kernel_where_the_setting_says(monkeypatch: pytest.MonkeyPatch) -> None:
    features, mlp, u = _jvp_problem()
    calls: list[bool] = []

    def fake(slope: torch.Tensor, lifted: torch.Tensor, w2: torch.Tensor, *, bf16: bool, rounded: bool) -> torch.Tensor:
        calls.append(bf16)
        assert rounded and w2.dtype == (torch.bfloat16 if bf16 else torch.float32)  # the kernel's operand, given
        return torch.zeros(lifted.shape[0], slope.shape[0])

    monkeypatch.setattr(dispatch, "why_not_fused", lambda device: None)
    monkeypatch.setattr(dispatch, "jvp_norms", fake)
    run = lambda matmul, kernel: perturbation_responses(features, mlp, u, h=5e-4, matmul=matmul, kernel=kernel)  # noqa: E731
    assert torch.equal(run("bf16", "auto"), torch.zeros(8, 90)) and calls == [True]
    assert run("tf32", "auto").abs().min() > 0 and calls == [True]  # tf32 stays on cuBLAS in auto mode
    assert torch.equal(run("tf32", "fused"), torch.zeros(8, 90)) and calls == [True, False]
    assert run("bf16", "torch").abs().min() > 0 and run("float32", "fused").abs().min() > 0
    assert calls == [True, False]


def test_a_scorer_makes_each_kernel_operand_once_until_the_weights_change(monkeypatch: pytest.MonkeyPatch) -> None:
    features, mlp, u = _jvp_problem()
    made: list[tuple[int, ...]] = []

    def operand(w: torch.Tensor, *, bf16: bool) -> torch.Tensor:
        made.append(tuple(w.shape))
        return w.to(torch.bfloat16)

    monkeypatch.setattr(dispatch, "why_not_fused", lambda device: None)
    monkeypatch.setattr(dispatch, "jvp_norms", lambda s, a, w2, **kw: torch.zeros(a.shape[0], s.shape[0]))
    monkeypatch.setattr(dispatch, "weight_operand", operand)
    scorer = Scorer(mlp)
    for _ in range(3):
        scorer.responses(features, u, h=5e-4, matmul="bf16")
    assert made == [(256, 64)]  # W2 converted on the first call only
    perturbation_responses(features, mlp, u, h=5e-4, matmul="bf16")  # a call without a scorer: its own, each time
    assert len(made) == 2
    with torch.no_grad():
        mlp[2].weight.mul_(2.0)  # edited in place: the scorer's operands go with its other caches
    scorer.responses(features, u, h=5e-4, matmul="bf16")
    scorer.responses(features, u, h=5e-4, matmul="bf16")
    assert len(made) == 3
    with torch.inference_mode():  # inference tensors keep no version counter: the key does without one
        fresh = Scorer(_mlp(16, 64, 256, 21, torch.float32))
        fresh.responses(features, u, h=5e-4, matmul="bf16")
    assert len(made) == 4


def test_the_pytorch_path_in_bf16_converts_w2_once_for_a_scorer(monkeypatch: pytest.MonkeyPatch) -> None:
    features, mlp, u = _jvp_problem()
    made: list[tuple[int, ...]] = []
    real = dispatch.weight_operand

    def operand(w: torch.Tensor, *, bf16: bool) -> torch.Tensor:
        made.append(tuple(w.shape))
        return real(w, bf16=bf16)

    monkeypatch.setattr(dispatch, "weight_operand", operand)
    scorer = Scorer(mlp)
    first = scorer.responses(features, u, h=5e-4, matmul="bf16", kernel="torch")
    for _ in range(2):
        assert torch.equal(scorer.responses(features, u, h=5e-4, matmul="bf16", kernel="torch"), first)
    assert made == [(256, 64)]  # W2 in bf16, made on the first call only
    want = perturbation_responses(features, mlp, u, h=5e-4, matmul="bf16", kernel="torch")
    assert torch.equal(first, want) and len(made) == 2  # a call without a scorer: its own conversion, same result


def test_a_kernel_that_fails_to_build_falls_back_for_that_call_only(monkeypatch: pytest.MonkeyPatch) -> None:
    features, mlp, u = _jvp_problem()
    reference = perturbation_responses(features, mlp, u, h=5e-4, matmul="bf16", kernel="torch")
    calls = _failing(monkeypatch, "jvp_norms", _compile_error(monkeypatch))
    for attempt in (1, 2):  # not sticky: the next call tries the kernel again
        with pytest.warns(UserWarning, match="fused jvp kernel unavailable"):
            got = perturbation_responses(features, mlp, u, h=5e-4, matmul="bf16")
        assert torch.equal(got, reference) and len(calls) == attempt
    with pytest.raises(CareError, match="fused jvp kernel cannot be built"):
        perturbation_responses(features, mlp, u, h=5e-4, matmul="bf16", kernel="fused")
    scorer = Scorer(mlp)  # a scorer remembers the failure for its own lifetime
    with pytest.warns(UserWarning):
        scorer.responses(features, u, h=5e-4, matmul="bf16")
    before = len(calls)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="care: ")
        assert torch.equal(scorer.responses(features, u, h=5e-4, matmul="bf16"), reference)
    assert len(calls) == before and set(scorer.kernel_failures) == {"jvp"}
    scorer.clear()
    assert scorer.kernel_failures == {}


def test_greedy_kernel_that_fails_to_build_falls_back_for_that_call_only(monkeypatch: pytest.MonkeyPatch) -> None:
    features = _clustered(200, 16, seed=30, dtype=torch.float32)
    weights = torch.rand(200, generator=torch.Generator().manual_seed(31))
    reference = diversity_greedy(weights, features, 25, 1e-8, kernel="torch")
    calls = _failing(monkeypatch, "greedy_orders", _compile_error(monkeypatch))
    for attempt in (1, 2):
        with pytest.warns(UserWarning, match="fused greedy kernel unavailable"):
            assert torch.equal(diversity_greedy(weights, features, 25, 1e-8), reference)
        assert len(calls) == attempt
    with pytest.raises(CareError, match="fused greedy kernel cannot be built"):
        diversity_greedy(weights, features, 25, 1e-8, kernel="fused")


def test_missing_kernel_module_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    features, mlp, u = _jvp_problem()
    calls = _failing(monkeypatch, "jvp_norms", ModuleNotFoundError("No module named 'triton'"))
    with pytest.warns(UserWarning, match="fused jvp kernel unavailable"):
        perturbation_responses(features, mlp, u, h=5e-4, matmul="bf16")
    assert calls == [1]


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("illegal address")])
def test_out_of_memory_and_other_runtime_errors_propagate(error: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    features, mlp, u = _jvp_problem()
    _failing(monkeypatch, "jvp_norms", error)
    _failing(monkeypatch, "greedy_orders", error)
    scorer = Scorer(mlp)
    with pytest.raises(type(error), match=str(error)):
        perturbation_responses(features, mlp, u, h=5e-4, matmul="bf16")
    with pytest.raises(type(error), match=str(error)):
        scorer.responses(features, u, h=5e-4, matmul="bf16")
    with pytest.raises(type(error), match=str(error)):
        diversity_greedy(torch.rand(90), features, 5, 1e-8)
    assert scorer.kernel_failures == {}


def _module_state() -> dict[str, object]:
    """Every care_core module's global names and a fingerprint of its mutable containers."""
    state: dict[str, object] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("care_core") or module is None:
            continue
        names = sorted(k for k, v in vars(module).items() if not isinstance(v, types.ModuleType))
        state[name] = [k for k in names if k != "__warningregistry__"]
        for key, value in vars(module).items():
            if key in ("__builtins__", "__warningregistry__"):
                continue
            if isinstance(value, MutableMapping):
                state[f"{name}.{key}"] = [(id(k), id(v)) for k, v in list(value.items())]
            elif isinstance(value, (MutableSequence, MutableSet)):
                state[f"{name}.{key}"] = sorted(map(id, value))
    return state


def test_no_module_state_changes_during_a_call() -> None:
    features = _clustered(120, 16, seed=40, dtype=torch.float32)
    mlp = _mlp(16, 32, 24, seed=41, dtype=torch.bfloat16)  # a converted copy is needed
    positions = torch.rand(120, 2, generator=torch.Generator().manual_seed(42))
    cfg = CaReConfig(m=8, seed=12345)  # directions never drawn before in this process
    before = _module_state()
    assert "care_core.scoring" in before and "care_core.anchors" in before
    care_reduce(features, mlp, positions, keep=10, config=cfg)
    care_reduce(features.double(), mlp, positions, keep=10, config=CaReConfig(m=4, seed=54321, engine="fd"))
    care_reduce(features, mlp, positions, keep=10, config=cfg, scorer=Scorer(mlp))
    assert _module_state() == before


def test_unknown_engine_is_an_error() -> None:
    features = _clustered(20, 8, seed=4)
    with pytest.raises(ValueError, match="unknown engine"):
        perturbation_responses(features, _mlp(8, 16, 8, seed=5), unit_directions(4, 8, seed=6), h=5e-4, engine="nope")


def test_images_are_packed_into_passes_of_bounded_rows() -> None:
    from care_core._chunks import CHUNK_ELEMENTS, row_groups, two_pass_rows

    # by hand: 5 + 3 = 8 fits a limit of 8; 4 starts a new pass; 10 exceeds the limit and goes alone; 2 after it
    assert row_groups([5, 3, 4, 10, 2], 8) == [[0, 1], [2], [3], [4]]
    assert row_groups([7], 3) == [[0]]
    # one direction's two (rows, max(d_v, d_out)) intermediates: 2^26 / (2 * 4096) rows at LLaVA-NeXT's widths
    assert two_pass_rows(1024, 4096) == 8192 and CHUNK_ELEMENTS == 2 * 8192 * 4096
    assert two_pass_rows(1 << 27, 8) == 1


class _RowCounter:
    """A projector (a callable with ``out_features``, so nothing probes its width) recording each call's rows."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.rows = module, []
        self.out_features = module[2].out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(int(x.shape[0]))
        return self.module(x)


@pytest.mark.parametrize("engine", ["fd", "jvp"])
def test_joint_responses_give_each_image_its_own_within_the_row_bound(engine: str) -> None:
    from care_core.scoring import joint_responses

    sizes, m = (42, 56, 49, 90), 6
    features = [_clustered(n, 8, seed=n) for n in sizes]
    projector = _RowCounter(_mlp(8, 16, 12, seed=3))
    directions = unit_directions(m, 8, seed=5, dtype=torch.float64)
    got = joint_responses(features, projector, directions, h=1e-3, engine=engine, max_rows=100)
    for c, v in zip(got, features, strict=True):
        # alone through the same code path (a wrapped MLP is no Linear-act-Linear to the engines: Eq. 1 literally)
        want = perturbation_responses(v, _RowCounter(projector.module), directions, h=1e-3, engine=engine)
        assert c.shape == want.shape and c.is_contiguous()
        torch.testing.assert_close(c, want, rtol=1e-12, atol=1e-14)
    if engine == "fd":  # passes of 42 + 56, 49 and 90 rows (at most 100), each direction at +h and -h
        assert sorted(set(projector.rows)) == sorted({m * 98, m * 49, m * 90})
        assert len(projector.rows) == 2 * 3


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
    if not triton_enabled(torch.device("cuda")):
        pytest.skip("Triton is not available")
    features = _clustered(700, 64, seed=10, dtype=torch.float32).cuda()
    mlp = _mlp(64, 256, 512, seed=11, dtype=torch.float32).cuda()
    u = unit_directions(64, 64, seed=12, device="cuda")
    ref = responses_jvp(features.double(), copy.deepcopy(mlp).double(), u.double())
    calls: list[bool] = []
    real = dispatch.jvp_norms
    monkeypatch.setattr(dispatch, "jvp_norms", lambda *a, **kw: calls.append(True) or real(*a, **kw))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="care: ")  # a fallback would warn
        fused = responses_jvp(features, mlp, u, matmul, kernel="fused")
    assert calls == [True]
    plain = responses_jvp(features, mlp, u, matmul, kernel="torch")
    assert calls == [True]
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
    from care_core.kernels.greedy import greedy_orders

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
    fused_alone = greedy_orders(weights, gram.reshape(-1), [n], [k])[0]
    assert torch.equal(fused_alone.cpu(), diversity_greedy_gram(weights, gram, k).cpu())
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


@cuda
def test_kernel_settings_on_cuda_run_the_paths_they_name(monkeypatch: pytest.MonkeyPatch) -> None:
    if not triton_enabled(torch.device("cuda")):
        pytest.skip("Triton is not available")
    features = _clustered(576, 64, seed=50, dtype=torch.float32).cuda()
    mlp = _mlp(64, 256, 512, seed=51, dtype=torch.float32).cuda()
    positions = torch.rand(576, 2, generator=torch.Generator().manual_seed(52)).cuda()
    calls = {"jvp_norms": 0, "greedy_orders": 0}
    for name in calls:
        real = getattr(dispatch, name)

        def counted(*args: object, name: str = name, real: object = real, **kwargs: object) -> torch.Tensor:
            calls[name] += 1
            return real(*args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(dispatch, name, counted)

    def reduce(**settings: Any) -> Reduction:
        return care_reduce(features, mlp, positions, keep=64, config=CaReConfig(**settings))

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="care: ")  # a fallback would warn
        # a plain call scores through the scorer kept on the projector: on CUDA its second layer goes through the
        # triangular factor, where the fused kernel is the tf32 default (docs/design/care.md §Response engines)
        default = reduce()
        assert calls == {"jvp_norms": 1, "greedy_orders": 1}
        reduce(matmul_precision="bf16")
        assert calls == {"jvp_norms": 2, "greedy_orders": 2}
        fused = reduce(kernel="fused")
        assert calls == {"jvp_norms": 3, "greedy_orders": 3}
        plain = reduce(kernel="torch")  # no fused kernel at all
        assert calls == {"jvp_norms": 3, "greedy_orders": 3}
    for got in (fused, plain):
        torch.testing.assert_close(got.psi_bar, default.psi_bar, atol=2e-3, rtol=0)
        shared = len(set(got.indices.tolist()) & set(default.indices.tolist()))
        assert shared >= 60


@cuda
def test_plain_care_reduce_on_cuda_goes_through_the_projectors_factor() -> None:
    features = _clustered(576, 64, seed=53, dtype=torch.float32).cuda()
    mlp = _mlp(64, 256, 512, seed=54, dtype=torch.float32).cuda().bfloat16()
    positions = torch.rand(576, 2, generator=torch.Generator().manual_seed(55)).cuda()
    cfg = CaReConfig(matmul_precision="bf16")
    plain = care_reduce(features, mlp, positions, keep=64, config=cfg)
    kept_on_projector = Scorer.for_projector(mlp)
    assert kept_on_projector._factors.get((torch.float32, features.device)) is not None  # made by the plain call
    scorer = Scorer(mlp)  # a user-owned scorer: the same settings, the same kernels, the same results
    for _ in range(2):
        kept = care_reduce(features, mlp, positions, keep=64, config=cfg, scorer=scorer)
        assert torch.equal(kept.indices, plain.indices) and torch.equal(kept.signals, plain.signals)
        torch.testing.assert_close(kept.psi_bar, plain.psi_bar, atol=1e-6, rtol=0)
    assert scorer.kernel_failures == {}


@cuda
@pytest.mark.parametrize("matmul", ["tf32", "bf16"])
def test_factor_on_cuda_is_as_accurate_as_the_dense_second_layer(matmul: str) -> None:
    """The scorer's promise: through R the responses and psi_bar are no further from float64 than W2's."""
    features = _clustered(576, 64, seed=56, dtype=torch.float32)
    mlp = _mlp(64, 256, 512, seed=57, dtype=torch.float64)
    positions = torch.rand(576, 2, generator=torch.Generator().manual_seed(58))
    cfg = CaReConfig(matmul_precision=matmul)  # type: ignore[arg-type]
    exact = care_reduce(features.double(), mlp, positions.double(), keep=64, config=CaReConfig())
    u = unit_directions(cfg.m, 64, cfg.seed, device="cuda")
    ref = responses_jvp(features.double(), mlp, u.cpu().double())
    gpu = features.cuda(), copy.deepcopy(mlp).float().cuda(), positions.cuda()
    errors: dict[str, tuple[float, float, int]] = {}
    for layer in ("dense", "triangular"):
        scorer = Scorer(gpu[1], second_layer=layer)
        c = scorer.responses(gpu[0], u, h=cfg.h, matmul=matmul).double().cpu()
        red = care_reduce(*gpu, keep=64, config=cfg, scorer=scorer)
        shared = len(set(red.indices.tolist()) & set(exact.indices.tolist()))
        errors[layer] = (((c - ref).abs().max() / ref.abs().max()).item(),
                         (red.psi_bar.double().cpu() - exact.psi_bar).abs().max().item(), shared)  # fmt: skip
    (c_dense, psi_dense, shared_dense), (c_tri, psi_tri, shared_tri) = errors["dense"], errors["triangular"]
    assert c_tri <= 2 * c_dense + 1e-6, errors
    assert psi_tri <= 2 * psi_dense + 1e-4, errors
    assert shared_tri >= shared_dense - 2, errors  # near-ties may swap, as between any two kernels


# ------------------------------------------------------------------------------------------------------------
# the generic jvp path (projectors that are not Linear-act-Linear, e.g. Qwen2.5-VL's merger)
class _NormedMLP(nn.Module):
    """LayerNorm then an MLP: not recognised as Linear-act-Linear, so the generic jvp path scores it."""

    def __init__(self, d_v: int, d_h: int, d_out: int) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(d_v), _mlp(d_v, d_h, d_out, seed=3)
        self.out_features = d_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x))


def _jvp_one_by_one(features: torch.Tensor, projector: nn.Module, directions: torch.Tensor) -> torch.Tensor:
    """||J u|| direction by direction, token by token batch: the definition, no vmap, no chunks."""
    rows = []
    for u in directions:
        _, jv = torch.func.jvp(projector, (features,), (u.expand_as(features),))
        rows.append(jv.norm(dim=-1))
    return torch.stack(rows)


@pytest.mark.parametrize("vmap_fails", [False, True])
def test_generic_jvp_path_matches_the_definition_with_or_without_vmap(vmap_fails: bool, monkeypatch) -> None:
    from care_core import scoring

    calls: list[int] = []
    rows_path = scoring._jvp_rows
    monkeypatch.setattr(scoring, "_jvp_rows", lambda *a: calls.append(1) or rows_path(*a))
    if vmap_fails:  # a projector whose ops vmap cannot batch: the error torch.func raises then

        def no_vmap(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("vmap: this operation has no batching rule")

        monkeypatch.setattr(torch.func, "vmap", no_vmap)
    features = _clustered(37, 12, seed=5)
    projector = _NormedMLP(12, 24, 16).double()
    directions = unit_directions(9, 12, seed=2, dtype=torch.float64)
    got = responses_jvp(features, projector, directions)
    assert len(calls) == int(vmap_fails)  # vmap batches the directions; the row-by-row path only as a fallback
    want = _jvp_one_by_one(features, projector, directions)
    assert got.shape == (9, 37)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    fd = perturbation_responses(features, projector, directions, h=1e-6, engine="fd")
    torch.testing.assert_close(got, fd, rtol=1e-6, atol=1e-9)  # Eq. 1's h -> 0 limit


def test_the_kernel_is_tuned_once_for_one_image_and_once_for_a_batch() -> None:
    from care_core.kernels.shapes import size_class

    # by hand: LLaVA-1.5 (576), NeXT (2880) and Qwen images up to 4095 rows are one class; batches another
    assert {size_class(n) for n in (1, 576, 2880, 4095)} == {0}
    assert {size_class(16 * n) for n in range(576, 2881, 48)} == {1}
