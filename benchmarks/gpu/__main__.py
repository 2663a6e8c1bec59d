"""GPU benchmark of CaRe at real model scale: full-size LLaVA-1.5-7B / LLaVA-NeXT-7B, random weights, bf16.

    python -m benchmarks.gpu                        # everything (one H100/H200: about 2 minutes)
    python -m benchmarks.gpu --only micro           # matmul rates, scoring engines, care_reduce, anchor selection
    python -m benchmarks.gpu --only generate        # the user-facing generate path, eager and from CUDA graphs
    python -m benchmarks.gpu --only batch           # care_reduce_batch over 1, 4, 16 images against separate calls
    python -m benchmarks.gpu --quick                # LLaVA-1.5-7B only, 3 scoring paths, care + random, one K
    python -m benchmarks.gpu --tiny --quick --device cpu   # smoke test of the benchmark itself (tiny widths)
    python -m benchmarks.gpu --docs                 # no run: docs/performance.md's tables from the newest full result

What it measures (CUDA events, warm-ups, medians):
* the card's dense matmul rate (bf16, tf32, fp32 at 8192^3): the floors of the scoring step;
* scoring (Eq. 1 responses, m = 64) at N = 576 and 2880 with every engine / precision / code path, against
  the exact derivative's floor m N d_h d_out multiply-adds, its error against float64 and how many anchors it
  shares with the float64 scores' anchors; ``care_reduce`` end to end; anchor selection (Eq. 3);
* per backbone and budget K: every registered method's own time (probes included), the projector, the first
  token through the adapter's ``generate`` (eager, and replayed from CUDA graphs by ``StaticGreedy``), peak memory;
* the generate path (``ReductionPipeline.time_answers``, CaRe at one K per backbone), eager and from
  CUDA graphs: first token from the vision features and whole answers.

LLaVA-NeXT-7B runs on a 672x672 copy of the photo (base view + 2x2 grid, N = 2880). On the CPU the CUDA-graph
cells say "CUDA graphs: not on CPU". Weights are random (timings do not depend on their values). Run from the
repository root; it imports care_core from there.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    ROOT,
    Clock,
    ResultsWriter,
    fail,
    make_parser,
    pick_device,
    run_main,
    say,
    source_state,
)
from benchmarks.gpu.batch import bench_batch
from benchmarks.gpu.context import BUDGETS, M_DIRECTIONS, Workload, build_workloads, card_slug, environment
from benchmarks.gpu.docs import DOC_FILE, write_docs
from benchmarks.gpu.generate import bench_generate
from benchmarks.gpu.report import print_tables, targets
from benchmarks.gpu.scoring import Micro, bench_anchors, bench_care_reduce, bench_scoring, matmul_rates
from benchmarks.gpu.workload import bench_workload
from care_core import CaReConfig
from care_core.methods import method_names

QUICK_METHODS = ("care", "random")
DURATION = (
    "full run: about 2 minutes on one H100/H200 (the committed results: 74 s and 101 s of work on an H200, model "
    "builds included; --only micro 28-45 s and --only generate 60 s on an H100); --quick: well under a minute on a "
    "GPU; --tiny --quick --device cpu: 50-90 s on a busy 2-core CPU (16 s of CPU time); --tiny --device cpu: about "
    "7 minutes on a 2-core CPU."
)


def parse(argv: list[str] | None) -> Any:
    parser = make_parser(__doc__, quick="LLaVA-1.5-7B only, 3 scoring paths, care and random at one K, 2 reps",
                         duration=DURATION, device="cuda")  # fmt: skip
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--only", choices=("all", "micro", "batch", "models", "generate"), default="all")
    parser.add_argument("--tiny", action="store_true", help="tiny widths (smoke test of this benchmark)")
    parser.add_argument("--methods", default="all", help="comma-separated method names, or 'all'")
    parser.add_argument("--no-graphs", action="store_true", help="no CUDA graphs in the models part")
    parser.add_argument("--docs", action="store_true",
                        help="no run: rewrite docs/performance.md's tables from the newest full result")  # fmt: skip
    parser.add_argument("--result", type=Path, default=None,
                        help="with --docs: render the tables this result holds instead of the newest")  # fmt: skip
    args = parser.parse_args(argv)
    if args.result is not None and not args.docs:
        raise fail("--result names the result --docs renders; give --docs too")
    if args.quick:
        args.reps = min(args.reps, 2)
    return args


def run_micro(workloads: list[Workload], micro: Micro, quick: bool, results: dict[str, Any]) -> None:
    features = {w.tokens.num_tokens: w.tokens.features for w in workloads}
    positions = {w.tokens.num_tokens: w.tokens.positions for w in workloads}
    keep = {w.tokens.num_tokens: w.budgets[-1] for w in workloads}
    projector = copy.deepcopy(workloads[0].adapter.projector).float()
    say("== scoring")
    results["scoring"] = bench_scoring(features, projector, keep, micro, quick)
    say("== care_reduce end to end")
    results["care_reduce"] = bench_care_reduce(features, positions, projector, keep, micro)
    say("== anchors")
    budgets = {w.tokens.num_tokens: w.budgets[-1:] if quick else w.budgets for w in workloads}
    results["anchors"] = bench_anchors(features, budgets, micro)


def run_batch(workloads: list[Workload], micro: Micro, results: dict[str, Any]) -> None:
    say("== care_reduce_batch")
    projector = copy.deepcopy(workloads[0].adapter.projector).float()
    features = {w.tokens.num_tokens: w.tokens.features for w in workloads}
    positions = {w.tokens.num_tokens: w.tokens.positions for w in workloads}
    keep = {w.tokens.num_tokens: w.budgets[-1] for w in workloads}
    results["batch"] = bench_batch(features, positions, projector, keep, micro)


def run_models(args: Any, workloads: list[Workload], micro: Micro, graphs: bool, results: dict[str, Any]) -> None:
    methods = list(QUICK_METHODS) if args.quick and args.methods == "all" else (
        method_names() if args.methods == "all" else args.methods.split(","))  # fmt: skip
    results["workloads"] = []
    for w in workloads:
        say(f"== {w.name}")
        results["workloads"].append(bench_workload(w, micro, methods, graphs, args.quick))


def run_generate(args: Any, workloads: list[Workload], micro: Micro, results: dict[str, Any]) -> None:
    say("== generate path (ReductionPipeline, CaRe)")
    results["generate"] = []
    for w in workloads:
        tower_ms = micro.clock.median(w.tower, reps=micro.reps)
        results["generate"] += bench_generate(w, tower_ms, w.budgets[-1], micro.reps, 8 if args.quick else 32)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.docs:
        changed = write_docs(ROOT, args.result)
        say(f"rewrote {', '.join(changed)} of {ROOT / DOC_FILE}" if changed else f"unchanged: {ROOT / DOC_FILE}")
        return
    device = pick_device(args.device)
    env = environment(device)
    writer = ResultsWriter(args, f"gpu-{card_slug(env['card'])}")
    clock = Clock(device)
    started = time.perf_counter()
    size = 256 if args.tiny or device.type == "cpu" else 8192
    results: dict[str, Any] = {"environment": env, "source": source_state(), "m": M_DIRECTIONS, "budgets": BUDGETS,
                               "quick": args.quick,
                               "tiny": args.tiny, "weights": "random (timings do not depend on weight values)",
                               "dtype": "bfloat16 model, float32 CaRe maths", "matmul_size": size}  # fmt: skip
    say(f"{env['card']} torch {env['torch']} triton {env['triton']} transformers {env['transformers']}")
    micro = Micro(clock, args.reps, matmul_rates(device, clock, size))
    results["matmul_tflops"] = micro.rates
    workloads = build_workloads(device, args.tiny, args.quick)
    if args.only in ("all", "micro"):
        run_micro(workloads, micro, args.quick, results)
        writer.save(results)
    if args.only in ("all", "batch"):
        run_batch(workloads, micro, results)
        writer.save(results)
    if args.only in ("all", "models"):
        run_models(args, workloads, micro, device.type == "cuda" and not args.no_graphs, results)
        writer.save(results)
    if args.only in ("all", "generate"):
        run_generate(args, workloads, micro, results)
    results["kernel_default"] = CaReConfig().kernel
    results["targets"] = targets(results)
    results["wall_s"] = time.perf_counter() - started
    print_tables(results)
    writer.finish(results)


if __name__ == "__main__":
    run_main(main)
