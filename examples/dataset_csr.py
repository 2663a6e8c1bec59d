"""A resumable data-set CSR run with the library alone (no care_cli): pairs sharded over processes, each finished
pair saved at once, a rerun computing only what is missing, statistics on rank 0.

    torchrun --nproc-per-node 2 examples/dataset_csr.py --data examples/csr_pairs.jsonl --output-dir runs/csr
    python examples/dataset_csr.py --data examples/csr_pairs.jsonl --output-dir runs/csr   # one process

Run it again with the same folder and it computes nothing new. The demo backbone is a tiny model, not a real VLM.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from care_core import CaReConfig
from care_core.budget import Budget
from care_core.images import load_image
from care_core.pipeline import ReductionPipeline
from care_core.runs import DatasetRun, csr_summary, pair_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help='JSONL of {"image": ..., "question": ...}')
    parser.add_argument("--output-dir", type=Path, required=True, help="results folder (rerun to resume)")
    parser.add_argument("--method", action="append", help="method (repeatable; default: care and random)")
    parser.add_argument("--keep", type=int, action="append", help="kept tokens K (repeatable; default: 64)")
    args = parser.parse_args()
    methods = args.method or ["care", "random"]
    budgets = [Budget.keep(k) for k in args.keep or [64]]
    config = CaReConfig(seed=0)
    lines = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    pairs = [(pair_id(n, args.data.parent / p["image"], p["question"]), args.data.parent / p["image"], p["question"])
             for n, p in enumerate(lines, start=1)]  # fmt: skip

    manifest = {"model": "tiny-llava", "config": config.to_dict()}  # a folder of another setup is refused
    with DatasetRun(args.output_dir, manifest=manifest, resume=True) as run:
        pipe = ReductionPipeline.from_pretrained("tiny-llava", methods=methods, config=config,
                                                 device=run.device("auto"))  # fmt: skip
        run.start()
        done = run.done_keys()
        computed = 0
        for pid, image, question in run.shard(pairs):
            plan = {m: [b for b in budgets if (pid, m, b.label) not in done] for m in methods}
            if not any(plan.values()):
                continue
            out = pipe(load_image(image), question, budgets, csr=True, plan=plan)
            run.append({"pair_id": pid, "method": r.method, "budget": r.budget.label, "N": out.num_tokens,
                        "K": r.keep, "csr": 100 * (r.csr or 0.0)} for r in out.runs)  # fmt: skip
            computed += 1
        print(f"rank {run.world.rank}: computed {computed} pair(s) now", flush=True)
        results = run.merge()
    if run.world.is_main:
        print(f"{len(results)} results in {args.output_dir}")
        for row in csr_summary(list(results.values()), methods, [b.label for b in budgets]):
            print(f"{row['method']:>8} {row['budget']:>6}: CSR x100 = {row['mean']:.2f} ± {row['ci95']:.2f} "
                  f"(95% CI, n = {row['n']})")  # fmt: skip


if __name__ == "__main__":
    main()
