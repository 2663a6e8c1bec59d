"""Shared set-up of the evaluation tests: the shipped offline tasks, quiet lmms-eval, a private datasets cache."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "examples" / "tasks"
POPE = TASKS / "care_pope_examples"
VQA = TASKS / "care_vqa_examples"
SHAPES = TASKS / "care_shapes_examples"


@pytest.fixture(scope="session", autouse=True)
def eval_environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """datasets writes its cache under tmp (never the user's), with no progress bars; nothing reaches the hub."""
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_DISABLE_PROGRESS_BARS")}
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path_factory.mktemp("hf_datasets"))
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
