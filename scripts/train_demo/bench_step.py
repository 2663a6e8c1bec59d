"""Seconds per optimiser step of the demo trainer (``scripts.train_demo``), to plan its runs within a time limit.

    python -m scripts.train_demo.bench_step                                  # one GPU: InternVL3 and OneVision
    python -m scripts.train_demo.bench_step --backbones tiny-llava-next --batches 128 --pools device
    python -m scripts.train_demo.bench_step --quick --device cpu             # batch 2, a few steps, on the CPU

For each backbone, batch size and place of the scene pool (``device``: on the GPU; ``cpu``: host memory, one batch
copied per step), it times the trainer's own step (``scripts.train_demo.loop.train_step``, what ``fit`` runs) in two
phases: the bucket of fewest tokens, which is every shipped recipe's warm-up bucket (InternVL3's one 448 px tile,
the other families' 336x336), at step 0 (all tokens); and the world's mix (a bucket drawn per step by its share of
the pool) at the middle of a run (half the steps feed a token subset). Each time is the mean of synchronised steps
after a few untimed ones, with the peak GPU memory of the phase (the pool included). The pool is drawn once per
backbone with ``--scenes`` scenes. Writes its JSON into --results-dir (default: a new scratch folder) and, only when
asked, to --out.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Clock,
    ResultsWriter,
    comma_list,
    fail,
    fmt,
    host,
    make_parser,
    pick_device,
    print_table,
    stamp,
)

BACKBONES = ("tiny-internvl3", "tiny-llava-onevision")  # the two demos still short of their target (issue #24)
PHASES = ("warm-up", "mix")  # the bucket of fewest tokens at step 0; the world's mix mid-run


def _phase(args: argparse.Namespace, parts: Any, phase: str) -> int:
    """Set ``args`` for the phase; the step index to time at (the warm-up: step 0 of the fewest-token bucket)."""
    if phase == PHASES[0]:
        fewest = min(parts.buckets, key=lambda geometry: geometry.n)
        args.warm_size, args.warm_share = fewest.sizes[0], 0.99
        return 0
    args.warm_size, args.warm_share = None, 0.0
    return args.steps // 2


def time_steps(args: argparse.Namespace, parts: Any, data: Any, phase: str, steps: tuple[int, int]) -> dict[str, Any]:
    """Mean seconds of ``steps[1]`` trainer steps after ``steps[0]`` untimed ones, and the phase's peak GPU memory."""
    import torch

    from scripts.train_demo.loop import optimiser, train_step

    step = _phase(args, parts, phase)
    opt, params = optimiser(args, parts)
    gen = torch.Generator().manual_seed(0)
    device = parts.aux.weight.device
    clock = Clock(device)

    def run(count: int) -> None:
        for _ in range(count):
            train_step(args, step, gen, data, parts, opt, params)

    if clock.cuda:
        torch.cuda.reset_peak_memory_stats(device)
    run(steps[0])
    clock.sync()
    seconds = clock.once(lambda: run(steps[1])) / 1e3 / steps[1]
    peak = round(torch.cuda.max_memory_allocated(device) / 1e9, 1) if clock.cuda else None
    return {"s_per_step": round(seconds, 4), "samples_per_s": round(args.batch / seconds, 1), "peak_gpu_gb": peak}


def measure(backbone: str, options: argparse.Namespace, device: Any) -> list[dict[str, Any]]:
    """Every (batch, pool, phase) of one backbone, from one drawn pool (``cli.prepare`` moves it where each pool
    setting keeps it, as ``--replicas`` does)."""
    with tempfile.TemporaryDirectory(prefix="care-train-step-") as scratch:  # the run's log only: removed after
        return _measure_in(backbone, options, device, Path(scratch))


def _measure_in(backbone: str, options: argparse.Namespace, device: Any, out: Path) -> list[dict[str, Any]]:
    """:func:`measure` with the training run's folder ``out`` (its log)."""
    import torch

    from scripts.train_demo import cli

    args = cli.parse(["--backbone", backbone, "--out", str(out), "--scenes", str(options.scenes), "--workers",
                      str(options.workers), "--device", str(device), "--steps", "1000"])  # fmt: skip
    run = cli.Run(out)
    _, processor, geometries, centres = cli.build(args, run)
    drawn = cli.draw(args, run, processor.image_processor, geometries, centres, torch.device("cpu"))
    rows = []
    for pool in options.pools:
        args.pool_device = pool
        parts, data = cli.prepare(args, run, drawn)
        for batch in options.batches:
            args.batch = batch
            for phase in PHASES:
                timed = time_steps(args, parts, data, phase, options.steps[phase])
                rows.append({"backbone": backbone, "batch": batch, "pool": pool, "phase": phase, **timed})
        del parts, data
    return rows


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__doc__, quick="batch 2, 8 scenes, 2 + 2 steps (about 1 minute on a 2-core CPU)",
                         duration="about 2 minutes a backbone on an H200 (1,500 scenes)", device="auto")  # fmt: skip
    parser.add_argument("--backbones", type=comma_list, default=list(BACKBONES))
    parser.add_argument("--batches", type=comma_list, default=["64", "128"])
    parser.add_argument("--pools", type=comma_list, default=["device", "cpu"], help="device, cpu or both")
    parser.add_argument("--scenes", type=int, default=1500, help="scenes drawn into each backbone's pool")
    parser.add_argument("--workers", type=int, default=8, help="processes drawing the scenes")
    args = parser.parse_args(argv)
    from scripts.train_demo.cli import trainable

    if unknown := [b for b in args.backbones if b not in trainable()]:
        raise fail(f"--backbones: {', '.join(unknown)} not one of {', '.join(trainable())}")
    if not all(b.isdigit() and int(b) > 0 for b in args.batches):
        raise fail(f"--batches takes positive whole numbers, got {','.join(args.batches)}")
    if not args.pools or not set(args.pools) <= {"device", "cpu"}:
        raise fail(f"--pools takes device and/or cpu, got {','.join(args.pools)}")
    args.batches = [2] if args.quick else [int(b) for b in args.batches]
    args.scenes = 8 if args.quick else args.scenes
    args.steps = dict.fromkeys(PHASES, (1, 1)) if args.quick else {PHASES[0]: (3, 15), PHASES[1]: (3, 25)}
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    device = pick_device(args.device)
    writer = ResultsWriter(args, f"{device.type}-bench_train_step")
    rows = [row for backbone in args.backbones for row in measure(backbone, args, device)]
    cells = [(r["backbone"], r["phase"], str(r["batch"]), r["pool"], fmt(r["s_per_step"], 3),
              fmt(r["samples_per_s"], 0), fmt(r["peak_gpu_gb"], 1)) for r in rows]  # fmt: skip
    header = ("backbone", "phase", "batch", "pool", "s/step", "samples/s", "peak GB")
    print_table(f"Demo trainer, seconds per step on {device}", header, cells, keys=2)
    card = None
    if device.type == "cuda":
        import torch

        card = torch.cuda.get_device_name(device)
    writer.finish({"date": stamp(), "machine": host(), "card": card, "scenes": args.scenes, "rows": rows})


if __name__ == "__main__":
    main()
