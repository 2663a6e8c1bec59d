"""CaRe's single-image reduction replayed from a CUDA graph (docs/design/generation.md §Reduction graphs): when it
applies, what its key names, that the CPU path is unchanged, the capture/replay bookkeeping (on the CPU through a
stand-in graph), and on CUDA that a replay is the eager reduction bit for bit on every trained demo's projector."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

import care_core.calibration
import care_core.care
from care_core import CaReConfig, care_reduce, reduce_visual_tokens
from care_core.backbones import DEMO_BACKBONES, load_backbone
from care_core.backbones._hf import quiet_transformers
from care_core.budget import Budget
from care_core.care import Reduction, _replayed, graph_key, graph_reason
from care_core.methods import MethodInputs, MethodResult, build_method
from care_core.methods.care_family import method_graph_reason, prca_key, prca_order_key
from care_core.pipeline import ReductionPipeline
from care_core.reduction_graphs import MAX_GRAPHS, ReductionGraphs
from care_core.scoring import Scorer
from care_core.timing import StageClock
from tests.core._problems import scene_image

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TRAINED_DEMOS = [name for name, spec in DEMO_BACKBONES.items() if spec.weights and spec.shipped]  # the six
CUDA = torch.device("cuda")  # a device object only: nothing here touches a GPU unless cuda_only


def _problem(n: int = 60, d_v: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.nn.Sequential, torch.Tensor]:
    """Features, a Linear-GELU-Linear projector and grid-free positions."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    projector = torch.nn.Sequential(torch.nn.Linear(d_v, 16), torch.nn.GELU(), torch.nn.Linear(16, 12))
    return torch.randn(n, d_v, generator=g), projector, torch.rand(n, 2, generator=g)


def _fields(red: Reduction) -> dict[str, torch.Tensor]:
    cal = red.calibration
    return {"indices": red.indices, "anchor_order": red.anchor_order, "tokens": red.tokens, "psi_bar": red.psi_bar,
            "residuals": cal.residuals, "confidence": cal.confidence, "accepted": cal.accepted,
            "nearest": cal.nearest}  # fmt: skip


def _assert_bitwise(got: Reduction, want: Reduction) -> None:
    for name, value in _fields(want).items():
        other = _fields(got)[name]
        assert other.dtype == value.dtype and torch.equal(other, value), name


# ------------------------------------------------------------------------------ when it applies
def test_graphs_replay_only_a_fresh_untimed_reduction_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert graph_reason(CUDA) is None
    assert "CUDA device" in str(graph_reason(torch.device("cpu")))
    assert "stage timer" in str(graph_reason(CUDA, stage_timer=StageClock(timed=False)))
    assert "memo" in str(graph_reason(CUDA, psi_bar=torch.zeros(4)))
    assert "memo" in str(graph_reason(CUDA, anchor_order=torch.zeros(2, dtype=torch.long)))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert "capturing" in str(graph_reason(CUDA))


def test_graph_key_changes_with_every_shape_and_setting_the_capture_depends_on() -> None:
    v, projector, _ = _problem()
    scorer = Scorer(projector)
    cfg = CaReConfig(m=6)
    u = scorer.directions(6, 8, cfg.seed)
    key = graph_key(v, 5, cfg, u, scorer)
    assert graph_key(torch.randn(60, 8), 5, cfg, torch.randn(6, 8), scorer) == key  # values are inputs, not keys
    changed = {
        "K": graph_key(v, 6, cfg, u, scorer),
        "N": graph_key(v[:-1], 5, cfg, u, scorer),
        "d_v": graph_key(torch.randn(60, 9), 5, cfg, torch.randn(6, 9), scorer),
        "dtype": graph_key(v.double(), 5, cfg, u.double(), scorer),
        "config": graph_key(v, 5, dataclasses.replace(cfg, alpha=0.3), u, scorer),
        "seed": graph_key(v, 5, dataclasses.replace(cfg, seed=1), u, scorer),
        "kernel": graph_key(v, 5, dataclasses.replace(cfg, kernel="torch"), u, scorer),
        "directions": graph_key(v, 5, cfg, u[:-1], scorer),
        "projector": graph_key(v, 5, cfg, u, Scorer(_problem()[1])),
    }
    for what, other in changed.items():
        assert other != key, what
    with torch.no_grad():
        first = projector[0]
        assert isinstance(first, torch.nn.Linear)
        first.weight.add_(0.0)  # an in-place edit: the version counter moves, the weights may not have
    assert graph_key(v, 5, cfg, u, scorer) != key
    edited = graph_key(v, 5, cfg, u, scorer)
    scorer.gate("auto").failed["jvp"] = "a build error"  # a kernel that failed changes the path the capture takes
    assert graph_key(v, 5, cfg, u, scorer) != edited


# ------------------------------------------------------------------------------ the CPU: nothing changes
def test_graphs_on_the_cpu_leave_care_reduce_as_it_is_and_capture_nothing() -> None:
    v, projector, p = _problem()
    graphs = ReductionGraphs()
    for keep in (5, 60):
        got = care_reduce(v, projector, p, keep=keep, config=CaReConfig(m=6), graphs=graphs)
        want = care_reduce(v, projector, p, keep=keep, config=CaReConfig(m=6))
        _assert_bitwise(got, want)
    assert (len(graphs), graphs.captures, graphs.replays, graphs.failures) == (0, 0, 0, {})


def test_pipeline_hands_its_graphs_to_methods_unless_turned_off() -> None:
    pipe = ReductionPipeline.from_pretrained("tiny-llava", methods=["care"], device="cpu")
    tokens = pipe.encode(scene_image((224, 224)))
    assert pipe.method_inputs(tokens, None).graphs is pipe.reduction_graphs
    assert pipe.method_inputs(tokens, None, cuda_graph=True).graphs is pipe.reduction_graphs
    assert pipe.method_inputs(tokens, None, cuda_graph=False).graphs is None
    result = pipe(tokens, None, [Budget.keep(16)])
    pipe.time_answers(result, max_new_tokens=1, repeats=1)  # the re-run from the features: eager on the CPU
    assert (len(pipe.reduction_graphs), pipe.reduction_graphs.captures, pipe.reduction_graphs.failures) == (0, 0, {})


def test_release_graphs_frees_the_reduction_graphs_and_the_decoding_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = ReductionPipeline.from_pretrained("tiny-llava", methods=["care"], device="cpu")
    freed: list[str] = []
    monkeypatch.setattr(pipe.reduction_graphs, "release", lambda: freed.append("reductions"))
    monkeypatch.setattr(pipe.adapter, "release_decoding_cache", lambda: freed.append("decoding"))
    pipe.release_graphs()
    assert freed == ["reductions", "decoding"]


# ------------------------------------------------------------------------------ bookkeeping, with a stand-in graph
def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _tensors(getattr(value, f.name))]
    if isinstance(value, tuple):
        return [t for item in value for t in _tensors(item)]
    return []


class _StandInGraph:
    """What a CUDA graph does, on the CPU: a replay recomputes the step on the static inputs into the outputs."""

    def __init__(self, step: Callable[[Any], Any], statics: tuple[torch.Tensor, ...], outputs: Any) -> None:
        self.step, self.statics, self.outputs = step, statics, outputs

    def replay(self) -> None:
        for static, value in zip(_tensors(self.outputs), _tensors(self.step(self.statics)), strict=True):
            static.copy_(value)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> list[BaseException | None]:
    """ReductionGraphs on the CPU: no side stream, captures made by :class:`_StandInGraph` (``failure[0]``, where
    set, is raised by the next capture instead)."""
    failure: list[BaseException | None] = [None]

    @contextmanager
    def no_stream(self: ReductionGraphs, device: torch.device) -> Iterator[None]:
        yield

    def capture(self: ReductionGraphs, statics: Any, step: Any, device: torch.device) -> tuple[Any, Any]:
        if failure[0] is not None:
            raise failure[0]
        outputs = step(statics)
        self.captures += 1
        return _StandInGraph(step, statics, outputs), outputs

    monkeypatch.setattr(ReductionGraphs, "_side_stream", no_stream)
    monkeypatch.setattr(ReductionGraphs, "_capture", capture)
    return failure


def test_a_replay_gives_each_call_its_own_inputs_reduction(stand_in: list[BaseException | None]) -> None:
    """Through care's captured step: the static inputs are everything the reduction reads (features, positions,
    directions), so new ones after the capture give their own eager result, and results are not the static
    outputs (a later replay leaves an earlier result as it was)."""
    graphs = ReductionGraphs()
    _, projector, _ = _problem()
    scorer, cfg = Scorer(projector), CaReConfig(m=6)
    calls = [_problem(seed=s)[::2] for s in (1, 2, 3, 1)]  # (features, positions); the last repeats the first
    results = []
    for v, p in calls:
        results.append(_replayed(graphs, v, p, 7, cfg, None, scorer))
        _assert_bitwise(results[-1], care_reduce(v, projector, p, keep=7, config=cfg, scorer=scorer))
    _assert_bitwise(results[1], care_reduce(calls[1][0], projector, calls[1][1], keep=7, config=cfg))
    assert (graphs.captures, graphs.replays, len(graphs)) == (1, 3, 1)
    g = torch.Generator().manual_seed(5)
    given = torch.nn.functional.normalize(torch.randn(6, 8, generator=g), dim=1)  # explicit directions: an input too
    v, p = calls[2]
    got = _replayed(graphs, v, p, 7, cfg, given, scorer)
    _assert_bitwise(got, care_reduce(v, projector, p, keep=7, config=cfg, directions=given))
    assert graphs.replays == 4
    assert got.tokens is got.calibration.tokens  # one output tensor stays one after the clone (float32: as eager)


def test_a_failed_capture_is_recorded_and_its_key_runs_eagerly(stand_in: list[BaseException | None]) -> None:
    graphs = ReductionGraphs()
    stand_in[0] = RuntimeError("operation not permitted when stream is capturing\nsecond line")
    step_calls: list[int] = []

    def step(statics: tuple[torch.Tensor, ...]) -> torch.Tensor:
        step_calls.append(1)
        return statics[0] * 2

    x = torch.arange(4.0)
    assert torch.equal(graphs.run("k", [x], step), x * 2)  # the first call's eager result stands
    assert graphs.failures == {"k": "capturing the reduction failed (RuntimeError: operation not permitted when "
                                    "stream is capturing second line)"}  # fmt: skip
    stand_in[0] = None  # captures would work now: the key stays eager anyway
    assert torch.equal(graphs.run("k", [x + 1], step), (x + 1) * 2)
    assert (graphs.captures, graphs.replays, len(graphs), len(step_calls)) == (0, 0, 0, 2)


def test_out_of_memory_during_a_capture_releases_every_graph_and_propagates(
    stand_in: list[BaseException | None],
) -> None:
    graphs = ReductionGraphs()
    graphs.run("a", [torch.ones(3)], lambda s: s[0] + 1)
    assert len(graphs) == 1
    stand_in[0] = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(torch.OutOfMemoryError):
        graphs.run("b", [torch.ones(3)], lambda s: s[0] + 1)
    assert len(graphs) == 0 and graphs.failures == {}  # not the computation's fault: "b" may capture later


def test_graphs_keep_the_most_recently_used_keys(stand_in: list[BaseException | None]) -> None:
    graphs = ReductionGraphs()

    def call(key: object) -> None:
        graphs.run(key, [torch.ones(2)], lambda s: s[0] * 3)

    for number in range(MAX_GRAPHS + 2):  # keys 0 and 1 are dropped
        call(number)
    call(2)  # a replay: key 2 becomes the most recent, key 3 the least
    call("new")  # drops key 3
    assert (len(graphs), graphs.captures, graphs.replays) == (MAX_GRAPHS, MAX_GRAPHS + 3, 1)
    for key in (2, 4, MAX_GRAPHS + 1, "new"):  # kept: replayed
        call(key)
    assert (graphs.captures, graphs.replays) == (MAX_GRAPHS + 3, 5)
    call(3)  # dropped: captured anew
    assert graphs.captures == MAX_GRAPHS + 4


# ------------------------------------------------------------------------------ the paths users answer through
@pytest.fixture
def cpu_graphs(monkeypatch: pytest.MonkeyPatch, stand_in: list[BaseException | None]) -> None:
    """The graph path forced on the CPU: care_core.care.graph_reason judges the features as if on CUDA (every other
    condition as it is), and captures are stand-in graphs (:func:`stand_in`)."""
    real = care_core.care.graph_reason
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(care_core.care, "graph_reason", lambda _device, **kwargs: real(CUDA, **kwargs))


CARE = build_method("care", CaReConfig(m=6))
PROJECTOR = _problem()[1]  # one for every image, so that two images can share one scoring pass


def _inputs(seed: int, graphs: ReductionGraphs | None, **changes: Any) -> MethodInputs:
    """One image's method inputs (the features and positions of :func:`_problem`), with a fresh memo."""
    v, _, p = _problem(seed=seed)
    return dataclasses.replace(MethodInputs(v, PROJECTOR, p, memo={}, graphs=graphs), **changes)


def _through_graphs(graphs: ReductionGraphs) -> int:
    return graphs.captures + graphs.replays


def _assert_same_result(got: MethodResult, want: MethodResult) -> None:
    for name in ("tokens", "token_index", "scores", "assignment", "signal_mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("selection_order", "residuals", "confidence"):
        assert torch.equal(got.info[name], want.info[name]), name


def test_cares_method_replays_only_a_single_untimed_image_with_nothing_memoised(cpu_graphs: None) -> None:
    graphs = ReductionGraphs()
    cfg = CARE.config  # type: ignore[attr-defined]
    eager_calls = {
        "timed": _inputs(1, graphs, stage_timer=StageClock()),
        "no graphs": _inputs(1, None),
        "larger budget planned": _inputs(1, graphs, planned_keeps=(7, 9)),
    }
    for what, one in eager_calls.items():
        assert method_graph_reason(cfg, one, 7) is not None, what
        CARE.batch([one], [7])
        assert _through_graphs(graphs) == 0, what
    hit = _inputs(1, graphs)
    build_method("prca-only", cfg).batch([hit], [7])  # PRCA's psi_bar and order now in the memo
    assert "memo" in str(method_graph_reason(cfg, hit, 7))
    CARE.batch([hit], [7])
    CARE.batch([_inputs(1, graphs), _inputs(2, graphs)], [7, 7])  # B = 2: one joint pass
    assert _through_graphs(graphs) == 0
    replayed = {"fresh memo": _inputs(1, graphs), "smaller budget planned": _inputs(2, graphs, planned_keeps=(3, 7)),
                "no memo": _inputs(3, graphs, memo=None)}  # fmt: skip
    for count, (what, one) in enumerate(replayed.items(), start=1):
        assert method_graph_reason(cfg, one, 7) is None, what
        CARE.batch([one], [7])
        assert _through_graphs(graphs) == count, what
    assert (graphs.captures, graphs.replays) == (1, 2)


def test_a_replayed_reduction_leaves_the_memo_the_eager_one_leaves_for_the_next_budget(cpu_graphs: None) -> None:
    graphs = ReductionGraphs()
    cfg = CARE.config  # type: ignore[attr-defined]
    keys = {prca_key(cfg), prca_order_key(cfg)}
    for seed in (1, 2):  # the first image is captured, the second replayed
        replayed, eager = _inputs(seed, graphs, planned_keeps=(3, 7)), _inputs(seed, None, planned_keeps=(3, 7))
        _assert_same_result(CARE(replayed, 7), CARE(eager, 7))
        assert replayed.memo is not None and eager.memo is not None
        assert set(replayed.memo) == set(eager.memo) == keys
        for key in keys:
            assert replayed.memo[key].dtype == eager.memo[key].dtype, key
            assert torch.equal(replayed.memo[key], eager.memo[key]), key
        stored = dict(replayed.memo)
        through = _through_graphs(graphs)
        _assert_same_result(CARE(replayed, 3), CARE(eager, 3))  # the next budget: from the memo, eagerly
        assert _through_graphs(graphs) == through
        assert all(replayed.memo[key] is stored[key] for key in keys)  # read, not recomputed
    assert (graphs.captures, graphs.replays) == (1, 1)


def test_an_untimed_pipeline_run_replays_cares_reduction_and_a_timed_one_does_not(cpu_graphs: None) -> None:
    pipe = ReductionPipeline.from_pretrained("tiny-llava", methods=["care"], device="cpu")
    graphs = pipe.reduction_graphs
    tokens = pipe.encode(scene_image((224, 224)))
    timed = pipe(tokens, None, [Budget.keep(16)]).runs[0]
    pipe(tokens, None, [Budget.keep(16)], timed=False, cuda_graph=False)
    pipe(tokens, None, [Budget.keep(16), Budget.keep(32)], timed=False)  # K = 16 first: its order is computed at 32
    assert _through_graphs(graphs) == 0
    for calls in (1, 2):  # captured, then replayed
        untimed = pipe(tokens, None, [Budget.keep(16)], timed=False)
        assert untimed.timings_ms == {} and untimed.runs[0].timings_ms == {}
        _assert_same_result(untimed.runs[0].result, timed.result)
        assert torch.equal(untimed.runs[0].projected, timed.projected)
        assert _through_graphs(graphs) == calls
    both = pipe(tokens, None, [Budget.keep(32), Budget.keep(16)], timed=False)  # 32 replayed (new K: captured)
    _assert_same_result(both.runs[1].result, timed.result)  # 16 from the memo the graph path filled
    assert (graphs.captures, graphs.replays) == (2, 1)


def test_the_dropin_replays_a_single_images_reduction_and_frees_the_graphs_on_leaving(
    cpu_graphs: None, home: Path
) -> None:
    adapter: Any = load_backbone("tiny-llava", device="cpu", home=home)
    with quiet_transformers():
        inputs = adapter.processor(images=[scene_image((300, 200))], text=[adapter.prompt("What is this?")],
                                   return_tensors="pt")  # fmt: skip
    eager = ReductionPipeline(adapter, ["care"]).run_batch([scene_image((300, 200))], ["What is this?"],
                                                          [Budget.keep(9)])[0].runs[0]  # fmt: skip
    with reduce_visual_tokens(adapter.model, processor=adapter.processor, keep=9) as reduction:
        graphs = reduction._pipeline.reduction_graphs
        answers = []
        for calls in (1, 2):  # captured, then replayed
            answers.append(adapter.model.generate(**inputs, max_new_tokens=3, do_sample=False))
            (result,) = reduction.results
            _assert_same_result(result, eager.result)
            assert (_through_graphs(graphs), len(graphs)) == (calls, 1)
        assert torch.equal(answers[0], answers[1])
    assert len(graphs) == 0  # freed with the block


# ------------------------------------------------------------------------------ CUDA
@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("reduction_graphs_home")


def _demo_features(name: str, home: Path) -> tuple[Any, torch.Tensor, torch.Tensor]:
    adapter: Any = load_backbone(name, device="cuda", home=home)
    with torch.no_grad():
        tokens = adapter.encode_image(scene_image((320, 240)))
    return adapter.projector, tokens.features, tokens.positions


def _variants(features: torch.Tensor) -> list[torch.Tensor]:
    """Three other features of the same shape, dtype and device (and the first again)."""
    g = torch.Generator(device=features.device).manual_seed(0)
    noise = torch.randn(features.shape, generator=g, device=features.device, dtype=torch.float32)
    scale = features.float().std()
    return [features, (features.float() + 0.05 * scale * noise).to(features.dtype), features.flip(0).contiguous(),
            features * 0.5, features]  # fmt: skip


@cuda_only
@pytest.mark.parametrize("name", TRAINED_DEMOS)
def test_a_replayed_reduction_is_the_eager_one_bitwise_on_each_trained_demo(name: str, home: Path) -> None:
    projector, features, positions = _demo_features(name, home)
    graphs, cfg = ReductionGraphs(), CaReConfig()
    keep = max(1, features.shape[0] // 9)
    for v in _variants(features):
        got = care_reduce(v, projector, positions, keep=keep, config=cfg, graphs=graphs)
        _assert_bitwise(got, care_reduce(v, projector, positions, keep=keep, config=cfg))
    assert (graphs.captures, graphs.replays, graphs.failures) == (1, 4, {})
    got = care_reduce(features, projector, positions, keep=keep + 3, config=cfg, graphs=graphs)  # another K
    _assert_bitwise(got, care_reduce(features, projector, positions, keep=keep + 3, config=cfg))
    assert (len(graphs), graphs.captures) == (2, 2)


@cuda_only
@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_a_replayed_reduction_in_float64_or_the_torch_kernels_is_the_eager_one(kernel: str, home: Path) -> None:
    projector, features, positions = _demo_features("tiny-qwen3-vl", home)
    graphs, cfg = ReductionGraphs(), CaReConfig(kernel=kernel)  # type: ignore[arg-type]
    for v in _variants(features.double())[:3]:
        got = care_reduce(v, projector, positions, keep=20, config=cfg, graphs=graphs)
        _assert_bitwise(got, care_reduce(v, projector, positions, keep=20, config=cfg))
    assert (graphs.captures, graphs.replays) == (1, 2)


@cuda_only
def test_a_capture_that_fails_on_cuda_gives_the_eager_result_and_says_why(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    projector, features, positions = _demo_features("tiny-llava", home)
    real = care_core.calibration.gate_confidence

    def uncapturable(*args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("an operation no graph can hold")
        return real(*args, **kwargs)

    monkeypatch.setattr(care_core.calibration, "gate_confidence", uncapturable)
    graphs = ReductionGraphs()
    for v in _variants(features)[:3]:
        got = care_reduce(v, projector, positions, keep=30, graphs=graphs)
        _assert_bitwise(got, care_reduce(v, projector, positions, keep=30))
    (reason,) = graphs.failures.values()
    assert "RuntimeError: an operation no graph can hold" in reason
    assert (graphs.captures, graphs.replays, len(graphs)) == (0, 0, 0)


@cuda_only
def test_release_frees_the_graphs_and_their_pool(home: Path) -> None:
    projector, features, positions = _demo_features("tiny-qwen2.5-vl", home)
    graphs = ReductionGraphs()
    for keep in (10, 20, 10):
        care_reduce(features, projector, positions, keep=keep, graphs=graphs)
    assert (len(graphs), graphs.captures, graphs.replays) == (2, 2, 1)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what remains reserved: live tensors, and the pool the graphs hold
    held = torch.cuda.memory_reserved()
    graphs.release()
    assert len(graphs) == 0 and torch.cuda.memory_reserved() < held
    got = care_reduce(features, projector, positions, keep=10, graphs=graphs)  # captured anew
    _assert_bitwise(got, care_reduce(features, projector, positions, keep=10))
    assert graphs.captures == 3


@cuda_only
def test_timed_answers_on_cuda_replay_cares_reduction_unless_graphs_are_off(home: Path) -> None:
    for cuda_graph, replayed in ((None, True), (False, False)):
        pipe = ReductionPipeline(load_backbone("tiny-llava", device="cuda", home=home), ["care"])
        result = pipe(scene_image((320, 240)), None, [Budget.keep(40)])
        pipe.time_answers(result, max_new_tokens=1, repeats=2, cuda_graph=cuda_graph)
        graphs = pipe.reduction_graphs
        assert (graphs.captures, graphs.replays) == ((1, 2) if replayed else (0, 0)), cuda_graph
        pipe.release_graphs()


@cuda_only
def test_an_untimed_pipeline_run_on_cuda_replays_and_equals_the_timed_one_bitwise(home: Path) -> None:
    pipe = ReductionPipeline(load_backbone("tiny-llava", device="cuda", home=home), ["care", "prca-only"])
    tokens = pipe.encode(scene_image((320, 240)))
    budgets = [Budget.keep(40), Budget.keep(20)]  # 40 replayed, then 20 (and prca-only) from the memo it filled
    timed = pipe(tokens, None, budgets)
    for calls in (1, 2):  # captured, then replayed
        untimed = pipe(tokens, None, budgets, timed=False)
        for got, want in zip(untimed.runs, timed.runs, strict=True):
            assert torch.equal(got.result.tokens, want.result.tokens), (got.method, got.keep)
            assert torch.equal(got.result.token_index, want.result.token_index), (got.method, got.keep)
            assert torch.equal(got.projected, want.projected), (got.method, got.keep)
        graphs = pipe.reduction_graphs
        assert (graphs.captures, graphs.replays, graphs.failures) == (1, calls - 1, {})
    pipe.release_graphs()


@cuda_only
def test_the_dropin_on_cuda_replays_one_image_and_answers_as_the_eager_path(home: Path) -> None:
    adapter: Any = load_backbone("tiny-llava", device="cuda", home=home)
    image, question = scene_image((300, 200)), "What is this?"
    with quiet_transformers():
        inputs = adapter.processor(images=[image], text=[adapter.prompt(question)], return_tensors="pt")
    inputs = inputs.to(adapter.device)
    eager = ReductionPipeline(adapter, ["care"]).run_batch([image], [question], [Budget.keep(9)])[0]  # timed: eager
    run = eager.runs[0]
    eager_ids = adapter.generate(question, eager.tokens, run.projected, 5, run.result.token_index).token_ids
    prompt_length = inputs["input_ids"].shape[1]
    with reduce_visual_tokens(adapter.model, processor=adapter.processor, keep=9) as reduction:
        graphs = reduction._pipeline.reduction_graphs
        for calls in (1, 2):  # captured, then replayed
            out = adapter.model.generate(**inputs, max_new_tokens=5, do_sample=False)
            (result,) = reduction.results
            _assert_same_result(result, run.result)
            assert tuple(out[0, prompt_length:].tolist()[: len(eager_ids)]) == eager_ids
            assert (graphs.captures, graphs.replays, graphs.failures) == (1, calls - 1, {})
    assert len(graphs) == 0
