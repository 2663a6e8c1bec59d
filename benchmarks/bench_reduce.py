"""CPU benchmark of `care reduce`: stage times with the demo backbone, and the core at real widths.

    python -m benchmarks.bench_reduce            # from the repository root: N = 576 and 2880, 3 repetitions
    python -m benchmarks.bench_reduce --quick    # N = 576, jvp engine, m = 8, one repetition

Prints rich tables and writes its JSON into --results-dir (default: a new scratch folder; --out FILE writes a
copy there too, never over an existing file). The demo backbone has random weights; timings do not depend on
weight values, but its widths are tiny, so its stage times say nothing about a 7B model (the core-only rows use
LLaVA's real projector shape, 1024->4096->4096).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from benchmarks.common import EXAMPLES, Clock, ResultsWriter, host, make_parser, print_table, run_main, stamp
from care_core import CaReConfig, care_reduce
from care_core.images import load_image
from care_core.pipeline import Budget, ReductionPipeline

CORE_STAGES = ("scoring_ms", "anchors_ms", "calibration_ms", "total_ms")


def bench_cli_stages(reps: int) -> list[dict[str, Any]]:
    """Median ms per stage of the pipeline `care reduce` runs (demo backbone, K = 11% of N, care)."""
    pipe = ReductionPipeline.from_pretrained(None, methods=["care"], config=CaReConfig(), device="cpu")
    budget = [Budget.ratio(0.11)]
    pipe(load_image(EXAMPLES / "astronaut.jpg"), None, budget)  # warm-up
    rows = []
    for name in ("astronaut.jpg", "coffee.jpg", "chelsea.jpg"):
        picture = load_image(EXAMPLES / name)
        samples: dict[str, list[float]] = {}
        for _ in range(reps):
            output = pipe(picture, None, budget)
            stages = {**output.timings_ms, **output.runs[0].timings_ms}
            stages["total"] = sum(stages.values())
            for stage, ms in stages.items():
                samples.setdefault(stage, []).append(ms)
        rows.append({"image": name, **{f"{k}_ms": statistics.median(v) for k, v in samples.items()}})
    return rows


def bench_core(sizes: list[int], reps: int, m: int, engines: tuple[str, ...]) -> list[dict[str, Any]]:
    """``care_reduce`` stage medians at LLaVA's projector widths, jvp and fd engines, K = 11% of N."""
    torch.manual_seed(0)
    d_v, d_h = 1024, 4096
    projector = torch.nn.Sequential(torch.nn.Linear(d_v, d_h), torch.nn.GELU(), torch.nn.Linear(d_h, d_h)).eval()
    clock = Clock(torch.device("cpu"))
    rows = []
    for n in sizes:
        features, positions, keep = torch.randn(n, d_v), torch.rand(n, 2), max(1, int(0.11 * n))
        for engine in engines:
            cfg = CaReConfig(engine=engine, m=m)  # type: ignore[arg-type]

            def run(timer: Any, cfg: CaReConfig = cfg, v: Any = features, p: Any = positions, k: int = keep) -> Any:
                return care_reduce(v, projector, p, keep=k, config=cfg, stage_timer=timer)

            stages = clock.median_stages(run, reps)
            rows.append({"N": n, "K": keep, "engine": engine, "m": m, **{f"{k}_ms": v for k, v in stages.items()},
                         "jvp_floor_gmacs": m * n * d_h * d_h / 1e9})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(
        __doc__,
        quick="N = 576, the jvp engine at m = 8, one repetition (about 15 s on a 2-core CPU)",
        duration="about 10 minutes on a 2-core CPU (N = 2880 with the fd engine dominates)",
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--m", type=int, default=64)
    args = parser.parse_args(argv)
    writer = ResultsWriter(args, "cpu-bench_reduce")
    reps = 1 if args.quick else args.reps
    cli_rows = bench_cli_stages(reps)
    stages = [k for k in cli_rows[0] if k.endswith("_ms")]
    print_table("care reduce, demo backbone (random weights), CPU: median ms per stage",
                ("image", *(s.removesuffix("_ms") for s in stages)),
                [(str(r["image"]), *(f"{r[s]:.1f}" for s in stages)) for r in cli_rows])  # fmt: skip
    if args.quick:
        core_rows = bench_core([576], reps, min(args.m, 8), ("jvp",))
    else:
        core_rows = bench_core([576, 2880], reps, args.m, ("jvp", "fd"))
    print_table("care_reduce core, d_v = 1024, projector 1024->4096->4096 GELU, float32, CPU: median ms",
                ("engine", "N", "K", *(s.removesuffix("_ms") for s in CORE_STAGES)),
                [(r["engine"], str(r["N"]), str(r["K"]), *(f"{r.get(s, float('nan')):.1f}" for s in CORE_STAGES))
                 for r in core_rows])  # fmt: skip
    payload = {"date": stamp(), "machine": host(), "torch_threads": torch.get_num_threads(), "reps": reps,
               "cli_stages_demo_backbone": cli_rows, "core": core_rows}  # fmt: skip
    writer.finish(payload)


if __name__ == "__main__":
    run_main(main)
