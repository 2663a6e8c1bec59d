"""The pipeline over a batch: every registered method on the three demos, per image exactly what batch 1 gives."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from care_core.budget import Budget
from care_core.errors import CareError
from care_core.methods import method_names
from care_core.pipeline import ImageResult, ReductionPipeline
from tests.backbones._helpers import noise_image

# eight images of different sizes and shapes (different N on LLaVA-NeXT and Qwen2.5-VL, so different K per ratio;
# NeXT canvases of two crops at most, to keep the test short)
SIZES = [(300, 420), (500, 260), (336, 336), (200, 640), (120, 200), (260, 300), (420, 300), (240, 360)]
QUESTIONS = ["Is there a red circle?", "What colour is the square?", "How many shapes?", "Where is the star?",
             "Is the triangle blue?", "What is left of it?", "Describe the image.", "Is there a cross?"]  # fmt: skip
BUDGETS = [Budget.ratio(0.1)]  # K_i from each image's own N
NEW_TOKENS = 3


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: intra-op threads only cost time on a busy CI box
    yield
    torch.set_num_threads(saved)


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


@pytest.mark.parametrize("order", [[2, 0, 1], list(range(8))], ids=["3-shuffled", "8"])
def test_a_batch_gives_every_image_what_it_gets_alone(
    batch_one: tuple[ReductionPipeline, list[ImageResult]], images: list[Any], order: list[int]
) -> None:
    pipe, alone = batch_one
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
