"""`care csr`: Calibrated Semantic Retention (Supp. A) of methods x budgets, on one pair or a JSONL file."""

from __future__ import annotations

import contextlib
import csv
import io
import math
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from care_cli import dataset_runs, render
from care_cli import options as opt
from care_cli.errors import UserError
from care_core.batch_sizes import BatchSize, parse_batch_size
from care_core.config import CaReConfig
from care_core.dataset_csr import BadPairs, Pair, dataset_csr, read_pairs, run_manifest
from care_core.runs import MANIFEST, DatasetRun, read_shards

if TYPE_CHECKING:
    from care_core.budget import Budget

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
    num_processes: dataset_runs.ProcessesOpt = 1,
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
    assert config is not None
    _check_arguments(image, question, data, output_dir, resume, num_processes, retry_bad)
    requested = parse_batch_size(batch_size)  # read once here; passed down as it is
    budgets = opt.budgets(opt.parse_ratio_specs(ratio), keep)
    names, every = opt.method_names(method)
    outputs = _output_files(plot, csv_path, output_dir, [p for p in (image, data) if p is not None], force)
    pairs, skipped = _given_pairs(image, question, data, skip_bad)
    run = DatasetRun(output_dir, manifest=run_manifest(model, dtype, config.to_dict()), resume=resume)
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
        raise dataset_runs.Interrupted(message) from None
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
        return read_pairs(data, skip_bad=skip_bad)
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
    dataset_runs.check_processes(num_processes)
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


def _launch(argv: list[str], num_processes: int, output_dir: Path | None, pairs: list[Pair]) -> int:
    """Run the command in ``num_processes`` processes (a temporary results folder unless --output-dir)."""
    with contextlib.ExitStack() as stack:
        extra: list[str] = []
        if output_dir is None:
            extra = ["--output-dir", stack.enter_context(tempfile.TemporaryDirectory(prefix="care-csr-"))]
        try:
            return dataset_runs.relaunch(argv, num_processes, extra)
        except KeyboardInterrupt:
            raise dataset_runs.Interrupted(_interrupted(argv, output_dir, pairs)) from None


def _interrupted(argv: list[str], output_dir: Path | None, pairs: list[Pair]) -> str:
    """The line an interrupted run prints: what is saved, and the command that resumes it (or starts it again, when
    it was interrupted before its folder was set up: before the model was loaded)."""
    if output_dir is None:
        return "interrupted: nothing was saved (with --output-dir a run can be resumed)"
    if not (output_dir.expanduser() / MANIFEST).is_file():
        return dataset_runs.interrupted_before_start(argv, output_dir)
    ids = {p.pair_id for p in pairs}
    done = len({key[0] for key in read_shards(output_dir)} & ids)
    return (f"interrupted: {done} of {len(pairs)} pairs done and saved in {output_dir}; resume with: "
            f"{dataset_runs.rerun_line(argv, '--resume')}")  # fmt: skip


def run_pairs(
    run: DatasetRun,
    pairs: list[Pair],
    names: list[str],
    budgets: list[Budget],
    config: CaReConfig,
    *,
    model: str | None,
    device: str,
    dtype: str,
    bad: BadPairs,
    every: bool,
    quiet: bool,
    batch_size: BatchSize,
) -> dict[str, Any]:
    """The backbone loaded, then care_core.dataset_csr.dataset_csr on this process's share of the pairs (``run``
    entered); rank 0 returns the report (others {}). With 'all' (``every``), methods the backbone cannot serve are
    left out and listed under ``methods_skipped``."""
    from care_core.pipeline import ReductionPipeline

    main = run.world.is_main
    with render.status("Loading backbone (the demo is built on first use)…", quiet=quiet or not main):
        pipe = ReductionPipeline.from_pretrained(model, methods=names, config=config, device=run.device(device),
                                                 dtype=dtype, skip_unavailable=every)  # fmt: skip
    if main:
        render.print_notices(pipe.adapter.notices)
    label = "CSR" if run.world.size == 1 else f"CSR (rank 0 of {run.world.size})"
    with render.progress(label, quiet=quiet or not main) as progress:
        bar = progress.add_task("", total=None)

        def advance(done: int, total: int, name: str) -> None:
            progress.update(bar, completed=done, total=total, description=name)

        result = dataset_csr(run, pipe, pairs, budgets, batch_size=batch_size, bad=bad, on_progress=advance,
                             on_notice=_notice)  # fmt: skip
    if not main:
        return {}
    if not result.results:  # the first reason says what went wrong where every pair went the same way
        raise UserError("every pair was skipped; nothing to report" + "".join(
            f" (line {s['line']}: {s['reason']})" for s in result.skipped[:1]))  # fmt: skip
    return {
        "command": "csr",
        "backbone": pipe.backbone.to_dict(),
        "methods": result.methods,
        "methods_skipped": pipe.skipped,
        "budgets": result.budgets,
        "config": config.to_dict(),
        "seed": config.seed,
        "pairs": result.pairs,
        "processes": run.world.size,
        "batch_size": result.batch.to_dict() | {"final": result.final_batch_size},
        "compute_seconds": result.compute_seconds,
        "peak_gpu_memory_gib": result.peak_gpu_memory_gib,
        "summary": result.summary(),
        "results": result.results,
        "skipped": result.skipped,
    }


def _notice(line: str) -> None:
    render.print_notices([line])


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
