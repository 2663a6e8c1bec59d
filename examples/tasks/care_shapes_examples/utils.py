"""Questions of the synthetic shapes world: the bare question as the prompt (as the demo was trained), and an
answer scores 1 when its first word, lower-cased, is the expected one-word answer."""

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
    return doc["question"].strip()


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    words = re.findall(r"[a-z0-9]+", results[0].lower())
    return {"accuracy": float(bool(words) and words[0] == doc["answers"][0])}
