"""`care eval`: benchmark accuracy of the unreduced model and of each method x budget with lmms-eval, in-process.

The backbone is loaded once; lmms-eval's ``simple_evaluate`` runs once per setting (all visual tokens first, then
every method at every budget) on the same documents, with a care model object around the loaded backbone. With
``--num-processes N`` torchrun starts N copies (data-parallel: each answers every N-th document; rank 0 gathers,
reports and writes). ``--output-dir`` keeps lmms-eval's result files, its response cache (a rerun answers only the
samples still missing, after any kill) and one summary JSON.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from care_cli import dataset_runs, render
from care_cli import options as opt
from care_cli.errors import UserError
from care_core.batch_sizes import parse_batch_size
from care_core.config import CaReConfig
from care_core.integrations import missing_task_path

if TYPE_CHECKING:
    from lmms_eval.tasks import TaskManager
    from rich.progress import Progress, TaskID

    from care_core.backbones.base import VLMAdapter
    from care_core.batch_sizes import BatchSize
    from care_core.budget import Budget
    from care_core.integrations.lmms_eval import SampleRecord, SettingRun, TaskSelection
    from care_core.integrations.settings import EvalSpec
    from care_core.runs import DatasetRun, Key, Processes

SUMMARY = "care_eval_summary.json"
CACHE_RUN_ID = "care-eval"  # fixed: a rerun's ranks reopen the databases a killed run left
SAMPLES = "samples"  # per-sample records (visual tokens, seconds): a resumed run reports those of cached answers
SAMPLES_FORMAT = "care.eval-samples/1"
SAMPLE_KEY = ("fingerprint", "task", "doc_id")
CACHE = "cache"  # lmms-eval's response cache
LMMS_FILES = "lmms_eval"  # lmms-eval's result files, a folder per setting
OUTPUT_FOLDERS = (SAMPLES, CACHE, LMMS_FILES)  # what a run writes in --output-dir, beside SUMMARY

TasksOpt = Annotated[
    list[str],
    typer.Option("--tasks", "-t", metavar="TASKS",
                 help="lmms-eval task names, local task folders or task YAML files; comma-separated and/or "
                      "repeatable (e.g. pope,gqa, or a folder in examples/tasks/).", show_default=False),
]  # fmt: skip
LimitOpt = Annotated[
    float | None, typer.Option("--limit", help="Documents per task: N (>= 1), or a fraction of the task (< 1).")
]
OutputDirOpt = Annotated[
    Path | None,
    typer.Option("--output-dir", "-o", help="Folder for lmms-eval's result files (per setting), its response cache "
                                            f"(a rerun resumes) and {SUMMARY}."),
]  # fmt: skip
MethodsOpt = Annotated[
    list[str] | None,
    typer.Option("--method", help="Method (repeatable; see 'care methods'), or 'all' for every method the backbone "
                                  "serves. The unreduced model is always evaluated too. Default: care.",
                 metavar="NAME"),
]  # fmt: skip
VerboseOpt = Annotated[bool, typer.Option("--verbose", help="Show lmms-eval's own log lines.", metavar="")]


def _split_tasks(values: list[str]) -> list[str]:
    """The --tasks entries, comma-separated ones split; a path that does not exist is refused here, before
    lmms-eval (seconds to import) is loaded."""
    out = [part.strip() for value in values for part in value.split(",") if part.strip()]
    if not out:
        raise UserError("--tasks: give at least one task")
    for spec in out:
        missing = missing_task_path(spec)
        if missing:
            raise UserError(f"--tasks {missing}")
    return list(dict.fromkeys(out))


@opt.with_config
def eval_command(
    ctx: typer.Context,
    tasks: TasksOpt,
    method: MethodsOpt = None,
    keep: opt.Keeps = None,
    ratio: opt.RatioSpecs = None,
    model: opt.Model = None,
    device: opt.Device = "auto",
    dtype: opt.Dtype = "auto",
    limit: LimitOpt = None,
    output_dir: OutputDirOpt = None,
    num_processes: dataset_runs.ProcessesOpt = 1,
    cuda_graphs: opt.CudaGraphs = None,
    batch_size: opt.BatchSize = "auto",
    verbose: VerboseOpt = False,
    json_output: opt.Json = False,
    config: CaReConfig | None = None,
) -> None:
    """Accuracy on lmms-eval tasks with all visual tokens and with each method at each budget (--keep/--ratio).

    Prints one table per task: the metric with all tokens, per method x budget, its retention (% of the unreduced
    metric), the visual tokens the language model saw and the seconds per sample.
    """
    from care_core.integrations import broken_torchvision, lmms_eval_missing
    from care_core.runs import Processes

    assert config is not None
    task_specs = _split_tasks(tasks)
    if limit is not None and (not math.isfinite(limit) or limit <= 0 or (limit > 1 and limit != int(limit))):
        raise UserError(f"--limit must be a whole number of documents or a fraction in (0, 1), got {limit:g}")
    dataset_runs.check_processes(num_processes)
    requested = parse_batch_size(batch_size)  # read once here; passed down as it is
    names, every = opt.method_names(method)
    specs = _specs(model, names, opt.budgets(opt.parse_ratio_specs(ratio), keep), device, dtype, config, cuda_graphs)
    for problem in (lmms_eval_missing(), broken_torchvision()):
        if problem:
            raise UserError(problem)
    from care_core.integrations import lmms_eval as plugin

    processes = Processes()
    argv = ctx.obj["argv"]
    with plugin.quiet(verbose):
        selection = plugin.select_tasks(task_specs)
        if output_dir is not None:
            _check_output_dir(output_dir, selection)
        try:
            if num_processes > 1 and processes.world.size == 1:
                plugin.task_manager(selection)  # unknown tasks fail here, once, before the processes start
                raise typer.Exit(dataset_runs.relaunch(argv, num_processes))
            with processes:
                report = run_eval(specs, selection, limit=limit, folder=output_dir, every=every, quiet=json_output,
                                  processes=processes, batch_size=requested)  # fmt: skip
        except KeyboardInterrupt:
            raise dataset_runs.Interrupted(_interrupted(argv, output_dir, processes.world.size)) from None
    if processes.world.is_main:
        if json_output:
            render.print_json(report)
        else:
            show_report(report)


def _specs(
    model: str | None, names: list[str], budgets: list[Budget], device: str, dtype: str, config: CaReConfig,
    cuda_graphs: bool | None,
) -> list[EvalSpec]:  # fmt: skip
    """The settings to evaluate: all visual tokens first, then every method at every budget."""
    import dataclasses

    from care_core.backbones.families import DEFAULT_DEMO
    from care_core.integrations.settings import EvalSpec

    base = EvalSpec(pretrained=model or DEFAULT_DEMO, method=None, device=device, dtype=dtype, config=config,
                    cuda_graph=cuda_graphs)  # fmt: skip
    specs = [base]
    for name in names:
        for budget in budgets:
            if budget.kind == "keep":
                specs.append(dataclasses.replace(base, method=name, keep=int(budget.value)))
            else:
                specs.append(dataclasses.replace(base, method=name, ratio=float(budget.value)))
    return specs


def _interrupted(argv: list[str], output_dir: Path | None, processes: int) -> str | None:
    """The line an interrupted run prints (None in a launched process: the launcher says it)."""
    if processes > 1:
        return None
    if output_dir is None:
        return "interrupted: nothing was saved (with --output-dir a rerun answers only what is missing)"
    from care_core.runs import MANIFEST

    if not (output_dir.expanduser() / SAMPLES / MANIFEST).is_file():  # the run had not set up its folder yet
        return dataset_runs.interrupted_before_start(argv, output_dir)
    return (f"interrupted: the answers so far are saved in {output_dir}; resume with: "
            f"{dataset_runs.rerun_line(argv)}")  # fmt: skip


def _check_output_dir(folder: Path, selection: TaskSelection) -> None:
    """A folder that is no task folder and holds no task file, never an input, and that can be created (with its
    missing parents, as ``mkdir -p``; nothing is created until the run has its tasks and model) and written in,
    down to what the run writes inside it."""
    from care_cli.io import check_output_folder

    target = check_output_folder(folder, folders=OUTPUT_FOLDERS, files=(SUMMARY,))
    for path in selection.include_paths:
        source = Path(path).resolve()
        if target == source or source in target.parents or target in source.parents:
            raise UserError(f"--output-dir {folder}: overlaps the task folder {source}; use another folder")


def run_eval(
    specs: list[EvalSpec],
    selection: TaskSelection,
    *,
    limit: float | None,
    folder: Path | None,
    every: bool,
    quiet: bool,
    processes: Processes,
    batch_size: BatchSize,
) -> dict[str, Any]:
    """Evaluate every setting on this process's share of the documents; rank 0 returns the report (others {}).

    ``batch_size``: a number is used by every setting, and a setting whose batches had to be split for memory hands
    its smaller size on to the next; auto is resolved per setting, for the tokens its answers read."""
    from care_core.integrations import lmms_eval as plugin
    from care_core.pipeline import backbone_info
    from care_core.runs import DatasetRun

    main = processes.world.is_main
    folder = folder.expanduser().resolve() if folder is not None else None
    with render.status("Loading backbone (the demo is built on first use)…", quiet=quiet or not main):
        adapter = plugin.load_adapter(specs[0])  # the model is checked before the tasks (which may need the hub)
    if main:
        render.print_notices(adapter.notices)
    manager = plugin.task_manager(selection)
    if main:  # rank 0 builds the tasks first (datasets cache), the others then read them
        plugin.load_tasks(selection.names, manager)
    processes.barrier()
    if not main:
        plugin.load_tasks(selection.names, manager)
    specs, skipped = _servable(specs, adapter, every)
    samples = DatasetRun(folder / SAMPLES if folder is not None else None, manifest={}, resume=True, key=SAMPLE_KEY,
                         run_format=SAMPLES_FORMAT, processes=processes)  # fmt: skip
    with samples:
        samples.start()  # creates the output folder: nothing is created before the tasks and model are known
        ran = _evaluate(specs, selection, manager, adapter, samples, limit=limit, folder=folder, quiet=quiet,
                        batch_size=batch_size)  # fmt: skip
        records = samples.merge()
    if not main:
        return {}
    settings = [_setting_report(run, _chosen(records, run.spec), selection.names, folder)
                | {"batch_size_start": run.batch.size, "batch_size": run.final_batch_size,
                   "peak_gpu_memory_gib": run.peak_gpu_memory_gib, "input_wait_seconds": run.input_wait_seconds}
                for run in ran]  # fmt: skip
    # the run's batch size: the first setting's (all tokens), with the device rule's pick for it
    return _report(settings, selection, backbone_info(adapter).to_dict(), specs, skipped, limit, processes, folder,
                   warm_up=ran[0].warmed_up, batch=ran[0].batch.to_dict())  # fmt: skip


def _servable(specs: list[EvalSpec], adapter: VLMAdapter, every: bool) -> tuple[list[EvalSpec], list[dict[str, str]]]:
    """The settings the backbone can serve; with 'all', the others are left out and listed."""
    from care_core.integrations import lmms_eval as plugin
    from care_core.pipeline import method_unavailable

    skipped: list[dict[str, str]] = []
    if every:
        kept = []
        for spec in specs:
            reason = None if spec.method is None else method_unavailable(spec.method, spec.config, adapter)
            if spec.method is None or reason is None:
                kept.append(spec)
            elif spec.method not in {s["method"] for s in skipped}:
                skipped.append({"method": spec.method, "reason": reason})
        specs = kept
    plugin.check_methods(specs, adapter)
    return specs, skipped


def _evaluate(
    specs: list[EvalSpec], selection: TaskSelection, manager: TaskManager, adapter: VLMAdapter, samples: DatasetRun, *,
    limit: float | None, folder: Path | None, quiet: bool, batch_size: BatchSize,
) -> list[SettingRun]:  # fmt: skip
    """Every setting in turn (care_core.integrations.lmms_eval.evaluate_setting), each answered sample's record
    saved as it comes; a number of ``batch_size`` split for memory is handed on to the next setting."""
    from care_core.integrations import lmms_eval as plugin
    from care_core.runs import scoped_environ

    processes = samples.processes
    cache_root = folder / CACHE if folder is not None else None
    if cache_root is not None and processes.world.is_main:
        cache_root.mkdir(exist_ok=True)
        plugin.merge_leftover_cache(cache_root)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    saved = _saved_answers(samples)  # read once: this run's own records belong to settings already finished
    ran = []
    with (
        render.progress("care eval", quiet=quiet or not processes.world.is_main) as progress,
        scoped_environ(LMMS_CACHE_RUN_ID=CACHE_RUN_ID),
    ):  # fixed: a rerun's ranks reopen a killed run's databases
        bar = progress.add_task("", total=None)
        for number, spec in enumerate(specs, start=1):
            progress.update(bar, description=f"{spec.label} ({number}/{len(specs)})", completed=0, total=None)
            run = plugin.evaluate_setting(spec, adapter, selection, manager, processes, batch_size=batch_size,
                                          limit=limit, cache=cache_root, stamp=stamp,
                                          on_batch=_saver(samples, spec, progress, bar), on_notice=_notice,
                                          answered=saved.get(spec.fingerprint(), {}))  # fmt: skip
            batch_size = batch_size.at_most(run.final_batch_size)
            ran.append(run)
    return ran


def _saved_answers(samples: DatasetRun) -> dict[str, dict[tuple[str, int], str]]:
    """The answers the output folder's records hold, by setting fingerprint, then (task, document): a killed or
    interrupted run saved each answered batch there, while lmms-eval's response cache keeps a setting's answers only
    once all of them are in, so a rerun takes these instead of computing them again."""
    saved: dict[str, dict[tuple[str, int], str]] = {}
    for record in samples.records().values():
        document = (str(record["task"]), int(record["doc_id"]))
        saved.setdefault(str(record["fingerprint"]), {})[document] = str(record["answer"])
    return saved


def _notice(line: str) -> None:
    render.print_notices([line])


def _saver(
    samples: DatasetRun, spec: EvalSpec, progress: Progress, bar: TaskID
) -> Callable[[int, int, list[SampleRecord]], None]:
    """The per-batch hook: save the answered samples' records (visual tokens, seconds; one write and fsync per
    batch) and move the bar."""
    fingerprint = spec.fingerprint()

    def on_batch(done: int, total: int, records: list[SampleRecord]) -> None:
        samples.append([{"fingerprint": fingerprint, "setting": spec.label, **vars(record)} for record in records])
        progress.update(bar, completed=done, total=total)

    return on_batch


def _chosen(records: dict[Key, dict[str, Any]], spec: EvalSpec) -> list[dict[str, Any]]:
    """The saved sample records of one setting (this run's and earlier runs' in the same folder)."""
    fingerprint = spec.fingerprint()
    return [r for r in records.values() if r["fingerprint"] == fingerprint]


def _report(
    settings: list[dict[str, Any]], selection: TaskSelection, backbone: dict[str, Any], specs: list[EvalSpec],
    skipped: list[dict[str, str]], limit: float | None, processes: Processes, folder: Path | None, *, warm_up: bool,
    batch: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    report = {
        "command": "eval",
        "backbone": backbone,
        "tasks": list(selection.names),
        "limit": limit,
        "processes": processes.world.size,
        "warm_up": warm_up,
        # what was asked for ("requested"), the size used by every setting where it was a number ("batch_size"),
        # and the device rule's pick with all tokens ("default"); per setting its own at its start and end
        "batch_size": batch,
        "config": specs[0].config.to_dict(),
        "methods_skipped": skipped,
        "settings": settings,
        "tables": _tables(settings, selection.names),
        "output_dir": str(folder) if folder is not None else None,
    }
    if folder is not None:
        from care_cli.io import atomic_write_text

        summary = folder / SUMMARY
        report["summary"] = str(summary)
        atomic_write_text(summary, json.dumps(report, indent=2, default=str) + "\n")
    return report


def _setting_report(
    run: SettingRun, records: list[dict[str, Any]], tasks: list[str], folder: Path | None
) -> dict[str, Any]:
    """One setting: metrics, answers, visual tokens and timings per task; lmms-eval's files when ``folder``.
    ``run.computed``: per task the documents answered now, and how many of those failed (answered with an empty
    string; the response cache keeps no empty answer, so a rerun answers them again).

    Visual tokens and seconds are those of the samples answered now or, for answers from the response cache, when
    they were answered (the records saved in ``folder``)."""
    from care_core.integrations import lmms_eval as plugin

    spec, results, computed = run.spec, run.results, run.computed
    per_task: dict[str, Any] = {}
    for task in tasks:
        answers = plugin.sample_answers(results, task)
        mine = [r for r in records if r["task"] == task and str(r["doc_id"]) in answers]
        fed = [r["visual_tokens"] for r in mine]
        seconds = [r["seconds"] for r in mine]
        per_task[task] = {
            "metrics": plugin.task_metrics(results, task),
            "metric_order": plugin.primary_metrics(results, task),
            "samples": len(answers),
            "computed": computed.get(task, (0, 0))[0],  # answered now; the rest came from the response cache
            "failed_samples": computed.get(task, (0, 0))[1],  # answered with an empty string: the sample failed
            "visual_tokens": sum(fed) / len(fed) if fed else None,
            "num_tokens": (sum(r["num_tokens"] for r in mine) / len(mine)) if mine else None,
            "seconds_per_sample": sum(seconds) / len(seconds) if seconds else None,
            "seconds_per_sample_median": statistics.median(seconds) if seconds else None,
            "answers": answers,
        }
    files: list[str] = []
    if folder is not None:
        files = _write_lmms_files(folder / LMMS_FILES / spec.slug, spec, results)
    samples = sum(t["samples"] for t in per_task.values())
    return {
        "setting": spec.label,
        "method": spec.method,
        "keep": spec.keep,
        "ratio": spec.ratio,
        "model_args": spec.model_args_string(),
        "wall_seconds": run.wall_seconds,
        "samples_per_second": samples / run.wall_seconds if run.wall_seconds > 0 else None,
        "tasks": per_task,
        "result_files": files,
    }


def _write_lmms_files(path: Path, spec: EvalSpec, results: dict[str, Any]) -> list[str]:
    """lmms-eval's own ``<date>_results.json`` and ``<date>_samples_<task>.jsonl``, as its CLI writes them."""
    from lmms_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=str(path))
    tracker.general_config_tracker.log_experiment_args(model_source="care", model_args=spec.model_args_string(),
                                                       system_instruction=None, chat_template=None,
                                                       fewshot_as_multiturn=False)  # fmt: skip
    results = dict(results)
    samples = results.pop("samples", {})
    copies = {task: [dict(s) for s in items] for task, items in samples.items()}
    tracker.save_results_aggregated(results=results, samples=copies, datetime_str=results.get("date") or "run")
    for task in results.get("configs", {}):
        if task in copies:
            tracker.save_results_samples(task_name=task, samples=copies[task])
    return sorted(str(p) for p in path.rglob("*") if p.is_file())


def _tables(settings: list[dict[str, Any]], tasks: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Per task, one row per setting: the primary metric, its retention against all tokens, tokens and time."""
    tables: dict[str, list[dict[str, Any]]] = {}
    for task in tasks:
        base = next((s for s in settings if s["method"] is None), None)
        order = (base or settings[0])["tasks"][task]["metric_order"] if settings else []
        metric = order[0] if order else None
        base_value = base["tasks"][task]["metrics"].get(metric) if base and metric else None
        rows = []
        for setting in settings:
            entry = setting["tasks"][task]
            value = entry["metrics"].get(metric) if metric else None
            retention = None
            if value is not None and base_value:
                retention = 100.0 * value / base_value
            rows.append({"setting": setting["setting"], "method": setting["method"] or "none",
                         "budget": _budget_label(setting), "metric": metric, "value": value, "retention": retention,
                         "visual_tokens": entry["visual_tokens"], "seconds_per_sample": entry["seconds_per_sample"],
                         "samples": entry["samples"], "computed": entry["computed"]})  # fmt: skip
        tables[task] = rows
    return tables


def _budget_label(setting: dict[str, Any]) -> str:
    if setting["method"] is None:
        return "all"
    return f"K={setting['keep']}" if setting["keep"] is not None else f"ratio {setting['ratio']:g}"


def show_report(report: dict[str, Any]) -> None:
    from care_cli import tables

    tables.print_eval(report)
    batch = report["batch_size"]
    if batch["requested"] == "auto":  # resolved per setting, for the tokens its answers read
        picked = "; ".join(f"{s['setting'] if s['method'] else 'all tokens'} {s['batch_size_start']}"
                           for s in report["settings"])  # fmt: skip
        render.stdout.print(f"batch size auto, per setting: {picked}", highlight=False)
    else:
        render.stdout.print(f"batch size {batch['batch_size']} (auto here: {batch['default']} with all tokens)",
                            highlight=False)  # fmt: skip
    for item in report["methods_skipped"]:
        render.stderr.print(f"[yellow]left out {item['method']}:[/] {item['reason']}")
    failed = sum(task["failed_samples"] for setting in report["settings"] for task in setting["tasks"].values())
    if failed:
        counted = "1 sample failed and was" if failed == 1 else f"{failed} samples failed and were"
        render.stderr.print(f"[yellow]{counted}[/] answered with an empty string, scored as a wrong answer (named "
                            "above)")  # fmt: skip
    if report.get("summary"):
        render.stdout.print(
            f"wrote {report['summary']} (lmms-eval's files under {report['output_dir']}/lmms_eval)", soft_wrap=True
        )
