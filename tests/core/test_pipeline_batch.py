"""The pipeline over a batch: every registered method on the three demos, per image exactly what batch 1 gives."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from care_core.budget import Budget
from care_core.csr import csr_from_reference, csr_reference
from care_core.errors import CareError
from care_core.methods import method_names
from care_core.pipeline import ImageResult, ReductionPipeline
from care_core.timing import StageClock
from tests.backbones._helpers import noise_image

# eight images of different sizes and shapes (different N on LLaVA-NeXT and Qwen2.5-VL, so different K per ratio;
# NeXT canvases of two crops at most, to keep the test short)
SIZES = [(300, 420), (500, 260), (336, 336), (200, 640), (120, 200), (260, 300), (420, 300), (240, 360)]
QUESTIONS = ["Is there a red circle?", "What colour is the square?", "How many shapes?", "Where is the star?",
             "Is the triangle blue?", "What is left of it?", "Describe the image.", "Is there a cross?"]  # fmt: skip
BUDGETS = [Budget.ratio(0.1)]  # K_i from each image's own N
NEW_TOKENS = 3


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def images() -> list[Any]:
    return [noise_image(h, w, seed=10 + i) for i, (h, w) in enumerate(SIZES)]


@pytest.fixture(scope="module", params=["tiny-llava", "tiny-llava-next", "tiny-qwen2.5-vl"])
def batch_one(request: pytest.FixtureRequest, images: list[Any]) -> tuple[ReductionPipeline, list[ImageResult]]:
    """Every method this demo serves, each image alone (batch 1): the reference."""
    pipe = ReductionPipeline.from_pretrained(request.param, methods=method_names(), skip_unavailable=True, device="cpu")
    alone = [pipe(image, question, BUDGETS, csr=True, generate=True, max_new_tokens=NEW_TOKENS)
             for image, question in zip(images, QUESTIONS, strict=True)]  # fmt: skip
    return pipe, alone


def _same(batched: ImageResult, alone: ImageResult) -> None:
    assert batched.num_tokens == alone.num_tokens
    assert [(r.method, r.budget, r.keep) for r in batched.runs] == [(r.method, r.budget, r.keep) for r in alone.runs]
    assert batched.full_answer is not None and alone.full_answer is not None
    assert batched.full_answer.token_ids == alone.full_answer.token_ids
    for got, ref in zip(batched.runs, alone.runs, strict=True):
        where = f"{got.method} {got.budget.label}"
        assert torch.equal(got.result.token_index, ref.result.token_index), where
        torch.testing.assert_close(got.result.tokens, ref.result.tokens, rtol=1e-5, atol=1e-6, msg=where)
        torch.testing.assert_close(got.projected, ref.projected, rtol=1e-5, atol=1e-5, msg=where)
        assert got.csr == pytest.approx(ref.csr, abs=1e-6), where
        assert got.answer is not None and ref.answer is not None
        assert got.answer.token_ids == ref.answer.token_ids, where
        assert got.answer.visual_tokens == ref.answer.visual_tokens, where


def test_a_batch_gives_every_image_what_it_gets_alone(
    batch_one: tuple[ReductionPipeline, list[ImageResult]], images: list[Any]
) -> None:
    pipe, alone = batch_one
    order = [5, 2, 7, 0, 3, 6, 1, 4]  # all eight sizes, shuffled: results come back in the order given
    assert len(pipe.methods) >= 4  # the demo serves several methods (all 16 on the LLaVA demos)
    out = pipe.run_batch([images[i] for i in order], [QUESTIONS[i] for i in order], BUDGETS, csr=True,
                         generate=True, max_new_tokens=NEW_TOKENS)  # fmt: skip
    assert len(out) == len(order) and all(r.batch_size == len(order) for r in out)
    for batched, i in zip(out, order, strict=True):
        _same(batched, alone[i])


def test_a_batch_needs_one_question_per_image(images: list[Any]) -> None:
    pipe = ReductionPipeline.from_pretrained("tiny-llava", methods=["random"], device="cpu")
    with pytest.raises(CareError, match="one question and plan per image"):
        pipe.run_batch(images[:2], ["only one"])


# methods that time their own inner stages (the CaRe family, ZOO-Prune) and some that do not; two kinds of budget
UNTIMED_METHODS = ["care", "simple-calib", "zoo-prune", "visionzip", "random"]
UNTIMED_BUDGETS = [Budget.ratio(0.1), Budget.keep(24)]


@pytest.fixture(scope="module")
def small_pipe() -> ReductionPipeline:
    return ReductionPipeline.from_pretrained("tiny-llava", methods=UNTIMED_METHODS, device="cpu")


def test_an_untimed_batch_gives_what_a_timed_one_gives_without_timings_or_syncs(
    small_pipe: ReductionPipeline, images: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    some, questions = images[:3], QUESTIONS[:3]
    timed = small_pipe.run_batch(some, questions, UNTIMED_BUDGETS, csr=True)

    def refuse(self: StageClock) -> None:
        raise AssertionError("a stage clock synchronised")

    monkeypatch.setattr(StageClock, "_sync", refuse)  # a timing clock syncs on every stage, even on the CPU
    untimed = small_pipe.run_batch(some, questions, UNTIMED_BUDGETS, csr=True, timed=False)
    with pytest.raises(AssertionError, match="synchronised"):  # the check bites on a timed run
        small_pipe.run_batch(some, questions, UNTIMED_BUDGETS, csr=True)
    assert len(untimed) == len(timed) == 3
    for got, ref in zip(untimed, timed, strict=True):
        assert got.timings_ms == {} and "reference" in ref.timings_ms
        assert [(r.method, r.budget, r.keep) for r in got.runs] == [(r.method, r.budget, r.keep) for r in ref.runs]
        assert len(got.runs) == len(UNTIMED_METHODS) * len(UNTIMED_BUDGETS)
        for one, other in zip(got.runs, ref.runs, strict=True):
            where = f"{one.method} {one.budget.label}"
            assert torch.equal(one.result.token_index, other.result.token_index), where
            assert torch.equal(one.result.tokens, other.result.tokens), where
            assert torch.equal(one.projected, other.projected), where
            assert one.csr is not None and one.csr == other.csr, where
            assert one.uniform_weights is other.uniform_weights is False, where
            assert one.timings_ms == {} and "method" in other.timings_ms, where
        assert {"scoring", "anchors", "calibration"} <= set(ref.run("care").timings_ms)  # inner stages timed


def test_every_csr_of_a_batch_is_the_float_of_its_own_run(small_pipe: ReductionPipeline, images: list[Any]) -> None:
    """Read together at the end of the batch, each CSR is bit for bit what that run's CSR alone reads as."""
    adapter = small_pipe.adapter
    out = small_pipe.run_batch(images[:3], QUESTIONS[:3], UNTIMED_BUDGETS, csr=True, timed=False)
    for result, question in zip(out, QUESTIONS[:3], strict=True):
        with torch.no_grad():
            reference = csr_reference(adapter.projector(result.tokens.features), adapter.question_embeddings(question))
        for run in result.runs:
            assert isinstance(run.csr, float)
            assert run.csr == csr_from_reference(reference, run.projected), f"{run.method} {run.budget.label}"
