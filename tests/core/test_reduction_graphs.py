"""CaRe's single-image reduction replayed from a CUDA graph (docs/design/generation.md §Reduction graphs): when it
applies, what its key names, that the CPU path is unchanged, the capture/replay bookkeeping (on the CPU through a
stand-in graph: a key runs eagerly at its first call, is captured at its second, replayed from its third), and on
CUDA that a replay is the eager reduction bit for bit on every trained demo's projector."""

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
from care_core.reduction_graphs import MAX_GRAPHS, MAX_SEEN_KEYS, ReductionGraphs
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


#: the fields a choice is made of: equal bit for bit whatever order the products were summed in
CHOICES = ("indices", "anchor_order", "tokens", "accepted", "nearest")


def _assert_same_choice(got: Reduction, want: Reduction) -> None:
    """The same tokens chosen and calibrated, the float scores within float32 rounding: for bfloat16 features, whose
    products cuBLAS may sum in another order on the capture's side stream than on the caller's (on one H200,
    tiny-gemma3's psi_bar moved by up to 3.6e-7 already in the capture call's eager run, tokens unchanged)."""
    mine, theirs = _fields(got), _fields(want)
    for name in CHOICES:
        assert torch.equal(mine[name], theirs[name]), name
    for name in set(theirs) - set(CHOICES):
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)


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
    calls = [_problem(seed=s)[::2] for s in (1, 2, 3, 1)]  # (features, positions), one key; the last repeats the first
    results = []
    for v, p in calls:  # seen, captured, replayed, replayed
        results.append(_replayed(graphs, v, p, 7, cfg, None, scorer))
        _assert_bitwise(results[-1], care_reduce(v, projector, p, keep=7, config=cfg, scorer=scorer))
    _assert_bitwise(results[2], care_reduce(calls[2][0], projector, calls[2][1], keep=7, config=cfg))
    assert (graphs.captures, graphs.replays, len(graphs)) == (1, 2, 1)
    g = torch.Generator().manual_seed(5)
    given = torch.nn.functional.normalize(torch.randn(6, 8, generator=g), dim=1)  # explicit directions: an input too
    v, p = calls[2]
    got = _replayed(graphs, v, p, 7, cfg, given, scorer)
    _assert_bitwise(got, care_reduce(v, projector, p, keep=7, config=cfg, directions=given))
    assert graphs.replays == 3
    assert got.tokens is got.calibration.tokens  # one output tensor stays one after the clone (float32: as eager)


def test_a_failed_capture_is_recorded_and_its_key_runs_eagerly(stand_in: list[BaseException | None]) -> None:
    graphs = ReductionGraphs()
    stand_in[0] = RuntimeError("operation not permitted when stream is capturing\nsecond line")
    step_calls: list[int] = []

    def step(statics: tuple[torch.Tensor, ...]) -> torch.Tensor:
        step_calls.append(1)
        return statics[0] * 2

    x = torch.arange(4.0)
    assert torch.equal(graphs.run("k", [x], step), x * 2)  # the first call: eager, no capture tried
    assert graphs.failures == {}
    assert torch.equal(graphs.run("k", [x - 1], step), (x - 1) * 2)  # the second's eager result stands
    assert graphs.failures == {"k": "capturing the reduction failed (RuntimeError: operation not permitted when "
                                    "stream is capturing second line)"}  # fmt: skip
    stand_in[0] = None  # captures would work now: the key stays eager anyway
    assert torch.equal(graphs.run("k", [x + 1], step), (x + 1) * 2)
    assert (graphs.captures, graphs.replays, len(graphs), len(step_calls)) == (0, 0, 0, 3)  # one step per call


def test_out_of_memory_during_a_capture_releases_every_graph_and_propagates(
    stand_in: list[BaseException | None],
) -> None:
    graphs = ReductionGraphs()

    def call(key: str) -> None:
        graphs.run(key, [torch.ones(3)], lambda s: s[0] + 1)

    call("a")
    call("a")  # captured at its second call
    assert len(graphs) == 1
    stand_in[0] = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    call("b")  # seen: nothing captured yet
    with pytest.raises(torch.OutOfMemoryError):
        call("b")
    assert len(graphs) == 0 and graphs.failures == {}  # not the computation's fault: "b" may capture later
    stand_in[0] = None
    call("b")  # starts over (its count ended with the capture that ran out of memory): seen, not captured
    assert graphs.captures == 1
    call("b")
    assert (graphs.captures, len(graphs)) == (2, 1)


def test_graphs_keep_the_most_recently_used_keys(stand_in: list[BaseException | None]) -> None:
    graphs = ReductionGraphs()

    def call(key: object) -> None:
        graphs.run(key, [torch.ones(2)], lambda s: s[0] * 3)

    for number in range(MAX_GRAPHS + 2):  # each key twice, so captured; keys 0 and 1 are dropped
        call(number)
        call(number)
    call(2)  # a replay: key 2 becomes the most recent, key 3 the least
    call("new")
    call("new")  # captured at its second call: drops key 3
    assert (len(graphs), graphs.captures, graphs.replays) == (MAX_GRAPHS, MAX_GRAPHS + 3, 1)
    for key in (2, 4, MAX_GRAPHS + 1, "new"):  # kept: replayed
        call(key)
    assert (graphs.captures, graphs.replays) == (MAX_GRAPHS + 3, 5)
    call(3)  # dropped, so forgotten: seen anew, eager
    assert (graphs.captures, graphs.replays) == (MAX_GRAPHS + 3, 5)
    call(3)  # its second call since: captured anew
    assert graphs.captures == MAX_GRAPHS + 4


def test_a_key_seen_once_runs_its_step_as_given_and_is_not_captured(stand_in: list[BaseException | None]) -> None:
    graphs = ReductionGraphs()
    given: list[torch.Tensor] = []

    def step(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        given.append(inputs[0])
        return inputs[0] * 2

    x = torch.arange(6.0)[::2]  # not contiguous: a static copy would be
    assert torch.equal(graphs.run("k", [x], step), torch.tensor([0.0, 4.0, 8.0]))
    assert (graphs.captures, graphs.replays, len(graphs)) == (0, 0, 0)
    assert len(given) == 1 and given[0] is x  # one plain run on the caller's own tensor: no static copy, no capture


def test_a_key_is_captured_at_its_second_call_and_replayed_from_its_third(
    stand_in: list[BaseException | None],
) -> None:
    graphs = ReductionGraphs()
    counts = []
    for value in (1.0, 2.0, 3.0, 4.0):  # one key, new values each call: each call's own result
        assert torch.equal(graphs.run("k", [torch.full((3,), value)], lambda s: s[0] * 3), torch.full((3,), 3 * value))
        counts.append((graphs.captures, graphs.replays, len(graphs)))
    assert counts == [(0, 0, 0), (1, 0, 1), (1, 1, 1), (1, 2, 1)]


def test_varied_keys_each_seen_once_capture_nothing(stand_in: list[BaseException | None]) -> None:
    graphs = ReductionGraphs()
    for number in range(MAX_GRAPHS + 4):  # more shapes than graphs are kept, none repeated
        graphs.run(number, [torch.ones(2)], lambda s: s[0] + 1)
    assert (graphs.captures, graphs.replays, len(graphs)) == (0, 0, 0)
    graphs.run(0, [torch.ones(2)], lambda s: s[0] + 1)  # the first comes back: remembered, captured
    assert (graphs.captures, len(graphs)) == (1, 1)


def test_the_keys_seen_are_remembered_up_to_a_bound_least_recent_forgotten_first(
    stand_in: list[BaseException | None],
) -> None:
    graphs = ReductionGraphs()

    def call(key: object) -> None:
        graphs.run(key, [torch.ones(2)], lambda s: s[0] + 1)

    for number in range(MAX_SEEN_KEYS + 1):  # one key more than are remembered: key 0 is forgotten
        call(number)
    call(0)  # seen anew, which forgets key 1 (now the least recently seen)
    assert graphs.captures == 0
    call(2)  # still remembered: captured
    assert graphs.captures == 1
    call(1)  # forgotten: seen anew
    assert graphs.captures == 1
    call(0)  # its second call since it was forgotten: captured
    assert graphs.captures == 2


def test_release_forgets_the_keys_seen(stand_in: list[BaseException | None]) -> None:
    graphs = ReductionGraphs()

    def call(key: str) -> None:
        graphs.run(key, [torch.ones(2)], lambda s: s[0] + 1)

    call("seen")
    call("captured")
    call("captured")
    assert (graphs.captures, len(graphs)) == (1, 1)
    graphs.release()
    call("seen")  # both start fresh: seen once, nothing captured
    call("captured")
    assert (graphs.captures, graphs.replays, len(graphs)) == (1, 0, 0)
    call("seen")
    assert (graphs.captures, len(graphs)) == (2, 1)


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


class _CountingGraphs(ReductionGraphs):
    """ReductionGraphs that count the calls handed to them: a key's first call neither captures nor replays, so
    only this tells it from a call that never reached the graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def run(self, key: Any, inputs: Any, step: Any, held: Callable[[], object] = lambda: None) -> Any:
        self.calls += 1
        return super().run(key, inputs, step, held)


class _OnCuda:
    """An adapter as a caller reading its ``device`` sees it on CUDA, doing its work where it is."""

    device = CUDA

    def __init__(self, adapter: Any) -> None:
        self._adapter = adapter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._adapter, name)


def _assert_same_result(got: MethodResult, want: MethodResult) -> None:
    for name in ("tokens", "token_index", "scores", "assignment", "signal_mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("selection_order", "residuals", "confidence"):
        assert torch.equal(got.info[name], want.info[name]), name


def test_cares_method_replays_only_a_single_untimed_image_with_nothing_memoised(cpu_graphs: None) -> None:
    graphs = _CountingGraphs()
    cfg = CARE.config  # type: ignore[attr-defined]
    eager_calls = {
        "timed": _inputs(1, graphs, stage_timer=StageClock()),
        "no graphs": _inputs(1, None),
        "larger budget planned": _inputs(1, graphs, planned_keeps=(7, 9)),
    }
    for what, one in eager_calls.items():
        assert method_graph_reason(cfg, one, 7) is not None, what
        CARE.batch([one], [7])
        assert graphs.calls == 0, what
    hit = _inputs(1, graphs)
    build_method("prca-only", cfg).batch([hit], [7])  # PRCA's psi_bar and order now in the memo
    assert "memo" in str(method_graph_reason(cfg, hit, 7))
    CARE.batch([hit], [7])
    CARE.batch([_inputs(1, graphs), _inputs(2, graphs)], [7, 7])  # B = 2: one joint pass
    assert graphs.calls == 0
    through = {"fresh memo": _inputs(1, graphs), "smaller budget planned": _inputs(2, graphs, planned_keeps=(3, 7)),
               "no memo": _inputs(3, graphs, memo=None)}  # fmt: skip
    for count, (what, one) in enumerate(through.items(), start=1):
        assert method_graph_reason(cfg, one, 7) is None, what
        CARE.batch([one], [7])
        assert graphs.calls == count, what
    assert (graphs.captures, graphs.replays) == (1, 1)  # one key (N, K): seen, captured, replayed


def test_a_replayed_reduction_leaves_the_memo_the_eager_one_leaves_for_the_next_budget(cpu_graphs: None) -> None:
    graphs = _CountingGraphs()
    cfg = CARE.config  # type: ignore[attr-defined]
    keys = {prca_key(cfg), prca_order_key(cfg)}
    for seed in (1, 2, 3):  # one key: the first image runs eagerly through the graphs, the second is captured, the
        # third replayed
        replayed, eager = _inputs(seed, graphs, planned_keeps=(3, 7)), _inputs(seed, None, planned_keeps=(3, 7))
        _assert_same_result(CARE(replayed, 7), CARE(eager, 7))
        assert replayed.memo is not None and eager.memo is not None
        assert set(replayed.memo) == set(eager.memo) == keys
        for key in keys:
            assert replayed.memo[key].dtype == eager.memo[key].dtype, key
            assert torch.equal(replayed.memo[key], eager.memo[key]), key
        stored = dict(replayed.memo)
        assert graphs.calls == seed
        _assert_same_result(CARE(replayed, 3), CARE(eager, 3))  # the next budget: from the memo, eagerly
        assert graphs.calls == seed
        assert all(replayed.memo[key] is stored[key] for key in keys)  # read, not recomputed
    assert (graphs.captures, graphs.replays) == (1, 1)


def test_an_untimed_pipeline_run_replays_cares_reduction_and_a_timed_one_does_not(cpu_graphs: None) -> None:
    pipe = ReductionPipeline.from_pretrained("tiny-llava", methods=["care"], device="cpu")
    graphs = pipe.reduction_graphs = _CountingGraphs()
    tokens = pipe.encode(scene_image((224, 224)))
    timed = pipe(tokens, None, [Budget.keep(16)]).runs[0]
    pipe(tokens, None, [Budget.keep(16)], timed=False, cuda_graph=False)
    pipe(tokens, None, [Budget.keep(16), Budget.keep(32)], timed=False)  # K = 16 first: its order is computed at 32
    assert graphs.calls == 0
    expected = {1: (0, 0), 2: (1, 0), 3: (1, 1)}  # (captures, replays): seen, captured, replayed
    for calls, counts in expected.items():
        untimed = pipe(tokens, None, [Budget.keep(16)], timed=False)
        assert untimed.timings_ms == {} and untimed.runs[0].timings_ms == {}
        _assert_same_result(untimed.runs[0].result, timed.result)
        assert torch.equal(untimed.runs[0].projected, timed.projected)
        assert (graphs.calls, graphs.captures, graphs.replays) == (calls, *counts)
    both = pipe(tokens, None, [Budget.keep(32), Budget.keep(16)], timed=False)  # 32 through the graphs: a new key
    _assert_same_result(both.runs[1].result, timed.result)  # 16 from the memo the graph path filled
    assert (graphs.calls, graphs.captures, graphs.replays) == (4, 1, 1)  # K = 32 seen once: eager


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
        for counts in ((0, 0, 0), (1, 0, 1), (1, 1, 1)):  # (captures, replays, graphs): seen, captured, replayed
            answers.append(adapter.model.generate(**inputs, max_new_tokens=3, do_sample=False))
            (result,) = reduction.results
            _assert_same_result(result, eager.result)
            assert (graphs.captures, graphs.replays, len(graphs)) == counts
        assert torch.equal(answers[0], answers[1]) and torch.equal(answers[0], answers[2])
    assert len(graphs) == 0  # freed with the block


def test_the_dropin_with_cuda_graph_false_never_hands_a_reduction_to_the_graphs(cpu_graphs: None, home: Path) -> None:
    adapter: Any = load_backbone("tiny-llava", device="cpu", home=home)
    with quiet_transformers():
        inputs = adapter.processor(images=[scene_image((300, 200))], text=[adapter.prompt("What is this?")],
                                   return_tensors="pt")  # fmt: skip
    eager = ReductionPipeline(adapter, ["care"]).run_batch([scene_image((300, 200))], ["What is this?"],
                                                          [Budget.keep(9)])[0].runs[0]  # fmt: skip
    reduction = reduce_visual_tokens(adapter.model, processor=adapter.processor, keep=9, cuda_graph=False)
    graphs = reduction._pipeline.reduction_graphs = _CountingGraphs()
    with reduction:
        for _ in range(3):  # with graphs, the second call would capture and the third replay
            adapter.model.generate(**inputs, max_new_tokens=1, do_sample=False)
            (result,) = reduction.results
            _assert_same_result(result, eager.result)
    assert (graphs.calls, graphs.captures, graphs.replays) == (0, 0, 0)


def test_timed_answers_warm_up_until_cares_rerun_is_captured_so_every_timed_round_replays(
    cpu_graphs: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA (the adapter's device as time_answers reads it) with graphs: two warm-up rounds (the re-run's key
    seen, then captured), so each of the timed rounds replays."""
    pipe = ReductionPipeline.from_pretrained("tiny-llava", methods=["care"], device="cpu")
    graphs = pipe.reduction_graphs = _CountingGraphs()
    result = pipe(pipe.encode(scene_image((224, 224))), None, [Budget.keep(16)])  # timed: eager
    assert graphs.calls == 0
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # the stage clocks' waits
    pipe.adapter = _OnCuda(pipe.adapter)  # type: ignore[assignment]
    pipe.time_answers(result, max_new_tokens=1, repeats=3)
    assert (graphs.calls, graphs.captures, graphs.replays) == (2 + 3, 1, 3)  # one re-run per round


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
    same = _assert_same_choice if features.dtype == torch.bfloat16 else _assert_bitwise  # tiny-gemma3's tower: bf16
    for v in _variants(features):  # five calls with one key: seen, captured, then three replays
        got = care_reduce(v, projector, positions, keep=keep, config=cfg, graphs=graphs)
        same(got, care_reduce(v, projector, positions, keep=keep, config=cfg))
    assert (graphs.captures, graphs.replays, graphs.failures) == (1, 3, {})
    for v in _variants(features)[:2]:  # another K: another key, seen then captured
        got = care_reduce(v, projector, positions, keep=keep + 3, config=cfg, graphs=graphs)
        same(got, care_reduce(v, projector, positions, keep=keep + 3, config=cfg))
    assert (len(graphs), graphs.captures, graphs.replays) == (2, 2, 3)


@cuda_only
@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_a_replayed_reduction_in_float64_or_the_torch_kernels_is_the_eager_one(kernel: str, home: Path) -> None:
    projector, features, positions = _demo_features("tiny-qwen3-vl", home)
    graphs, cfg = ReductionGraphs(), CaReConfig(kernel=kernel)  # type: ignore[arg-type]
    for v in _variants(features.double())[:4]:  # seen, captured, replayed twice
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
    for v in _variants(features)[:3]:  # seen; the capture fails (the call's eager result stands); eager
        got = care_reduce(v, projector, positions, keep=30, graphs=graphs)
        _assert_bitwise(got, care_reduce(v, projector, positions, keep=30))
    (reason,) = graphs.failures.values()
    assert "RuntimeError: an operation no graph can hold" in reason
    assert (graphs.captures, graphs.replays, len(graphs)) == (0, 0, 0)


@cuda_only
def test_release_frees_the_graphs_and_their_pool(home: Path) -> None:
    projector, features, positions = _demo_features("tiny-qwen2.5-vl", home)
    graphs = ReductionGraphs()
    for keep in (10, 20, 10, 20, 10):  # 10 and 20 seen, captured; 10 replayed
        care_reduce(features, projector, positions, keep=keep, graphs=graphs)
    assert (len(graphs), graphs.captures, graphs.replays) == (2, 2, 1)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what remains reserved: live tensors, and the pool the graphs hold
    held = torch.cuda.memory_reserved()
    graphs.release()
    assert len(graphs) == 0 and torch.cuda.memory_reserved() < held
    for captures in (2, 3):  # the key forgotten with the graphs: seen anew, then captured anew
        got = care_reduce(features, projector, positions, keep=10, graphs=graphs)
        _assert_bitwise(got, care_reduce(features, projector, positions, keep=10))
        assert graphs.captures == captures


@cuda_only
def test_timed_answers_on_cuda_replay_cares_reduction_unless_graphs_are_off(home: Path) -> None:
    for cuda_graph, replayed in ((None, True), (False, False)):
        pipe = ReductionPipeline(load_backbone("tiny-llava", device="cuda", home=home), ["care"])
        result = pipe(scene_image((320, 240)), None, [Budget.keep(40)])  # timed: eager
        pipe.time_answers(result, max_new_tokens=1, repeats=2, cuda_graph=cuda_graph)
        graphs = pipe.reduction_graphs  # with graphs: two warm-up rounds (seen, captured), two timed replays
        assert (graphs.captures, graphs.replays) == ((1, 2) if replayed else (0, 0)), cuda_graph
        pipe.release_graphs()


@cuda_only
def test_an_untimed_pipeline_run_on_cuda_replays_and_equals_the_timed_one_bitwise(home: Path) -> None:
    pipe = ReductionPipeline(load_backbone("tiny-llava", device="cuda", home=home), ["care", "prca-only"])
    tokens = pipe.encode(scene_image((320, 240)))
    budgets = [Budget.keep(40), Budget.keep(20)]  # 40 replayed, then 20 (and prca-only) from the memo it filled
    timed = pipe(tokens, None, budgets)
    for counts in ((0, 0), (1, 0), (1, 1)):  # (captures, replays): seen, captured, replayed
        untimed = pipe(tokens, None, budgets, timed=False)
        for got, want in zip(untimed.runs, timed.runs, strict=True):
            assert torch.equal(got.result.tokens, want.result.tokens), (got.method, got.keep)
            assert torch.equal(got.result.token_index, want.result.token_index), (got.method, got.keep)
            assert torch.equal(got.projected, want.projected), (got.method, got.keep)
        graphs = pipe.reduction_graphs
        assert (graphs.captures, graphs.replays, graphs.failures) == (*counts, {})
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
        for counts in ((0, 0), (1, 0), (1, 1)):  # (captures, replays): seen, captured, replayed
            out = adapter.model.generate(**inputs, max_new_tokens=5, do_sample=False)
            (result,) = reduction.results
            _assert_same_result(result, run.result)
            assert tuple(out[0, prompt_length:].tolist()[: len(eager_ids)]) == eager_ids
            assert (graphs.captures, graphs.replays, graphs.failures) == (*counts, {})
    assert len(graphs) == 0
