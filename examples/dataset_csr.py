"""A resumable data-set CSR run with the library alone (no care_cli): pairs sharded over processes, run in batches
(the device's default size; a batch out of GPU memory is split), each finished batch saved at once, a rerun
computing only what is missing, statistics on rank 0.

    torchrun --nproc-per-node 2 examples/dataset_csr.py --data examples/csr_pairs.jsonl --output-dir runs/csr
    python examples/dataset_csr.py --data examples/csr_pairs.jsonl --output-dir runs/csr   # one process

Run it again with the same folder and it computes nothing new. The demo backbone is a tiny model, not a real VLM.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from care_core import CaReConfig
from care_core.batching import Batches, default_batch_size
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
        todo = []
        for pid, image, question in run.shard(pairs):
            plan = {m: [b for b in budgets if (pid, m, b.label) not in done] for m in methods}
            if any(plan.values()):
                todo.append((pid, image, question, plan))

        def answer(chunk: list[tuple]) -> list:  # one batch: per pair what it gives alone
            return pipe.run_batch([load_image(i) for _, i, _, _ in chunk], [q for _, _, q, _ in chunk], budgets,
                                  csr=True, plans=[plan for *_, plan in chunk])  # fmt: skip

        def save(chunk: list[tuple], outputs: list) -> None:  # each finished batch at once
            run.append({"pair_id": pid, "method": r.method, "budget": r.budget.label, "N": out.num_tokens,
                        "K": r.keep, "csr": 100 * (r.csr or 0.0)}
                       for (pid, *_), out in zip(chunk, outputs, strict=True) for r in out.runs)  # fmt: skip

        size = default_batch_size(pipe.adapter, max_new_tokens=None)  # no answers: CSR only
        Batches(size, device=pipe.adapter.device, on_notice=print).run(todo, answer, save)
        computed = len(todo)
        print(f"rank {run.world.rank}: computed {computed} pair(s) now", flush=True)
        results = run.merge()
    if run.world.is_main:
        print(f"{len(results)} results in {args.output_dir}")
        for row in csr_summary(list(results.values()), methods, [b.label for b in budgets]):
            print(f"{row['method']:>8} {row['budget']:>6}: CSR x100 = {row['mean']:.2f} ± {row['ci95']:.2f} "
                  f"(95% CI, n = {row['n']})")  # fmt: skip


if __name__ == "__main__":
    main()
