"""Accuracy of the trained demo backbone on held-out synthetic questions, with all tokens and with every registered
method at K = 64, 128, 192; the CSR of each; Spearman's rho between CSR and accuracy across method x budget.

    python -m benchmarks.bench_demo_accuracy [--model tiny-llava] [--questions 500] [--workers 15]
    python -m benchmarks.bench_demo_accuracy --quick   # 10 questions, care and random at K = 64, one worker
    python -m benchmarks.bench_demo_accuracy --markdown RESULT.json [--keep 64]   # the docs' tables, no run

Answers come from ``adapter.generate`` (greedy; ``kept`` = the method's token indices), as ``care reduce
--generate`` gets them; the first word is compared case-insensitively. Each worker process loads the backbone
on the CPU in float32 (one thread), so the numbers are the ones the CPU tests see. Every accuracy comes with its
95% Wilson interval, every method x K cell with McNemar's exact p against ``random`` at the same K and against all
tokens (same questions), and Spearman's rho with its 95% interval (``care_core.statistics``; docs/design/measures.md
§Statistics). The JSON keeps each cell's per-question answers (``outcomes``, 0/1 in question order). Prints one
table per K and writes its JSON into --results-dir (default: a new scratch folder; --out FILE writes a copy there
too, never over a file); ``--markdown`` renders the docs' tables from such a file. Run from the repository root.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ResultsWriter, at_least_one, fail, make_parser, print_table, run_main, say, stamp
from benchmarks.demo_world import HELDOUT_SPLIT, configured_method, heldout_items, load_photos, use_pil_image_processor
from care_core.statistics import mcnemar_exact, spearman, wilson_interval

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


def _accuracy(hits: list[int]) -> dict[str, float]:
    """Accuracy in % with its 95% Wilson interval."""
    interval = wilson_interval(sum(hits), len(hits))
    return {"accuracy": round(100 * interval.estimate, 2), "accuracy_low": round(100 * interval.low, 2),
            "accuracy_high": round(100 * interval.high, 2)}  # fmt: skip


def _paired(these: list[int], other: list[int]) -> dict[str, Any]:
    """McNemar's exact test of ``these`` answers against ``other`` on the same questions."""
    test = mcnemar_exact(these, other)
    return {"only_this": test.only_a, "only_other": test.only_b, "p": test.p_value}


def _correlation(csr: list[float], accuracy: list[float]) -> dict[str, Any]:
    """Spearman's rho of CSR against accuracy over the cells, with its 95% interval (None where undefined)."""
    result = spearman(csr, accuracy)
    defined = result.reason is None
    return {"rho": round(result.rho, 4) if defined else None, "low": round(result.low, 4) if defined else None,
            "high": round(result.high, 4) if defined else None, "cells": result.n, "confidence": result.confidence,
            "interval": "Fisher z, var 1.06/(n-3) (Fieller, Hartley & Pearson 1957)",
            "undefined": result.reason}  # fmt: skip


def summarise(rows: list[dict[str, Any]], methods: list[str], keeps: list[int]) -> dict[str, Any]:
    """Accuracy with Wilson intervals, McNemar p against random (same K) and all tokens, Spearman CSR vs accuracy;
    ``outcomes``: every cell's per-question 0/1 answers in question order ("all tokens" with no reduction)."""
    from care_core.synthetic import QUESTION_TYPES

    def per_type(hits: list[int]) -> dict[str, float]:
        by_type = {t: [h for h, r in zip(hits, rows, strict=True) if r["type"] == t] for t in QUESTION_TYPES}
        return {t: round(100 * sum(h) / len(h), 2) if h else float("nan") for t, h in by_type.items()}

    outcomes: dict[str, list[int]] = {"all tokens": [r["all"] for r in rows]}
    csr: dict[str, float] = {}  # unrounded means: rounding could tie cells that differ
    cells: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for name in methods:
        for k in keeps:
            got = [r["cells"][f"{name}@{k}"] for r in rows]
            errors = [g["error"] for g in got if "error" in g]
            if errors:
                skipped[name] = errors[0]
                continue
            outcomes[f"{name}@{k}"] = [g["hit"] for g in got]
            csr[f"{name}@{k}"] = sum(g["csr"] for g in got) / len(got)
            cells.append({"method": name, "K": k, "csr": round(csr[f"{name}@{k}"], 2)})
    for cell in cells:
        hits, random = outcomes[f"{cell['method']}@{cell['K']}"], outcomes.get(f"random@{cell['K']}")
        against_random = _paired(hits, random) if random is not None and cell["method"] != "random" else None
        cell.update(_accuracy(hits), per_type=per_type(hits), vs_random=against_random,
                    vs_all_tokens=_paired(hits, outcomes["all tokens"]))  # fmt: skip
    seconds: dict[str, float] = {}
    for r in rows:
        for name, s in r["seconds"].items():
            seconds[name] = seconds.get(name, 0.0) + s
    return {
        "all_tokens": {**_accuracy(outcomes["all tokens"]), "per_type": per_type(outcomes["all tokens"])},
        "cells": cells,
        "skipped_methods": skipped,
        "spearman_csr_accuracy": _correlation(list(csr.values()), [sum(outcomes[key]) / len(rows) for key in csr]),
        "method_cpu_seconds_per_question": {n: round(s / len(rows), 4) for n, s in seconds.items()},
        "outcomes": outcomes,
    }


# ----------------------------------------------------------------------------------------- tables
def accuracy_text(entry: dict[str, Any]) -> str:
    """``74.8 [70.8, 78.4]``: accuracy % and its 95% interval."""
    return f"{entry['accuracy']:.1f} [{entry['accuracy_low']:.1f}, {entry['accuracy_high']:.1f}]"


def p_text(test: dict[str, Any] | None) -> str:
    """A McNemar p-value in at most 6 characters (``<0.001``, ``0.032``, ``1.000``); a dash where none applies."""
    if test is None:
        return "—"
    return "<0.001" if test["p"] < 0.001 else f"{test['p']:.3f}"


def rho_text(correlation: dict[str, Any]) -> str:
    """``0.86 [0.76, 0.92] over 48 cells`` (or why rho is undefined)."""
    if correlation["rho"] is None:
        return f"undefined ({correlation['undefined']})"
    low, high = correlation["low"], correlation["high"]
    return f"{correlation['rho']:.2f} [{low:.2f}, {high:.2f}] over {correlation['cells']} cells"


def detail_rows(payload: dict[str, Any], k: int) -> list[tuple[str, str, str, str, str]]:
    """One K's rows: method, accuracy [95% CI], p vs random, p vs all tokens, CSR (all tokens first)."""
    rows = [("all tokens", accuracy_text(payload["all_tokens"]), "—", "—", "—")]
    for c in payload["cells"]:
        if c["K"] == k:
            rows.append((c["method"], accuracy_text(c), p_text(c["vs_random"]), p_text(c["vs_all_tokens"]),
                         f"{c['csr']:.1f}"))  # fmt: skip
    return rows


def show(payload: dict[str, Any], keeps: list[int]) -> None:
    """One rich table per K (80 columns), then the per-type accuracy and Spearman's rho."""
    header = ("method", "acc. % [95% CI]", "p vs random", "p vs all", "CSR %")
    for k in keeps:
        title = f"{payload['model']}, K = {k}: held-out accuracy, {payload['questions']} questions"
        print_table(title, header, detail_rows(payload, k))
    say("p: McNemar's exact test on the same questions, against random at the same K and against all tokens")
    say(f"all tokens per type: {payload['all_tokens']['per_type']}")
    say(f"Spearman rho (CSR vs accuracy, 95% CI): {rho_text(payload['spearman_csr_accuracy'])}")
    for name, reason in payload["skipped_methods"].items():
        say(f"skipped {name}: {reason}")


def render_markdown(payload: dict[str, Any], keeps: list[int]) -> str:
    """The docs' tables from a results JSON: accuracy [95% CI] by K, then one table per K with McNemar p-values
    and CSR, then Spearman's rho. Method names are code-quoted; "all tokens" is not."""
    methods = list(dict.fromkeys(c["method"] for c in payload["cells"]))
    by = {(c["method"], c["K"]): c for c in payload["cells"]}
    lines = [f"| method | {' | '.join(f'acc. K={k} [95% CI]' for k in keeps)} |",
             f"| --- |{' ---: |' * len(keeps)}",
             f"| all tokens | {accuracy_text(payload['all_tokens'])} |{' |' * (len(keeps) - 1)}"]  # fmt: skip
    for name in methods:
        cells = [accuracy_text(by[name, k]) if (name, k) in by else "—" for k in keeps]
        lines.append(f"| `{name}` | {' | '.join(cells)} |")
    for k in keeps:
        lines += ["", f"K = {k}, {payload['questions']} questions:", "",
                  "| method | accuracy % [95% CI] | p vs `random` | p vs all tokens | CSR % |",
                  "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
        for name, *values in detail_rows(payload, k):
            lines.append(f"| {name if name == 'all tokens' else f'`{name}`'} | {' | '.join(values)} |")
    lines += ["", f"Spearman ρ between CSR and accuracy (95% CI): {rho_text(payload['spearman_csr_accuracy'])}."]
    return "\n".join(lines) + "\n"


def print_markdown(path: Path, keeps: list[int] | None) -> None:
    """``--markdown FILE``: print the docs' tables of a results JSON; one error line if it cannot."""
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise fail(f"--markdown {path}: cannot read it as JSON ({exc})") from None
    if payload.get("benchmark") != "bench_demo_accuracy" or "outcomes" not in payload:
        raise fail(f"--markdown {path}: not a bench_demo_accuracy result with per-question outcomes (rerun it)")
    chosen = [k for k in payload["keeps"] if keeps is None or k in keeps]
    if not chosen:
        raise fail(f"--markdown {path}: has K = {payload['keeps']}, none of --keep {keeps}")
    sys.stdout.write(render_markdown(payload, chosen))


def parse(argv: list[str] | None) -> Any:
    parser = make_parser(__doc__, quick="10 questions, care and random at K = 64, one worker (about 40 s on a "
                         "2-core CPU)", duration="500 questions, every method at 3 budgets: 118 s with 16 workers on a "
                         "16-core host (the committed result), so about 16 minutes on 2 cores")  # fmt: skip
    parser.add_argument("--model", default="tiny-llava")
    parser.add_argument("--home", default=None, help="care home for the demo (default: $CARE_HOME)")
    parser.add_argument("--questions", type=int, default=500)
    parser.add_argument("--keep", type=int, nargs="+", default=None, help="K (default: 64 128 192)")
    parser.add_argument("--method", nargs="+", default=None, help="default: every registered method")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--workers", type=int, default=max(1, (mp.cpu_count() or 2) - 1))
    parser.add_argument("--markdown", type=Path, default=None, metavar="RESULT_JSON",
                        help="print the docs' markdown tables of a results file (only its --keep budgets if given) "
                        "and run nothing")  # fmt: skip
    args = parser.parse_args(argv)
    if args.markdown is not None:
        return args
    args.keep = args.keep or [64, 128, 192]
    if args.quick:
        args.questions, args.keep, args.workers = min(args.questions, 10), [64], 1
        args.method = args.method or ["care", "random"]
    at_least_one("--questions", args.questions)
    return args


def main(argv: list[str] | None = None) -> None:
    from care_core.backbones import load_backbone
    from care_core.backbones.demo import file_sha256
    from care_core.methods import method_names

    args = parse(argv)
    if args.markdown is not None:
        print_markdown(args.markdown, args.keep)
        return
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
    show(payload, args.keep)
    writer.finish(payload)


if __name__ == "__main__":
    run_main(main)
