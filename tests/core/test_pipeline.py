"""The library pipeline: same numbers as the core functions, budgets, questions, fair answer timing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from care_core import CaReConfig, care_reduce, csr_score
from care_core.backbones.base import ImageTokens
from care_core.budget import Budget, budgets_from
from care_core.errors import BudgetError, MethodError, QuestionError
from care_core.generation import Generation
from care_core.images import load_image
from care_core.methods import MethodInputs, build_method
from care_core.pipeline import ImageResult, MethodRun, ReductionPipeline
from care_core.reduction_graphs import ReductionGraphs
from care_core.vocabulary import DEFAULT_QUESTION

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QUESTION = "What is the person holding?"


@pytest.fixture(scope="module")
def pipe() -> ReductionPipeline:
    config = CaReConfig(seed=7, alpha=0.3, theta_c=0.8)
    return ReductionPipeline.from_pretrained("tiny-llava", methods=["care", "random", "sparsevlm"], config=config,
                                             device="cpu")  # fmt: skip


@pytest.fixture(scope="module")
def image() -> Any:
    return load_image(EXAMPLES / "astronaut.jpg")


def test_care_through_the_pipeline_equals_the_core(pipe: ReductionPipeline, image: Any) -> None:
    out = pipe(image, QUESTION, [Budget.keep(40)], csr=True)
    run = out.run("care")
    tokens = pipe.encode(image)
    adapter = pipe.adapter
    red = care_reduce(tokens.features, adapter.projector, tokens.positions, keep=40, config=pipe.config)
    assert torch.equal(run.result.indices, red.indices)
    assert torch.equal(run.result.signals, red.signals)
    assert torch.allclose(run.result.tokens, red.tokens, rtol=0, atol=1e-6)
    with torch.no_grad():
        expected = csr_score(adapter.projector(tokens.features), adapter.projector(red.tokens),
                             adapter.question_embeddings(QUESTION))  # fmt: skip
    assert run.csr == pytest.approx(expected, abs=1e-6)
    assert run.keep == 40 and run.result.num_tokens == 40


def test_every_method_and_budget_is_run_once(pipe: ReductionPipeline, image: Any) -> None:
    budgets = budgets_from([0.11, 0.11], [128])
    assert budgets == [Budget.ratio(0.11), Budget.keep(128)]
    out = pipe(image, QUESTION, budgets, csr=True)
    assert [(r.method, r.budget.label, r.keep) for r in out.runs] == [
        (m, b, k) for m in ("care", "random", "sparsevlm") for b, k in (("ratio 0.11", 63), ("K=128", 128))
    ]
    assert all(0.0 <= r.csr <= 1.0 for r in out.runs)


def test_budgets_are_checked() -> None:
    for bad in (0, -0.1, 1.5, float("nan"), True):
        with pytest.raises(BudgetError):
            Budget.ratio(bad)  # type: ignore[arg-type]
    for bad_keep in (0, -3, 2.5, True):
        with pytest.raises(BudgetError):
            Budget.keep(bad_keep)  # type: ignore[arg-type]
    with pytest.raises(BudgetError):
        budgets_from([], [])
    assert Budget.keep(600).label == "K=600"
    with pytest.raises(BudgetError, match="576"):
        Budget.keep(600).resolve(576)


def test_question_rules(pipe: ReductionPipeline, image: Any) -> None:
    with pytest.raises(QuestionError):
        pipe(image, None, [Budget.keep(8)], csr=True)
    with pytest.raises(QuestionError):
        pipe(image, "   ", [Budget.keep(8)])
    out = pipe(image, None, [Budget.keep(8)])  # sparsevlm reads a question: the default stands in, and says so
    assert out.question == DEFAULT_QUESTION and out.question_defaulted
    out = pipe(image, QUESTION, [Budget.keep(8)])
    assert out.question == QUESTION and not out.question_defaulted


def test_unknown_method_fails_before_loading() -> None:
    with pytest.raises(MethodError, match="unknown method"):
        ReductionPipeline.from_pretrained("no-such-model", methods=["carre"])


class _SlowFirstAdapter:
    """Records calls; the first language-model call of the process is slow, as a cold first forward is."""

    device = torch.device("cpu")
    dtype = torch.float32
    projector = torch.nn.Identity()

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def language_model_logits(self, question: str, tokens: Any, projected: torch.Tensor, kept: Any = None) -> None:
        if not self.calls:
            time.sleep(0.3)
        self.calls.append(("prefill", int(projected.shape[0])))
        time.sleep(0.002)

    def generate(self, question: str, tokens: Any, projected: torch.Tensor, max_new_tokens: int = 32,
                 kept: Any = None, *, cuda_graph: bool | None = None) -> Generation:  # fmt: skip
        self.calls.append(("generate", int(projected.shape[0])))
        time.sleep(0.004)
        return Generation(f"{projected.shape[0]} rows", (1,) * max_new_tokens, "eager", "a stand-in adapter")

    def visual_tokens_fed(self, tokens: Any, rows: int, kept: Any = None) -> int:
        return rows + 1  # e.g. a newline row the backbone adds


def test_timed_answers_warm_up_alternate_and_keep_the_plain_answers() -> None:
    """The timed comparison runs every side's stages after a warm-up, in alternating order; texts and decoding
    are the adapter's answers, visual tokens what the backbone says it fed."""
    fake = _SlowFirstAdapter()
    pipe = object.__new__(ReductionPipeline)
    pipe.adapter, pipe.config, pipe.memoize = fake, CaReConfig(), True  # type: ignore[assignment]
    pipe.reduction_graphs = ReductionGraphs()
    pipe.methods = {"random": build_method("random", pipe.config)}
    features = torch.randn(576, 4, generator=torch.Generator().manual_seed(0))
    tokens = ImageTokens(features, torch.rand(576, 2), torch.zeros(576, 4), (24, 24), (0.0, 0.0, 24.0, 24.0))
    reduced = pipe.methods["random"](MethodInputs(features, fake.projector, tokens.positions), 64)
    run = MethodRun("random", Budget.keep(64), 64, reduced, reduced.tokens)
    plain = ImageResult(tokens, None, False, [run])
    timed = pipe.time_answers(plain, max_new_tokens=4, repeats=3)
    assert timed.question == DEFAULT_QUESTION and timed.question_defaulted  # no question: the default stands in
    assert fake.calls[0] == ("prefill", 576) and fake.calls[4] == ("prefill", 64)  # warm-up: each side once
    timed_prefills = [rows for kind, rows in fake.calls[8:] if kind == "prefill"]
    assert timed_prefills == [576, 64, 64, 576, 576, 64]  # alternating order, so no side always goes first
    full, red = timed.full_answer, timed.runs[0].answer
    assert full is not None and red is not None and run.answer is None  # a new result; the given one unchanged
    assert (full.text, full.visual_tokens, red.text, red.visual_tokens) == ("576 rows", 577, "64 rows", 65)
    assert full.decoding == "eager" and full.eager_reason == "a stand-in adapter"
    for answer in (full, red):  # the cold first call was a warm-up: no timed prefill carries its 300 ms
        assert answer.prefill_ms is not None and answer.prefill_ms < 150 and answer.repeats == 3
        assert answer.total_ms is not None and answer.total_ms >= 4
        assert answer.first_token_ms is not None and answer.first_token_from_features_ms is not None


def test_plain_answers_are_the_timed_answers(pipe: ReductionPipeline, image: Any) -> None:
    plain = pipe(image, QUESTION, [Budget.keep(32)], generate=True, max_new_tokens=3)
    assert plain.full_answer is not None and plain.full_answer.repeats == 0 and plain.full_answer.total_ms is None
    timed = pipe.time_answers(plain, max_new_tokens=3, repeats=1)
    for before, after in zip(plain.runs, timed.runs, strict=True):
        assert before.answer is not None and after.answer is not None
        assert (before.answer.text, before.answer.visual_tokens) == (after.answer.text, after.answer.visual_tokens)
    assert timed.full_answer is not None and timed.full_answer.text == plain.full_answer.text
    assert timed.full_answer.visual_tokens == plain.full_answer.visual_tokens == 576


def test_budget_independent_work_is_shared_and_changes_nothing(image: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import care_core.care
    import care_core.methods.zoo_prune

    names = ["care", "prca-only", "prca+simple-calib", "zoo-prune", "simple-calib", "confidence-calib"]
    budgets = [Budget.keep(8), Budget.keep(16), Budget.ratio(0.1)]
    shared = ReductionPipeline.from_pretrained("tiny-llava", methods=names, config=CaReConfig(m=16), device="cpu")
    alone = ReductionPipeline(shared.adapter, names, CaReConfig(m=16), memoize=False)
    tokens = shared.encode(image)
    calls = {"prca": 0, "zoo": 0}
    prca, zoo = care_core.care.prca_scores, care_core.methods.zoo_prune.ZooPrune._fresh_scores

    def count_prca(*args: Any, **kwargs: Any) -> Any:
        calls["prca"] += 1
        return prca(*args, **kwargs)

    def count_zoo(self: Any, inputs: Any) -> Any:
        calls["zoo"] += 1
        return zoo(self, inputs)

    monkeypatch.setattr(care_core.care, "prca_scores", count_prca)
    monkeypatch.setattr(care_core.methods.zoo_prune.ZooPrune, "_fresh_scores", count_zoo)
    with_memo = shared(tokens, None, budgets)
    counted = dict(calls)
    without = alone(tokens, None, budgets)
    assert counted["zoo"] == 1  # three ZOO-Prune-anchored methods x three budgets: one sensitivity
    assert counted["prca"] == 1  # care, prca-only and prca+simple-calib at every budget: one psi_bar
    assert calls["zoo"] - counted["zoo"] == 3 * len(budgets)
    for a, b in zip(with_memo.runs, without.runs, strict=True):
        assert (a.method, a.budget) == (b.method, b.budget)
        assert torch.equal(a.result.tokens, b.result.tokens)
        assert torch.equal(a.result.token_index, b.result.token_index)


def test_greedy_orders_run_once_per_image_at_the_largest_planned_budget(
    image: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pipeline hands each image its budgets' K (``MethodInputs.planned_keeps``), so with the budgets in
    ascending order DivPrune's greedy, SADS (shared by the ZOO-anchored methods) and PRCA's Eq. 3 (shared by the
    PRCA-anchored ones) each run once, at the largest K; every run's result is that of a pipeline without a memo."""
    import care_core.care
    import care_core.care_batch
    import care_core.methods.divprune

    names = ["divprune", "zoo-prune", "simple-calib", "care", "prca-only"]
    budgets = [Budget.keep(8), Budget.keep(16), Budget.ratio(0.1)]  # 576 tokens: K = 8, 16, 57
    shared = ReductionPipeline.from_pretrained("tiny-llava", methods=names, config=CaReConfig(m=16), device="cpu")
    alone = ReductionPipeline(shared.adapter, names, CaReConfig(m=16), memoize=False)
    tokens = shared.encode(image)
    lengths: list[tuple[str, int]] = []
    for module, name in ((care_core.methods.divprune, "divprune_select"), (care_core.care_batch, "diversity_greedy"),
                         (care_core.care, "diversity_greedy")):  # fmt: skip
        real, at = getattr(module, name), 1 if name == "divprune_select" else 2

        def counted(*args: Any, _real: Any = real, _at: int = at, _name: str = name, **kwargs: Any) -> Any:
            lengths.append((_name, int(args[_at])))
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    with_memo = shared(tokens, None, budgets)
    assert lengths == [("divprune_select", 57), ("diversity_greedy", 57), ("diversity_greedy", 57)]
    without = alone(tokens, None, budgets)
    assert len(lengths) == 3 + len(names) * len(budgets), "without a memo, every run computes its own order"
    for a, b in zip(with_memo.runs, without.runs, strict=True):
        assert (a.method, a.budget, a.keep) == (b.method, b.budget, b.keep)
        assert torch.equal(a.result.tokens, b.result.tokens)
        assert torch.equal(a.result.token_index, b.result.token_index)
        assert torch.equal(a.result.info["selection_order"], b.result.info["selection_order"])
