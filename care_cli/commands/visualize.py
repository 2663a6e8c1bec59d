"""`care visualize IMAGE`: which tokens each method keeps, drawn on the original image (paper Fig. 7, Supp. E)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from care_cli import options as opt
from care_cli import render
from care_cli.errors import UserError

FORMATS = (".png", ".pdf", ".svg")
MAX_DPI = 1200
MAX_FIGURE_PIXELS = 200_000_000  # refuse canvases that would take gigabytes to render

ImageArg = Annotated[Path, typer.Argument(help="Image file (any size, mode or EXIF orientation).", show_default=False)]
MethodOpt = Annotated[
    list[str] | None,
    typer.Option("--method", help="Method name, repeatable: one panel per method, in order. Default: care."),
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of every method that draws random numbers.")]
ViewOpt = Annotated[
    str | None,
    typer.Option("--view", help="LLaVA-NeXT: draw the high-resolution tokens (high, default) or the base view (base)."),
]
ScoresOpt = Annotated[
    bool, typer.Option("--scores", help="Add a heat map of the first method's per-token scores (psi_bar for CaRe).")
]
LinksOpt = Annotated[bool, typer.Option("--links", help="Draw a thin line from each signal to the anchor it feeds.")]
QuestionOpt = Annotated[
    str | None, typer.Option("--question", "-q", help="Question for methods that read one (e.g. sparsevlm).")
]
OutOpt = Annotated[
    Path | None, typer.Option("--out", "-o", help="Figure file: .png, .pdf or .svg (by extension).", show_default=False)
]
DpiOpt = Annotated[float, typer.Option("--dpi", help="Resolution (pixels per inch) of the figure.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace --out if it exists.")]


def visualize(
    image: ImageArg,
    method: MethodOpt = None,
    ratio: opt.Ratio = None,
    keep: opt.Keep = None,
    model: opt.Model = None,
    device: opt.Device = "auto",
    dtype: opt.Dtype = "auto",
    seed: SeedOpt = 42,
    view: ViewOpt = None,
    scores: ScoresOpt = False,
    links: LinksOpt = False,
    question: QuestionOpt = None,
    out: OutOpt = None,
    dpi: DpiOpt = 150.0,
    force: ForceOpt = False,
    json_output: opt.Json = False,
) -> None:
    """Draw anchors (red), calibration signals (green) and discarded tokens (dimmed) on the original image."""
    from care_cli.io import atomic_write_bytes, check_output_path, load_image

    opt.check_budget(ratio, keep)
    names = parse_methods(method)
    if view is not None and view.strip().lower() not in ("high", "base"):
        raise UserError(f"--view must be 'high' or 'base', got {view!r}")
    if not (math.isfinite(dpi) and 0 < dpi <= MAX_DPI):
        raise UserError(f"--dpi must be in (0, {MAX_DPI}], got {dpi:g}")
    if out is None:
        raise UserError("give --out FILE (.png, .pdf or .svg)")
    out_path = check_output_path(out, [image], force=True)  # a folder, a missing folder, the input itself
    if out_path.suffix.lower() not in FORMATS:
        raise UserError(f"--out {Path(out).name}: use a .png, .pdf or .svg file name")
    if out_path.exists() and not force:
        raise UserError(f"{' '.join(str(out).split())}: exists; pass --force to replace it")
    if question is not None and not question.strip():
        from care_core.errors import QuestionError

        raise QuestionError("--question is empty")
    picture = load_image(image)

    report, drawing = build_figure(picture, names, ratio=ratio, keep=keep, model=model, device=device, dtype=dtype,
                                   seed=seed, view=view.strip().lower() if view else None, scores=scores,
                                   links=links, question=question, dpi=dpi)  # fmt: skip
    width, height = drawing.size_px
    if width * height > MAX_FIGURE_PIXELS:
        raise UserError(f"--dpi {dpi:g} gives a {width}x{height} canvas; use a smaller --dpi")
    fmt = out_path.suffix.lower().lstrip(".")
    buffer = io.BytesIO()
    drawing.figure.savefig(buffer, format=fmt, dpi=drawing.dpi, metadata=_metadata(fmt))
    atomic_write_bytes(out_path, buffer.getvalue())
    report["image"] = {"path": str(image), "height": picture.height, "width": picture.width}
    report["out"] = str(out_path)
    report["format"] = fmt
    if json_output:
        render.print_json(report)
    else:
        show_report(report)


def parse_methods(names: list[str] | None) -> list[str]:
    """Canonical method names in the order given (duplicates dropped); unknown names suggest close ones."""
    from care_core.methods import canonical_name

    return list(dict.fromkeys(canonical_name(n) for n in names or ["care"]))


def _metadata(fmt: str) -> dict[str, Any]:
    """Reproducible files: no creation date in PDF / SVG."""
    if fmt == "pdf":
        return {"CreationDate": None, "Creator": "care visualize"}
    if fmt == "svg":
        return {"Date": None, "Creator": "care visualize"}
    return {"Software": "care visualize"}


def build_figure(
    picture: Any,
    names: list[str],
    *,
    ratio: float | None,
    keep: int | None,
    model: str | None,
    device: str,
    dtype: str,
    seed: int,
    view: str | None,
    scores: bool,
    links: bool,
    question: str | None,
    dpi: float,
) -> tuple[dict[str, Any], Any]:
    """Load the backbone, run every method, draw the figure; returns the JSON report and the OverlayFigure."""
    import numpy as np
    import torch

    from care_cli.commands.csr import configured_method
    from care_core import resolve_budget
    from care_core.backbones import load_backbone
    from care_core.errors import QuestionError
    from care_core.methods import MethodInputs
    from care_core.overlays import PanelInput, TokenGeometry, overlay_figure

    methods = {name: configured_method(name, seed) for name in names}
    needs = sorted(set().union(*(m.needs for m in methods.values())))
    if "question" in needs and question is None:
        wanting = ", ".join(n for n, m in methods.items() if "question" in m.needs)
        raise QuestionError(f"{wanting} needs a question: pass --question")
    with render.stderr.status("Loading backbone (the demo is built on first use)…"):
        adapter = load_backbone(model, device=device, dtype=None if dtype == "auto" else dtype)
    for name, method_obj in methods.items():
        adapter.check_probes(sorted(set(method_obj.needs) - {"question"}), name)
    notes: list[str] = []
    panels: list[PanelInput] = []
    with torch.no_grad(), render.stderr.status("Encoding the image and running the methods…"):
        tokens = adapter.encode_image(picture)
        n = tokens.num_tokens
        k = resolve_budget(n, ratio, keep)
        probes = adapter.probe_inputs(tokens, needs, question=question) if needs else {}
        inputs = MethodInputs(tokens.features, adapter.projector, tokens.positions, grid=tokens.grid,
                              probes=probes, seed=seed)  # fmt: skip
        for name, method_obj in methods.items():
            result = method_obj(inputs, k)
            panels.append(PanelInput.from_result(name, type(method_obj).category, result, k))
    geometry = TokenGeometry.from_tokens(tokens)
    if view is not None and geometry.views is None:
        notes.append(f"--view {view} ignored: the {adapter.family} backbone has a single view of the image")
    drawing = overlay_figure(np.asarray(picture), geometry, panels, backbone=adapter.name, view=view or "high",
                             show_scores=scores, links=links, note=render.DEMO_NOTE if adapter.is_demo else None,
                             dpi=dpi)  # fmt: skip
    notes.extend(drawing.notes)
    figure = drawing.to_dict()
    report: dict[str, Any] = {
        "command": "visualize",
        "backbone": {"name": adapter.name, "family": adapter.family, "demo": adapter.is_demo,
                     "note": render.DEMO_NOTE if adapter.is_demo else None,
                     "device": str(adapter.device), "dtype": str(adapter.dtype).removeprefix("torch.")},
        "methods": names,
        "N": n,
        "K": k,
        "seed": seed,
        "view": None if geometry.views is None else (view or "high"),
        "seen_box": [float(v) for v in geometry.seen_box],
        "dpi": figure["dpi"],
        "figure_px": figure["figure_px"],
        "units": "pixels of the figure at --dpi, (0, 0) = top-left; for PDF/SVG, x 72/dpi gives points",
        "panels": figure["panels"],
        "scores_panel": figure["scores_panel"],
        "notes": notes,
    }  # fmt: skip
    return report, drawing


def show_report(report: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"care visualize — N = {report['N']}, K = {report['K']}", title_justify="left",
                  caption=report["backbone"]["note"], caption_style="bold yellow")  # fmt: skip
    table.add_column("panel", style="bold cyan")
    table.add_column("category")
    table.add_column("anchors / kept", justify="right")
    table.add_column("signals", justify="right")
    table.add_column("signal share", justify="right")
    for panel in report["panels"]:
        s = panel["summary"]
        share = "—" if s["signal_share"] is None else f"{100 * s['signal_share']:.1f}%"
        table.add_row(panel["method"], panel["category"], str(s["num_anchors"]), str(s["num_signals"]), share)
    render.stdout.print(table)
    for note in report["notes"]:
        render.stderr.print(f"[yellow]note:[/] {note}")
    width, height = report["figure_px"]
    render.stdout.print(f"wrote {report['out']} ({width}x{height} px at {report['dpi']:g} dpi)")
