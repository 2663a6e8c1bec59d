"""The held-out evaluation (split seed 1) of a trained model folder through the adapter's own generate path, on CPU
worker processes: all tokens, and random selection and ``care`` at K = 64."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import torch

from benchmarks.demo_world import HELDOUT_SPLIT, heldout_items, load_photos, use_pil_image_processor
from care_core.synthetic import QUESTION_TYPES, answer_question, first_word, make_scene

from .pool import ignore_ctrl_c

_eval: dict[str, Any] = {}


def _init_eval(folder: str, random_keep: int, size: tuple[int, int] | None) -> None:
    from care_core.backbones import load_backbone
    from care_core.methods import build_method

    ignore_ctrl_c()
    torch.set_num_threads(1)
    adapter = load_backbone(folder, device="cpu", dtype="float32")
    use_pil_image_processor(adapter)
    _eval.update(adapter=adapter, photos=load_photos(), random=build_method("random", seed=0),
                 care=build_method("care"), keep=random_keep, size=size)  # fmt: skip


def _eval_one(item: tuple[int, str, str, str]) -> tuple[str, int, int, int]:
    index, question, answer, qtype = item
    adapter = _eval["adapter"]
    scene = make_scene(HELDOUT_SPLIT, index, size=_eval["size"], photos=_eval["photos"])
    tokens = adapter.encode_image(scene.image)
    full, _ = answer_question(adapter, tokens, question)
    reduced, _ = answer_question(adapter, tokens, question, method=_eval["random"], keep=_eval["keep"])
    calibrated, _ = answer_question(adapter, tokens, question, method=_eval["care"], keep=_eval["keep"])
    return (
        qtype,
        int(first_word(full) == answer),
        int(first_word(reduced) == answer),
        int(first_word(calibrated) == answer),
    )


def evaluate(
    folder: Path, count: int, workers: int, random_keep: int, run: Any, size: tuple[int, int] | None = None
) -> dict[str, Any]:
    """Held-out accuracy (split seed 1) through ``adapter.generate`` (float32 on the CPU, ``workers`` processes):
    all tokens, and random selection and care at K = ``random_keep``; scenes at ``size`` (None: the world's mix)."""
    items = heldout_items(count, size)
    advance = run.phase(f"evaluating {count} held-out questions ({workers} workers)", total=len(items))
    rows = []
    initargs = (str(folder), random_keep, size)
    with mp.get_context("spawn").Pool(workers, initializer=_init_eval, initargs=initargs) as pool:
        for row in pool.imap(_eval_one, items, chunksize=4):
            rows.append(row)
            advance(1)
    result: dict[str, Any] = {}
    for key, col in (("all", 1), (f"random@{random_keep}", 2), (f"care@{random_keep}", 3)):
        per_type: dict[str, list[int]] = {}
        for row in rows:
            per_type.setdefault(row[0], []).append(int(row[col]))
        flat = [h for v in per_type.values() for h in v]
        result[key] = {
            "accuracy": round(100 * sum(flat) / len(flat), 2),
            "per_type": {t: round(100 * sum(v) / len(v), 2) for t in QUESTION_TYPES if (v := per_type.get(t))},
            "questions": len(flat),
        }
        run.log(f"held-out {key}: {result[key]}")
    return result
