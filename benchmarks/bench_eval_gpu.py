"""Throughput of `care eval` at full scale (issue #22): LLaVA-NeXT-7B with CaRe K=160 and LLaVA-1.5-7B with CaRe
K=64 (random weights, bf16), each next to the unreduced model at the same batch size; and (issue #47, when named in
``--backbones``) LLaVA-OneVision-7B, Qwen2.5-VL-7B, Qwen3-VL-8B and InternVL3-8B at the latency gate's image sides
with K = floor(N/9); each backbone with its stages per sample.

    python -m benchmarks.bench_eval_gpu --backbones llava-onevision-7b,qwen2.5-vl-7b,qwen3-vl-8b,internvl3-8b

    python -m benchmarks.bench_eval_gpu                # per backbone one care eval at --batch-size auto, 516 samples
    python -m benchmarks.bench_eval_gpu --batch-sizes 1,auto --processes 1,2   # batch 1 too; 1 and 2 GPUs
    python -m benchmarks.bench_eval_gpu --tokenizer bytes   # the prompts spelt byte by byte (see below)
    python -m benchmarks.bench_eval_gpu --quick        # one copy of the task (12 samples)
    python -m benchmarks.bench_eval_gpu --tiny --quick --device cpu   # smoke test of the benchmark (tiny widths)

What it does, per backbone (``--backbones``):
1. builds it (CLIP-L/336 24 layers, Vicuna-7B; NeXT with anyres pinpoints; the family's builder in
   ``care_core.backbones.<family>.demo``) with seeded random weights directly on the GPU, and saves it with
   ``save_pretrained`` (model + processor) to a local folder, so that ``--model <folder>`` loads it like any
   checkpoint. Its stand-in tokenizer (``--tokenizer``) gives the task's prompts the row counts of the real
   checkpoints' Llama 2 tokenizer, 29-30 text rows (default ``llama-pieces``: the byte tokenizer of the demos knowing
   that tokenizer's pieces of these prompts, ``care_core.backbones.full_size_parts.LLAMA_POPE_PIECES``; other text
   stays bytes), or spells each byte as a row, 96-102
   (``bytes``, the tokenizer of every figure of this benchmark recorded before 2026-11-27 night);
2. times the image preprocessing before the vision tower: the saved folder's image processor (loaded alone, no
   model) on 16 task images through ``care_core.backbones.chat_adapter.preprocess_images``, the function
   ``ChatAdapter.preprocess`` runs, with its thread pool and with one thread;
3. runs ``care eval --model <folder> --method care --keep K --tasks <task> --batch-size B`` exactly as a user would
   (a separate process; ``--num-processes N`` for N GPUs; ``--cuda-graphs`` or ``--no-cuda-graphs``, see
   ``--decoding``) on a copy of the shipped task ``examples/tasks/care_pope_examples`` whose 12 documents are
   repeated ``--copies`` times. One command evaluates both settings (all tokens first, then CaRe K), at the batch
   size given, or with ``auto`` at each setting's own pick (care eval resolves it per setting); from its summary
   JSON, per setting: the batch size used, samples per second over lmms-eval's pass, its wall time and the peak GPU
   memory; and, from the records care eval saves, each process's batches in the order answered (size and seconds:
   one-time costs inside the timed pass show as the slow ones); process 0's read apart (``batch_profile``): its first
   batch, the median full batch between first and last (the steady state, and samples/s from it), its last, and the
   pass's seconds outside its batches.

For the backbones of issue #47 (``Backbone.family``): the task's images resized to the gate's side (768, 1008, 1024,
672), K = floor(N/9) with N their processor's tokens at that side, the gate's stand-in tokenizer (the Qwen2 tokenizer's
pieces, ``QWEN_POPE_PIECES``: the real 27-39 text rows; ``--tokenizer`` is the LLaVA ones'), and after the
commands each stage's time and share per sample at the batch size care eval used for CaRe, all tokens and CaRe
(:func:`stage_times`: preprocessing, vision tower, CaRe, prefill, decoding), measured in this process: on these
families the tower is a share no reduction after it can save.

Then it reports CaRe / all tokens of the same command, the issue's targets MET or NOT MET (NeXT CaRe >= 50 samples/s,
issue #47's; CaRe >= 3x all tokens on NeXT and >= 2x on LLaVA-1.5, judged where both settings ran at one batch size,
and >= 1.5x on OneVision, judged also with each at its own ``auto`` batch size; Qwen2.5-VL, Qwen3-VL and InternVL3
reported; 2 processes
>= 1.8x one and 4 processes >= 3.5x, where both ran) and the preprocessing's share of the CaRe setting's time per
sample. Random weights: answers run to ``max_new_tokens`` (8) every time, so timings compare like with like, and
accuracy means nothing. On a GPU, ``care eval`` answers once untimed before each setting. Writes its JSON into
--results-dir (default: a new scratch folder; --out FILE writes a copy there too, never over an existing file). Run
from the repository root.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (
    EXAMPLES,
    PERFORMANCE_DOC,
    PROCESS_TARGETS,
    RESULTS,
    ROOT,
    ResultsWriter,
    comma_list,
    commit_label,
    fail,
    fmt,
    make_parser,
    median_wall_ms,
    print_table,
    replace_block,
    run_main,
    say,
    source_state,
)
from benchmarks.gpu.context import host_cpu, launch_us
from benchmarks.models import Builder
from care_core.backbones.full_size_parts import DEFAULT_TOKENIZER, TASK_TOKENIZER
from care_core.backbones.llava_1_5.demo import build_llava_1_5_7b
from care_core.backbones.llava_next.demo import build_llava_next_7b
from care_core.batch_sizes import free_memory, is_out_of_memory

TASK = EXAMPLES / "tasks" / "care_pope_examples"
PREPROCESS_IMAGES = 16  # images per timed preprocessing call (a batch of the size auto picks at the least)
PREPROCESS_REPS = 3


@dataclass(frozen=True)
class Backbone:
    """One benchmarked backbone: how it is built, CaRe's budget and the issue's targets.

    ``builder``: a LLaVA-7B builder (it takes the stand-in tokenizer), or None for ``family``'s full-size model
    (``benchmarks.models.FULL_SIZE``, the latency gate's, with its own stand-in tokenizer). ``side``: the task's images
    resized to this square side (the gate's), None: as shipped. ``keep``: K, None for floor(N/9) at ``side``.
    """

    builder: Builder | None
    keep: int | None
    min_samples_per_s: float | None  # CaRe's rate on one GPU
    min_speedup: float | None  # CaRe / all tokens at the same batch size; None: reported only
    family: str | None = None
    side: int | None = None
    #: min_speedup judged also with each setting at the batch size its ``auto`` picks, as a user runs them (issue #47's
    #: OneVision target); issue #22's LLaVA targets compare at one batch size only
    speedup_at_auto: bool = False


BACKBONES = {
    # issue #47 raised NeXT's rate from issue #22's 35 samples/s to 50
    "llava-next-7b": Backbone(build_llava_next_7b, keep=160, min_samples_per_s=50.0, min_speedup=3.0),
    "llava-1.5-7b": Backbone(build_llava_1_5_7b, keep=64, min_samples_per_s=None, min_speedup=2.0),
    "llava-onevision-7b": Backbone(None, None, None, 1.5, family="llava-onevision", side=768, speedup_at_auto=True),
    "qwen2.5-vl-7b": Backbone(None, None, None, None, family="qwen2.5-vl", side=1008),
    "qwen3-vl-8b": Backbone(None, None, None, None, family="qwen3-vl", side=1024),
    "internvl3-8b": Backbone(None, None, None, None, family="internvl3", side=672),
}
DEFAULT_BACKBONES = ("llava-next-7b", "llava-1.5-7b")  # the families issue #47 adds run when named (--backbones)
STAGE_NEW_TOKENS = 8  # the answers' length in care eval (random weights answer to max_new_tokens)
#: how the stage shares' tower is timed (:func:`tower_ms_per_image`), recorded in each result
TOWER_TIMING = "encode_processed alone"
#: how the stage shares' decoding is timed (:func:`answer_times`), recorded in each result; before: two medians
DECODING_TIMING = "paired rounds"
#: the docs' words for a result made before (no ``tower_timing``): its tower is a difference of two calls' times
OLD_TOWER_TIMING = " (the tower as the features stage less the pool's preprocessing timed in another call)"
#: what a setting's clock starts after, besides the warm-up batch on a GPU (care eval's ``evaluate_setting``)
SETTING_CLOCK = "after lmms-eval's aggregation imports"
#: the docs' words for a result made before (no ``setting_clock``): the first setting, all tokens, paid them
OLD_SETTING_CLOCK = (
    "; each backbone's first setting (all tokens) also paid lmms-eval's one-time imports, which later runs pay before "
    "the clock"
)
STAGE_REPEATS = 3  # timed answer calls per stage figure (median)
QUICK = (
    "one copy of the task (12 samples), one process; --tiny --quick --device cpu: about 1 minute on a 2-core CPU "
    "(both tiny backbones)"
)
DURATION = (
    "the default (both backbones, --batch-size auto, 516 samples, 1 GPU): about 4-6 minutes on one H100 (per "
    "backbone about 30-60 s to build and save, then one care eval command of about 1.5-2.5 minutes). Batch 1 "
    "(--batch-sizes 1,auto) adds about 3-4 minutes per backbone: one backbone per call (--backbones), or fewer "
    "--copies, keeps a call under 10 minutes; --processes 1,2 adds about 1-2 minutes per backbone"
)


def build_model(name: str, folder: Path, device: str, tiny: bool, tokenizer: str) -> dict[str, Any]:
    """The backbone with random weights (the LLaVA ones with the stand-in ``tokenizer``), saved to ``folder``;
    returns what it cost."""
    from benchmarks.models import save_full_size_model, save_random_model

    spec = BACKBONES[name]
    if spec.builder is None:
        assert spec.family is not None
        return save_full_size_model(spec.family, folder, device, tiny)
    return save_random_model(spec.builder, folder, device, tiny, tokenizer=tokenizer)


def keep_of(name: str) -> int:
    """CaRe's K for the backbone: its own, or floor(N/9) with N its full-size spec's tokens at ``side``."""
    from fractions import Fraction

    from benchmarks.models import FULL_SIZE
    from care_core.budget import keep_from_ratio
    from care_core.flops.specs import KNOWN_BACKBONES
    from care_core.flops.tokens import visual_tokens

    spec = BACKBONES[name]
    if spec.keep is not None:
        return spec.keep
    assert spec.family is not None and spec.side is not None
    n = visual_tokens(KNOWN_BACKBONES[FULL_SIZE[spec.family].spec], spec.side, spec.side).tokens
    return keep_from_ratio(Fraction(1, 9), n)


def task_rows() -> list[dict[str, Any]]:
    """The shipped task's documents, images by absolute path (they are relative to the tasks' folder)."""
    rows = [json.loads(line) for line in (TASK / "data.jsonl").read_text(encoding="utf-8").splitlines() if line]
    return [dict(row, image=str((TASK.parent / row["image"]).resolve())) for row in rows]


def write_task(folder: Path, copies: int, side: int | None = None) -> str:
    """The shipped POPE-style task with its documents repeated ``copies`` times (images resized to ``side`` x ``side``
    where given, written beside the task)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(TASK.parent / "care_task_utils.py", folder.parent / "care_task_utils.py")  # the YAML's ../ functions
    config = (TASK / "care_pope_examples.yaml").read_text(encoding="utf-8")
    name = f"care_pope_examples_x{copies}"
    (folder / f"{name}.yaml").write_text(re.sub(r"(?m)^task: .*$", f"task: {name}", config), encoding="utf-8")
    rows = task_rows()
    if side is not None:
        rows = [dict(row, image=str(resized(Path(row["image"]), side, folder / "images"))) for row in rows]
    lines = [json.dumps(dict(row, question_id=copy * len(rows) + row["question_id"]))
             for copy in range(copies) for row in rows]  # fmt: skip
    (folder / "data.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return name


def resized(image: Path, side: int, folder: Path) -> Path:
    """``image`` resized to side x side (RGB PNG) in ``folder``; returns its path."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{image.stem}-{side}.png"
    if not out.exists():
        Image.open(image).convert("RGB").resize((side, side)).save(out)
    return out


def saved_processor(folder: Path, name: str) -> Any:
    """The saved folder's processor, loaded as care loads it (the family's image-only processor where transformers'
    needs torchvision)."""
    from transformers import AutoProcessor

    from benchmarks.models import FULL_SIZE
    from care_core.backbones.families import import_path

    family = BACKBONES[name].family
    if family is None:
        return AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    return import_path(FULL_SIZE[family].adapter)._load_processor(folder)


def time_preprocessing(folder: Path, name: str) -> dict[str, Any]:
    """ms per image of the saved processor's image processor on PREPROCESS_IMAGES task images, as
    ``ChatAdapter.preprocess`` runs it (its thread pool) and on one thread (median of PREPROCESS_REPS calls)."""
    from care_core.backbones.chat_adapter import preprocess_images, preprocess_workers
    from care_core.images import load_image

    image_processor = saved_processor(folder, name).image_processor
    paths = [row["image"] for row in task_rows()]
    images = [load_image(paths[i % len(paths)]) for i in range(PREPROCESS_IMAGES)]
    out: dict[str, Any] = {"images": len(images), "threads": preprocess_workers(len(images))}
    for key, workers in (("ms_per_image_threads", None), ("ms_per_image_one_thread", 1)):
        preprocess_images(image_processor, images[:2], workers=workers)  # warm-up
        seconds = []
        for _ in range(PREPROCESS_REPS):
            start = time.perf_counter()
            preprocess_images(image_processor, images, workers=workers)
            seconds.append(time.perf_counter() - start)
        out[key] = 1e3 * statistics.median(seconds) / len(images)
    return out


@dataclass(frozen=True)
class Run:
    """One care eval command of the plan."""

    backbone: str
    processes: int
    batch_size: str
    decoding: str

    @property
    def slug(self) -> str:
        return f"{self.backbone}-n{self.processes}-b{self.batch_size}-{self.decoding}"


def care_eval(model: Path, task: Path, run: Run, device: str, dtype: str, work: Path) -> dict[str, Any]:
    """``care eval`` as a user runs it; its summary per setting."""
    command = [sys.executable, "-m", "care_cli", "eval", "--model", str(model), "--method", "care",
               "--keep", str(keep_of(run.backbone)), "--tasks", str(task), "--device", device, "--dtype", dtype,
               "--batch-size", run.batch_size, "--output-dir", str(work / f"out-{run.slug}"), "--json"]  # fmt: skip
    if run.processes > 1:
        command += ["--num-processes", str(run.processes)]
    if run.decoding != "auto":
        command.append("--cuda-graphs" if run.decoding == "graphs" else "--no-cuda-graphs")
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
    batches = batch_seconds(work / f"out-{run.slug}" / "samples")
    rows = [setting_row(setting, run, report["batch_size"]) | {"batches": batches.get(setting["setting"], [])}
            for setting in report["settings"]]  # fmt: skip
    for row in rows:
        row["batch_profile"] = batch_profile(row["batches"], row["wall_s"])
    say(f"  {total:.0f} s; " + "; ".join(f"{r['setting']}: {r['samples_per_s']:.2f} samples/s" for r in rows))
    return {"command_s": total, "batch": report["batch_size"], "rows": rows, "backbone": report["backbone"]}


def batch_seconds(folder: Path) -> dict[str, list[list[Any]]]:
    """Per setting, each process's batches in the order answered: [rank, batch size, seconds], from the records
    care eval saves (one line per sample, the batch's wall time shared out equally). One-time costs inside the
    timed pass (graph captures, kernel builds at new shapes) show as the slow batches."""
    out: dict[str, list[list[Any]]] = {}
    for rank, shard in enumerate(sorted(folder.glob("shard-*.jsonl"))):
        left = 0
        for line in shard.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if left == 0:  # the first record of a batch: its size says how many lines follow
                left = int(record["batch_size"])
                out.setdefault(record["setting"], []).append([rank, left, record["seconds"] * left])
            left -= 1
    return out


def batch_profile(batches: list[list[Any]], wall_s: float) -> dict[str, Any] | None:
    """Rank 0's batches read apart: the first (warm-up left-overs: graphs at the task's padded lengths), the median
    of the full ones between first and last (the steady state, and ``steady_samples_per_s`` from it), the last (a
    short tail), and the pass's seconds outside all of rank 0's batches (lmms-eval, waiting for inputs)."""
    own = [(int(size), float(seconds)) for rank, size, seconds in batches if rank == 0]
    if not own:
        return None
    full = max(size for size, _ in own)
    middle = sorted(seconds for size, seconds in own[1:-1] if size == full)
    median = statistics.median(middle) if middle else None
    return {"batches": len(own), "full_size": full, "first_s": own[0][1], "median_s": median, "last_s": own[-1][1],
            "last_size": own[-1][0], "outside_s": wall_s - sum(seconds for _, seconds in own),
            "steady_samples_per_s": full / median if median else None}  # fmt: skip


def setting_row(setting: dict[str, Any], run: Run, batch: dict[str, Any]) -> dict[str, Any]:
    (entry,) = setting["tasks"].values()
    return {
        "backbone": run.backbone, "setting": setting["setting"], "method": setting["method"], "keep": setting["keep"],
        "processes": run.processes, "decoding": run.decoding, "batch_size_requested": run.batch_size,
        "batch_size_start": setting.get("batch_size_start", batch["batch_size"]),  # auto: this setting's own pick
        "batch_size": setting["batch_size"],  # at its end (after any split)
        "batch_size_auto_all_tokens": batch["default"], "samples": entry["samples"],
        "wall_s": setting["wall_seconds"], "samples_per_s": setting["samples_per_second"],
        "peak_gpu_memory_gib": setting.get("peak_gpu_memory_gib"),
        "input_wait_s": setting.get("input_wait_seconds"),  # None in results from before care eval reported it
        "model_s_per_sample_mean": entry["seconds_per_sample"], "visual_tokens": entry["visual_tokens"],
    }  # fmt: skip


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's rate over the all-tokens row of the same command (``x_all_tokens``), and over the same row with
    one process (``x_one_process``), where those ran."""

    def key(row: dict[str, Any], **changes: Any) -> tuple[Any, ...]:
        row = {**row, **changes}
        return (row["backbone"], row["processes"], row["decoding"], row["batch_size_requested"], row["method"])

    by_key = {key(r): r for r in rows}
    for row in rows:
        base = by_key.get(key(row, method=None))
        one = by_key.get(key(row, processes=1)) if row["processes"] > 1 else None
        unreduced = base if row["method"] is not None else None  # the all-tokens row a reduced row is compared with
        row["x_all_tokens"] = row["samples_per_s"] / unreduced["samples_per_s"] if unreduced else None
        # auto picks each setting's size for the tokens its answers read: the ratio is then not at one batch size
        row["same_batch_as_all_tokens"] = unreduced is not None and _sizes(row) == _sizes(unreduced)
        row["x_one_process"] = row["samples_per_s"] / one["samples_per_s"] if one else None


def _sizes(row: dict[str, Any]) -> tuple[int, int]:
    return row["batch_size_start"], row["batch_size"]


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, per CaRe row: its rate on one GPU, its speed-up over all tokens, 2 GPUs over one."""
    checks = []
    for row in rows:
        if row["method"] is None:
            continue
        spec, where = BACKBONES[row["backbone"]], f"{row['backbone']} batch {row['batch_size']}"
        if row["processes"] == 1 and spec.min_samples_per_s is not None:
            checks.append(check(where, "CaRe samples/s", row["samples_per_s"], spec.min_samples_per_s))
        at_auto = spec.speedup_at_auto and row["batch_size_requested"] == "auto" and row["x_all_tokens"] is not None
        if spec.min_speedup is not None and (row["same_batch_as_all_tokens"] or at_auto):
            checks.append(check(where + f", {row['processes']} proc", "CaRe / all tokens", row["x_all_tokens"],
                                spec.min_speedup))  # fmt: skip
        target = PROCESS_TARGETS.get(row["processes"])
        if row["x_one_process"] is not None and target is not None:
            checks.append(check(where, f"{row['processes']} procs / 1", row["x_one_process"], target))
    return checks


def check(where: str, what: str, value: float | None, target: float) -> dict[str, Any]:
    met = value is not None and value >= target
    return {"where": where, "what": what, "value": value, "target": target, "met": met}


def preprocess_shares(rows: list[dict[str, Any]], preprocessing: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The preprocessing's ms per image against the CaRe setting's measured ms per sample (1000 / samples per s)."""
    out = []
    for row in rows:
        if row["method"] is None or row["processes"] != 1:
            continue
        cost = preprocessing[row["backbone"]]
        per_sample_ms = 1e3 / row["samples_per_s"]
        out.append({"backbone": row["backbone"], "batch_size": row["batch_size"], "per_sample_ms": per_sample_ms,
                    **cost, "share_threads": cost["ms_per_image_threads"] / per_sample_ms,
                    "share_one_thread": cost["ms_per_image_one_thread"] / per_sample_ms})  # fmt: skip
    return out


def environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__, "device": device,
                           "cpu_count": os.cpu_count()}  # fmt: skip
    try:
        from importlib.metadata import version

        env["lmms_eval"] = version("lmms_eval")
    except Exception:
        env["lmms_eval"] = None
    env["host_cpu"] = host_cpu()
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if device.startswith("cuda") and torch.cuda.is_available():
        env["launch_us"] = round(launch_us(torch.device(device)), 2)  # how fast this host feeds the GPU
    return env


def card_slug(env: dict[str, Any]) -> str:
    gpus = env.get("gpus") or ["cpu"]
    match = re.search(r"(H100|H200|A100|L40S|L4|B200)", gpus[0])
    return (match.group(1) if match else re.sub(r"[^a-z0-9]+", "-", gpus[0].lower())).lower()


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser(__doc__, quick=QUICK, duration=DURATION, device="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny widths instead of 7B (smoke test of the script)")
    parser.add_argument(
        "--backbones",
        default=",".join(DEFAULT_BACKBONES),
        help=f"comma list of {', '.join(BACKBONES)} (default: {', '.join(DEFAULT_BACKBONES)})",
    )
    parser.add_argument(
        "--batch-sizes", default="auto", help="comma list of care eval --batch-size values, e.g. 1,auto"
    )
    parser.add_argument("--copies", type=int, default=43, help="repeat the 12 task documents this many times")
    parser.add_argument("--processes", default="1", help="comma list of process counts (one GPU each), e.g. 1,2")
    parser.add_argument(
        "--decoding", default="graphs", help="comma list: graphs (--cuda-graphs), eager, auto (neither)"
    )
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--tokenizer", default=TASK_TOKENIZER, choices=(TASK_TOKENIZER, DEFAULT_TOKENIZER),
                        help="the LLaVA models' stand-in tokenizer: knowing the Llama 2 tokenizer's pieces of the "
                             "task's prompts (29-30 text rows, as the real checkpoints' tokenizer gives; the "
                             "default), or every text byte by byte (96-102)")  # fmt: skip
    parser.add_argument("--docs", action="store_true", help="no run: rewrite docs/performance.md's care eval block "
                        "from the newest committed result")  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.copies, args.processes = 1, "1"
    return args


def plan(args: argparse.Namespace) -> list[Run]:
    """The care eval commands to run, per backbone."""
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise fail("no CUDA device; run with --tiny --device cpu for a smoke test")
    unknown = [b for b in comma_list(args.backbones) if b not in BACKBONES]
    if unknown:
        raise fail(f"--backbones: unknown {', '.join(unknown)} (choose from {', '.join(BACKBONES)})")
    processes = [int(p) for p in comma_list(args.processes)]
    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    if args.device.startswith("cuda") and max(processes) > gpus:
        raise fail(f"--processes {max(processes)}: only {gpus} GPU(s) visible")
    decodings = comma_list(args.decoding)
    if args.device == "cpu":
        decodings = [d for d in decodings if d != "graphs"] or ["eager"]
    return [Run(b, n, size, d) for b in comma_list(args.backbones) for n in processes
            for size in comma_list(args.batch_sizes) for d in decodings]  # fmt: skip


def show(rows: list[dict[str, Any]], checks: list[dict[str, Any]], shares: list[dict[str, Any]], title: str) -> None:
    header = ("backbone", "setting", "procs", "batch", "samples/s", "wall s", "peak GiB", "x all", "x 1 proc")
    print_table(title, header, [(r["backbone"], f"{r['setting'] if r['method'] else 'all tokens'} ({r['decoding']})",
                                 str(r["processes"]),
                                 batch_label(r), fmt(r["samples_per_s"]),
                                 fmt(r["wall_s"], 1), fmt(r["peak_gpu_memory_gib"], 1), fmt(r["x_all_tokens"]),
                                 fmt(r["x_one_process"])) for r in rows])  # fmt: skip
    print_table("process 0's batches, s (steady: the median full one between first and last)",
                ("backbone", "setting", "first", "steady", "last (n)", "outside", "inputs", "steady/s"),
                [(r["backbone"], r["setting"] if r["method"] else "all tokens", fmt(p["first_s"]),
                  fmt(p["median_s"]), f"{fmt(p['last_s'])} ({p['last_size']})", fmt(p["outside_s"], 1),
                  fmt(r.get("input_wait_s"), 1), fmt(p["steady_samples_per_s"]))
                 for r in rows if (p := r.get("batch_profile"))])  # fmt: skip
    print_table("targets of issue #22", ("where", "what", "value", "target", "verdict"),
                [(c["where"], c["what"], fmt(c["value"]), f">= {c['target']:g}", "MET" if c["met"] else "NOT MET")
                 for c in checks])  # fmt: skip
    print_table("image preprocessing before the vision tower (ms per image; share of CaRe's time per sample)",
                ("backbone", "batch", "threads", "ms/img pool", "ms/img 1 thread", "ms/sample", "share pool",
                 "share 1 thread"),
                [(s["backbone"], str(s["batch_size"]), str(s["threads"]), fmt(s["ms_per_image_threads"], 1),
                  fmt(s["ms_per_image_one_thread"], 1), fmt(s["per_sample_ms"], 1), f"{100 * s['share_threads']:.0f}%",
                  f"{100 * s['share_one_thread']:.0f}%") for s in shares])  # fmt: skip


def show_stages(done: dict[str, dict[str, Any]]) -> None:
    """The stage table of the backbones timed per stage (ms per sample, share of the sample's time)."""
    names = ("preprocessing", "tower", "care", "prefill", "decoding")

    def cell(side: dict[str, Any], key: str) -> str:
        return f"{fmt(side['ms_per_sample'][key], 1)} ({100 * side['share'][key]:.0f}%)"

    timed = [(name, one["stages"]) for name, one in done.items() if one.get("stages")]
    settings = ("all tokens", "care")
    table = [(name, label, str(stages["batch_size"]), *(cell(stages[label], k) for k in names),
              fmt(stages[label]["total_ms"], 1)) for name, stages in timed for label in settings]  # fmt: skip
    if table:
        print_table(
            "stages per sample, ms (share), at care eval's batch size, in this process",
            ("backbone", "setting", "batch", *names, "total"),
            table,
        )


def batch_label(row: dict[str, Any]) -> str:
    """The batch size used, "->" the size it ended at where out-of-memory splitting cut it, (what was asked)."""
    end = f"->{row['batch_size']}" if row["batch_size"] != row["batch_size_start"] else ""
    return f"{row['batch_size_start']}{end} ({row['batch_size_requested']})"


def bench_backbone(name: str, runs: list[Run], args: argparse.Namespace, work: Path, task: Path) -> dict[str, Any]:
    """Build and save one backbone, time its preprocessing, run its care eval commands and time its stages in this
    process; its folder is removed."""
    folder = work / f"{name}-{'tiny' if args.tiny else 'random'}"
    side = BACKBONES[name].side
    if side is not None:  # the gate's image side: the task's images resized, in a task of this backbone's own
        task = work / f"task-{side}"
        write_task(task, args.copies, side)
    cuda = args.device.startswith("cuda")
    say(f"building {'tiny' if args.tiny else 'full-size'} {name} with random weights into {folder} ...")
    built = build_model(name, folder, "cuda:0" if cuda else "cpu", args.tiny, args.tokenizer)
    say(
        f"  {built['parameters'] / 1e9:.2f} B parameters, built {built['build_s']:.1f} s, saved {built['save_s']:.1f} s"
    )
    preprocessing = time_preprocessing(folder, name)
    say(f"  preprocessing: {preprocessing['ms_per_image_threads']:.1f} ms/image on {preprocessing['threads']} threads,"
        f" {preprocessing['ms_per_image_one_thread']:.1f} on one")  # fmt: skip
    dtype = "bfloat16" if cuda else "float32"
    done = [care_eval(folder, task, run, args.device, dtype, work) for run in runs]
    care_rows = [r for cmd in done for r in cmd["rows"] if r["method"] is not None and r["processes"] == 1]
    batch = int(care_rows[0]["batch_size_start"]) if care_rows else 1
    stages, stages_skipped = None, None
    try:
        stages = stage_times(folder, name, batch, preprocessing, args.device, dtype, task)
    except Exception as exc:  # a diagnostic: its out-of-memory must not lose the commands' rows
        if not is_out_of_memory(exc):
            raise
        stages_skipped = f"out of memory timing the stages at batch {batch}"
        say(f"  stages: {stages_skipped}")
        free_memory()
    shutil.rmtree(folder, ignore_errors=True)  # a 7B folder is 14 GB: one at a time on the disk
    return {"model": built, "preprocessing": preprocessing, "commands": done, "stages": stages,
            "stages_skipped": stages_skipped}  # fmt: skip


def care_ms_per_sample(method_ms: dict[str, float], batch: int) -> float:
    """CaRe's time per sample from its group's stage timings for a batch: every stage, since the pipeline's "method"
    keeps only the time outside the stages the method times itself (CaRe's scoring, anchors and calibration), and
    "projection" follows them."""
    return sum(method_ms.values()) / batch


def answer_times(adapter: Any, feed: tuple[list[Any], ...], batch: int, device: str) -> tuple[int, float, float]:
    """The batch size timed, the ms of ``generate_batch`` with 1 new token (the prefill), and the ms that the other
    :data:`STAGE_NEW_TOKENS` - 1 tokens add (the decoding), on the first that many samples of ``feed`` (questions,
    tokens, projected rows, kept indices). The 1-token and the :data:`STAGE_NEW_TOKENS`-token calls alternate for
    :data:`STAGE_REPEATS` rounds after one untimed call of each (which captures any graphs): the prefill is the median
    of the 1-token calls, the decoding the median of the rounds' differences, so that a change in the card's pace
    between calls cancels out of it (two separate medians once gave Qwen2.5-VL's all-token decoding -6 ms a sample).
    The size is ``batch``, halved while it runs out of memory (all tokens' prompts are ten times CaRe's)."""
    import torch

    cuda = torch.cuda.is_available() and device.startswith("cuda")

    def paired_ms(size: int) -> tuple[float, float]:
        def call(new_tokens: int) -> Callable[[], None]:
            def step() -> None:  # the answers are on the host when it returns: nothing left to wait for
                adapter.generate_batch(*(part[:size] for part in feed), max_new_tokens=new_tokens)

            return step

        first, whole = call(1), call(STAGE_NEW_TOKENS)
        first()  # untimed: each captures any graphs
        whole()
        rounds = [(median_wall_ms(first, 1, cuda), median_wall_ms(whole, 1, cuda)) for _ in range(STAGE_REPEATS)]
        return statistics.median(f for f, _ in rounds), statistics.median(w - f for f, w in rounds)

    size = batch
    while True:
        try:
            return (size, *paired_ms(size))
        except Exception as exc:
            if not is_out_of_memory(exc) or size == 1:
                raise
            free_memory()
            size //= 2


def tower_ms_per_image(adapter: Any, images: Sequence[Any], device: str) -> float:
    """ms per image of the vision tower alone: ``encode_processed`` on ``images`` preprocessed beforehand (the
    pixels' copy to the device included), ended on the host, median of :data:`STAGE_REPEATS` calls after one untimed.
    Timed apart because the features stage less a preprocessing time measured in another call mixes two calls'
    paces: where the pool ran slower than in the pipeline, it gave LLaVA-NeXT's tower 0.7 ms an image (its 5 crops
    take about 5)."""
    import torch

    cuda = torch.cuda.is_available() and device.startswith("cuda")
    processed = adapter.preprocess(images)
    sizes = [(image.height, image.width) for image in images]

    def step() -> None:
        with torch.no_grad():
            adapter.encode_processed(processed, sizes)
        if cuda:
            torch.cuda.synchronize()

    step()  # untimed: kernels, caches
    return median_wall_ms(step, STAGE_REPEATS, cuda) / len(images)


def stage_times(folder: Path, name: str, batch: int, preprocessing: dict[str, Any], device: str, dtype: str,
                task: Path) -> dict[str, Any]:  # fmt: skip
    """Per sample, at the batch size care eval used for CaRe: the image preprocessing, the vision tower, CaRe (the
    method and the projector), the prefill (the first token) and the decoding (the other tokens), for all tokens and
    for CaRe, in this process (care eval's has ended) on the task's first ``batch`` documents: the tower timed alone
    (:func:`tower_ms_per_image`), CaRe from ``ReductionPipeline.run_batch``'s stage timings (every stage of its
    group, :func:`care_ms_per_sample`), the answers from ``generate_batch``
    (:func:`answer_times`, at a smaller batch where all tokens' answers run out of memory)."""
    import torch

    from care_core.backbones import load_backbone
    from care_core.budget import Budget
    from care_core.images import load_image
    from care_core.pipeline import ReductionPipeline

    rows = [json.loads(line) for line in (task / "data.jsonl").read_text(encoding="utf-8").splitlines() if line]
    docs = [rows[i % len(rows)] for i in range(batch)]
    images, questions = [load_image(d["image"]) for d in docs], [d["question"] for d in docs]
    adapter = load_backbone(str(folder), device=device, dtype=dtype)
    pipe = ReductionPipeline(adapter, ["care"])
    budgets = [Budget.keep(keep_of(name))]
    pipe.run_batch(images, questions, budgets)  # warm-up: kernels, caches
    results = pipe.run_batch(images, questions, budgets)
    timings, pre_ms = results[0].timings_ms, preprocessing["ms_per_image_threads"]
    tokens = [r.tokens for r in results]
    with torch.no_grad():
        feeds: dict[str, tuple[list[torch.Tensor], list[torch.Tensor | None]]] = {
            "all tokens": ([adapter.projector(t.features) for t in tokens], [None] * batch),
            "care": ([r.runs[0].projected for r in results], [r.runs[0].result.token_index for r in results]),
        }

    method_ms = results[0].runs[0].timings_ms  # the CaRe group's stages, for the whole batch
    care_ms = care_ms_per_sample(method_ms, batch)
    out: dict[str, Any] = {"batch_size": batch, "new_tokens": STAGE_NEW_TOKENS, "timings_ms": timings,
                           "care_timings_ms": method_ms, "tower_timing": TOWER_TIMING,
                           "decoding_timing": DECODING_TIMING}  # fmt: skip
    tower_ms = tower_ms_per_image(adapter, images, device)
    for label, reduce_ms in (("all tokens", 0.0), ("care", care_ms)):
        projected, kept = feeds[label]
        size, first, decoding = answer_times(adapter, (questions, tokens, projected, kept), batch, device)
        per = {"preprocessing": pre_ms, "tower": tower_ms, "care": reduce_ms, "prefill": first / size,
               "decoding": decoding / size}  # fmt: skip
        total = sum(per.values())
        out[label] = {"ms_per_sample": per, "share": {k: v / total for k, v in per.items()}, "total_ms": total,
                      "answer_batch_size": size}  # fmt: skip
    return out


#: the block of docs/performance.md rendered from the newest committed result (``--docs``)
DOC_FILE = PERFORMANCE_DOC
BEGIN, END = (
    "<!-- eval-throughput:begin (python -m benchmarks.bench_eval_gpu --docs) -->",
    "<!-- eval-throughput:end -->",
)


def _committed(folder: Path) -> list[Path]:
    """The committed results that name their commit, oldest first (file names start with the date)."""
    return [p for p in sorted(folder.glob("*-eval-gpu-*.json")) if "source" in json.loads(p.read_text("utf-8"))]


def newest_per_backbone(folder: Path = RESULTS) -> list[tuple[Path, list[str]]]:
    """Each committed result that is the newest for some backbone, oldest first, with those backbones: a run of a
    few families never hides another family's newest figures, and a superseded family's rows are never shown."""
    owner: dict[str, Path] = {}
    for path in _committed(folder):
        for name in json.loads(path.read_text("utf-8")).get("backbones", {}):
            owner[name] = path
    files = sorted(set(owner.values()))
    return [(path, [name for name, where in owner.items() if where == path]) for path in files]


def _rate_cell(row: dict[str, Any] | None) -> str:
    return "—" if row is None else f"{row['samples_per_s']:.2f} ({row['batch_size']}, {row['peak_gpu_memory_gib']:.1f})"


def _pass_line(row: dict[str, Any]) -> str:
    """CaRe's pass read apart (:func:`batch_profile`): the steady rate beside the one-time costs in the whole one."""
    p, wait = row["batch_profile"], row.get("input_wait_s")
    waited = "" if wait is None else f" ({wait:.1f} s of them waiting for prepared images)"
    return (f"{row['backbone']} CaRe's pass (process 0): first batch {p['first_s']:.2f} s, full batches "
            f"{p['median_s']:.2f} s ({p['steady_samples_per_s']:.2f} samples/s), {p['outside_s']:.1f} s outside its "
            f"batches{waited}.")  # fmt: skip


def _stage_line(name: str, stages: dict[str, Any]) -> str:
    """Per sample with CaRe and with all tokens; CaRe's from its raw stage timings (:func:`care_ms_per_sample`)."""
    care = dict(stages["care"]["ms_per_sample"], care=care_ms_per_sample(stages["care_timings_ms"],
                                                                          stages["batch_size"]))  # fmt: skip
    care, care_note = _resolved(care)
    total = sum(care.values())
    parts = ", ".join(f"{key} {value:.1f} ({100 * value / total:.0f}%)" for key, value in care.items())
    whole, whole_note = _resolved(stages["all tokens"]["ms_per_sample"])
    size = stages["all tokens"].get("answer_batch_size", stages["batch_size"])
    at = (
        ""
        if size == stages["batch_size"]
        else f" (answers at batch {size}: batch {stages['batch_size']} ran out of memory)"
    )
    how = "" if stages.get("tower_timing") == TOWER_TIMING else OLD_TOWER_TIMING
    return (
        f"{name} per sample at batch {stages['batch_size']}, timed stage by stage{how}: {parts} ms with CaRe "
        f"({total:.1f}){care_note}; prefill {whole['prefill']:.1f} of {sum(whole.values()):.1f} with all "
        f"tokens{whole_note}{at}."
    )


def _resolved(per_sample: dict[str, float]) -> tuple[dict[str, float], str]:
    """``per_sample`` without the stages timed below zero, and a note naming them for the docs. A stage below zero is
    a difference of two calls that the card's change of pace between them outran (older results' decoding, from two
    separate medians; :func:`answer_times` pairs the calls now): it is no time, and no total includes it."""
    kept = {stage: ms for stage, ms in per_sample.items() if ms >= 0}
    below = [f"{stage} {ms:.1f}" for stage, ms in per_sample.items() if ms < 0]
    return kept, f" (not counted: {', '.join(below)} ms, timed below zero)" if below else ""


def render_markdown(results: dict[str, Any], name: str, backbones: Sequence[str] | None = None) -> str:
    """The docs' block for a result named ``name``: per backbone and setting its rate, the targets (judged from its
    rows by :func:`targets`), the stages; ``backbones``: only these (default: all the result ran)."""
    results = results if backbones is None else _only(results, set(backbones))
    source = results["source"]
    commit = commit_label(source)
    lines = ["| backbone (image), CaRe K | procs | all tokens: samples/s (batch, peak GiB) | CaRe: samples/s (batch, "
             "peak GiB) | CaRe ÷ all tokens |", "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for row in (r for r in results["rows"] if r["method"] is not None):
        alone = next((r for r in results["rows"] if r["method"] is None and r["backbone"] == row["backbone"]
                      and r["processes"] == row["processes"]), None)  # fmt: skip
        side = BACKBONES[row["backbone"]].side if row["backbone"] in BACKBONES else None
        ratio = "—" if row["x_all_tokens"] is None else f"{row['x_all_tokens']:.2f}"
        same = "" if row["same_batch_as_all_tokens"] else " (batches differ)"
        lines.append(f"| {row['backbone']} ({f'{side}²' if side else 'task images'}), {row['keep']} | "
                     f"{row['processes']} | {_rate_cell(alone)} | {_rate_cell(row)} | {ratio}{same} |")  # fmt: skip
    verdicts = [f"{t['where']}, {t['what']} {t['value']:.2f} (target {t['target']}): "
                f"{'MET' if t['met'] else 'NOT MET'}" for t in targets(results["rows"])]  # fmt: skip
    lines += ["", "Targets: " + ("; ".join(verdicts) if verdicts else "none judged") + "."]
    lines += [_pass_line(row) for row in results["rows"] if row["method"] is not None and row.get("batch_profile")]
    lines += [_stage_line(b, done["stages"]) for b, done in results["backbones"].items() if done.get("stages")]
    lines += [f"{b} stages: not timed ({done['stages_skipped']})." for b, done in results["backbones"].items()
              if done.get("stages_skipped")]  # fmt: skip
    lines += [f"{s['backbone']} preprocessing: {s['ms_per_image_threads']:.1f} ms an image on the pool "
              f"({s['ms_per_image_one_thread']:.1f} on one thread), {100 * s['share_threads']:.0f}% of CaRe's "
              f"{s['per_sample_ms']:.1f} ms a sample." for s in results["preprocessing_share"]]  # fmt: skip
    card = results["environment"].get("gpus", ["?"])[0]
    first = results["rows"][0]
    clock = "" if results.get("setting_clock") == SETTING_CLOCK else OLD_SETTING_CLOCK
    lines += ["", f"{first['samples']} samples, `--batch-size {first['batch_size_requested']}`, {first['decoding']} "
              f"decoding, one {card} per process{clock}. Source: `benchmarks/results/{name}` "
              f"(`python -m benchmarks.bench_eval_gpu`, commit {commit})."]  # fmt: skip
    return "\n".join(lines) + "\n"


def write_docs(root: Path = ROOT) -> bool:
    """Rewrite :data:`DOC_FILE`'s block from the newest committed result; returns whether it changed."""
    return replace_block(root / DOC_FILE, BEGIN, END, docs_block(root / "benchmarks" / "results"))


def docs_block(folder: Path = RESULTS) -> str:
    """The docs' block: each backbone's figures from its newest committed result (:func:`newest_per_backbone`)."""
    newest = newest_per_backbone(folder)
    if not newest:
        raise fail("no committed care eval result that names its commit (benchmarks/results/*-eval-gpu-*.json)")
    return "\n".join(render_markdown(json.loads(path.read_text(encoding="utf-8")), path.name, names)
                     for path, names in newest)  # fmt: skip


def _only(results: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """``results`` with only the rows, stages and preprocessing shares of the backbones ``names`` (its targets are
    judged from its rows when rendered)."""
    return results | {
        "rows": [row for row in results["rows"] if row["backbone"] in names],
        "backbones": {name: done for name, done in results["backbones"].items() if name in names},
        "preprocessing_share": [s for s in results["preprocessing_share"] if s["backbone"] in names],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.docs:
        print(f"{'rewrote' if write_docs() else 'unchanged:'} the care eval block of {ROOT / DOC_FILE}")
        return
    env = environment(args.device)
    writer = ResultsWriter(args, f"eval-gpu-{card_slug(env)}")
    runs = plan(args)
    results: dict[str, Any] = {"benchmark": "care eval throughput (issues #22, #47)",
                               "date": dt.datetime.now(dt.timezone.utc).isoformat(), "environment": env,
                               "source": source_state(), "tiny": args.tiny, "tokenizer": args.tokenizer,
                               "setting_clock": SETTING_CLOCK, "backbones": {}}  # fmt: skip
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="care-bench-eval-", dir=args.work) as scratch:
        work = Path(scratch)
        results["task"] = write_task(work / "task", args.copies)  # as shipped; a backbone with a side makes its own
        for name in dict.fromkeys(run.backbone for run in runs):
            mine = [run for run in runs if run.backbone == name]
            results["backbones"][name] = bench_backbone(name, mine, args, work, work / "task")
            writer.save(results)  # an interrupted run keeps the backbones it finished
    rows = [row for done in results["backbones"].values() for cmd in done["commands"] for row in cmd["rows"]]
    add_ratios(rows)
    preprocessing = {name: done["preprocessing"] for name, done in results["backbones"].items()}
    results |= {"rows": rows, "targets": targets(rows), "preprocessing_share": preprocess_shares(rows, preprocessing)}
    size = "tiny" if args.tiny else "7B"
    show_stages(results["backbones"])
    show(rows, results["targets"], results["preprocessing_share"],
         f"care eval on {results['task']} ({rows[0]['samples']} samples), {size} random weights, "
         f"{args.tokenizer} tokenizer, {env.get('gpus', ['cpu'])[0]}")  # fmt: skip
    writer.finish(results)


if __name__ == "__main__":
    run_main(main)
