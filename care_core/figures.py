"""Figures as matplotlib Figure objects (Agg canvas, nothing saved or shown here)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties

# Okabe & Ito (2008), "Color Universal Design": eight colours told apart with any colour vision, plus grey;
# ordered so that neighbouring methods never get the two blues. Every pair, and each against the overlays'
# anchor red and signal green, is at least ΔE76 = 26 apart in CIELAB.
METHOD_COLORS: tuple[str, ...] = (
    "#0072B2",  # blue
    "#E69F00",  # orange
    "#009E73",  # bluish green
    "#D55E00",  # vermillion
    "#CC79A7",  # reddish purple
    "#56B4E9",  # sky blue
    "#F0E442",  # yellow
    "#999999",  # grey
    "#000000",  # black
)
# After all colours are used, the palette repeats with a hatch (the colour and the hatch tell methods apart).
METHOD_HATCHES: tuple[str, ...] = ("", "///", "...", "xxx")
CHART_DPI = 150.0
FONT_PT = 9.0  # ticks, legend, axis labels: legible at CHART_DPI (no text below 8 pt)
TITLE_PT = 10.0
NOTE_COLOUR = "darkred"
BAR_IN = 0.22  # width of one bar (narrower once the plot would be wider than PLOT_MAX_IN)
PLOT_MAX_IN = 10.0
ZERO_BASE_RATIO = 0.5  # the y axis starts at 0 unless every bar's lowest point is above this share of the top
# Every figure's text, tick labels and mathtext in DejaVu Sans, which ships with matplotlib: the same letters on
# every machine whatever its matplotlibrc (the layout measures text in this font).
FONT_FAMILY = "DejaVu Sans"


def pinned_fonts() -> Any:
    """A context (also a decorator) in which figures are built in :data:`FONT_FAMILY`, mathtext included. Tick
    labels made later, when the figure is drawn, copy the first tick's, which is made while building."""
    return matplotlib.rc_context({"font.family": "sans-serif", "font.sans-serif": [FONT_FAMILY],
                                  "mathtext.fontset": "dejavusans"})  # fmt: skip


def has_interval(row: dict[str, Any]) -> bool:
    """Whether a summary row's mean has a spread to show: it pools two or more pairs (rows without a count ``n``
    are taken to have one)."""
    return int(row.get("n", 2)) >= 2


def method_style(index: int) -> tuple[str, str]:
    """(colour, hatch) of the `index`-th method of a chart."""
    colour = METHOD_COLORS[index % len(METHOD_COLORS)]
    hatch = METHOD_HATCHES[(index // len(METHOD_COLORS)) % len(METHOD_HATCHES)]
    return colour, hatch


def csr_axis_range(lows: Sequence[float], highs: Sequence[float]) -> tuple[float, float]:
    """The y range of a CSR chart: from 0, or zoomed in when all values are close.

    ``lows`` / ``highs`` are each bar's mean - std and mean + std (x 100). The axis starts at 0 unless
    every ``low`` is above half the highest ``high``; then it starts at the whole number just below the
    lowest ``low`` minus a margin of 10% of the spread (at least 0.5), so that close values (e.g. all
    between 40 and 45) can be told apart, and the axis label says where it starts. The top is the
    highest ``high`` plus the same margin, capped at 100 unless a value is above 100.
    """
    finite_lo = [v for v in lows if math.isfinite(v)]
    finite_hi = [v for v in highs if math.isfinite(v)]
    if not finite_lo or not finite_hi:
        return 0.0, 100.0
    lo, hi = min(finite_lo), max(finite_hi)
    pad = max(0.1 * (hi - lo), 0.5)
    top = hi + pad
    top = min(100.0, top) if hi <= 100 else top
    top = math.ceil(top) if top < 100 else top
    bottom = 0.0
    if lo > ZERO_BASE_RATIO * hi and lo > 0:
        bottom = float(max(0, math.floor(lo - pad)))
    if top <= bottom:
        top = bottom + 1.0
    return bottom, float(top)


def _wrap(text: str, max_px: float, renderer: Any, size: float) -> str:
    prop = FontProperties(size=size)
    lines: list[str] = []
    for paragraph in text.split("\n"):
        current = ""
        for word in paragraph.split(" "):
            candidate = f"{current} {word}" if current else word
            if current and renderer.get_text_width_height_descent(candidate, prop, ismath=False)[0] > max_px:
                lines.append(current)
                current = word
            else:
                current = candidate
        lines.append(current)
    return "\n".join(lines)


def _legend_and_note(
    fig: Figure, canvas: FigureCanvasAgg, plot_w: float, methods: int, note: str | None, dpi: float
) -> tuple[Any, float]:
    """The method legend right of the axes, the canvas widened to hold it, and ``note`` as a wrapped footer.

    Returns the renderer and the usable text width in pixels (for wrapping the title).
    """
    legend = fig.legend(loc="outside right upper", fontsize=FONT_PT, frameon=False, title="method",
                        title_fontsize=FONT_PT)  # fmt: skip
    renderer = canvas.get_renderer()
    legend_w = legend.get_window_extent(renderer).width / dpi + 0.15
    fig.set_size_inches(plot_w + legend_w, 4.2 if methods <= 12 else 4.2 + 0.16 * (methods - 12))
    usable = (plot_w + legend_w - 0.3) * dpi
    if note:
        fig.supxlabel(_wrap(note, usable, renderer, FONT_PT), fontsize=FONT_PT, color=NOTE_COLOUR)
    return renderer, usable


@pinned_fonts()
def csr_bar_chart(
    rows: Sequence[dict[str, Any]], *, title: str, note: str | None = None, dpi: float = CHART_DPI
) -> Figure:
    """Grouped bars of 100 x CSR: one group per budget, one bar per method, ± std over the pairs as error bars
    (none for a bar of one pair; the y label says which).

    `rows` hold `method`, `budget`, `mean`, `std` and `n` (as `care csr` summarises them), in display order.
    Methods get colour-blind-safe colours (:data:`METHOD_COLORS`, then hatched); the legend sits right of
    the axes, never over a bar; the y range follows :func:`csr_axis_range`; ``note`` (e.g. the demo
    backbone's warning) is a footer wrapped to the figure's width. Laid out with matplotlib's
    constrained layout, so everything lies inside the canvas when saved with the figure's size.
    """
    methods = list(dict.fromkeys(r["method"] for r in rows))
    budgets = list(dict.fromkeys(r["budget"] for r in rows))
    lookup = {(r["method"], r["budget"]): r for r in rows}
    width = 0.8 / max(1, len(methods))
    plot_w = min(PLOT_MAX_IN, max(5.0, 1.0 + BAR_IN * len(methods) * len(budgets) / 0.8))
    fig = Figure(figsize=(plot_w, 4.2), dpi=dpi, facecolor="white", layout="constrained")
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    lows, highs = [], []
    for i, method in enumerate(methods):
        found = [(j, lookup[(method, b)]) for j, b in enumerate(budgets) if (method, b) in lookup]
        xs = [j - 0.4 + width * (i + 0.5) for j, _ in found]
        means = [float(row["mean"]) for _, row in found]
        stds = [float(row["std"]) if has_interval(row) and math.isfinite(float(row["std"])) else 0.0
                for _, row in found]  # fmt: skip
        lows += [m - d for m, d in zip(means, stds, strict=True)]
        highs += [m + d for m, d in zip(means, stds, strict=True)]
        colour, hatch = method_style(i)
        dark = sum(to_rgb(colour)) < 1.2
        bars = [(x, m, d) for (_, row), x, m, d in zip(found, xs, means, stds, strict=True) if has_interval(row)]
        ax.bar(xs, means, width=width * 0.92, label=method, color=colour, edgecolor="black", linewidth=0.5,
               hatch=hatch or None, hatchcolor="white" if dark else "black")  # fmt: skip
        if bars:  # error bars only where the bar pools two or more pairs
            ax.errorbar([b[0] for b in bars], [b[1] for b in bars], yerr=[b[2] for b in bars], fmt="none",
                        ecolor="0.2", elinewidth=0.9, capsize=2.0, capthick=0.9)  # fmt: skip
    bottom, top = csr_axis_range(lows, highs)
    ax.set_ylim(bottom, top)
    ax.set_xticks(range(len(budgets)), budgets)
    ax.set_xlim(-0.5, len(budgets) - 0.5)
    spread = ", mean ± std over pairs" if any(has_interval(r) for r in rows) else ", one pair"
    ax.set_ylabel("CSR (×100)" + spread + ("" if bottom == 0 else f", axis from {bottom:g}"), fontsize=FONT_PT)
    ax.set_xlabel("budget", fontsize=FONT_PT)
    ax.tick_params(labelsize=FONT_PT)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)
    renderer, usable = _legend_and_note(fig, canvas, plot_w, len(methods), note, dpi)
    ax.set_title(_wrap(title, usable, renderer, TITLE_PT), fontsize=TITLE_PT)
    return fig


CURVE_MIN_BUDGETS = 3  # `care csr --plot` draws curves from this many budgets on, grouped bars below it


@pinned_fonts()
def csr_budget_curves(
    rows: Sequence[dict[str, Any]], *, title: str, note: str | None = None, dpi: float = CHART_DPI
) -> Figure:
    """CSR (x100) against the share of visual tokens kept, one line per method, 95% confidence band (where a point
    pools two or more pairs; the y label says whether there is one).

    `rows` hold `method`, `mean`, `ci95` (half-width of the 95% interval of the mean over pairs), `n` (pairs) and
    `kept_pct` (mean 100 K / N over pairs), one per method x budget, as `care csr` summarises them. The x
    axis is the kept share, so ratio and keep budgets share one axis. Colours as :func:`csr_bar_chart`
    (colour-blind safe; a line style per repeated colour); legend right of the axes; ``note`` as a footer.
    """
    methods = list(dict.fromkeys(r["method"] for r in rows))
    styles = ("-", "--", ":", "-.")
    markers = ("o", "s", "^", "D", "v", "P", "X", "*", "h")
    fig = Figure(figsize=(6.4, 4.2), dpi=dpi, facecolor="white", layout="constrained")
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    lows, highs = [], []
    for i, method in enumerate(methods):
        points = sorted((float(r["kept_pct"]), float(r["mean"]), float(r.get("ci95") or 0.0), has_interval(r))
                        for r in rows if r["method"] == method)  # fmt: skip
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
        half = [p[2] if p[3] and math.isfinite(p[2]) else 0.0 for p in points]
        colour, _ = method_style(i)
        style = styles[(i // len(METHOD_COLORS)) % len(styles)]
        ax.plot(xs, ys, color=colour, linestyle=style, marker=markers[i % len(markers)], markersize=4,
                linewidth=1.6, label=method, zorder=3)  # fmt: skip
        if any(p[3] for p in points):  # a band only over points that pool two or more pairs
            ax.fill_between(xs, [y - h for y, h in zip(ys, half, strict=True)],
                            [y + h for y, h in zip(ys, half, strict=True)], where=[p[3] for p in points],
                            color=colour, alpha=0.18, linewidth=0, zorder=2)  # fmt: skip
        lows += [y - h for y, h in zip(ys, half, strict=True)]
        highs += [y + h for y, h in zip(ys, half, strict=True)]
    bottom, top = csr_axis_range(lows, highs)
    ax.set_ylim(bottom, top)
    ax.set_xlim(left=0)
    ax.set_xlabel("visual tokens kept (% of N)", fontsize=FONT_PT)
    spread = ", mean ± 95% CI" if any(has_interval(r) for r in rows) else ", one pair (no interval)"
    ylabel = "CSR (×100)" + spread + ("" if bottom == 0 else f", axis from {bottom:g}")
    ax.set_ylabel(ylabel, fontsize=FONT_PT)
    ax.tick_params(labelsize=FONT_PT)
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)
    renderer, usable = _legend_and_note(fig, canvas, 6.4, len(methods), note, dpi)
    fig.suptitle(_wrap(title, usable, renderer, TITLE_PT), fontsize=TITLE_PT)
    return fig
