"""The pipeline owns one Scorer for its projector and every PRCA method scores through it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from care_core import CaReConfig
from care_core.budget import Budget
from care_core.images import load_image
from care_core.pipeline import ReductionPipeline

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_pipeline_scores_through_one_kept_scorer(monkeypatch: Any) -> None:
    import care_core.scoring

    pipe = ReductionPipeline.from_pretrained("tiny-llava", methods=["care", "prca-only"], config=CaReConfig(m=8),
                                             device="cpu")  # fmt: skip
    scorer = pipe.scorer
    assert scorer is pipe.scorer and scorer.projector is pipe.adapter.projector
    seen: list[Any] = []
    original = care_core.scoring.Scorer.responses

    def spy(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(care_core.scoring.Scorer, "responses", spy)
    image = load_image(EXAMPLES / "astronaut.jpg")
    pipe(image, "What is this?", [Budget.keep(16), Budget.keep(8)])
    pipe(image, "What is this?", [Budget.keep(16)])
    # psi_bar is shared by both methods and budgets of an image: one scoring per image, both through the scorer
    assert seen == [scorer, scorer]
