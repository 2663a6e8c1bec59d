"""`care csr`: Calibrated Semantic Retention (Supp. A) of methods x budgets, on one pair or a JSONL file."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from care_cli import options as opt
from care_cli import render
from care_cli.errors import UserError
from care_core.config import CaReConfig
from care_core.errors import ImageError, QuestionError

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
    bool, typer.Option("--skip-bad", help="Skip bad JSONL lines and list them, instead of stopping.", metavar="")
]
PLOT_FORMATS = (".png", ".pdf", ".svg")
CSV_COLUMNS = ["line", "image", "question", "backbone", "demo", "method", "budget", "N", "K", "tokens_out", "csr",
               "uniform_weights"]  # fmt: skip


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
ProcessesOpt = Annotated[
    int,
    typer.Option("--num-processes", "-n", help="Processes to split the pairs over (one GPU each on CUDA; CPU "
                                               "processes otherwise), started through torchrun."),
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
    num_processes: ProcessesOpt = 1,
    skip_bad: SkipBadOpt = False,
    force: opt.Force = False,
    json_output: opt.Json = False,
    config: CaReConfig | None = None,
) -> None:
    """CSR (x100) of each method at each budget: how much question-relevant meaning survives.

    At least one budget is required (--ratio and --keep are repeatable; --ratio A:B:STEP gives a range).
    Several budgets draw a CSR-against-budget curve with --plot.
    """
    from care_cli import runs
    from care_cli.io import check_distinct_outputs, check_output_path

    assert config is not None
    if (image is None) == (data is None):
        raise UserError("give either IMAGE with --question, or --data pairs.jsonl")
    if image is not None and question is None:
        raise UserError("IMAGE needs --question")
    opt.check_question(question)
    if data is not None and question is not None:
        raise UserError("--question goes with IMAGE; with --data each line carries its own question")
    if num_processes < 1:
        raise UserError(f"--num-processes must be at least 1, got {num_processes}")
    if resume and output_dir is None:
        raise UserError("--resume needs --output-dir (the folder of the run to continue)")
    budgets = opt.budgets(opt.parse_ratio_specs(ratio), keep)
    names, every = opt.method_names(method)
    inputs_given = [p for p in (image, data) if p is not None]
    check_distinct_outputs({"--plot": plot, "--csv": csv_path})
    plot_path = csv_file = None
    if plot is not None:
        plot_path = check_output_path(plot, inputs_given, force, option="--plot", suffixes=PLOT_FORMATS)
    if csv_path is not None:
        csv_file = check_output_path(csv_path, inputs_given, force, option="--csv", suffixes=(".csv",))
    if data is not None:
        pairs, skipped = read_pairs(data, skip_bad)
    else:
        assert image is not None and question is not None
        pairs, skipped = [Pair(None, image, question)], []
    world = runs.World.from_env()
    ident = runs.identity(model, dtype, config.to_dict())
    if output_dir is not None:
        runs.check_folder(output_dir, ident, resume)

    if num_processes > 1 and world.size == 1:  # start the processes; they do the work and rank 0 reports
        from care_cli.launch import launch, strip_option

        argv = strip_option(strip_option(ctx.obj["argv"], "--num-processes"), "-n")
        with contextlib.ExitStack() as stack:
            if output_dir is None:
                folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="care-csr-"))
                argv += ["--output-dir", folder]
            code = launch(argv, num_processes)
        raise typer.Exit(code)

    report = run_pairs(pairs, names, budgets, config, model=model, device=device, dtype=dtype, skip_bad=skip_bad,
                       every=every, quiet=json_output, folder=output_dir, world=world, ident=ident)  # fmt: skip
    if not world.is_main:
        return
    report["skipped"] = skipped + report["skipped"]
    if csv_file is not None:
        write_csv(csv_file, report)
        report["csv"] = str(csv_file)
    if plot_path is not None:
        write_plot(plot_path, report)
        report["plot"] = str(plot_path)
    if json_output:
        render.print_json(report)
    else:
        show_report(report)


def run_pairs(
    pairs: list[Pair],
    names: list[str],
    budgets: list[Any],
    config: CaReConfig,
    *,
    model: str | None,
    device: str,
    dtype: str,
    skip_bad: bool,
    every: bool,
    quiet: bool,
    folder: Path | None = None,
    world: Any = None,
    ident: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Every method x budget on every pair (this process's share of them) through the library pipeline.

    With ``folder``, finished pairs are appended to this rank's shard and results already there are not
    recomputed; rank 0 merges all shards into the report. With 'all' (``every``), methods the backbone
    cannot serve are left out and listed under ``methods_skipped``; methods named one by one must run.
    """
    from care_cli import runs
    from care_cli.io import load_image
    from care_core.pipeline import ReductionPipeline

    world = world or runs.World()
    runs.barrier(world)  # every process has checked the folder before any writes to it
    if world.size > 1:
        from care_core.backbones.loading import process_device

        device = process_device(device, world_size=world.size, local_rank=world.local_rank)
    with render.status("Loading backbone (the demo is built on first use)…", quiet=quiet or not world.is_main):
        pipe = ReductionPipeline.from_pretrained(model, methods=names, config=config, device=device, dtype=dtype,
                                                 skip_unavailable=every)  # fmt: skip
    if world.is_main:
        render.print_notices(pipe.adapter.notices)
    backbone = pipe.backbone
    methods = list(pipe.methods)
    labels = {b.label: b for b in budgets}
    ids = [runs.pair_id(p.line, p.image, p.question) for p in pairs]
    done: dict[tuple[str, str, str], dict[str, Any]] = {}
    if folder is not None:
        if world.is_main:
            runs.write_manifest(folder, ident or {}, backbone.to_dict())
        runs.barrier(world)
        done = runs.read_shards(folder)
    mine = world.take(list(zip(ids, pairs, strict=True)))
    todo = []
    for pid, pair in mine:
        plan = {m: [b for b in budgets if (pid, m, b.label) not in done] for m in methods}
        if any(plan.values()):
            todo.append((pid, pair, plan))
    fresh: dict[tuple[str, str, str], dict[str, Any]] = {}
    skipped: list[dict[str, Any]] = []
    label = "CSR" if world.size == 1 else f"CSR (rank 0 of {world.size})"
    with contextlib.ExitStack() as stack, render.progress(label, quiet=quiet or not world.is_main) as progress:
        shard = stack.enter_context(runs.shard(folder, world)) if folder is not None else None
        task = progress.add_task("", total=len(todo))
        for pid, pair, plan in todo:
            where = f"{pair.image}" if pair.line is None else f"line {pair.line} ({pair.image})"
            progress.update(task, description=pair.image.name)
            try:
                picture = load_image(pair.image)
                output = pipe(picture, pair.question, budgets, csr=True, plan=plan)
            except (UserError, ImageError, QuestionError) as exc:
                if not skip_bad or pair.line is None:
                    raise UserError(f"{where}: {exc}") from exc
                skipped.append({"line": pair.line, "reason": str(exc)})
                progress.advance(task)
                continue
            records = [{
                "pair_id": pid, "line": pair.line, "image": str(pair.image), "question": pair.question,
                "backbone": backbone.name, "demo": backbone.demo,
                "method": run.method, "budget": run.budget.label, "N": output.num_tokens, "K": run.keep,
                "tokens_out": run.result.num_tokens, "csr": _x100(run.csr), "uniform_weights": run.uniform_weights,
            } for run in output.runs]  # fmt: skip
            if shard is not None:
                shard.append(records)
            fresh.update((runs.result_key(r), r) for r in records)
            progress.advance(task)
    if folder is not None:
        runs.barrier(world)  # every shard is complete
        if not world.is_main:
            runs.finish(world)
            return {}
        done = runs.read_shards(folder)
        runs.finish(world)
    else:
        done = fresh
    results = []
    for pid in ids:
        for name in methods:
            for budget in labels:
                record = done.get((pid, name, budget))
                if record is not None:
                    results.append({k: v for k, v in record.items() if k != "pair_id"})
    if not results:
        raise UserError("every pair was skipped; nothing to report")
    reported_pairs = {r["line"] if r["line"] is not None else r["image"] for r in results}
    return {
        "command": "csr",
        "backbone": backbone.to_dict(),
        "methods": methods,
        "methods_skipped": pipe.skipped,
        "budgets": list(labels),
        "config": config.to_dict(),
        "seed": config.seed,
        "pairs": len(reported_pairs),
        "processes": world.size,
        "summary": summarise(results, methods, list(labels)),
        "results": results,
        "skipped": skipped,
    }


def _x100(csr: float | None) -> float:
    if csr is None:
        raise AssertionError("the pipeline ran with csr=True, so every run has a CSR")
    return 100 * csr


def summarise(results: list[dict[str, Any]], names: list[str], budgets: list[str]) -> list[dict[str, Any]]:
    """Per method x budget, in the order given: mean, population std, count of 100 x CSR, the half-width of
    its 95% confidence interval (normal approximation, sample std; 0 for one pair) and the mean kept share."""
    rows = []
    for name in names:
        for budget in budgets:
            chosen = [r for r in results if r["method"] == name and r["budget"] == budget]
            if not chosen:
                continue
            values = [r["csr"] for r in chosen]
            n = len(values)
            ci95 = 1.96 * statistics.stdev(values) / math.sqrt(n) if n > 1 else 0.0
            rows.append({"method": name, "budget": budget, "mean": statistics.fmean(values),
                         "std": statistics.pstdev(values) if n > 1 else 0.0, "n": n, "ci95": ci95,
                         "kept_pct": statistics.fmean(100 * r["K"] / r["N"] for r in chosen)})  # fmt: skip
    return rows


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
