"""CSR at data-set scale: pairs/s of `care csr` on a full-size LLaVA-NeXT-7B (random weights), every method that
serves it x 3 budgets, three ways in one run on the same pairs:

1. the pair-by-pair loop of the first release (one process; every method and budget computes everything);
2. the library pipeline on one GPU (one process; budget-independent work shared per image);
3. the pipeline sharded over every visible GPU by `care csr --num-processes` (torchrun), when there are >= 2.

    python -m benchmarks.bench_csr_scale                 # on a CUDA machine, from the repository root
    python -m benchmarks.bench_csr_scale --quick         # 4 pairs
    python -m benchmarks.bench_csr_scale --tiny --quick --device cpu   # smoke test of the benchmark anywhere

Random weights give real timings (the cost does not depend on the values), meaningless CSR. Prints a table and
writes its JSON into --results-dir (default: a new scratch folder; --out FILE writes a copy there too, never over
an existing file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import EXAMPLES, ROOT, ResultsWriter, make_parser, print_table, stamp
from benchmarks.models import build_llava_next

BUDGETS = (640, 320, 160)
QUESTIONS = ("What is in the image?", "What colour is the main object?", "Where was this taken?",
             "Is there a person?", "What is on the left?", "How many objects are there?",
             "What is the person doing?", "Describe the background.")  # fmt: skip
QUICK_METHODS = ("care", "random", "divprune")
QUICK = "2 pairs, care, random and divprune only (--tiny --quick --device cpu: about 1 minute on a 2-core CPU)"
DURATION = (
    "24 pairs: about 2 minutes on 2 x H200 (the committed result: 25 s loop + 7 s pipeline + 3 s sharded, plus "
    "three 7B builds); --tiny --device cpu with --pairs 4: about 6 minutes on a 2-core CPU"
)
PHOTOS = ("astronaut.jpg", "coffee.jpg", "chelsea.jpg")


def make_pairs(folder: Path, count: int) -> Path:
    lines = [json.dumps({"image": str(EXAMPLES / PHOTOS[i % 3]), "question": QUESTIONS[i % len(QUESTIONS)]})
             for i in range(count)]  # fmt: skip
    path = folder / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def build_adapter(device: str, tiny: bool) -> Any:
    """LLaVA-NeXT-7B (CLIP-L/336 + Vicuna-7B shapes), seeded random weights, bf16 on CUDA (benchmarks.models)."""
    from care_core.backbones.llava_next import LlavaNextAdapter

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, processor = build_llava_next(dev, dtype, tiny)
    return LlavaNextAdapter(model, processor, name="llava-next-7b (random weights)" if not tiny else "tiny-next")


def old_loop(adapter: Any, pairs: list[Any], names: list[str], config: Any) -> float:
    """The first release's `run_csr` loop: per pair encode, reference, probes; per method x budget everything."""
    from care_core.csr import csr_from_reference, csr_reference
    from care_core.images import load_image
    from care_core.methods import MethodInputs, build_method
    from care_core.pipeline import Budget

    methods = {name: build_method(name, config) for name in names}
    needs = sorted(set().union(*(m.needs for m in methods.values())) - {"question"})
    budgets = [Budget.keep(k) for k in BUDGETS]
    sync(adapter)
    start = time.perf_counter()
    with torch.no_grad():
        for pair in pairs:
            picture = load_image(pair["image"])
            question = adapter.question_embeddings(pair["question"])
            tokens = adapter.encode_image(picture)
            reference = csr_reference(adapter.projector(tokens.features), question)
            probes = adapter.probe_inputs(tokens, needs, question=pair["question"]) if needs else {}
            probes["question"] = question
            inputs = MethodInputs(
                tokens.features, adapter.projector, tokens.positions, grid=tokens.grid, probes=probes, seed=config.seed
            )  # fmt: skip  (no memo: as the first release)
            for method in methods.values():
                for budget in budgets:
                    result = method(inputs, budget.resolve(tokens.num_tokens))
                    csr_from_reference(reference, adapter.projector(result.tokens.to(adapter.dtype)))
    sync(adapter)
    return time.perf_counter() - start


def pipeline_run(adapter: Any, pairs: list[Any], names: list[str], config: Any) -> float:
    from care_core.images import load_image
    from care_core.pipeline import Budget, ReductionPipeline

    pipe = ReductionPipeline(adapter, names, config)
    budgets = [Budget.keep(k) for k in BUDGETS]
    sync(adapter)
    start = time.perf_counter()
    for pair in pairs:
        pipe(load_image(pair["image"]), pair["question"], budgets, csr=True)
    sync(adapter)
    return time.perf_counter() - start


def sync(adapter: Any) -> None:
    if adapter.device.type == "cuda":
        torch.cuda.synchronize(adapter.device)


def worker(args: argparse.Namespace) -> None:
    """One rank of the sharded run: build the model, wait for all ranks, time this rank's share, report."""
    from care_core.config import CaReConfig
    from care_core.runs import Processes, World

    world = World.from_env()
    device = world.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    adapter = build_adapter(device, args.tiny)
    names = served(adapter, args.quick)
    pairs = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    pipeline_run(adapter, pairs[: world.size], names, CaReConfig())  # warm-up
    with Processes(world, backend="gloo") as processes:  # a barrier for the clock, not a data path
        processes.barrier()
        start = time.perf_counter()
        seconds = pipeline_run(adapter, world.take(pairs), names, CaReConfig())
        processes.barrier()
        wall = time.perf_counter() - start
    if world.is_main:
        Path(args.report).write_text(json.dumps({"wall_s": wall, "rank0_s": seconds, "processes": world.size}))


def served(adapter: Any, quick: bool) -> list[str]:
    """The methods that serve the backbone (with ``quick``: only those of QUICK_METHODS)."""
    from care_core.methods import methods_for_backbone

    names = methods_for_backbone(adapter.family)
    return [n for n in names if n in QUICK_METHODS] if quick else names


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__doc__, quick=QUICK, duration=DURATION, device="auto")
    parser.add_argument("--pairs", type=int, default=24)
    parser.add_argument("--tiny", action="store_true", help="tiny widths (smoke test)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--report", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.pairs = min(args.pairs, 2)
    return args


def sharded(data: Path, scratch: Path, gpus: int, tiny: bool, quick: bool) -> float:
    """Wall seconds of the pipeline sharded over ``gpus`` processes by torchrun (this module's --worker)."""
    report = scratch / "sharded.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
           "-m", "benchmarks.bench_csr_scale", "--worker", "--data", str(data), "--report", str(report),
           "--device", "cuda"] + (["--tiny"] if tiny else []) + (["--quick"] if quick else [])  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "4"})
    return float(json.loads(report.read_text())["wall_s"])


def show(rows: list[dict[str, Any]], names: list[str], pairs: int, card: str) -> None:
    base, single = rows[0]["pairs_per_s"], rows[1]["pairs_per_s"]
    for row in rows:
        row["vs_first_release"] = row["pairs_per_s"] / base
        row["vs_one_process"] = row["pairs_per_s"] / single
    title = (f"care csr, LLaVA-NeXT-7B (random weights), {len(names)} methods x {len(BUDGETS)} budgets "
             f"(K = {', '.join(map(str, BUDGETS))}), {pairs} pairs, {card}")  # fmt: skip
    print_table(title, ("run", "pairs/s", "s", "x first release", "x one process"),
                [(r["run"], f"{r['pairs_per_s']:.2f}", f"{r['seconds']:.1f}", f"{r['vs_first_release']:.2f}",
                  f"{r['vs_one_process']:.2f}") for r in rows])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.worker:
        worker(args)
        return
    writer = ResultsWriter(args, "bench_csr_scale")
    from care_cli.versions import versions
    from care_core.config import CaReConfig

    scratch = Path(tempfile.mkdtemp(prefix="care-bench-csr-"))  # the pairs file and the sharded run's report
    data = make_pairs(scratch, args.pairs)
    pairs = [json.loads(line) for line in data.read_text().splitlines()]
    device = args.device if args.device != "cuda" else "cuda:0"
    adapter = build_adapter(device, args.tiny)
    names, config = served(adapter, args.quick), CaReConfig()
    pipeline_run(adapter, pairs[:2], names, config)  # warm-up: kernels, allocator, demo caches
    old_s = old_loop(adapter, pairs, names, config)
    new_s = pipeline_run(adapter, pairs, names, config)
    rows: list[dict[str, Any]] = [{"run": "first release: pair-by-pair loop", "processes": 1, "seconds": old_s},
            {"run": "pipeline, 1 process", "processes": 1, "seconds": new_s}]  # fmt: skip
    gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
    if gpus >= 2:
        del adapter
        torch.cuda.empty_cache()
        rows.append({"run": f"pipeline, {gpus} processes (torchrun, one GPU each)", "processes": gpus,
                     "seconds": sharded(data, scratch, gpus, args.tiny, args.quick)})  # fmt: skip
    for row in rows:
        row["pairs_per_s"] = len(pairs) / row["seconds"]
    card = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu"
    show(rows, names, len(pairs), card)
    writer.finish({"date": stamp(), "card": card, "gpus": gpus, "tiny": args.tiny, "methods": names,
                   "budgets": list(BUDGETS), "pairs": len(pairs), "rows": rows, "versions": versions()})  # fmt: skip


if __name__ == "__main__":
    main()
