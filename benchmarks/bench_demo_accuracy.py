"""Accuracy of the trained demo backbone on held-out synthetic questions, with all tokens and with every registered
method at K = 64, 128, 192; the CSR of each; Spearman's rho between CSR and accuracy across method x budget.

    python benchmarks/bench_demo_accuracy.py [--model tiny-llava] [--questions 500] [--workers 15]

Answers come from ``adapter.generate`` (greedy; ``kept`` = the method's token indices), as ``care reduce
--generate`` gets them; the first word is compared case-insensitively. Each worker process loads the backbone
on the CPU in float32 (one thread), so the numbers are the ones the CPU tests see. Prints a table and writes JSON
to a new dated file under benchmarks/results/ (never overwriting one).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import multiprocessing as mp
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "scripts"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

HELDOUT_SPLIT = 1
PHOTOS = ("astronaut.jpg", "chelsea.jpg", "coffee.jpg")

_state: dict[str, Any] = {}


def load_photos() -> list[Any]:
    from PIL import Image

    return [Image.open(ROOT / "examples" / name).convert("RGB") for name in PHOTOS]


def configured_method(name: str, seed: int) -> Any:
    """The named method at its defaults, with ``seed`` wherever it draws random numbers (as ``care csr``)."""
    from care_core import CaReConfig
    from care_core.methods import build_method, method_class

    fields = {f.name for f in dataclasses.fields(method_class(name))}
    options: dict[str, Any] = {}
    if "seed" in fields:
        options["seed"] = seed
    if "config" in fields:
        options["config"] = CaReConfig(seed=seed)
    return build_method(name, **options)


def use_pil_image_processor(adapter: Any) -> None:
    """The PIL CLIP processor (what the package uses without torchvision, and what training used)."""
    ip = adapter.processor.image_processor
    if type(ip).__name__.endswith("Pil") or not hasattr(ip, "crop_size"):
        return
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    adapter.processor.image_processor = CLIPImageProcessorPil(
        size=dict(ip.size), crop_size=dict(ip.crop_size), do_center_crop=ip.do_center_crop
    )


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


def heldout_items(count: int) -> list[tuple[int, str, str, str]]:
    from care_core.synthetic import iter_questions

    pairs = iter_questions(HELDOUT_SPLIT, count, photos=load_photos())
    return [(scene.index, qa.question, qa.answer, qa.type) for scene, qa in pairs]


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
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("method", style="cyan")
    for k in keeps:
        table.add_column(f"acc K={k}", justify="right")
        table.add_column(f"CSR K={k}", justify="right")
    table.add_row("all tokens", *[f"{summary['all_tokens']['accuracy']:.1f}", "100.0"] * len(keeps), style="bold")
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for c in summary["cells"]:
        by.setdefault(c["method"], {})[c["K"]] = c
    for name, per_k in by.items():
        values: list[str] = []
        for k in keeps:
            values += [f"{per_k[k]['accuracy']:.1f}", f"{per_k[k]['csr']:.1f}"]
        table.add_row(name, *values)
    console = Console()
    console.print(table)
    console.print(f"all tokens per type: {summary['all_tokens']['per_type']}")
    console.print(f"Spearman rho (CSR vs accuracy, {len(summary['cells'])} method x budget cells): "
                  f"{summary['spearman_csr_accuracy']}")  # fmt: skip
    for name, reason in summary["skipped_methods"].items():
        console.print(f"skipped {name}: {reason}")


def result_path(folder: Path, tag: str) -> Path:
    stem = f"{dt.date.today().isoformat()}-{tag}-bench_demo_accuracy"
    path = folder / f"{stem}.json"
    n = 2
    while path.exists():
        path = folder / f"{stem}-{n}.json"
        n += 1
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llava")
    parser.add_argument("--home", default=None, help="care home for the demo (default: $CARE_HOME)")
    parser.add_argument("--questions", type=int, default=500)
    parser.add_argument("--keep", type=int, nargs="+", default=[64, 128, 192])
    parser.add_argument("--method", nargs="+", default=None, help="default: every registered method")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--workers", type=int, default=max(1, (mp.cpu_count() or 2) - 1))
    parser.add_argument("--tag", default=platform.node().split(".")[0] or "host", help="part of the result file name")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)

    from care_core.backbones import load_backbone
    from care_core.backbones.demo import file_sha256
    from care_core.methods import method_names

    methods = args.method or method_names()
    adapter = load_backbone(args.model, device="cpu", dtype="float32", home=Path(args.home) if args.home else None)
    weights = Path(adapter.model.name_or_path) / "model.safetensors"
    items = heldout_items(args.questions)
    start = time.perf_counter()
    ctx = mp.get_context("spawn")
    init_args = (args.model, args.home, methods, args.keep, args.seed)
    with ctx.Pool(args.workers, initializer=_init, initargs=init_args) as pool:
        rows = pool.map(_one, items, chunksize=2)
    seconds = time.perf_counter() - start
    summary = summarise(rows, methods, args.keep)
    title = f"{args.model}: held-out accuracy (%) and CSR, {len(rows)} questions"
    show(summary, args.keep, title)
    payload = {
        "benchmark": "bench_demo_accuracy",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/bench_demo_accuracy.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model,
        "demo_note": adapter.demo_note,
        "weights_sha256": file_sha256(weights) if weights.is_file() else None,
        "questions": len(rows),
        "heldout_split_seed": HELDOUT_SPLIT,
        "method_seed": args.seed,
        "keeps": args.keep,
        "host": {
            "machine": platform.node(),
            "cpus": mp.cpu_count(),
            "workers": args.workers,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "note": "answers computed on the CPU (float32, one thread per worker)",
        },
        "wall_seconds": round(seconds, 1),
        **summary,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    path = result_path(args.results, args.tag)
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
