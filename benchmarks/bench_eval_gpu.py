"""Throughput of `care eval` at full scale: LLaVA-NeXT-7B (random weights, bf16), unreduced vs CaRe K=160.

    python -m benchmarks.bench_eval_gpu                # 1 GPU, and 2 GPUs when two are visible
    python -m benchmarks.bench_eval_gpu --quick        # 1 process, 1 copy of the task, CUDA graphs only
    python -m benchmarks.bench_eval_gpu --tiny --quick --device cpu   # smoke test of the benchmark (tiny widths)

What it does:
1. builds LLaVA-NeXT-7B (CLIP-L/336 24 layers, Vicuna-7B, anyres pinpoints; ``benchmarks.models``) with
   seeded random weights directly on the GPU, and saves it with ``save_pretrained`` (model + processor, the byte
   tokenizer of the demos) to a local folder, so that ``--model <folder>`` loads it like any checkpoint;
2. writes a copy of the shipped task ``examples/tasks/care_pope_examples`` whose documents are repeated ``--copies``
   times (12 x copies samples; the same photos and questions), to have enough samples for a rate;
3. runs ``care eval --model <folder> --method care --keep 160 --tasks <task>`` exactly as a user would (a separate
   process, ``--num-processes N`` for N GPUs; ``--cuda-graphs`` and ``--no-cuda-graphs``, see ``--decoding``) and
   reads its summary JSON: per setting (all tokens / CaRe K=160) the
   wall time of lmms-eval's pass, samples per second, and the mean / median model seconds per sample.

Random weights: answers run to ``max_new_tokens`` (8) every time, so timings compare like with like, and accuracy
means nothing. On a GPU, ``care eval`` answers once untimed before each setting, so the first CUDA calls of a process
are not in the timed pass. Writes its JSON into --results-dir (default: a new scratch folder; --out FILE writes a
copy there too, never over an existing file). Run from the repository root.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import EXAMPLES, ROOT, ResultsWriter, make_parser, print_table, say

TASK = EXAMPLES / "tasks" / "care_pope_examples"
KEEP = 160
QUICK = (
    "one process, one copy of the task (12 samples), one decoding (graphs on CUDA, eager on the CPU); "
    "--tiny --quick --device cpu: about 1 minute on a 2-core CPU"
)
DURATION = (
    "about 4-6 minutes on one or two H100/H200 (the committed results: 7 s build, then 74-127 s per care eval "
    "command, 2 decodings x 1-2 process counts of 192 samples)"
)


def build_model(folder: Path, device: str, tiny: bool) -> dict[str, Any]:
    """LLaVA-NeXT-7B with random weights, saved to ``folder``; returns what it cost."""
    import torch

    from benchmarks.models import build_llava_next

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    start = time.perf_counter()
    model, processor = build_llava_next(torch.device(device), dtype, tiny)
    built = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    model.save_pretrained(str(folder))
    processor.save_pretrained(str(folder))
    saved = time.perf_counter() - start
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"parameters": params, "dtype": str(dtype).removeprefix("torch."), "build_s": built, "save_s": saved,
            "tiny": tiny}  # fmt: skip


def write_task(folder: Path, copies: int) -> str:
    """The shipped POPE-style task with its documents repeated ``copies`` times (images by absolute path)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(TASK.parent / "care_task_utils.py", folder.parent / "care_task_utils.py")  # the YAML's ../ functions
    config = (TASK / "care_pope_examples.yaml").read_text(encoding="utf-8")
    name = f"care_pope_examples_x{copies}"
    (folder / f"{name}.yaml").write_text(re.sub(r"(?m)^task: .*$", f"task: {name}", config), encoding="utf-8")
    rows = [json.loads(line) for line in (TASK / "data.jsonl").read_text(encoding="utf-8").splitlines() if line]
    lines = []
    for copy in range(copies):
        for row in rows:
            item = dict(row, question_id=copy * len(rows) + row["question_id"])
            item["image"] = str((TASK.parent / row["image"]).resolve())  # paths are relative to the tasks' folder
            lines.append(json.dumps(item))
    (folder / "data.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return name


def run_care_eval(
    model: Path, task: Path, processes: int, device: str, dtype: str, work: Path, decoding: str
) -> dict[str, Any]:
    out = work / f"out-n{processes}-{decoding}"
    command = [sys.executable, "-m", "care_cli", "eval", "--model", str(model), "--method", "care",
               "--keep", str(KEEP), "--tasks", str(task), "--device", device, "--dtype", dtype,
               "--output-dir", str(out), "--json"]  # fmt: skip
    if processes > 1:
        command += ["--num-processes", str(processes)]
    if decoding != "auto":
        command.append("--cuda-graphs" if decoding == "graphs" else "--no-cuda-graphs")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(work / "datasets"),
           "CARE_HOME": str(work / "care_home")}  # fmt: skip
    say(f"$ {' '.join(command)}")
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    total = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"care eval failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    report = json.loads(done.stdout)
    rows = []
    for setting in report["settings"]:
        (entry,) = setting["tasks"].values()
        rows.append({
            "setting": setting["setting"], "processes": processes, "decoding": decoding, "samples": entry["samples"],
            "wall_s": setting["wall_seconds"], "samples_per_s": setting["samples_per_second"],
            "model_s_per_sample_mean": entry["seconds_per_sample"],
            "model_s_per_sample_median": entry["seconds_per_sample_median"],
            "visual_tokens": entry["visual_tokens"], "num_tokens": entry["num_tokens"],
        })  # fmt: skip
    return {"processes": processes, "decoding": decoding, "command_s": total, "rows": rows,
            "backbone": report["backbone"]}  # fmt: skip


def environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "device": device}  # fmt: skip
    try:
        from importlib.metadata import version

        env["lmms_eval"] = version("lmms_eval")
    except Exception:
        env["lmms_eval"] = None
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return env


def card_slug(env: dict[str, Any]) -> str:
    gpus = env.get("gpus") or ["cpu"]
    match = re.search(r"(H100|H200|A100|L40S|L4|B200)", gpus[0])
    return (match.group(1) if match else re.sub(r"[^a-z0-9]+", "-", gpus[0].lower())).lower()


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__doc__, quick=QUICK, duration=DURATION, device="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny widths instead of 7B (smoke test of the script)")
    parser.add_argument("--copies", type=int, default=16, help="repeat the 12 task documents this many times")
    parser.add_argument("--processes", default="auto", help="comma list, e.g. 1,2; auto: 1, and 2 with 2+ GPUs")
    parser.add_argument(
        "--decoding", default="graphs,eager", help="comma list: graphs (--cuda-graphs), eager, auto (neither)"
    )
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.quick:
        args.copies, args.processes, args.decoding = 1, "1", "graphs"
    return args


def plan(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """The process counts and decodings to run."""
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device; run with --tiny --device cpu for a smoke test")
    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    processes = (
        ([1, 2] if gpus >= 2 else [1]) if args.processes == "auto" else [int(p) for p in args.processes.split(",")]
    )
    decodings = [d.strip() for d in args.decoding.split(",") if d.strip()]
    if args.device == "cpu":
        decodings = [d for d in decodings if d != "graphs"] or ["eager"]
    return processes, decodings


def show(rows: list[dict[str, Any]], title: str) -> None:
    header = ("setting", "decoding", "procs", "tokens", "samples/s", "wall s", "s/sample mean", "s/sample median")
    print_table(title, header, [(r["setting"], r["decoding"], str(r["processes"]), f"{r['visual_tokens']:.0f}",
                                 f"{r['samples_per_s']:.2f}", f"{r['wall_s']:.1f}",
                                 f"{r['model_s_per_sample_mean']:.3f}", f"{r['model_s_per_sample_median']:.3f}")
                                for r in rows])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    env = environment(args.device)
    writer = ResultsWriter(args, f"eval-gpu-{card_slug(env)}")
    processes, decodings = plan(args)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    with tempfile.TemporaryDirectory(prefix="care-bench-eval-", dir=args.work) as scratch:
        work = Path(scratch)
        model = work / ("llava-next-tiny" if args.tiny else "llava-next-7b-random")
        say(f"building {'tiny' if args.tiny else '7B'} LLaVA-NeXT with random weights into {model} ...")
        built = build_model(model, "cuda:0" if args.device.startswith("cuda") else "cpu", args.tiny)
        say(f"  {built['parameters'] / 1e9:.2f} B parameters, built {built['build_s']:.1f} s, saved "
            f"{built['save_s']:.1f} s")  # fmt: skip
        task = work / "task"
        task_name = write_task(task, args.copies)
        runs = [run_care_eval(model, task, n, args.device, dtype, work, d) for n in processes for d in decodings]
    rows = [row for run in runs for row in run["rows"]]
    show(rows, f"care eval on {task_name} ({rows[0]['samples']} samples), LLaVA-NeXT-{'tiny' if args.tiny else '7B'}"
               f" random weights, {dtype}, {env.get('gpus', ['cpu'])[0]}")  # fmt: skip
    writer.finish({"benchmark": "care eval throughput", "date": dt.datetime.now(dt.timezone.utc).isoformat(),
                   "environment": env, "model": built, "task": task_name, "keep": KEEP, "runs": runs,
                   "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
