"""POPE-style yes/no questions over the example photos: prompt, image, scoring and aggregation.

lmms-eval loads this file next to its YAML (``!function utils.<name>``). Images are paths relative to
this folder; answers are scored on their first word (yes / no), as POPE does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from PIL import Image

HERE = Path(__file__).resolve().parent


def doc_to_visual(doc: dict[str, Any]) -> list[Image.Image]:
    with Image.open(HERE / doc["image"]) as image:
        return [image.convert("RGB")]


def doc_to_text(doc: dict[str, Any], lmms_eval_specific_kwargs: dict[str, Any] | None = None) -> str:
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['question'].strip()}{kwargs.get('post_prompt', '')}"


def yes_no(text: str) -> str:
    """'yes', 'no' or 'other' from the first word of an answer."""
    words = re.findall(r"[a-z]+", text.lower())
    return words[0] if words and words[0] in ("yes", "no") else "other"


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
    record = {
        "question_id": doc["question_id"],
        "prediction": yes_no(results[0]),
        "truth": doc["answer"].strip().lower(),
    }
    return {"pope_accuracy": record, "pope_f1": record, "pope_yes_ratio": record}


def accuracy(records: list[dict[str, Any]]) -> float:
    return sum(r["prediction"] == r["truth"] for r in records) / len(records) if records else 0.0


def f1(records: list[dict[str, Any]]) -> float:
    tp = sum(r["prediction"] == "yes" and r["truth"] == "yes" for r in records)
    fp = sum(r["prediction"] == "yes" and r["truth"] == "no" for r in records)
    fn = sum(r["prediction"] != "yes" and r["truth"] == "yes" for r in records)
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def yes_ratio(records: list[dict[str, Any]]) -> float:
    """Share of answers that are 'yes' (0.5 is balanced on this set)."""
    return sum(r["prediction"] == "yes" for r in records) / len(records) if records else 0.0
