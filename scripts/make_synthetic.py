"""Write questions of the synthetic shapes world (``care_core.synthetic``) as JSONL + PNG images.

    python -m scripts.make_synthetic OUT_DIR [--split 1] [--questions 500] [--photos examples/*.jpg]

Run from the repository root (as a module: it imports care_core and the benchmarks' photo list from there).

Each line is ``{"image": "images/<split>-<index>.png", "question": ..., "answer": ..., "type": ...}`` with the
image path relative to the JSONL file, so ``care csr --data OUT_DIR/questions.jsonl`` reads it. Split 1 is the
held-out split the demo backbone was evaluated on (it was trained on split 0). Types come in turn (colour,
shape, exists, count, position), as in the benchmark.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from PIL import Image

from benchmarks.common import EXAMPLES
from benchmarks.demo_world import PHOTOS
from care_core.synthetic import iter_questions

DEFAULT_PHOTOS = [EXAMPLES / name for name in PHOTOS]


def write_split(out: Path, split: int, count: int, photos: Sequence[Path] = ()) -> Path:
    """Write ``count`` questions of split ``split`` under ``out``; return the JSONL file."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "images").mkdir(exist_ok=True)
    backgrounds = [Image.open(p).convert("RGB") for p in photos]
    path = out / "questions.jsonl"
    written: set[int] = set()
    with open(path, "w", encoding="utf-8") as fh:
        for scene, qa in iter_questions(split, count, photos=backgrounds):
            name = f"images/{split}-{scene.index:06d}.png"
            if scene.index not in written:
                scene.image.save(out / name)
                written.add(scene.index)
            record = {"image": name, "question": qa.question, "answer": qa.answer, "type": qa.type}
            fh.write(json.dumps(record) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--split", type=int, default=1, help="split seed (0: training split, 1: held-out)")
    parser.add_argument("--questions", type=int, default=500)
    parser.add_argument("--photos", type=Path, nargs="*", default=DEFAULT_PHOTOS, help="background photos")
    args = parser.parse_args(argv)
    path = write_split(args.out, args.split, args.questions, args.photos)
    print(f"wrote {args.questions} questions to {path}")


if __name__ == "__main__":
    main()
