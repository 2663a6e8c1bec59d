"""Which tokens each method keeps on the trained demo, measured against the object the question is about.

    python -m benchmarks.bench_demo_coverage [--model tiny-llava] [--questions 250] [--keep 64] [--workers 2]
    python -m benchmarks.bench_demo_coverage --quick   # 20 questions, care and random, one worker

For held-out synthetic questions (split seed 1, as ``benchmarks.bench_demo_accuracy``) about an object ("What colour
is the circle?", "Is the red square on the left or the right?", "Is there a blue cross?" answered yes), every
registered method reduces the image's N visual tokens (576 on ``tiny-llava``) to K, and we read off, from the
object labels of the scene (the object drawn at the centre of each token's footprint in the original image, from
the adapter's token geometry ``ImageTokens.boxes``, so any ``--model`` works: crops, tiles, merged patches):

- ``on objects``: the share of the kept tokens that lie on any object (the objects cover a few % of the tokens);
- ``named kept``: how often at least one token on the object asked about is among the kept tokens;
- ``named reaches``: how often at least one of its tokens reaches the language model, kept or merged into a
  kept token (the method's ``assignment``; for CaRe, a calibration signal injected into an anchor).

Questions whose object covers no token's centre are left out.

It explains the accuracy table of ``benchmarks.bench_demo_accuracy``: a method that never keeps the question's
object has to carry it some other way. Reductions run on the CPU in float32 (one thread per worker). Prints a table and
writes its JSON into --results-dir (default: a new scratch folder; --out FILE writes a copy there too, never over
a file). Run from the repository root.
"""

from __future__ import annotations

import multiprocessing as mp
import platform
import sys
import time
from typing import Any

import numpy as np
import torch

from benchmarks.common import ResultsWriter, fail, make_parser, print_table, run_main, stamp
from benchmarks.demo_world import HELDOUT_SPLIT, configured_method, heldout_items, load_photos, use_pil_image_processor

_state: dict[str, Any] = {}


def _init(model: str, methods: list[str], keeps: list[int], seed: int) -> None:
    from care_core.backbones import load_backbone

    torch.set_num_threads(1)
    adapter = load_backbone(model, device="cpu", dtype="float32")
    use_pil_image_processor(adapter)
    _state.update(adapter=adapter, photos=load_photos(), keeps=keeps, seed=seed,
                  methods={m: configured_method(m, seed) for m in methods})  # fmt: skip


def token_objects(tokens: Any, scene: Any) -> np.ndarray:
    """(N,) int: 1 + the index of the object drawn at the centre of each token's footprint (0: background).

    The footprint is the adapter's own geometry (``tokens.boxes``, original-image pixels), so every backbone
    family reads the same rule; a centre outside the image (padding) reads the nearest edge pixel.
    """
    from care_core.synthetic import label_image

    labels = np.asarray(label_image(scene), dtype=np.int64)[:, :, 0]
    boxes = tokens.boxes.to(torch.float64).numpy()
    height, width = labels.shape
    x = np.clip(np.floor((boxes[:, 0] + boxes[:, 2]) / 2), 0, width - 1).astype(np.int64)
    y = np.clip(np.floor((boxes[:, 1] + boxes[:, 3]) / 2), 0, height - 1).astype(np.int64)
    return labels[y, x]


def asked_about(objects: Any, question: str, qtype: str, answer: str) -> list[int]:
    """1 + the indices of the objects the question is about (``care_core.synthetic``'s phrasings); [] for counts
    and for "is there a ...?" answered no."""

    def match(obj: Any) -> bool:
        if qtype == "colour":
            return question.endswith(f"the {obj.shape}?")
        if qtype == "shape":
            return question.endswith(f"is {obj.colour}?")
        if qtype == "exists":
            return answer == "yes" and question.endswith(f"a {obj.name}?")
        if qtype == "position":
            return question.startswith(f"Is the {obj.name} ")
        return False

    return [i + 1 for i, obj in enumerate(objects) if match(obj)]


def _one(item: tuple[int, str, str, str]) -> dict[str, Any] | None:
    from care_core.errors import MethodError
    from care_core.methods import MethodInputs
    from care_core.synthetic import make_scene

    index, question, answer, qtype = item
    adapter = _state["adapter"]
    scene = make_scene(HELDOUT_SPLIT, index, photos=_state["photos"])
    named = asked_about(scene.objects, question, qtype, answer)
    if not named:
        return None
    tokens = adapter.encode_image(scene.image)
    at = token_objects(tokens, scene)
    if not np.isin(at, named).any():  # too small to cover any token's centre
        return None
    row: dict[str, Any] = {"type": qtype, "cells": {}}
    with torch.no_grad():
        question_embeds = adapter.question_embeddings(question)
        for name, method in _state["methods"].items():
            needs = sorted(set(method.needs) - {"question"})
            try:
                probes = adapter.probe_inputs(tokens, needs, question=question) if needs else {}
            except MethodError as exc:
                row["cells"][name] = {"error": str(exc)}
                continue
            probes["question"] = question_embeds
            inputs = MethodInputs(tokens.features, adapter.projector, tokens.positions, grid=tokens.grid,
                                  probes=probes, seed=_state["seed"])  # fmt: skip
            for k in _state["keeps"]:
                result = method(inputs, k)
                kept = result.token_index[result.token_index >= 0].numpy()
                reaches = kept if result.assignment is None else np.nonzero(result.assignment.numpy() >= 0)[0]
                row["cells"][f"{name}@{k}"] = {
                    "on_objects": float((at[kept] > 0).mean()) if kept.size else 0.0,
                    "named_kept": int(np.isin(at[kept], named).any()),
                    "named_reaches": int(np.isin(at[reaches], named).any()),
                }
    row["object_share"] = float((at > 0).mean())
    row["demo_note"] = adapter.demo_note
    return row


def summarise(rows: list[dict[str, Any]], methods: list[str], keeps: list[int]) -> dict[str, Any]:
    cells, skipped = [], {}
    for name in methods:
        for k in keeps:
            got = [r["cells"].get(f"{name}@{k}") or r["cells"].get(name) for r in rows]
            if any(g is None or "error" in g for g in got):
                skipped[name] = next((g["error"] for g in got if g and "error" in g), "not run")
                continue
            cells.append({
                "method": name, "K": k,
                "on_objects_pct": round(100 * sum(g["on_objects"] for g in got) / len(got), 2),
                "named_kept_pct": round(100 * sum(g["named_kept"] for g in got) / len(got), 2),
                "named_reaches_pct": round(100 * sum(g["named_reaches"] for g in got) / len(got), 2),
            })  # fmt: skip
    return {"questions_about_an_object": len(rows),
            "object_patch_share_pct": round(100 * sum(r["object_share"] for r in rows) / len(rows), 2),
            "cells": cells, "skipped_methods": skipped}  # fmt: skip


def show(summary: dict[str, Any], title: str) -> None:
    header = ("method", "K", "on objects %", "named kept %", "named reaches %")
    rows = [(c["method"], str(c["K"]), f"{c['on_objects_pct']:.1f}", f"{c['named_kept_pct']:.1f}",
             f"{c['named_reaches_pct']:.1f}") for c in summary["cells"]]  # fmt: skip
    print_table(title, header, rows)


def parse(argv: list[str] | None) -> Any:
    parser = make_parser(__doc__, quick="20 questions, care and random at K = 64, one worker (about 15 s on a "
                         "2-core CPU)", duration="250 questions, every method: about 1 minute with 2 workers on "
                         "2 cores (the committed result: 57 s)")  # fmt: skip
    parser.add_argument("--model", default="tiny-llava")
    parser.add_argument("--questions", type=int, default=250, help="held-out questions drawn (types balanced)")
    parser.add_argument("--keep", type=int, action="append", help="K (repeatable; default 64)")
    parser.add_argument("--method", action="append", help="method (repeatable; default every one the model serves)")
    parser.add_argument("--workers", type=int, default=max(1, (mp.cpu_count() or 2)))
    parser.add_argument("--seed", type=int, default=42, help="seed of the methods that draw random numbers")
    args = parser.parse_args(argv)
    if args.quick:
        args.questions, args.workers = min(args.questions, 20), 1
        args.method = args.method or ["care", "random"]
    return args


def _served_methods(model: str) -> list[str]:
    """Every registered method that serves the model's family (``--method all``'s list; ``pool`` refuses
    LLaVA-NeXT, for one)."""
    from care_core.backbones import load_backbone
    from care_core.methods.registry import methods_for_backbone

    return methods_for_backbone(load_backbone(model).family)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    writer = ResultsWriter(args, "cpu-bench_demo_coverage")
    keeps = args.keep or [64]
    methods = args.method or _served_methods(args.model)
    items = heldout_items(args.questions)
    start = time.perf_counter()
    with mp.get_context("spawn").Pool(args.workers, initializer=_init,
                                      initargs=(args.model, methods, keeps, args.seed)) as pool:  # fmt: skip
        rows = [r for r in pool.map(_one, items, chunksize=4) if r is not None]
    if not rows:
        raise fail(f"none of the {len(items)} held-out questions is about an object a token centre lies on "
                   "(draw more with --questions)")  # fmt: skip
    summary = summarise(rows, methods, keeps)
    wall = time.perf_counter() - start
    note = rows[0]["demo_note"]
    title = (f"{args.model}: {summary['questions_about_an_object']} held-out questions about an object "
             f"(objects cover {summary['object_patch_share_pct']:.1f}% of the tokens)"
             + (f"; {note}" if note else ""))  # fmt: skip
    show(summary, title)
    command = "python -m benchmarks.bench_demo_coverage " + " ".join(sys.argv[1:] if argv is None else argv)
    payload = {"benchmark": "bench_demo_coverage", "date": stamp(), "command": command,
               "model": args.model, "demo_note": note, "questions_drawn": args.questions,
               "heldout_split_seed": HELDOUT_SPLIT, "method_seed": args.seed, "keeps": keeps,
               "wall_seconds": round(wall, 1),
               "host": {"machine": platform.machine(), "cpus": mp.cpu_count(), "workers": args.workers,
                        "torch": torch.__version__, "python": platform.python_version()},
               **summary}  # fmt: skip
    writer.finish(payload)


if __name__ == "__main__":
    run_main(main)
