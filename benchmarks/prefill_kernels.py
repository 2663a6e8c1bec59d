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

Each family runs in a process of its own, as a user's process holds one model: a process that has compiled the static
loop's pieces for one model's widths recompiles them for the next model's with the widths symbolic (dynamo's automatic
dynamic shapes), and those kernels are slower (Qwen2.5-VL's gated activation: 15 us a layer against 8).

What it shows: how much of the prefill is the GEMMs (cuBLAS at these row counts: compute and weight reading are close,
so neither side of the floor's max is reached) and the other kernels; where the prefill replays a CUDA graph, the
graph alone (:func:`replayed_prefill` replayed ``--reps`` times, each to a synchronisation, unprofiled: the profiler
adds about 1 us to each of a graph's ~400 kernels) and the call's time outside it (wall less the replay: the host's
prompt assembly and checks, and the token read back). Run from the repository root.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
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
    child_result,
    commit_label,
    fail,
    fmt,
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
DURATION = "eight families, each in a process of its own: about 4 minutes on one H200 (the builds are most of it)"


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


def replayed_prefill(adapter: Any) -> Any | None:
    """The CUDA graph of the prefill the adapter's last answer replayed, or None where it decoded without graphs. Read
    from the adapter's static loop (private: no public API hands out a graph, which only this diagnosis replays)."""
    loop = getattr(adapter, "_greedy_graphs", None)
    entry = None if loop is None or loop.last_shape is None else loop.prefills.get(loop.last_shape)
    return None if entry is None else entry.graph


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
    prefill, graph = replayed_prefill(adapter), None
    if prefill is not None:

        def replay() -> None:
            prefill.replay()
            torch.cuda.synchronize(device)

        replay_ms = median_wall_ms(replay, reps, True)
        graph = {"replay_ms": replay_ms, "outside_ms": wall_ms - replay_ms}
    summary = kernel_summary(profiled_events(step, device, PROFILED_CALLS), PROFILED_CALLS)
    text_rows = text_rows_of(adapter, tokens)
    visual_rows = adapter.visual_tokens_fed(tokens, int(rows.shape[0]), kept)
    floor_ms = (floor := prefill_floor_ms(adapter.model, visual_rows + text_rows))["floor_ms"]
    x_floor = {"wall": wall_ms / floor_ms, "kernels": summary["kernels_ms"] / floor_ms,
               **{label: ms / floor_ms for label, ms in summary["ms"].items()}}  # fmt: skip
    if graph is not None:
        x_floor["graph"] = graph["replay_ms"] / floor_ms
    return {"family": family, "N": tokens.num_tokens, "K": keep, "visual_rows": visual_rows, "text_rows": text_rows,
            "decoding": decoding, "wall_ms": wall_ms, "floor": floor, "kernels": summary, "graph": graph,
            "x_floor": x_floor}  # fmt: skip


def in_own_process(family: str, args: Any, folder: Path) -> dict[str, Any]:
    """:func:`bench_family` in a child process: nothing another family compiled or captured reaches it."""
    out = folder / f"{family}.json"
    command = [sys.executable, "-m", "benchmarks.prefill_kernels", "--families", family, "--reps", str(args.reps),
               "--device", str(args.device), "--child-out", str(out), *(["--tiny"] if args.tiny else [])]  # fmt: skip
    return child_result(command, out, {"family": family})


def with_floor(ms: float | None, floor_ms: float) -> str:
    """A cell: ``ms`` and, in brackets, its multiple of ``floor_ms`` (a dash where there is no figure)."""
    return "—" if ms is None else f"{ms:.2f} ({ms / floor_ms:.2f})"


def family_cells(f: dict[str, Any]) -> list[str]:
    """One family's cells: floor, wall, the graph's replay alone and the time outside it (each ms, × floor where it
    has one), the kernels, GEMMs (× floor), attention, the other kernels, kernels a call; dashes where no graph ran."""
    floor_ms, kernels, graph = f["floor"]["floor_ms"], f["kernels"], f.get("graph") or {}
    return [f"{floor_ms:.2f}", with_floor(f["wall_ms"], floor_ms), with_floor(graph.get("replay_ms"), floor_ms),
            fmt(graph.get("outside_ms")), with_floor(kernels["kernels_ms"], floor_ms),
            with_floor(kernels["ms"]["gemm"], floor_ms), f"{kernels['ms']['attention']:.2f}",
            f"{kernels['ms']['other']:.2f}", f"{kernels['kernels_per_call']:.0f}"]  # fmt: skip


#: the columns of :func:`family_cells`, after the family, K and the rows fed
CELL_NAMES = (
    "floor ms", "wall ms (× floor)", "graph alone ms (× floor)", "outside the graph ms", "kernels ms (× floor)",
    "GEMMs ms (× floor)", "attention ms", "other kernels ms", "kernels a call",
)  # fmt: skip


def print_families(families: list[dict[str, Any]]) -> None:
    header = ["family", "K", "rows", "decoding", *CELL_NAMES]
    rows = [[f["family"], "—", "—", f["error"], *["—"] * len(CELL_NAMES)] if "error" in f else
            [f["family"], str(f["K"]), str(f["visual_rows"] + f["text_rows"]), f["decoding"], *family_cells(f)]
            for f in families]  # fmt: skip
    print_table("The K-row prefill (first token from CaRe's rows, batch 1), per call", header, rows)
    for family in (f for f in families if "error" not in f):
        say(f"{family['family']}: " + "; ".join(f"{k['ms']:.3f} ms {k['name'][:70]}" for k in family["kernels"]["top"]))


# ----------------------------------------------------------------------------------------- docs
#: the block of docs/performance.md rendered from the newest committed result (``--docs``)
DOC_FILE = PERFORMANCE_DOC
RESULT_PATTERN = "*-prefill-kernels.json"  # the committed results' names
BEGIN, END = ("<!-- prefill-kernels:begin (python -m benchmarks.prefill_kernels --docs) -->",
              "<!-- prefill-kernels:end -->")  # fmt: skip


def render_markdown(results: dict[str, Any], name: str) -> str:
    """The docs' block for a result named ``name``: per family the :data:`CELL_NAMES` columns (:func:`family_cells`)."""
    source = results["source"]
    commit = commit_label(source)
    lines = ["| family | K | rows fed | " + " | ".join(CELL_NAMES) + " |",
             "| --- | ---: | ---: | " + " | ".join(["---:"] * len(CELL_NAMES)) + " |"]  # fmt: skip
    for f in (f for f in results["families"] if "error" not in f):
        lines.append(f"| {f['family']} | {f['K']} | {f['visual_rows'] + f['text_rows']} | "
                     + " | ".join(family_cells(f)) + " |")  # fmt: skip
    card = results["environment"].get("card", "?")
    lines += ["", f"Batch 1, default decoding, on one {card}, each family in a process of its own; per call, kernels "
              f"from {results['profiled_calls']} profiled calls, wall and the graph alone the medians of "
              f"{results['reps']}. Source: `benchmarks/results/{name}` (`python -m benchmarks.prefill_kernels`, "
              f"commit {commit})."]  # fmt: skip
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
    parser.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)  # the parent's, for a child
    args = parser.parse_args(argv)
    args.families = families_option(args.families)
    at_least_one("--reps", args.reps)
    if args.quick:
        args.reps = min(args.reps, 3)
    if args.child_out is not None and len(args.families) != 1:
        raise fail("--child-out takes one --families entry")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.docs:
        say(f"{'rewrote' if write_docs() else 'unchanged:'} the prefill kernels block of {ROOT / DOC_FILE}")
        return
    device = pick_device(args.device)
    if args.child_out is not None:  # one family, in the process the parent started for it
        result = bench_family(args.families[0], device, args.reps, args.tiny)
        args.child_out.write_text(json.dumps(result) + "\n", encoding="utf-8")
        return
    env = environment(device)
    writer = ResultsWriter(args, f"gpu-{card_slug(env['card'])}-prefill-kernels")
    results: dict[str, Any] = {"environment": env, "source": source_state(), "question": QUESTION, "tiny": args.tiny,
                               "reps": args.reps, "profiled_calls": PROFILED_CALLS, "kernel_classes": KERNEL_CLASSES,
                               "weights": "random (timings do not depend on weight values)",
                               "families": []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="care-prefill-kernels-") as folder:
        for family in args.families:
            say(f"{family} ...")
            results["families"].append(in_own_process(family, args, Path(folder)))
            writer.save(results)
    print_families(results["families"])
    writer.finish(results)


if __name__ == "__main__":
    run_main(main)
