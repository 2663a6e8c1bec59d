"""A resumable data-set CSR run with the library alone (no care_cli), as `care csr --data` runs it.

care_core.dataset_csr.dataset_csr, the function behind `care csr --data`: pairs sharded over processes, run in
batches (the device's default size; a batch out of GPU memory is split), each finished batch saved at once, a rerun
computing only what is missing, statistics on rank 0.

    torchrun --nproc-per-node 2 examples/dataset_csr.py --data examples/csr_pairs.jsonl --output-dir runs/csr
    python examples/dataset_csr.py --data examples/csr_pairs.jsonl --output-dir runs/csr   # one process

Run it again with the same folder and it computes nothing new. The demo backbone is a tiny model, not a real VLM.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from care_core import CaReConfig
from care_core.budget import Budget
from care_core.dataset_csr import dataset_csr, read_pairs, run_manifest
from care_core.pipeline import ReductionPipeline
from care_core.runs import DatasetRun

MODEL = "tiny-llava"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help='JSONL of {"image": ..., "question": ...}')
    parser.add_argument("--output-dir", type=Path, required=True, help="results folder (rerun to resume)")
    parser.add_argument("--method", action="append", help="method (repeatable; default: care and random)")
    parser.add_argument("--keep", type=int, action="append", help="kept tokens K (repeatable; default: 64)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, ... (default: auto)")
    args = parser.parse_args()
    methods = args.method or ["care", "random"]
    budgets = [Budget.keep(k) for k in args.keep or [64]]
    config = CaReConfig(seed=0)
    pairs, _ = read_pairs(args.data)

    # the manifest `care csr` writes: a folder of another setup is refused, and either can resume the other's run
    with DatasetRun(args.output_dir, manifest=run_manifest(MODEL, "auto", config.to_dict()), resume=True) as run:
        pipe = ReductionPipeline.from_pretrained(MODEL, methods=methods, config=config, device=run.device(args.device))
        result = dataset_csr(run, pipe, pairs, budgets, on_notice=print)  # batch size: the device's default
    print(f"rank {run.world.rank}: computed {result.computed} pair(s) now", flush=True)
    if run.world.is_main:
        print(f"{len(result.results)} results in {args.output_dir}")
        for row in result.summary():
            print(f"{row['method']:>8} {row['budget']:>6}: CSR x100 = {row['mean']:.2f} ± {row['ci95']:.2f} "
                  f"(95% CI, n = {row['n']})")  # fmt: skip


if __name__ == "__main__":
    main()
