"""`care csr`: Calibrated Semantic Retention (Supp. A) of methods x budgets, on one pair or a JSONL file."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from care_cli import options as opt
from care_cli import render
from care_cli.errors import UserError

ImageArg = Annotated[
    Path | None, typer.Argument(help="One image (with --question); or use --data.", show_default=False)
]
QuestionOpt = Annotated[str | None, typer.Option("--question", "-q", help="The question for IMAGE.")]
DataOpt = Annotated[
    Path | None,
    typer.Option("--data", help='JSONL of {"image": ..., "question": ...}; image paths relative to the file.'),
]
MethodOpt = Annotated[
    list[str] | None, typer.Option("--method", help="Method name (repeatable) or 'all'. Default: care.")
]
RatioOpt = Annotated[list[float] | None, typer.Option("--ratio", "-r", help="Retention ratio in (0, 1] (repeatable).")]
KeepOpt = Annotated[list[int] | None, typer.Option("--keep", "-k", help="Tokens kept, K (repeatable).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of every method that draws random numbers.")]
PlotOpt = Annotated[Path | None, typer.Option("--plot", help="Grouped bar chart (PNG, PDF or SVG by extension).")]
CsvOpt = Annotated[Path | None, typer.Option("--csv", help="Per-pair results as CSV.")]
SkipBadOpt = Annotated[
    bool, typer.Option("--skip-bad", help="Skip bad JSONL lines and list them, instead of stopping.")
]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace --plot / --csv files that exist.")]


@dataclass(frozen=True)
class Budget:
    kind: str  # "ratio" or "keep"
    value: float

    @property
    def label(self) -> str:
        return f"ratio {self.value:g}" if self.kind == "ratio" else f"K={int(self.value)}"

    def resolve(self, num_tokens: int) -> int:
        from care_core import resolve_budget

        if self.kind == "ratio":
            return resolve_budget(num_tokens, ratio=self.value)
        return resolve_budget(num_tokens, keep=int(self.value))


@dataclass(frozen=True)
class Pair:
    line: int | None  # 1-based line in the JSONL file, None for a single pair
    image: Path
    question: str


def parse_budgets(ratios: list[float] | None, keeps: list[int] | None) -> list[Budget]:
    budgets = [Budget("ratio", r) for r in ratios or []] + [Budget("keep", k) for k in keeps or []]
    if not budgets:
        raise UserError("give at least one budget: --ratio R or --keep K (both repeatable)")
    for b in budgets:
        if b.kind == "ratio":
            opt.check_budget(b.value, None)
        else:
            opt.check_budget(None, int(b.value))
    return list(dict.fromkeys(budgets))


def parse_methods(names: list[str] | None) -> tuple[list[str], bool]:
    """Canonical method names, and whether they were named one by one (False for 'all')."""
    from care_core.methods import canonical_name, method_names

    names = names or ["care"]
    if any(n.strip().lower() == "all" for n in names):
        return method_names(), False
    return list(dict.fromkeys(canonical_name(n) for n in names)), True


def read_pairs(path: Path, skip_bad: bool) -> tuple[list[Pair], list[dict[str, Any]]]:
    """Pairs of a JSONL file; a bad line stops with its line number unless `skip_bad`."""
    if not path.exists():
        raise UserError(f"{path}: no such file")
    if path.is_dir():
        raise UserError(f"{path}: is a folder, expected a JSONL file")
    try:
        text = path.read_text(encoding="utf-8")
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
        if not isinstance(record.get(key), str) or not record[key].strip():
            raise UserError(f"{where}: missing or empty field {key!r}")
    image = Path(record["image"]).expanduser()
    if not image.is_absolute():
        image = path.parent / image
    return Pair(number, image, record["question"])


def configured_method(name: str, seed: int) -> Any:
    """The named method at its defaults, with `seed` wherever it draws random numbers."""
    from care_core import CaReConfig
    from care_core.methods import create_method, method_class

    fields = {f.name for f in dataclasses.fields(method_class(name))}
    options: dict[str, Any] = {}
    if "seed" in fields:
        options["seed"] = seed
    if "config" in fields:
        options["config"] = CaReConfig(seed=seed)
    return create_method(name, **options)


def csr(
    image: ImageArg = None,
    question: QuestionOpt = None,
    data: DataOpt = None,
    method: MethodOpt = None,
    ratio: RatioOpt = None,
    keep: KeepOpt = None,
    model: opt.Model = None,
    device: opt.Device = "auto",
    dtype: opt.Dtype = "auto",
    seed: SeedOpt = 42,
    plot: PlotOpt = None,
    csv_path: CsvOpt = None,
    skip_bad: SkipBadOpt = False,
    force: ForceOpt = False,
    json_output: opt.Json = False,
) -> None:
    """CSR (x100) of each method at each budget: how much question-relevant meaning survives."""
    from care_cli.io import check_output_path

    if (image is None) == (data is None):
        raise UserError("give either IMAGE with --question, or --data pairs.jsonl")
    if image is not None and (question is None or not question.strip()):
        raise UserError("IMAGE needs --question (a non-empty question)")
    if data is not None and question is not None:
        raise UserError("--question goes with IMAGE; with --data each line carries its own question")
    budgets = parse_budgets(ratio, keep)
    names, explicit = parse_methods(method)
    inputs_given = [p for p in (image, data) if p is not None]
    plot_path = check_output_path(plot, inputs_given, force) if plot is not None else None
    csv_file = check_output_path(csv_path, inputs_given, force) if csv_path is not None else None
    if plot_path is not None and plot_path.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise UserError(f"--plot {plot_path.name}: use a .png, .pdf or .svg file name")
    if data is not None:
        pairs, skipped = read_pairs(data, skip_bad)
    else:
        assert image is not None and question is not None
        pairs, skipped = [Pair(None, image, question)], []

    report = run_csr(pairs, names, budgets, model=model, device=device, dtype=dtype, seed=seed, skip_bad=skip_bad,
                     explicit=explicit)  # fmt: skip
    report["skipped"] = skipped + report["skipped"]
    if csv_file is not None:
        write_csv(csv_file, report["results"])
        report["csv"] = str(csv_file)
    if plot_path is not None:
        write_plot(plot_path, report)
        report["plot"] = str(plot_path)
    if json_output:
        render.print_json(report)
    else:
        show_report(report)


def run_csr(
    pairs: list[Pair],
    names: list[str],
    budgets: list[Budget],
    *,
    model: str | None,
    device: str,
    dtype: str,
    seed: int,
    skip_bad: bool,
    explicit: bool = True,
) -> dict[str, Any]:
    """Evaluate every method x budget on every pair; the full-sequence reference is computed once per pair.

    Methods named one by one must run on this backbone (else a one-line error); with 'all', a method the
    backbone cannot serve is left out and listed under `methods_skipped` with the reason.
    """
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from care_cli.io import load_image
    from care_core.backbones import load_backbone
    from care_core.csr import csr_from_reference, csr_reference
    from care_core.errors import MethodError
    from care_core.methods import MethodInputs

    methods = {name: configured_method(name, seed) for name in names}
    with render.stderr.status("Loading backbone (the demo is built on first use)…"):
        adapter = load_backbone(model, device=device, dtype=None if dtype == "auto" else dtype)
    methods_skipped: list[dict[str, str]] = []
    for name, method_obj in list(methods.items()):
        try:
            adapter.check_probes(sorted(set(method_obj.needs) - {"question"}), name)
        except MethodError as exc:
            if explicit:
                raise
            methods_skipped.append({"method": name, "reason": str(exc)})
            del methods[name]
    needs = sorted(set().union(*(m.needs for m in methods.values())) - {"question"})
    results: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    progress = Progress(TextColumn("[bold]CSR"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=render.stderr, transient=True)  # fmt: skip
    with progress, torch.no_grad():
        task = progress.add_task("", total=len(pairs))
        for pair in pairs:
            where = f"{pair.image}" if pair.line is None else f"line {pair.line} ({pair.image})"
            progress.update(task, description=pair.image.name)
            try:
                picture = load_image(pair.image)
                question_embeds = adapter.question_embeddings(pair.question)
            except UserError as exc:
                if not skip_bad or pair.line is None:
                    raise UserError(f"{where}: {exc}") from exc
                skipped.append({"line": pair.line, "reason": str(exc)})
                progress.advance(task)
                continue
            tokens = adapter.encode_image(picture)
            n = tokens.num_tokens
            ks = {b: b.resolve(n) for b in budgets}
            reference = csr_reference(adapter.projector(tokens.features), question_embeds)
            probes = adapter.probe_inputs(tokens, needs, question=pair.question) if needs else {}
            probes["question"] = question_embeds
            inputs = MethodInputs(tokens.features, adapter.projector, tokens.positions, grid=tokens.grid,
                                  probes=probes, seed=seed)  # fmt: skip
            for name, method_obj in list(methods.items()):
                for budget, k in ks.items():
                    try:
                        result = method_obj(inputs, k)
                    except MethodError as exc:
                        if explicit:
                            raise
                        methods_skipped.append({"method": name, "reason": str(exc)})
                        del methods[name]
                        results[:] = [r for r in results if r["method"] != name]
                        break
                    projected = adapter.projector(result.tokens.to(adapter.dtype))
                    results.append({
                        "line": pair.line, "image": str(pair.image), "question": pair.question,
                        "method": name, "budget": budget.label, "N": n, "K": k, "tokens_out": result.num_tokens,
                        "csr": 100 * csr_from_reference(reference, projected),
                        "uniform_weights": reference.uniform,
                    })  # fmt: skip
            progress.advance(task)
    if not results:
        raise UserError("every pair was skipped; nothing to report")
    return {
        "command": "csr",
        "backbone": {"name": adapter.name, "family": adapter.family, "demo": adapter.is_demo,
                     "note": render.DEMO_NOTE if adapter.is_demo else None,
                     "device": str(adapter.device), "dtype": str(adapter.dtype).removeprefix("torch.")},
        "methods": list(methods),
        "methods_skipped": methods_skipped,
        "budgets": [b.label for b in budgets],
        "seed": seed,
        "pairs": len(pairs) - len(skipped),
        "summary": summarise(results, list(methods), budgets),
        "results": results,
        "skipped": skipped,
    }  # fmt: skip


def summarise(results: list[dict[str, Any]], names: list[str], budgets: list[Budget]) -> list[dict[str, Any]]:
    """Mean, population std and count of 100 x CSR per method x budget, in the order given."""
    rows = []
    for name in names:
        for budget in budgets:
            values = [r["csr"] for r in results if r["method"] == name and r["budget"] == budget.label]
            if not values:
                continue
            rows.append({"method": name, "budget": budget.label, "mean": statistics.fmean(values),
                         "std": statistics.pstdev(values) if len(values) > 1 else 0.0, "n": len(values)})  # fmt: skip
    return rows


def write_csv(path: Path, results: list[dict[str, Any]]) -> None:
    from care_cli.io import atomic_write_text

    buffer = io.StringIO()
    columns = ["line", "image", "question", "method", "budget", "N", "K", "tokens_out", "csr", "uniform_weights"]
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    for row in results:
        writer.writerow({k: row[k] for k in columns})
    atomic_write_text(path, buffer.getvalue())


def write_plot(path: Path, report: dict[str, Any]) -> None:
    from care_cli.io import atomic_write_bytes
    from care_core.figures import csr_bar_chart

    backbone = report["backbone"]
    title = f"CSR ×100 on {backbone['name']} ({report['pairs']} pair{'s' if report['pairs'] != 1 else ''})"
    figure = csr_bar_chart(report["summary"], title=title, note=backbone["note"])
    buffer = io.BytesIO()
    figure.savefig(buffer, format=path.suffix.lower().lstrip("."), dpi=150)
    atomic_write_bytes(path, buffer.getvalue())


def show_report(report: dict[str, Any]) -> None:
    from rich.table import Table

    budgets = report["budgets"]
    lookup = {(r["method"], r["budget"]): r for r in report["summary"]}
    table = Table(title=f"CSR ×100 — mean ± std (n) over {report['pairs']} pair(s)", title_justify="left",
                  caption=report["backbone"]["note"], caption_style="bold yellow")  # fmt: skip
    table.add_column("method", style="bold cyan")
    for b in budgets:
        table.add_column(b, justify="right")
    for name in report["methods"]:
        cells = []
        for b in budgets:
            row = lookup.get((name, b))
            cells.append("—" if row is None else f"{row['mean']:.2f} ± {row['std']:.2f} ({row['n']})")
        table.add_row(name, *cells)
    render.stdout.print(table)
    for item in report["methods_skipped"]:
        render.stderr.print(f"[yellow]left out {item['method']}:[/] {item['reason']}")
    for item in report["skipped"]:
        render.stderr.print(f"[yellow]skipped line {item['line']}:[/] {item['reason']}")
    for key in ("csv", "plot"):
        if report.get(key):
            render.stdout.print(f"wrote {report[key]}")
    if any(math.isnan(r["csr"]) for r in report["results"]):
        render.stderr.print("[red]some CSR values are NaN[/]")
