"""`care eval`: benchmark accuracy of the unreduced model and of each method x budget with lmms-eval, in-process.

The backbone is loaded once; lmms-eval's ``simple_evaluate`` runs once per setting (all visual tokens first, then
every method at every budget) on the same documents, with a care model object around the loaded backbone. With
``--num-processes N`` torchrun starts N copies (data-parallel: each answers every N-th document; rank 0 gathers,
reports and writes). ``--output-dir`` keeps lmms-eval's result files, its response cache (a rerun answers only the
samples still missing, after any kill) and one summary JSON.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from care_cli import options as opt
from care_cli import render
from care_cli.errors import UserError
from care_core.config import CaReConfig

SUMMARY = "care_eval_summary.json"
CACHE_RUN_ID = "care-eval"  # fixed: a rerun's ranks reopen the databases a killed run left

TasksOpt = Annotated[
    list[str],
    typer.Option("--tasks", "-t", metavar="TASKS",
                 help="lmms-eval task names, local task folders or task YAML files; comma-separated and/or "
                      "repeatable (e.g. pope,gqa or examples/tasks/care_pope_examples).", show_default=False),
]  # fmt: skip
LimitOpt = Annotated[
    float | None, typer.Option("--limit", help="Documents per task: N (>= 1), or a fraction of the task (< 1).")
]
OutputDirOpt = Annotated[
    Path | None,
    typer.Option("--output-dir", "-o", help="Folder for lmms-eval's result files (per setting), its response cache "
                                            f"(a rerun resumes) and {SUMMARY}."),
]  # fmt: skip
ProcessesOpt = Annotated[
    int,
    typer.Option("--num-processes", "-n", help="Data-parallel processes (one GPU each on CUDA; CPU processes "
                                               "otherwise), started through torchrun."),
]  # fmt: skip
MethodsOpt = Annotated[
    list[str] | None,
    typer.Option("--method", help="Method (repeatable; see 'care methods'), or 'all' for every method the backbone "
                                  "serves. The unreduced model is always evaluated too. Default: care.",
                 metavar="NAME"),
]  # fmt: skip
VerboseOpt = Annotated[bool, typer.Option("--verbose", help="Show lmms-eval's own log lines.", metavar="")]


def _split_tasks(values: list[str]) -> list[str]:
    out = [part.strip() for value in values for part in value.split(",") if part.strip()]
    if not out:
        raise UserError("--tasks: give at least one task")
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
    num_processes: ProcessesOpt = 1,
    cuda_graphs: opt.CudaGraphs = None,
    verbose: VerboseOpt = False,
    json_output: opt.Json = False,
    config: CaReConfig | None = None,
) -> None:
    """Accuracy on lmms-eval tasks with all visual tokens and with each method at each budget (--keep/--ratio).

    Prints one table per task: the metric with all tokens, per method x budget, its retention (% of the unreduced
    metric), the visual tokens the language model saw and the seconds per sample.
    """
    from care_cli import runs
    from care_core.backbones.families import DEFAULT_DEMO
    from care_core.integrations import broken_torchvision, lmms_eval_missing
    from care_core.integrations.settings import EvalSpec

    assert config is not None
    task_specs = _split_tasks(tasks)
    if limit is not None and (not math.isfinite(limit) or limit <= 0 or (limit > 1 and limit != int(limit))):
        raise UserError(f"--limit must be a whole number of documents or a fraction in (0, 1), got {limit:g}")
    if num_processes < 1:
        raise UserError(f"--num-processes must be at least 1, got {num_processes}")
    budgets = opt.budgets(opt.parse_ratio_specs(ratio), keep)
    names, every = opt.method_names(method)
    missing = lmms_eval_missing()
    if missing:
        raise UserError(missing)
    broken = broken_torchvision()
    if broken:
        raise UserError(broken)
    pretrained = model or DEFAULT_DEMO
    specs = [EvalSpec(pretrained=pretrained, method=None, device=device, dtype=dtype, config=config,
                      cuda_graph=cuda_graphs)]  # fmt: skip
    for name in names:
        for budget in budgets:
            size = {"keep": int(budget.value)} if budget.kind == "keep" else {"ratio": float(budget.value)}
            specs.append(EvalSpec(pretrained=pretrained, method=name, device=device, dtype=dtype, config=config,
                                  cuda_graph=cuda_graphs, **size))  # fmt: skip
    _quiet_lmms_eval(verbose)
    from care_core.integrations import lmms_eval as plugin

    selection = plugin.select_tasks(task_specs)
    if output_dir is not None:
        _check_output_dir(output_dir, selection)
    world = runs.World.from_env()
    if num_processes > 1 and world.size == 1:
        from care_cli.launch import launch, strip_option

        plugin.task_manager(selection)  # unknown tasks fail here, once, before the processes start
        argv = strip_option(strip_option(ctx.obj["argv"], "--num-processes"), "-n")
        raise typer.Exit(launch(argv, num_processes))
    report = run_eval(specs, selection, limit=limit, folder=output_dir, every=every, quiet=json_output, world=world)
    if not world.is_main:
        return
    if json_output:
        render.print_json(report)
    else:
        show_report(report)


def _quiet_lmms_eval(verbose: bool) -> None:
    """lmms-eval logs to stdout through loguru: send it to stderr (errors only unless --verbose); no tqdm bars."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if not verbose:
        os.environ.setdefault("TQDM_DISABLE", "1")
    import lmms_eval.models  # noqa: F401  (adds its stdout sink on import; replaced below)
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="INFO" if verbose else "ERROR", format="{level}: {message}")
    if not verbose:  # lmms-eval's own bars ("Postprocessing", request building) pass disable= and ignore TQDM_DISABLE
        import lmms_eval.api.task as task_module
        import lmms_eval.evaluator as evaluator
        from tqdm import tqdm

        def silent_tqdm(*args: Any, **kwargs: Any) -> Any:
            kwargs["disable"] = True
            return tqdm(*args, **kwargs)

        evaluator.tqdm = silent_tqdm
        task_module.tqdm = silent_tqdm  # type: ignore[attr-defined]
    with contextlib.suppress(Exception):
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()


def _check_output_dir(folder: Path, selection: Any) -> None:
    """A folder (created if missing) that is no task folder and holds no task file; never an input."""
    target = folder.expanduser().resolve()
    if target.exists() and not target.is_dir():
        raise UserError(f"--output-dir {folder}: is a file, expected a folder")
    for path in selection.include_paths:
        source = Path(path).resolve()
        if target == source or source in target.parents or target in source.parents:
            raise UserError(f"--output-dir {folder}: overlaps the task folder {source}; use another folder")
    if not target.parent.exists():
        raise UserError(f"--output-dir {folder}: folder {target.parent} does not exist")


def _init_distributed(world: Any) -> None:
    """One process group for lmms-eval's gathers: NCCL between GPUs, gloo on the CPU."""
    if world.size == 1:
        return
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        from care_core.backbones.loading import process_device

        mine = torch.device(process_device("cuda", world_size=world.size, local_rank=world.local_rank))
        torch.cuda.set_device(mine)
        dist.init_process_group("nccl", device_id=mine)
    else:
        dist.init_process_group("gloo")


def _barrier(world: Any) -> None:
    if world.size > 1:
        import torch.distributed as dist

        dist.barrier()


def _gather(world: Any, value: Any) -> list[Any]:
    if world.size == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, value)
    return out


def run_eval(
    specs: list[Any],
    selection: Any,
    *,
    limit: float | None,
    folder: Path | None,
    every: bool,
    quiet: bool,
    world: Any,
) -> dict[str, Any]:
    """Evaluate every setting on this process's share of the documents; rank 0 returns the report (others {})."""
    from lmms_eval.evaluator import simple_evaluate

    from care_core.integrations import lmms_eval as plugin
    from care_core.pipeline import backbone_info

    _init_distributed(world)
    manager = plugin.task_manager(selection)
    cache_root = None
    if folder is not None:
        folder = folder.expanduser().resolve()
        cache_root = folder / "cache"
        if world.is_main:
            folder.mkdir(parents=True, exist_ok=True)
            cache_root.mkdir(exist_ok=True)
            plugin.merge_leftover_cache(cache_root)
        os.environ["LMMS_CACHE_RUN_ID"] = CACHE_RUN_ID
    # rank 0 builds the tasks first (datasets cache), the others then read them; errors surface before the model loads
    if world.is_main:
        plugin.load_tasks(selection.names, manager)
    _barrier(world)
    if not world.is_main:
        plugin.load_tasks(selection.names, manager)
    with render.status("Loading backbone (the demo is built on first use)…", quiet=quiet or not world.is_main):
        adapter = plugin.load_adapter(specs[0])
    skipped: list[dict[str, str]] = []
    if every:
        from care_core.pipeline import method_unavailable

        kept = []
        for spec in specs:
            reason = None if spec.method is None else method_unavailable(spec.method, spec.config, adapter)
            if reason is None:
                kept.append(spec)
            elif spec.method not in {s["method"] for s in skipped}:
                skipped.append({"method": spec.method, "reason": reason})
        specs = kept
    plugin.check_methods(specs, adapter)
    backbone = backbone_info(adapter).to_dict()
    settings: list[dict[str, Any]] = []
    # on a GPU each setting first answers once untimed, so that seconds per sample are the steady state
    warm_up = adapter.device.type == "cuda"
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    with render.progress("care eval", quiet=quiet or not world.is_main) as progress:
        bar = progress.add_task("", total=None)
        for number, spec in enumerate(specs, start=1):
            progress.update(bar, description=f"{spec.label} ({number}/{len(specs)})", completed=0, total=None)

            def on_sample(done: int, total: int, bar: Any = bar) -> None:
                progress.update(bar, completed=done, total=total)

            lm = plugin.CareLMM.from_spec(spec, adapter, on_sample=on_sample)
            if warm_up:
                lm.warm_up()
            start = time.perf_counter()
            results = simple_evaluate(
                model=lm, model_args=spec.model_args_string(), tasks=list(selection.names), task_manager=manager,
                limit=limit, use_cache=str(cache_root) if cache_root is not None else None, log_samples=True,
                bootstrap_iters=1000, verbosity="ERROR", distributed_executor_backend="torchrun",
                process_docs_parallel=1, datetime_str=stamp,
            )  # fmt: skip
            wall = time.perf_counter() - start
            records = [r for part in _gather(world, [vars(r) for r in lm.records]) for r in part]
            _barrier(world)  # rank 0 has merged this setting's cache before anyone opens it again
            if world.is_main:
                settings.append(_setting_report(spec, results, records, wall, selection.names, folder))
    if not world.is_main:
        return {}
    report = {
        "command": "eval",
        "backbone": backbone,
        "tasks": list(selection.names),
        "limit": limit,
        "processes": world.size,
        "warm_up": warm_up,
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
    spec: Any, results: dict[str, Any], records: list[dict[str, Any]], wall: float, tasks: list[str],
    folder: Path | None,
) -> dict[str, Any]:  # fmt: skip
    """One setting: metrics, answers, visual tokens and timings per task; lmms-eval's files when ``folder``."""
    from care_core.integrations import lmms_eval as plugin

    per_task: dict[str, Any] = {}
    for task in tasks:
        mine: dict[Any, Any] = {}
        for record in records:  # padding copies of a document on other ranks repeat its record: keep the first
            if record["task"] == task:
                mine.setdefault(record["doc_id"], record)
        answers = plugin.sample_answers(results, task)
        fed = [r["visual_tokens"] for r in mine.values()]
        seconds = [r["seconds"] for r in mine.values()]
        per_task[task] = {
            "metrics": plugin.task_metrics(results, task),
            "metric_order": plugin.primary_metrics(results, task),
            "samples": len(answers),
            "computed": len(mine),  # answered now; the rest came from the response cache
            "visual_tokens": sum(fed) / len(fed) if fed else None,
            "num_tokens": (sum(r["num_tokens"] for r in mine.values()) / len(mine)) if mine else None,
            "seconds_per_sample": sum(seconds) / len(seconds) if seconds else None,
            "seconds_per_sample_median": statistics.median(seconds) if seconds else None,
            "answers": answers,
        }
    files: list[str] = []
    if folder is not None:
        files = _write_lmms_files(folder / "lmms_eval" / spec.slug, spec, results)
    samples = sum(t["samples"] for t in per_task.values())
    return {
        "setting": spec.label,
        "method": spec.method,
        "keep": spec.keep,
        "ratio": spec.ratio,
        "model_args": spec.model_args_string(),
        "wall_seconds": wall,
        "samples_per_second": samples / wall if wall > 0 else None,
        "tasks": per_task,
        "result_files": files,
    }


def _write_lmms_files(path: Path, spec: Any, results: dict[str, Any]) -> list[str]:
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
    for item in report["methods_skipped"]:
        render.stderr.print(f"[yellow]left out {item['method']}:[/] {item['reason']}")
    if report.get("summary"):
        render.stdout.print(f"wrote {report['summary']} (lmms-eval's files under {report['output_dir']}/lmms_eval)")
