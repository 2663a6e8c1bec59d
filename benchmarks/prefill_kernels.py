"""Where the K-row prefill's time goes, per family at full size: the latency gate's "prefill" (the first token from
CaRe's projected rows: prompt assembly, prefill, the token on the host) timed, then profiled, its GPU kernels summed
per class (:data:`KERNEL_CLASSES`: the GEMMs, attention, the rest) per call, each against the gate's floor.

    python -m benchmarks.prefill_kernels                         # the six families of issue #47, one H200
    python -m benchmarks.prefill_kernels --families qwen3-vl     # one family
    python -m benchmarks.prefill_kernels --tiny --device cpu --families llava-1.5   # smoke test (no GPU kernels)
    python -m benchmarks.prefill_kernels --docs                  # no run: docs/performance.md's block, rewritten

Per family (:mod:`benchmarks.models`' full-size build with random weights in bf16, one at a time;
``examples/astronaut.jpg`` at the gate's side, K = floor(N/9) as in :func:`benchmarks.latency.keeps_for`): one
untimed CaRe run gives the projected rows and their indices; the call ``adapter.generate(question, tokens, rows,
max_new_tokens=1, kept=...)`` with the default decoding (CUDA graphs where the family's decoder allows them) runs
:data:`WARM_UP_CALLS` times untimed, then ``--reps`` times timed (median wall ms), then :data:`PROFILED_CALLS` times
under ``torch.profiler`` with CUDA activity. The floor is :func:`benchmarks.latency.prefill_floor_ms` for the rows the
language model reads (K visual rows as fed, plus the prompt's text rows).

What it shows: how much of the prefill is the GEMMs (cuBLAS at these row counts: compute and weight reading are close,
so neither side of the floor's max is reached), how much the other kernels, and how much the host adds (wall less the
kernels' sum). Run from the repository root.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    PERFORMANCE_DOC,
    RESULTS,
    ROOT,
    ResultsWriter,
    at_least_one,
    commit_label,
    fmt,
    free_device_memory,
    make_parser,
    median_wall_ms,
    newest_file,
    pick_device,
    print_table,
    render_newest,
    run_main,
    say,
    source_state,
)
from benchmarks.gpu.context import card_slug, environment
from benchmarks.latency import QUESTION, families_option, gate_image, keeps_for, prefill_floor_ms, text_rows_of
from benchmarks.models import FULL_SIZE, full_size_adapter

#: kernel classes, first match wins, by kernel name: cuBLAS/cuBLASLt (nvjet, gemm, gemv, their split-K reduction)
#: and CUTLASS matrix products; fused attention (cuDNN's SDPA, flash, memory-efficient); everything else "other"
KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    ("gemm", r"nvjet|gemm|gemv|splitKreduce|cutlass|xmma"),
    ("attention", r"sdpa|flash|fmha|attention"),
)
WARM_UP_CALLS = 3  # untimed calls first: kernels tuned, graphs captured
PROFILED_CALLS = 2  # calls under the profiler (its figures are per call)
TOP_KERNELS = 6  # kernels named per family, by time
DURATION = "six families: about 2-3 minutes on one H200 (each full-size build is most of it)"


def kernel_class(name: str) -> str:
    """The :data:`KERNEL_CLASSES` class of a GPU kernel's name ("other" where none matches)."""
    return next((label for label, pattern in KERNEL_CLASSES if re.search(pattern, name, re.IGNORECASE)), "other")


def kernel_summary(events: Iterable[dict[str, Any]], calls: int) -> dict[str, Any]:
    """Per call, from a Chrome trace's events (those of category ``kernel`` with a ``dur`` in µs): kernels
    launched, ms per class and in all, and the :data:`TOP_KERNELS` longest kernels by name."""
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    per_class = {label: 0.0 for label, _ in KERNEL_CLASSES} | {"other": 0.0}
    by_name: dict[str, float] = {}
    for event in kernels:
        ms = float(event["dur"]) / 1e3 / calls
        per_class[kernel_class(event["name"])] += ms
        by_name[event["name"]] = by_name.get(event["name"], 0.0) + ms
    top = sorted(by_name.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    return {"kernels_per_call": len(kernels) / calls, "ms": per_class, "kernels_ms": sum(per_class.values()),
            "top": [{"name": name[:120], "ms": ms} for name, ms in top]}  # fmt: skip


def profiled_events(step: Callable[[], Any], device: torch.device, calls: int) -> list[dict[str, Any]]:
    """The Chrome-trace events of ``calls`` calls of ``step`` under ``torch.profiler`` (CUDA activity on CUDA)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(calls):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory(prefix="care-prefill-trace-") as folder:
        path = Path(folder) / "trace.json"
        profile.export_chrome_trace(str(path))
        events: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))["traceEvents"]
    return events


def bench_family(family: str, device: torch.device, reps: int, tiny: bool) -> dict[str, Any]:
    """One family: CaRe's rows at K = floor(N/9), their first token timed and profiled, and the floor."""
    from care_core.budget import Budget
    from care_core.pipeline import ReductionPipeline

    adapter = full_size_adapter(family, device, tiny=tiny)
    tokens = adapter.encode_image(gate_image(family))
    keep = keeps_for(family, tokens.num_tokens)["N/9"]
    run = ReductionPipeline(adapter, ["care"])(tokens, QUESTION, [Budget.keep(keep)]).runs[0]
    rows, kept = run.projected, run.result.token_index

    def step() -> Any:
        with torch.no_grad():
            return adapter.generate(QUESTION, tokens, rows, max_new_tokens=1, kept=kept)

    decoding = [step() for _ in range(WARM_UP_CALLS)][-1].decoding
    wall_ms = median_wall_ms(step, reps, device.type == "cuda")
    summary = kernel_summary(profiled_events(step, device, PROFILED_CALLS), PROFILED_CALLS)
    text_rows = text_rows_of(adapter, tokens)
    visual_rows = adapter.visual_tokens_fed(tokens, int(rows.shape[0]), kept)
    floor = prefill_floor_ms(adapter.model, visual_rows + text_rows)
    x_floor = {label: ms / floor["floor_ms"] for label, ms in summary["ms"].items()}
    return {"family": family, "N": tokens.num_tokens, "K": keep, "visual_rows": visual_rows, "text_rows": text_rows,
            "decoding": decoding, "wall_ms": wall_ms, "floor": floor, "kernels": summary,
            "x_floor": {"wall": wall_ms / floor["floor_ms"], "kernels": summary["kernels_ms"] / floor["floor_ms"],
                        **x_floor}}  # fmt: skip


def print_families(families: list[dict[str, Any]]) -> None:
    header = ["family", "K", "rows", "decoding", "floor ms", "wall ms", "kernels ms", "GEMM ms", "attention ms",
              "other ms", "kernels/call", "wall x floor", "kernels x floor", "GEMM x floor"]  # fmt: skip
    rows = [[f["family"], str(f["K"]), str(f["visual_rows"] + f["text_rows"]), f["decoding"],
             fmt(f["floor"]["floor_ms"]), fmt(f["wall_ms"]), fmt(f["kernels"]["kernels_ms"]),
             fmt(f["kernels"]["ms"]["gemm"]), fmt(f["kernels"]["ms"]["attention"]), fmt(f["kernels"]["ms"]["other"]),
             fmt(f["kernels"]["kernels_per_call"], 0), fmt(f["x_floor"]["wall"]), fmt(f["x_floor"]["kernels"]),
             fmt(f["x_floor"]["gemm"])] for f in families]  # fmt: skip
    print_table("The K-row prefill (first token from CaRe's rows, batch 1), per call", header, rows)
    for family in families:
        say(f"{family['family']}: " + "; ".join(f"{k['ms']:.3f} ms {k['name'][:70]}" for k in family["kernels"]["top"]))


# ----------------------------------------------------------------------------------------- docs
#: the block of docs/performance.md rendered from the newest committed result (``--docs``)
DOC_FILE = PERFORMANCE_DOC
RESULT_PATTERN = "*-prefill-kernels.json"  # the committed results' names
BEGIN, END = ("<!-- prefill-kernels:begin (python -m benchmarks.prefill_kernels --docs) -->",
              "<!-- prefill-kernels:end -->")  # fmt: skip


def render_markdown(results: dict[str, Any], name: str) -> str:
    """The docs' block for a result named ``name``: per family the floor, the wall time, the kernels' sum and the
    GEMMs' (each with its multiple of the floor), attention, the other kernels and the kernels launched per call."""
    source = results["source"]
    commit = commit_label(source)
    lines = ["| family | K | rows fed | floor ms | wall ms (× floor) | kernels ms (× floor) | GEMMs ms (× floor) | "
             "attention ms | other kernels ms | kernels a call |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for f in results["families"]:
        ms, x = f["kernels"]["ms"], f["x_floor"]
        lines.append(f"| {f['family']} | {f['K']} | {f['visual_rows'] + f['text_rows']} | {f['floor']['floor_ms']:.2f} "
                     f"| {f['wall_ms']:.2f} ({x['wall']:.2f}) | {f['kernels']['kernels_ms']:.2f} ({x['kernels']:.2f}) "
                     f"| {ms['gemm']:.2f} ({x['gemm']:.2f}) | {ms['attention']:.2f} | {ms['other']:.2f} "
                     f"| {f['kernels']['kernels_per_call']:.0f} |")  # fmt: skip
    card = results["environment"].get("card", "?")
    lines += ["", f"Batch 1, default decoding, on one {card}; per call, kernels from {results['profiled_calls']} "
              f"profiled calls, wall the median of {results['reps']}. Source: `benchmarks/results/{name}` "
              f"(`python -m benchmarks.prefill_kernels`, commit {commit})."]  # fmt: skip
    return "\n".join(lines) + "\n"


def newest_result(folder: Path = RESULTS) -> Path | None:
    """The newest committed result (file names start with the date), None where there is none."""
    return newest_file(folder, RESULT_PATTERN)


def write_docs(root: Path = ROOT) -> bool:
    """Rewrite :data:`DOC_FILE`'s block from the newest committed result; returns whether it changed."""
    return render_newest(root, RESULT_PATTERN, DOC_FILE, (BEGIN, END), render_markdown)


def parse(argv: list[str] | None) -> Any:
    parser = make_parser(__doc__ or "", quick="3 timed calls instead of --reps", duration=DURATION, device="cuda")
    parser.add_argument("--families", default=",".join(FULL_SIZE), help="comma-separated: " + ", ".join(FULL_SIZE))
    parser.add_argument("--reps", type=int, default=20, help="timed calls per family (default 20)")
    parser.add_argument("--tiny", action="store_true", help="the demo widths (smoke test of this benchmark)")
    parser.add_argument("--docs", action="store_true",
                        help="no run: rewrite docs/performance.md's block from the newest result")  # fmt: skip
    args = parser.parse_args(argv)
    args.families = families_option(args.families)
    at_least_one("--reps", args.reps)
    if args.quick:
        args.reps = min(args.reps, 3)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.docs:
        say(f"{'rewrote' if write_docs() else 'unchanged:'} the prefill kernels block of {ROOT / DOC_FILE}")
        return
    device = pick_device(args.device)
    env = environment(device)
    writer = ResultsWriter(args, f"gpu-{card_slug(env['card'])}-prefill-kernels")
    results: dict[str, Any] = {"environment": env, "source": source_state(), "question": QUESTION, "tiny": args.tiny,
                               "reps": args.reps, "profiled_calls": PROFILED_CALLS, "kernel_classes": KERNEL_CLASSES,
                               "weights": "random (timings do not depend on weight values)",
                               "families": []}  # fmt: skip
    for family in args.families:
        say(f"{family} ...")
        results["families"].append(bench_family(family, device, args.reps, args.tiny))
        writer.save(results)
        free_device_memory(device)
    print_families(results["families"])
    writer.finish(results)


if __name__ == "__main__":
    run_main(main)
