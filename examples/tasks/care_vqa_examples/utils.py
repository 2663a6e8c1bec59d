"""Open-answer questions over the example photos: prompt, image and VQA-style scoring.

An answer scores 1 for ``exact_match`` when, normalised (lower case, no punctuation or articles), it equals
one of the accepted answers, and 1 for ``contains`` when one of them appears in it as whole words.
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
    kwargs = lmms_eval_specific_kwargs or {}
    return f"{kwargs.get('pre_prompt', '')}{doc['question'].strip()}{kwargs.get('post_prompt', '')}"


def normalise(text: str) -> str:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return " ".join(w for w in words if w not in ARTICLES)


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    prediction = normalise(results[0])
    accepted = [normalise(a) for a in doc["answers"]]
    padded = f" {prediction} "
    return {
        "exact_match": float(prediction in accepted),
        "contains": float(any(a and f" {a} " in padded for a in accepted)),
    }
