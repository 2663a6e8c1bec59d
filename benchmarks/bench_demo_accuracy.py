"""Accuracy of the trained demo backbone on held-out synthetic questions, with all tokens and with every registered
method at K = 64, 128, 192; the CSR of each; Spearman's rho between CSR and accuracy across method x budget.

    python -m benchmarks.bench_demo_accuracy [--model tiny-llava] [--questions 500] [--workers 15]
    python -m benchmarks.bench_demo_accuracy --quick   # 10 questions, care and random at K = 64, one worker

Answers come from ``adapter.generate`` (greedy; ``kept`` = the method's token indices), as ``care reduce
--generate`` gets them; the first word is compared case-insensitively. Each worker process loads the backbone
on the CPU in float32 (one thread), so the numbers are the ones the CPU tests see. Prints a table and writes its
JSON into --results-dir (default: a new scratch folder; --out FILE writes a copy there too, never over a file).
Run from the repository root.
"""

from __future__ import annotations

import multiprocessing as mp
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ResultsWriter, make_parser, print_table, say, stamp
from benchmarks.demo_world import HELDOUT_SPLIT, configured_method, heldout_items, load_photos, use_pil_image_processor

_state: dict[str, Any] = {}


def _init(model: str, home: str | None, methods: list[str], keeps: list[int], seed: int) -> None:
    from care_core.backbones import load_backbone

    torch.set_num_threads(1)
    adapter = load_backbone(model, device="cpu", dtype="float32", home=Path(home) if home else None)
    use_pil_image_processor(adapter)
    _state.update(
        adapter=adapter,
        photos=load_photos(),
        methods={m: configured_method(m, seed) for m in methods},
        keeps=keeps,
        seed=seed,
    )


def _one(item: tuple[int, str, str, str]) -> dict[str, Any]:
    from care_core.csr import csr_from_reference, csr_reference
    from care_core.errors import MethodError
    from care_core.synthetic import answer_question, first_word, make_scene

    index, question, answer, qtype = item
    adapter = _state["adapter"]
    scene = make_scene(HELDOUT_SPLIT, index, photos=_state["photos"])
    tokens = adapter.encode_image(scene.image)
    full_text, full = answer_question(adapter, tokens, question)
    reference = csr_reference(full, adapter.question_embeddings(question))
    row: dict[str, Any] = {"type": qtype, "all": int(first_word(full_text) == answer), "cells": {}, "seconds": {}}
    for name, method in _state["methods"].items():
        for k in _state["keeps"]:
            start = time.perf_counter()
            try:
                text, projected = answer_question(adapter, tokens, question, method=method, keep=k, seed=_state["seed"])
            except MethodError as exc:
                row["cells"][f"{name}@{k}"] = {"error": str(exc)}
                continue
            row["cells"][f"{name}@{k}"] = {
                "hit": int(first_word(text) == answer),
                "csr": 100 * csr_from_reference(reference, projected),
            }
            row["seconds"][name] = row["seconds"].get(name, 0.0) + time.perf_counter() - start
    return row


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for t in range(i, j + 1):
                out[order[t]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx > 0 and vy > 0 else float("nan")


def summarise(rows: list[dict[str, Any]], methods: list[str], keeps: list[int]) -> dict[str, Any]:
    from care_core.synthetic import QUESTION_TYPES

    def acc(hits: list[int]) -> float:
        return round(100 * sum(hits) / len(hits), 2) if hits else float("nan")

    def per_type(key: Any) -> dict[str, float]:
        return {t: acc([key(r) for r in rows if r["type"] == t and key(r) is not None]) for t in QUESTION_TYPES}

    cells: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for name in methods:
        for k in keeps:
            key = f"{name}@{k}"
            got = [r["cells"][key] for r in rows]
            errors = [g["error"] for g in got if "error" in g]
            if errors:
                skipped[name] = errors[0]
                continue
            cells.append({
                "method": name,
                "K": k,
                "accuracy": acc([g["hit"] for g in got]),
                "per_type": per_type(lambda r, key=key: r["cells"][key]["hit"]),
                "csr": round(sum(g["csr"] for g in got) / len(got), 2),
            })  # fmt: skip
    rho = spearman([c["csr"] for c in cells], [c["accuracy"] for c in cells]) if len(cells) > 2 else float("nan")
    seconds: dict[str, float] = {}
    for r in rows:
        for name, s in r["seconds"].items():
            seconds[name] = seconds.get(name, 0.0) + s
    return {
        "all_tokens": {"accuracy": acc([r["all"] for r in rows]), "per_type": per_type(lambda r: r["all"])},
        "cells": cells,
        "skipped_methods": skipped,
        "spearman_csr_accuracy": round(rho, 4),
        "method_cpu_seconds_per_question": {n: round(s / len(rows), 4) for n, s in seconds.items()},
    }


def show(summary: dict[str, Any], keeps: list[int], title: str) -> None:
    header = ["method"]
    for k in keeps:
        header += [f"acc K={k}", f"CSR K={k}"]
    rows = [("all tokens", *[f"{summary['all_tokens']['accuracy']:.1f}", "100.0"] * len(keeps))]
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for c in summary["cells"]:
        by.setdefault(c["method"], {})[c["K"]] = c
    for name, per_k in by.items():
        values: list[str] = []
        for k in keeps:
            values += [f"{per_k[k]['accuracy']:.1f}", f"{per_k[k]['csr']:.1f}"]
        rows.append((name, *values))
    print_table(title, header, rows)
    say(f"all tokens per type: {summary['all_tokens']['per_type']}")
    say(f"Spearman rho (CSR vs accuracy, {len(summary['cells'])} method x budget cells): "
        f"{summary['spearman_csr_accuracy']}")  # fmt: skip
    for name, reason in summary["skipped_methods"].items():
        say(f"skipped {name}: {reason}")


def parse(argv: list[str] | None) -> Any:
    parser = make_parser(__doc__, quick="10 questions, care and random at K = 64, one worker (about 40 s on a "
                         "2-core CPU)", duration="500 questions, every method at 3 budgets: 118 s with 16 workers on a "
                         "16-core host (the committed result), so about 16 minutes on 2 cores")  # fmt: skip
    parser.add_argument("--model", default="tiny-llava")
    parser.add_argument("--home", default=None, help="care home for the demo (default: $CARE_HOME)")
    parser.add_argument("--questions", type=int, default=500)
    parser.add_argument("--keep", type=int, nargs="+", default=[64, 128, 192])
    parser.add_argument("--method", nargs="+", default=None, help="default: every registered method")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--workers", type=int, default=max(1, (mp.cpu_count() or 2) - 1))
    args = parser.parse_args(argv)
    if args.quick:
        args.questions, args.keep, args.workers = min(args.questions, 10), [64], 1
        args.method = args.method or ["care", "random"]
    return args


def main(argv: list[str] | None = None) -> None:
    from care_core.backbones import load_backbone
    from care_core.backbones.demo import file_sha256
    from care_core.methods import method_names

    args = parse(argv)
    writer = ResultsWriter(args, "cpu-bench_demo_accuracy")
    methods = args.method or method_names()
    adapter = load_backbone(args.model, device="cpu", dtype="float32", home=Path(args.home) if args.home else None)
    weights = Path(adapter.model.name_or_path) / "model.safetensors"
    items = heldout_items(args.questions)
    start = time.perf_counter()
    init_args = (args.model, args.home, methods, args.keep, args.seed)
    with mp.get_context("spawn").Pool(args.workers, initializer=_init, initargs=init_args) as pool:
        rows = pool.map(_one, items, chunksize=2)
    seconds = time.perf_counter() - start
    summary = summarise(rows, methods, args.keep)
    show(summary, args.keep, f"{args.model}: held-out accuracy (%) and CSR, {len(rows)} questions")
    payload = {
        "benchmark": "bench_demo_accuracy", "date": stamp(),
        "command": "python -m benchmarks.bench_demo_accuracy " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model, "demo_note": adapter.demo_note,
        "weights_sha256": file_sha256(weights) if weights.is_file() else None, "questions": len(rows),
        "heldout_split_seed": HELDOUT_SPLIT, "method_seed": args.seed, "keeps": args.keep,
        "host": {"machine": platform.node(), "cpus": mp.cpu_count(), "workers": args.workers,
                 "torch": torch.__version__, "python": platform.python_version(),
                 "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                 "note": "answers computed on the CPU (float32, one thread per worker)"},
        "wall_seconds": round(seconds, 1), **summary,
    }  # fmt: skip
    writer.finish(payload)


if __name__ == "__main__":
    main()
