"""Prompt, image and scoring of the example tasks (care_pope_examples, care_vqa_examples, care_shapes_examples).

lmms-eval loads this file through each task YAML's ``!function ../care_task_utils.<name>``. Image paths in the
tasks' data.jsonl are relative to this folder.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from PIL import Image

HERE = Path(__file__).resolve().parent
ARTICLES = {"a", "an", "the"}


def doc_to_visual(doc: dict[str, Any]) -> list[Image.Image]:
    with Image.open(HERE / doc["image"]) as image:
        return [image.convert("RGB")]


def doc_to_text(doc: dict[str, Any], lmms_eval_specific_kwargs: dict[str, Any] | None = None) -> str:
    """The question between the task's pre- and post-prompt (none: the bare question, as the demo was trained)."""
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['question'].strip()}{kwargs.get('post_prompt', '')}"


# ---------------------------------------------------------------------------------- POPE: yes / no, first word
def yes_no(text: str) -> str:
    """'yes', 'no' or 'other' from the first word of an answer."""
    words = re.findall(r"[a-z]+", text.lower())
    return words[0] if words and words[0] in ("yes", "no") else "other"


def pope_results(doc: dict[str, Any], results: list[str]) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------- VQA: open answers
def normalise(text: str) -> str:
    """Lower case, no punctuation or articles."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return " ".join(w for w in words if w not in ARTICLES)


def vqa_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """``exact_match``: the normalised answer equals an accepted one; ``contains``: one appears in it as words."""
    prediction = normalise(results[0])
    accepted = [normalise(a) for a in doc["answers"]]
    padded = f" {prediction} "
    return {
        "exact_match": float(prediction in accepted),
        "contains": float(any(a and f" {a} " in padded for a in accepted)),
    }


# ---------------------------------------------------------------------------------- shapes: one word
def shapes_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """1 when the answer's first word, lower-cased, is the expected one-word answer."""
    words = re.findall(r"[a-z0-9]+", results[0].lower())
    return {"accuracy": float(bool(words) and words[0] == doc["answers"][0])}
