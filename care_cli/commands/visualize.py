"""`care visualize IMAGE`: which tokens each method keeps, drawn on the original image (paper Fig. 7, Supp. E)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from care_cli import options as opt
from care_cli import render
from care_cli.errors import UserError
from care_core.config import CaReConfig
from care_core.errors import one_line

if TYPE_CHECKING:
    from PIL import Image

    from care_core.budget import Budget
    from care_core.overlays import OverlayFigure, TokenGeometry
    from care_core.pipeline import ImageResult, ReductionPipeline

FORMATS = (".png", ".pdf", ".svg")
MAX_DPI = 1200
MAX_FIGURE_PIXELS = 200_000_000  # refuse canvases that would take gigabytes to render

ImageArg = Annotated[Path, typer.Argument(help="Image file (any size, mode or EXIF orientation).", show_default=False)]
MethodOpt = Annotated[
    list[str] | None,
    typer.Option("--method", metavar="NAME",
                 help="Method name, repeatable: one panel per method, in order; 'all' for every method the backbone "
                      "can run. Default: care."),
]  # fmt: skip
ViewOpt = Annotated[
    str | None,
    typer.Option("--view", help="LLaVA-NeXT: draw the high-resolution tokens (high, default) or the base view (base)."),
]
ScoresOpt = Annotated[
    bool,
    typer.Option("--scores", metavar="", help="Add a heat map of the first method's per-token scores."),
]
LinksOpt = Annotated[
    bool, typer.Option("--links", metavar="", help="Draw a thin line from each signal to the anchor it feeds.")
]
QuestionOpt = Annotated[
    str | None, typer.Option("--question", "-q", help="Question for methods that read one (e.g. sparsevlm).")
]
OutOpt = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="Figure file (required): .png, .pdf or .svg (by extension).", show_default=False),
]
DpiOpt = Annotated[float, typer.Option("--dpi", help="Resolution (pixels per inch) of the figure.")]


@opt.with_config
def visualize(
    image: ImageArg,
    method: MethodOpt = None,
    ratio: opt.Ratio = None,
    keep: opt.Keep = None,
    model: opt.Model = None,
    device: opt.Device = "auto",
    dtype: opt.Dtype = "auto",
    view: ViewOpt = None,
    scores: ScoresOpt = False,
    links: LinksOpt = False,
    question: QuestionOpt = None,
    out: OutOpt = None,
    dpi: DpiOpt = 150.0,
    force: opt.Force = False,
    json_output: opt.Json = False,
    config: CaReConfig | None = None,
) -> None:
    """Draw anchors (red), calibration signals (green) and discarded tokens (dimmed) on the original image.

    A budget (--ratio or --keep) and --out are required.
    """
    from care_cli.io import atomic_write_bytes, check_output_path, load_image

    assert config is not None
    budget = opt.budget(ratio, keep)
    names, every = opt.method_names(method)
    if view is not None and view.strip().lower() not in ("high", "base"):
        raise UserError(f"--view must be 'high' or 'base', got {view!r}")
    if not (math.isfinite(dpi) and 0 < dpi <= MAX_DPI):
        raise UserError(f"--dpi must be in (0, {MAX_DPI}], got {dpi:g}")
    if out is None:
        raise UserError("give --out FILE (.png, .pdf or .svg)")
    out_path = check_output_path(out, [image], force, suffixes=FORMATS)
    opt.check_question(question)
    picture = load_image(image)

    report, drawing = build_figure(picture, names, config, image_name=one_line(image), every=every, budget=budget,
                                   model=model, device=device, dtype=dtype,
                                   view=view.strip().lower() if view else None, scores=scores, links=links,
                                   question=question, dpi=dpi, quiet=json_output)  # fmt: skip
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


def _metadata(fmt: str) -> dict[str, Any]:
    """Reproducible files: no creation date in PDF / SVG."""
    if fmt == "pdf":
        return {"CreationDate": None, "Creator": "care visualize"}
    if fmt == "svg":
        return {"Date": None, "Creator": "care visualize"}
    return {"Software": "care visualize"}


def build_figure(
    picture: Image.Image,
    names: list[str],
    config: CaReConfig,
    *,
    image_name: str,
    every: bool,
    budget: Budget,
    model: str | None,
    device: str,
    dtype: str,
    view: str | None,
    scores: bool,
    links: bool,
    question: str | None,
    dpi: float,
    quiet: bool,
) -> tuple[dict[str, Any], OverlayFigure]:
    """Run every method through the library pipeline and draw the figure (``image_name``: the file, as errors name
    it); the JSON report and the drawing."""
    import numpy as np

    from care_core.overlays import PanelInput, TokenGeometry, overlay_figure
    from care_core.pipeline import ReductionPipeline

    with render.status("Loading backbone (the demo is built on first use)…", quiet=quiet):
        pipe = ReductionPipeline.from_pretrained(model, methods=names, config=config, device=device, dtype=dtype,
                                                 skip_unavailable=every)  # fmt: skip
    render.print_notices(pipe.adapter.notices)
    pipe.adapter.check_image(picture, name=image_name)
    with render.status("Encoding the image and running the methods…", quiet=quiet):
        output = pipe(picture, question, [budget])
    backbone = pipe.backbone
    notes = [f"left out {item['method']}: {item['reason']}" for item in pipe.skipped]
    if output.question_defaulted:
        notes.append(f"no --question: methods that read one were asked “{output.question}”")
    panels = [PanelInput.from_result(run.method, run.category, run.result, run.keep) for run in output.runs]
    geometry = TokenGeometry.from_tokens(output.tokens)
    if view is not None and geometry.views is None:
        notes.append(f"--view {view} ignored: the {backbone.family} backbone has a single view of the image")
    side: Literal["high", "base"] = "base" if view == "base" else "high"
    drawing = overlay_figure(np.asarray(picture), geometry, panels, backbone=backbone.name, view=side,
                             show_scores=scores, links=links, note=backbone.note, dpi=dpi)  # fmt: skip
    notes.extend(drawing.notes)
    return _report(pipe, output, geometry, drawing.to_dict(), config=config, view=view, notes=notes), drawing


def _report(
    pipe: ReductionPipeline, output: ImageResult, geometry: TokenGeometry, figure: dict[str, Any], *,
    config: CaReConfig, view: str | None, notes: list[str],
) -> dict[str, Any]:  # fmt: skip
    """The JSON report of a figure: backbone, methods, N and K, the view, each panel's geometry, notes."""
    return {
        "command": "visualize",
        "backbone": pipe.backbone.to_dict(),
        "methods": list(pipe.methods),
        "methods_skipped": pipe.skipped,
        "N": output.num_tokens,
        "K": output.runs[0].keep,
        "seed": config.seed,
        "question": output.question,
        "view": None if geometry.views is None else (view or "high"),
        "seen_box": [float(v) for v in geometry.seen_box],
        "dpi": figure["dpi"],
        "figure_px": figure["figure_px"],
        "units": "pixels of the figure at --dpi, (0, 0) = top-left; for PDF/SVG, x 72/dpi gives points",
        "panels": figure["panels"],
        "scores_panel": figure["scores_panel"],
        "notes": notes,
    }  # fmt: skip


def show_report(report: dict[str, Any]) -> None:
    columns = [
        render.Column("panel", "name", key=True, style="bold cyan"),
        render.Column("category", "name"),
        render.Column("anchors /\nkept"),
        render.Column("signals"),
        render.Column("signal\nshare"),
    ]
    rows = []
    for panel in report["panels"]:
        s = panel["summary"]
        share = "—" if s["signal_share"] is None else f"{100 * s['signal_share']:.1f}%"
        rows.append([panel["method"], panel["category"], str(s["num_anchors"]), str(s["num_signals"]), share])
    render.print_table(f"care visualize — N = {report['N']}, K = {report['K']}", columns, rows,
                       caption=report["backbone"]["note"], caption_style="bold yellow")  # fmt: skip
    for note in report["notes"]:
        render.stderr.print(f"[yellow]note:[/] {note}")
    width, height = report["figure_px"]
    render.stdout.print(f"wrote {report['out']} ({width}x{height} px at {report['dpi']:g} dpi)")
