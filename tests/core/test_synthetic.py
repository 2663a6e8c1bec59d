"""The synthetic shapes world: deterministic scenes, answerable one-word questions, the JSONL writer."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from care_core.synthetic import (
    COLOURS,
    IMAGE_SIZES,
    QUESTION_TYPES,
    SHAPES,
    first_word,
    iter_questions,
    label_image,
    make_scene,
    scene_size,
)

ROOT = Path(__file__).resolve().parents[2]
PHOTOS = [Image.open(ROOT / "examples" / n).convert("RGB") for n in ("astronaut.jpg", "chelsea.jpg", "coffee.jpg")]


def test_scenes_are_deterministic_per_seed_and_index() -> None:
    a, b = make_scene(0, 7, photos=PHOTOS), make_scene(0, 7, photos=PHOTOS)
    assert a.image.tobytes() == b.image.tobytes() and a.objects == b.objects and a.questions == b.questions
    other = make_scene(1, 7, photos=PHOTOS)  # the held-out split: another seed, other scenes
    assert other.image.tobytes() != a.image.tobytes()
    assert make_scene(0, 8).image.tobytes() != make_scene(0, 7).image.tobytes()


def test_scene_size_is_the_size_of_the_image_make_scene_draws() -> None:
    for seed in (0, 1):
        sizes = [scene_size(seed, index) for index in range(40)]
        assert sizes == [make_scene(seed, index).image.size[::-1] for index in range(40)]  # PIL: (width, height)
        assert len(set(sizes)) > 3  # the world's mix, not one size


@pytest.mark.parametrize("index", range(12))
def test_objects_are_drawn_where_and_as_they_say(index: int) -> None:
    scene = make_scene(0, index, photos=PHOTOS)
    width, height = scene.image.size
    assert (height, width) in IMAGE_SIZES and scene.image.mode == "RGB"
    side = min(width, height)
    pixels = np.asarray(scene.image)
    labels = np.asarray(label_image(scene))[..., 0]
    assert len(scene.objects) >= 1
    for i, obj in enumerate(scene.objects):
        x, y = obj.center
        # inside the central square, which every backbone sees (LLaVA-1.5 centre-crops it)
        assert (width - side) / 2 <= x - obj.side / 2 and x + obj.side / 2 <= (width + side) / 2
        assert (height - side) / 2 <= y - obj.side / 2 and y + obj.side / 2 <= (height + side) / 2
        assert obj.shape in SHAPES and obj.colour in COLOURS
        assert tuple(pixels[round(y), round(x)]) == COLOURS[obj.colour]  # centre pixel: the object's colour
        assert labels[round(y), round(x)] == i + 1
    assert (labels > 0).mean() < 0.5  # background stays visible


def test_questions_have_one_word_answers_that_follow_from_the_objects() -> None:
    seen: Counter[tuple[str, str]] = Counter()
    for index in range(150):
        scene = make_scene(0, index)
        objects = scene.objects
        width, height = scene.image.size
        for qa in scene.questions:
            assert qa.type in QUESTION_TYPES and qa.answer == qa.answer.lower() and " " not in qa.answer
            seen[(qa.type, qa.answer)] += 1
            words = qa.question.rstrip("?").split()
            if qa.type == "colour":  # "What colour is the <shape>?"
                (match,) = [o for o in objects if o.shape == words[-1]]
                assert qa.answer == match.colour
            elif qa.type == "shape":  # "What shape is <colour>?"
                (match,) = [o for o in objects if o.colour == words[-1]]
                assert qa.answer == match.shape
            elif qa.type == "exists":  # "Is there a <colour> <shape>?"
                present = any(o.colour == words[-2] and o.shape == words[-1] for o in objects)
                assert qa.answer == ("yes" if present else "no")
            elif qa.type == "count":
                if words[2] == "shapes":
                    assert qa.answer == str(len(objects))
                else:
                    assert qa.answer == str(sum(words[2] in (o.shape + "s", o.shape + "es") for o in objects))
            else:  # "Is the <colour> <shape> on the left or the right?" / "at the top or the bottom?"
                (match,) = [o for o in objects if o.colour == words[2] and o.shape == words[3]]
                if "left" in words:
                    assert qa.answer == ("left" if match.center[0] < width / 2 else "right")
                else:
                    assert qa.answer == ("top" if match.center[1] < height / 2 else "bottom")
    # every answer of every type occurs: the questions are not all one answer
    for qtype, answers in {
        "exists": {"yes", "no"},
        "position": {"left", "right", "top", "bottom"},
        "colour": set(COLOURS),
        "shape": set(SHAPES),
    }.items():
        assert {a for t, a in seen if t == qtype} == answers


def test_iter_questions_balances_types() -> None:
    pairs = list(iter_questions(1, 20))
    assert [qa.type for _, qa in pairs] == list(QUESTION_TYPES) * 4
    assert [s.index for s, _ in pairs] == sorted(s.index for s, _ in pairs)


def test_first_word() -> None:
    assert first_word(" Red.  circle") == "red" and first_word("") == "" and first_word('"Yes",') == "yes"


def test_writer_makes_jsonl_that_care_csr_reads(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from make_synthetic import write_split
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    from care_core.dataset_csr import read_pairs

    path = write_split(tmp_path / "syn", 1, 6)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["type"] for r in records] == [*QUESTION_TYPES, QUESTION_TYPES[0]]
    assert all(set(r) == {"image", "question", "answer", "type"} for r in records)
    pairs, skipped = read_pairs(path, skip_bad=False)
    assert not skipped and len(pairs) == 6 and all(p.image.is_file() for p in pairs)
    first = next(iter_questions(1, 1))[0]
    assert Image.open(pairs[0].image).tobytes() == first.image.tobytes()  # PNG: lossless


def test_answer_question_answers_from_the_methods_rows() -> None:
    """Through the pipeline: the language model gets the method's K projected rows (kept = their token indices),
    or all N; the answer is the adapter's greedy answer to those rows."""
    import torch

    from care_core import CaReConfig
    from care_core.methods import MethodInputs, build_method
    from care_core.pipeline import ReductionPipeline
    from care_core.synthetic import answer_question

    adapter = ReductionPipeline.from_pretrained("tiny-llava", device="cpu").adapter
    scene = make_scene(1, 0)
    tokens = adapter.encode_image(scene.image)
    question = scene.questions[0].question
    method = build_method("care", config=CaReConfig(seed=0, m=8))
    text, projected = answer_question(adapter, tokens, question, method=method, keep=32)
    with torch.no_grad():
        result = method(MethodInputs(tokens.features, adapter.projector, tokens.positions, grid=tokens.grid), 32)
        rows = adapter.projector(result.tokens.to(adapter.dtype))
        want = adapter.generate(question, tokens, rows, max_new_tokens=10, kept=result.token_index)
    assert torch.equal(projected, rows) and text == want.text
    full_text, full_rows = answer_question(adapter, tokens, question)
    with torch.no_grad():
        assert full_rows.shape[0] == tokens.num_tokens
        assert full_text == adapter.generate(question, tokens, full_rows, max_new_tokens=10).text
