"""CPU benchmark of `care reduce`: stage times with the demo backbone, and the core at real widths.

    python benchmarks/bench_reduce.py                  # full run (several minutes on 2 cores)
    python benchmarks/bench_reduce.py --quick          # N = 576 only, fewer repetitions

Prints rich tables and writes a new file benchmarks/results/<date>-<time>-cpu-bench_reduce.json (never an
existing one; --out FILE chooses another path, which must not exist either). The demo backbone has
random weights; timings do not depend on weight values, but its widths are tiny, so its stage times
say nothing about a 7B model (the core-only rows use LLaVA's real projector shape, 1024->4096->4096).
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import time
from pathlib import Path

import torch
from _results import check_new, write_result
from rich.console import Console
from rich.table import Table

from care_cli.versions import versions
from care_core import CaReConfig, care_reduce
from care_core.images import load_image
from care_core.pipeline import Budget, ReductionPipeline

ROOT = Path(__file__).resolve().parents[1]
console = Console(width=140)


def bench_cli_stages(reps: int) -> list[dict[str, object]]:
    """Median ms per stage of the pipeline `care reduce` runs (demo backbone, K = 11% of N, care)."""
    pipe = ReductionPipeline.from_pretrained(None, methods=["care"], config=CaReConfig(), device="cpu")
    budget = [Budget.ratio(0.11)]
    pipe(load_image(ROOT / "examples/astronaut.jpg"), None, budget)  # warm-up
    rows = []
    for name in ("astronaut.jpg", "coffee.jpg", "chelsea.jpg"):
        picture = load_image(ROOT / "examples" / name)
        samples: dict[str, list[float]] = {}
        for _ in range(reps):
            output = pipe(picture, None, budget)
            stages = {**output.timings_ms, **output.runs[0].timings_ms}
            stages["total"] = sum(stages.values())
            for stage, ms in stages.items():
                samples.setdefault(stage, []).append(ms)
        rows.append({"image": name, **{f"{k}_ms": statistics.median(v) for k, v in samples.items()}})
    return rows


def _time(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    values = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        values.append((time.perf_counter() - start) * 1e3)
    return statistics.median(values)


def bench_core(sizes: list[int], reps: int, m: int) -> list[dict[str, object]]:
    torch.manual_seed(0)
    d_v, d_h = 1024, 4096
    projector = torch.nn.Sequential(torch.nn.Linear(d_v, d_h), torch.nn.GELU(), torch.nn.Linear(d_h, d_h)).eval()
    rows = []
    for n in sizes:
        features = torch.randn(n, d_v)
        positions = torch.rand(n, 2)
        keep = max(1, int(0.11 * n))
        for engine in ("jvp", "fd"):
            cfg = CaReConfig(engine=engine, m=m)  # type: ignore[arg-type]
            stages: dict[str, float] = {}

            def clock(name: str, _stages: dict[str, float] = stages):  # type: ignore[no-untyped-def]
                class _C:
                    def __enter__(self) -> None:
                        self.t = time.perf_counter()

                    def __exit__(self, *exc: object) -> None:
                        _stages[name] = (time.perf_counter() - self.t) * 1e3

                return _C()

            def run(cfg=cfg, clock=clock, features=features, positions=positions, keep=keep):  # type: ignore[no-untyped-def]
                return care_reduce(features, projector, positions, keep=keep, config=cfg, stage_timer=clock)

            total = _time(run, reps)
            floor_macs = m * n * d_h * d_h
            rows.append({"N": n, "K": keep, "engine": engine, "m": m, "total_ms": total,
                         **{f"{k}_ms": v for k, v in stages.items()},
                         "jvp_floor_gmacs": floor_macs / 1e9})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 576 only and one repetition")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    check_new(args.out)
    reps = 1 if args.quick else args.reps
    sizes = [576] if args.quick else [576, 2880]

    cli_rows = bench_cli_stages(reps)
    table = Table(title="care reduce, demo backbone (random weights), CPU — median ms per stage")
    stages = [k for k in cli_rows[0] if k.endswith("_ms")]
    table.add_column("image")
    for s in stages:
        table.add_column(s, justify="right")
    for row in cli_rows:
        table.add_row(str(row["image"]), *(f"{row[s]:.1f}" for s in stages))
    console.print(table)

    core_rows = bench_core(sizes, reps, args.m)
    table = Table(title="care_reduce core, d_v = 1024, projector 1024->4096->4096 GELU, float32, CPU — median ms")
    for col in ("N", "K", "engine", "scoring_ms", "anchors_ms", "calibration_ms", "total_ms"):
        table.add_column(col, justify="right")
    for row in core_rows:
        table.add_row(
            *(
                f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c])
                for c in ("N", "K", "engine", "scoring_ms", "anchors_ms", "calibration_ms", "total_ms")
            )
        )
    console.print(table)

    payload = {
        "date": dt.date.today().isoformat(),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": torch.get_num_threads()},
        "versions": versions(),
        "reps": reps,
        "cli_stages_demo_backbone": cli_rows,
        "core": core_rows,
    }  # fmt: skip
    console.print(f"wrote {write_result(payload, 'cpu-bench_reduce', args.out)}")


if __name__ == "__main__":
    main()
