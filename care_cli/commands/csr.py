"""`care csr`: Calibrated Semantic Retention (Supp. A) of methods x budgets, on one pair or a JSONL file."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from care_cli import options as opt
from care_cli import render, run_options
from care_cli.errors import UserError
from care_core.config import CaReConfig
from care_core.errors import CareError, failure_line, one_line
from care_core.runs import FAILED

if TYPE_CHECKING:
    from PIL import Image

    from care_core.prefetch import Prefetcher
    from care_core.runs import DatasetRun

ImageArg = Annotated[
    Path | None, typer.Argument(help="One image (with --question); or use --data.", show_default=False)
]
QuestionOpt = Annotated[str | None, typer.Option("--question", "-q", help="The question for IMAGE.")]
DataOpt = Annotated[
    Path | None,
    typer.Option("--data", help='JSONL of {"image": ..., "question": ...}; image paths relative to the file.'),
]
PlotOpt = Annotated[
    Path | None,
    typer.Option("--plot", help="Figure (.png, .pdf or .svg): grouped bars for one or two budgets, CSR-against-"
                                "budget curves with a 95% band from three budgets on."),
]  # fmt: skip
CsvOpt = Annotated[Path | None, typer.Option("--csv", help="Per-pair results as a .csv file.")]
SkipBadOpt = Annotated[
    bool,
    typer.Option("--skip-bad", metavar="", help="Skip bad JSONL lines and pairs that fail (an image the model "
                                                "cannot take) and list them, instead of stopping; with --output-dir "
                                                "the failed pairs are recorded, and --resume skips them again."),
]  # fmt: skip
PLOT_FORMATS = (".png", ".pdf", ".svg")
CSV_COLUMNS = ["line", "image", "question", "backbone", "demo", "method", "budget", "N", "K", "tokens_out", "csr",
               "uniform_weights"]  # fmt: skip


@dataclass(frozen=True)
class BadPairs:
    """What a run does with a pair that fails alone: stop with its error, or ``skip`` it (recorded as bad in the
    run's folder); ``retry``: compute again the pairs an earlier run recorded as bad (else they stay skipped)."""

    skip: bool = False
    retry: bool = False


@dataclass(frozen=True)
class Pair:
    line: int | None  # 1-based line in the JSONL file, None for a single pair
    image: Path
    question: str


def read_pairs(path: Path, skip_bad: bool) -> tuple[list[Pair], list[dict[str, Any]]]:
    """Pairs of a JSONL file; a bad line stops with its line number unless `skip_bad`."""
    if not path.exists():
        raise UserError(f"{path}: no such file")
    if path.is_dir():
        raise UserError(f"{path}: is a folder, expected a JSONL file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a UTF-8 BOM is not part of the data
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read it ({exc})") from exc
    pairs: list[Pair] = []
    skipped: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            pairs.append(_parse_line(path, number, line))
        except UserError as exc:
            if not skip_bad:
                raise
            skipped.append({"line": number, "reason": str(exc)})
    if not pairs:
        raise UserError(f"{path}: no usable image-question pairs")
    return pairs, skipped


def _parse_line(path: Path, number: int, line: str) -> Pair:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with 'image' and 'question'")
    for key in ("image", "question"):
        if key not in record:
            raise UserError(f"{where}: missing field {key!r}")
        if not isinstance(record[key], str):
            raise UserError(f"{where}: field {key!r} must be a string, got {type(record[key]).__name__}")
        if not record[key].strip():
            raise UserError(f"{where}: field {key!r} is empty")
    image = Path(record["image"]).expanduser()
    if not image.is_absolute():
        image = path.parent / image
    return Pair(number, image, record["question"])


OutputDirOpt = Annotated[
    Path | None,
    typer.Option("--output-dir", help="Folder for per-process result shards and the run manifest: makes the run "
                                      "resumable (see --resume). Needed to resume; optional otherwise."),
]  # fmt: skip
ResumeOpt = Annotated[
    bool,
    typer.Option("--resume", metavar="", help="Continue the run in --output-dir: compute only the pair x method x "
                                              "budget results it lacks (same model and hyperparameters only)."),
]  # fmt: skip


RetryBadOpt = Annotated[
    bool,
    typer.Option("--retry-bad", metavar="", help="With --resume: compute again the pairs the run recorded as bad "
                                                 "(see --skip-bad)."),
]  # fmt: skip


@opt.with_config
def csr(
    ctx: typer.Context,
    image: ImageArg = None,
    question: QuestionOpt = None,
    data: DataOpt = None,
    method: opt.Methods = None,
    ratio: opt.RatioSpecs = None,
    keep: opt.Keeps = None,
    model: opt.Model = None,
    device: opt.Device = "auto",
    dtype: opt.Dtype = "auto",
    plot: PlotOpt = None,
    csv_path: CsvOpt = None,
    output_dir: OutputDirOpt = None,
    resume: ResumeOpt = False,
    retry_bad: RetryBadOpt = False,
    num_processes: run_options.ProcessesOpt = 1,
    batch_size: opt.BatchSize = "auto",
    skip_bad: SkipBadOpt = False,
    force: opt.Force = False,
    json_output: opt.Json = False,
    config: CaReConfig | None = None,
) -> None:
    """CSR (x100) of each method at each budget: how much question-relevant meaning survives.

    At least one budget is required (--ratio and --keep are repeatable; --ratio START:STOP:STEP gives a range).
    Several budgets draw a CSR-against-budget curve with --plot.
    """
    from care_core.batching import parse_batch_size
    from care_core.runs import DatasetRun

    assert config is not None
    _check_arguments(image, question, data, output_dir, resume, num_processes, retry_bad)
    requested = parse_batch_size(batch_size)
    budgets = opt.budgets(opt.parse_ratio_specs(ratio), keep)
    names, every = opt.method_names(method)
    outputs = _output_files(plot, csv_path, output_dir, [p for p in (image, data) if p is not None], force)
    pairs, skipped = _given_pairs(image, question, data, skip_bad)
    run = DatasetRun(output_dir, manifest=identity(model, dtype, config.to_dict()), resume=resume)
    argv = ctx.obj["argv"]
    if num_processes > 1 and run.world.size == 1:  # start the processes; they do the work and rank 0 reports
        raise typer.Exit(_launch(argv, num_processes, output_dir, pairs))
    try:
        with run:
            report = run_pairs(run, pairs, names, budgets, config, model=model, device=device, dtype=dtype,
                               bad=BadPairs(skip_bad, retry_bad), every=every, quiet=json_output,
                               batch_size=requested)  # fmt: skip
    except KeyboardInterrupt:
        message = _interrupted(argv, output_dir, pairs) if run.world.size == 1 else None
        raise run_options.Interrupted(message) from None
    if run.world.is_main:
        report["skipped"] = sorted(skipped + report["skipped"], key=lambda item: item["line"])
        _write_outputs(report, *outputs)
        if json_output:
            render.print_json(report)
        else:
            show_report(report)


def _given_pairs(
    image: Path | None, question: str | None, data: Path | None, skip_bad: bool
) -> tuple[list[Pair], list[dict[str, Any]]]:
    """The pairs to run: the JSONL file's (bad lines skipped with ``skip_bad``, and listed), or IMAGE's one."""
    if data is not None:
        return read_pairs(data, skip_bad)
    assert image is not None and question is not None
    return [Pair(None, image, question)], []


def _check_arguments(
    image: Path | None, question: str | None, data: Path | None, output_dir: Path | None, resume: bool,
    num_processes: int, retry_bad: bool,
) -> None:  # fmt: skip
    if (image is None) == (data is None):
        raise UserError("give either IMAGE with --question, or --data pairs.jsonl")
    if image is not None and question is None:
        raise UserError("IMAGE needs --question")
    opt.check_question(question)
    if data is not None and question is not None:
        raise UserError("--question goes with IMAGE; with --data each line carries its own question")
    run_options.check_processes(num_processes)
    if resume and output_dir is None:
        raise UserError("--resume needs --output-dir (the folder of the run to continue)")
    if retry_bad and not resume:
        raise UserError("--retry-bad goes with --resume (it retries the pairs a run in --output-dir recorded as bad)")


def _output_files(
    plot: Path | None, csv_path: Path | None, output_dir: Path | None, inputs: list[Path], force: bool
) -> tuple[Path | None, Path | None]:
    """The --plot and --csv files, checked before any work (never an input, not overwritten without --force), and
    the --output-dir folder (one that can be created and written in)."""
    from care_cli.io import check_distinct_outputs, check_output_folder, check_output_path

    if output_dir is not None:
        check_output_folder(output_dir)
    check_distinct_outputs({"--plot": plot, "--csv": csv_path})
    plot_path = csv_file = None
    if plot is not None:
        plot_path = check_output_path(plot, inputs, force, option="--plot", suffixes=PLOT_FORMATS)
    if csv_path is not None:
        csv_file = check_output_path(csv_path, inputs, force, option="--csv", suffixes=(".csv",))
    return plot_path, csv_file


def _write_outputs(report: dict[str, Any], plot_path: Path | None, csv_file: Path | None) -> None:
    if csv_file is not None:
        write_csv(csv_file, report)
        report["csv"] = str(csv_file)
    if plot_path is not None:
        write_plot(plot_path, report)
        report["plot"] = str(plot_path)


def identity(model: str | None, dtype: str, config: dict[str, Any]) -> dict[str, Any]:
    """What must match for results of two runs to be mixed (the run's manifest)."""
    from care_core.backbones.families import DEFAULT_DEMO

    shown = model or DEFAULT_DEMO
    folder = Path(shown).expanduser()
    if folder.exists():
        shown = str(folder.resolve())
    return {"model": shown, "dtype": dtype, "config": config}


def _launch(argv: list[str], num_processes: int, output_dir: Path | None, pairs: list[Pair]) -> int:
    """Run the command in ``num_processes`` processes (a temporary results folder unless --output-dir)."""
    with contextlib.ExitStack() as stack:
        extra: list[str] = []
        if output_dir is None:
            extra = ["--output-dir", stack.enter_context(tempfile.TemporaryDirectory(prefix="care-csr-"))]
        try:
            return run_options.relaunch(argv, num_processes, extra)
        except KeyboardInterrupt:
            raise run_options.Interrupted(_interrupted(argv, output_dir, pairs)) from None


def _interrupted(argv: list[str], output_dir: Path | None, pairs: list[Pair]) -> str:
    """The line an interrupted run prints: what is saved, and the command that resumes it (or starts it again, when
    it was interrupted before its folder was set up: before the model was loaded)."""
    if output_dir is None:
        return "interrupted: nothing was saved (with --output-dir a run can be resumed)"
    from care_core.runs import MANIFEST, read_shards

    if not (output_dir.expanduser() / MANIFEST).is_file():
        return run_options.interrupted_before_start(argv, output_dir)
    ids = {_pair_id(p) for p in pairs}
    done = len({key[0] for key in read_shards(output_dir)} & ids)
    return (f"interrupted: {done} of {len(pairs)} pairs done and saved in {output_dir}; resume with: "
            f"{run_options.rerun_line(argv, '--resume')}")  # fmt: skip


def _pair_id(pair: Pair) -> str:
    from care_core.runs import pair_id

    return pair_id(pair.line, pair.image, pair.question)


def run_pairs(
    run: DatasetRun,
    pairs: list[Pair],
    names: list[str],
    budgets: list[Any],
    config: CaReConfig,
    *,
    model: str | None,
    device: str,
    dtype: str,
    bad: BadPairs,
    every: bool,
    quiet: bool,
    batch_size: Any = "auto",
) -> dict[str, Any]:
    """Every method x budget on every pair (this process's share of them) through the library pipeline, in batches
    of ``batch_size`` pairs (a number or "auto", resolved on the loaded backbone). ``run`` (a
    :class:`care_core.runs.DatasetRun`, entered) saves each finished batch and knows what earlier runs saved; rank 0
    merges every process's results into the report (others return {}). With 'all' (``every``), methods the
    backbone cannot serve are left out and listed under ``methods_skipped``; ``bad``: what a failing pair does."""
    from care_core.pipeline import ReductionPipeline

    main = run.world.is_main
    with render.status("Loading backbone (the demo is built on first use)…", quiet=quiet or not main):
        pipe = ReductionPipeline.from_pretrained(model, methods=names, config=config, device=run.device(device),
                                                 dtype=dtype, skip_unavailable=every)  # fmt: skip
    if main:
        render.print_notices(pipe.adapter.notices)
    backbone = pipe.backbone
    run.start(backbone={k: backbone.to_dict()[k] for k in ("name", "family", "demo")})
    ids = [_pair_id(p) for p in pairs]
    items = list(zip(ids, pairs, strict=True))
    skipped, batch, cost = _timed_compute(run, pipe, items, budgets, batch_size, bad=bad, quiet=quiet)
    done = run.merge()
    if not main:
        return {}
    labels = [b.label for b in budgets]
    results = [{k: v for k, v in done[(pid, name, label)].items() if k != "pair_id"}
               for pid in ids for name in pipe.methods for label in labels if (pid, name, label) in done]  # fmt: skip
    if not results:  # the first reason says what went wrong where every pair went the same way
        raise UserError("every pair was skipped; nothing to report" + "".join(
            f" (line {s['line']}: {s['reason']})" for s in skipped[:1]))  # fmt: skip
    from care_core.runs import csr_summary

    return {
        "command": "csr",
        "backbone": backbone.to_dict(),
        "methods": list(pipe.methods),
        "methods_skipped": pipe.skipped,
        "budgets": labels,
        "config": config.to_dict(),
        "seed": config.seed,
        "pairs": len({r["line"] if r["line"] is not None else r["image"] for r in results}),
        "processes": run.world.size,
        "batch_size": batch,
        **cost,
        "summary": csr_summary(results, list(pipe.methods), labels),
        "results": results,
        "skipped": skipped,
    }


def _timed_compute(
    run: DatasetRun, pipe: Any, items: list[tuple[str, Pair]], budgets: list[Any], batch_size: Any, *,
    bad: BadPairs, quiet: bool,
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:  # fmt: skip
    """:func:`_compute`, the skipped pairs of every process, and what the computing cost: ``compute_seconds`` (all
    processes, from after every model is loaded to the slowest one's end; resumed results cost nothing) and
    ``peak_gpu_memory_gib`` (the most any process held for tensors meanwhile; None off CUDA)."""
    from care_core.batching import peak_gpu_memory_gib, reset_peak_gpu_memory

    reset_peak_gpu_memory(pipe.adapter.device)
    run.processes.barrier()  # every process has loaded its model: the clock measures the computing only
    start = time.perf_counter()
    skipped, batch = _compute(run, pipe, items, budgets, batch_size, bad=bad, quiet=quiet)
    skipped = [s for part in run.processes.gather(skipped) for s in part]  # also waits for the slowest process
    seconds = time.perf_counter() - start
    peaks = [p for p in run.processes.gather(peak_gpu_memory_gib(pipe.adapter.device)) if p is not None]
    return skipped, batch, {"compute_seconds": seconds, "peak_gpu_memory_gib": max(peaks) if peaks else None}


def _compute(
    run: DatasetRun, pipe: Any, items: list[tuple[str, Pair]], budgets: list[Any], batch_size: Any, *,
    bad: BadPairs, quiet: bool,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """This process's share of the pairs, each method x budget not saved yet, in batches (each finished batch saved
    at once). A pair that fails inside a batch is retried alone (care_core.batching.Batches); failing alone, it
    stops the run, or with ``bad.skip`` it is skipped and recorded as bad in the run's folder, where a resumed run
    skips it again unless ``bad.retry``. Returns the pairs skipped as bad, and the batch size: used, requested, the
    device's default and the final one (after any out-of-memory split)."""
    from care_core.batching import Batches, choose_batch_size
    from care_core.prefetch import image_prefetcher

    choice = choose_batch_size(batch_size, pipe.adapter, max_new_tokens=None, attention_layers=pipe.attention_layers)
    batches = Batches(choice.size, device=pipe.adapter.device, on_notice=lambda line: render.print_notices([line]))
    todo, skipped = _todo(run, list(pipe.methods), items, budgets, bad.retry)
    label = "CSR" if run.world.size == 1 else f"CSR (rank 0 of {run.world.size})"
    with (
        render.progress(label, quiet=quiet or not run.world.is_main) as progress,
        image_prefetcher(pipe.adapter, _open_image, todo, batches.size, key=_item_key) as loader,
    ):
        task = progress.add_task("", total=len(todo))

        def failing(item: tuple[str, Pair, Any], exc: Exception) -> Failed:
            pair = item[1]
            if not bad.skip or pair.line is None:
                raise _pair_error(pair, exc) from exc
            return Failed(failure_line(exc))

        def finished(chunk: list[Any], outputs: list[Any]) -> None:
            loader.release(chunk)
            run.append(record for output in outputs if not isinstance(output, Failed) for record in output)
            failed = [(pid, pair, output.reason) for (pid, pair, _), output in zip(chunk, outputs, strict=True)
                      if isinstance(output, Failed)]  # fmt: skip
            run.append_failures(_failure_record(pid, pair, reason) for pid, pair, reason in failed)
            skipped.extend({"line": pair.line, "reason": reason} for _, pair, reason in failed)
            progress.update(task, advance=len(chunk), description=chunk[-1][1].image.name)

        batches.run(todo, lambda chunk: _csr_batch(pipe, loader, chunk, budgets, ahead=batches.size), finished,
                    failing)  # fmt: skip
    return skipped, choice.to_dict() | {"final": batches.size}


@dataclass(frozen=True)
class Failed:
    """What a pair that failed alone gives instead of its records: the error, on one line."""

    reason: str


def _todo(
    run: DatasetRun, methods: list[str], items: list[tuple[str, Pair]], budgets: list[Any], retry_bad: bool
) -> tuple[list[tuple[str, Pair, dict[str, list[Any]]]], list[dict[str, Any]]]:
    """This process's (pair id, pair, plan: the budgets per method not saved yet) to compute, and the pairs an
    earlier run recorded as bad, skipped (as they were then) unless ``retry_bad``."""
    done = run.done_keys()
    bad = {} if retry_bad else run.failures()
    todo = []
    skipped: list[dict[str, Any]] = []
    for pid, pair in run.shard(items):
        plan = {m: [b for b in budgets if (pid, m, b.label) not in done] for m in methods}
        if not any(plan.values()):
            continue
        if pid in bad:
            skipped.append({"line": pair.line, "reason": bad[pid][FAILED]})
        else:
            todo.append((pid, pair, plan))
    return todo, skipped


def _pair_error(pair: Pair, exc: Exception) -> UserError:
    """The one-line error of a pair that failed alone (a CareError's parameters still rendered as flags)."""
    where = f"{pair.image}" if pair.line is None else f"line {pair.line} ({pair.image})"
    return UserError(f"{where}: {one_line(exc.template) if isinstance(exc, CareError) else failure_line(exc)}")


def _failure_record(pid: str, pair: Pair, reason: str) -> dict[str, Any]:
    """The shard line recording a bad pair (care_core.runs.FAILED)."""
    return {"pair_id": pid, "line": pair.line, "image": str(pair.image), "question": pair.question, FAILED: reason}


def _open_image(item: tuple[str, Pair, Any]) -> Image.Image:
    """A (pair id, pair, plan)'s image, decoded (on a loader thread); ImageError if it is not a readable image."""
    from care_cli.io import load_image

    return load_image(item[1].image)


def _item_key(item: tuple[str, Pair, Any]) -> str:
    return item[0]  # the pair id: unique within a run


def _csr_batch(
    pipe: Any, loader: Prefetcher[Any, Any], chunk: list[Any], budgets: list[Any], *, ahead: int
) -> list[Any]:
    """The records of one batch of (pair id, pair, plan), with CSR. The images come prepared from ``loader``, which
    then starts the ``ahead`` pairs after the batch. Records, not the pipeline's results: those hold the batch's
    tensors on the device, and a run keeps what its batches return until it ends."""
    from care_core.prefetch import encoded_inputs

    images = encoded_inputs(pipe.adapter, loader.inputs(chunk, ahead))
    # untimed: the records hold no timings, and the stage clocks' CUDA syncs would leave the GPU idle
    results = pipe.run_batch(images, [pair.question for _, pair, _ in chunk], budgets, csr=True,
                             plans=[plan for _, _, plan in chunk], timed=False)  # fmt: skip
    backbone = pipe.backbone
    return [_records(pid, pair, backbone, result) for (pid, pair, _), result in zip(chunk, results, strict=True)]


def _records(pid: str, pair: Pair, backbone: Any, output: Any) -> list[dict[str, Any]]:
    """One pair's results, one record per method x budget (the shard's line format)."""
    return [{
        "pair_id": pid, "line": pair.line, "image": str(pair.image), "question": pair.question,
        "backbone": backbone.name, "demo": backbone.demo,
        "method": run.method, "budget": run.budget.label, "N": output.num_tokens, "K": run.keep,
        "tokens_out": run.result.num_tokens, "csr": _x100(run.csr), "uniform_weights": run.uniform_weights,
    } for run in output.runs]  # fmt: skip


def _x100(csr: float | None) -> float:
    if csr is None:
        raise AssertionError("the pipeline ran with csr=True, so every run has a CSR")
    return 100 * csr


def write_csv(path: Path, report: dict[str, Any]) -> None:
    """Per-pair rows; every row names the backbone and whether it is a demo."""
    from care_cli.io import atomic_write_text

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    for row in report["results"]:
        writer.writerow({k: row[k] for k in CSV_COLUMNS})
    atomic_write_text(path, buffer.getvalue())


def write_plot(path: Path, report: dict[str, Any]) -> None:
    """Grouped bars for one or two budgets; CSR-against-budget curves with a 95% band from three on."""
    from care_cli.io import atomic_write_bytes
    from care_core.figures import CURVE_MIN_BUDGETS, csr_bar_chart, csr_budget_curves

    backbone = report["backbone"]
    title = f"CSR ×100 on {backbone['name']} ({report['pairs']} pair{'s' if report['pairs'] != 1 else ''})"
    draw = csr_budget_curves if len(report["budgets"]) >= CURVE_MIN_BUDGETS else csr_bar_chart
    figure = draw(report["summary"], title=title, note=backbone["note"])
    buffer = io.BytesIO()
    figure.savefig(buffer, format=path.suffix.lower().lstrip("."), dpi=150)
    atomic_write_bytes(path, buffer.getvalue())


def show_report(report: dict[str, Any]) -> None:
    from care_cli import tables

    tables.print_csr(report)
    for item in report["methods_skipped"]:
        render.stderr.print(f"[yellow]left out {item['method']}:[/] {item['reason']}")
    for item in report["skipped"]:
        render.stderr.print(f"[yellow]skipped line {item['line']}:[/] {item['reason']}")
    for key in ("csv", "plot"):
        if report.get(key):
            render.stdout.print(f"wrote {report[key]}")
    if any(math.isnan(r["csr"]) for r in report["results"]):
        render.stderr.print("[red]some CSR values are NaN[/]")
