"""Token overlays: which visual tokens a method keeps, drawn on the original image (paper Fig. 7, Supp. E).

Pure drawing, no file I/O: a numpy image, each token's footprint in original-image pixels and the
methods' results go in; a :class:`matplotlib.figure.Figure` (Agg canvas, never pyplot) comes out with,
per panel, the pixel boxes of the anchors and signals in the figure's own pixel coordinates.

Conventions (the paper's): calibration anchors (the paper's Calib-Anchors) / kept tokens are red boxes
(:data:`RED`), accepted calibration signals green boxes (:data:`GREEN`), discarded tokens are dimmed, the part of
the image the model never sees (outside ``seen_box``, e.g. LLaVA-1.5's centre crop) is hatched grey. Merging
methods colour each input token by the output token it merged into. Box outlines are drawn *inside* each footprint (the
stroke's outer edge is the footprint's edge), so neighbouring boxes never paint over each other.

Layout (a figure for a paper, at any aspect ratio and panel count), in inches rounded to whole pixels at
``dpi``: each image is drawn with the area of a :data:`IMAGE_SIDE_IN` square (its long side at most
:data:`IMAGE_LONG_MAX_IN`, or longer, up to :data:`IMAGE_LONG_CAP_IN`, to keep the short side at least
:data:`IMAGE_SHORT_MIN_IN`), so a square image is 480 x 480 px at 150 dpi and a panorama is a band, not
a strip. Panels (and the heat map) fill a row-major grid of columns at least :data:`COLUMN_MIN_IN`
wide, at most :data:`ROW_MAX_IN` a row, choosing the number of columns whose canvas is closest to
:data:`TARGET_SIDE_RATIO`; titles, legend and footer are wrapped to the width they have, and
:data:`MARGIN_IN` of white surrounds everything. White space is added only to keep the canvas between
1:3 and 3:1. The canvas thus depends on the image's aspect ratio, the panels and their text, never on
the image's resolution. The figure saved with that dpi (and without ``bbox_inches="tight"``) is exactly
``size_px`` pixels, and the reported boxes are in that canvas, ``(0, 0)`` at the top-left pixel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle
from matplotlib.text import Text
from matplotlib.ticker import FuncFormatter, MaxNLocator

from care_core.figures import NOTE_COLOUR, pinned_fonts

RED = "#ff0000"  # calibration anchors / kept tokens
GREEN = "#00c000"  # accepted calibration signals
DIM = 0.3  # brightness factor of discarded tokens' footprints
UNSEEN_FACE = (0.55, 0.55, 0.55, 0.6)
UNSEEN_HATCH = "0.3"
MERGE_ALPHA = 0.45
SCORE_CMAP = "viridis"
LINKS_MAX = 100  # links drawn per panel at most: the strongest signal of each anchor, the strongest first

# Layout, in inches (rounded to whole pixels at the figure's dpi).
IMAGE_SIDE_IN = 3.2  # each image has the area of a square of this side ...
IMAGE_LONG_MAX_IN = 6.4  # ... unless its long side would exceed this
IMAGE_SHORT_MIN_IN = 1.0  # a panorama's long side grows past IMAGE_LONG_MAX_IN to keep this short side ...
IMAGE_LONG_CAP_IN = 12.0  # ... up to this long side
COLUMN_MIN_IN = 2.2  # minimum width of a grid column (room for a wrapped title)
ROW_MAX_IN = 14.0  # widest row of panels
TARGET_SIDE_RATIO = 1.6  # the grid whose canvas (width / height) is closest to this wins
MAX_SIDE_RATIO = 3.0  # the canvas stays between 1:MAX_SIDE_RATIO and MAX_SIDE_RATIO:1
MARGIN_IN = 0.1
GAP_X_IN = 0.2  # between columns
GAP_Y_IN = 0.14  # between rows
TITLE_PAD_IN = 0.05  # between a title and its image
LEGEND_PAD_IN = 0.08  # between the grid and the legend
NOTE_PAD_IN = 0.04  # between the legend and the footer
CBAR_GAP_IN = 0.08
CBAR_W_IN = 0.12
CBAR_LABELS_IN = 0.55
TITLE_PT = 9.0
LEGEND_PT = 8.5
NOTE_PT = 8.5
TICK_PT = 8.0
MIN_FONT_PT = 8.0  # no text is smaller
LINE_SPACING = 1.2

View = Literal["high", "base"]
_VIEW_CODES: dict[str, int] = {"base": 0, "high": 1}


def _is_psi_bar(method: str) -> bool:
    """Whether `method`'s scores are psi_bar (its class's ``score_label``); unregistered names are not."""
    from care_core.errors import MethodError
    from care_core.methods import score_label

    try:
        return score_label(method) == "psi_bar"
    except MethodError:
        return False


@dataclass(frozen=True)
class TokenGeometry:
    """Where every visual token's pixels come from in the original image."""

    boxes: np.ndarray  # (N, 4) float64 [x0, y0, x1, y1] footprints in original-image pixels
    image_size: tuple[int, int]  # (height, width) of the original image
    seen_box: tuple[float, float, float, float]  # [x0, y0, x1, y1] of the original image the tokens cover
    views: np.ndarray | None = None  # (N,) LLaVA-NeXT: 0 = base-view token, 1 = high-resolution token

    @classmethod
    def from_tokens(cls, tokens: Any) -> TokenGeometry:
        """From a backbone's ``ImageTokens`` (``views`` read with getattr: only tiled backbones carry it)."""
        views = getattr(tokens, "views", None)
        return cls(
            boxes=_numpy(tokens.boxes).astype(np.float64).reshape(-1, 4),
            image_size=(int(tokens.image_size[0]), int(tokens.image_size[1])),
            seen_box=tuple(float(v) for v in tokens.seen_box),  # type: ignore[arg-type]
            views=None if views is None else _numpy(views).astype(np.int64).reshape(-1),
        )

    @property
    def num_tokens(self) -> int:
        return int(self.boxes.shape[0])


@dataclass(frozen=True)
class PanelInput:
    """One method's result, reduced to what a panel draws (numpy, CPU)."""

    method: str
    category: str  # "selection", "merging" or "calibration"
    keep: int  # the budget K
    token_index: np.ndarray  # (K_out,) patch index per output row, -1 = none
    assignment: np.ndarray | None = None  # (N,) output row per input token, -1 = dropped
    signals: np.ndarray | None = None  # accepted calibration signals
    scores: np.ndarray | None = None  # (N,) the method's per-token scores
    confidence: np.ndarray | None = None  # (N,) calibration: each residual token's c_r (Eq. 6), NaN elsewhere

    @classmethod
    def from_result(cls, method: str, category: str, result: Any, keep: int) -> PanelInput:
        """From a ``MethodResult`` (tensors on any device)."""
        assignment = None if result.assignment is None else _numpy(result.assignment).astype(np.int64).reshape(-1)
        confidence = None
        if assignment is not None and "confidence" in result.info and "residuals" in result.info:
            confidence = np.full(assignment.size, np.nan)
            confidence[_numpy(result.info["residuals"]).astype(np.int64)] = _numpy(result.info["confidence"])
        return cls(
            method=method,
            category=category,
            keep=int(keep),
            token_index=_numpy(result.token_index).astype(np.int64).reshape(-1),
            assignment=assignment,
            signals=None if result.signals is None else _numpy(result.signals).astype(np.int64).reshape(-1),
            scores=None if result.scores is None else _numpy(result.scores).astype(np.float64).reshape(-1),
            confidence=confidence,
        )

    @property
    def anchors(self) -> np.ndarray:
        """Ascending unique patch indices the output keeps (or merges into)."""
        idx = self.token_index[self.token_index >= 0]
        return np.unique(idx)


@dataclass
class PanelInfo:
    """What one drawn panel shows, with boxes in the figure's pixel coordinates."""

    method: str
    category: str
    summary: dict[str, Any]
    anchor_tokens: list[int]
    signal_tokens: list[int]
    anchors: list[list[float]]  # [x0, y0, x1, y1] per anchor, figure pixels, (0, 0) top-left
    signals: list[list[float]]
    image_extent: list[float]  # [x0, y0, x1, y1] of the image axes, figure pixels
    links: list[tuple[int, int]] = field(default_factory=list)  # (signal, anchor) tokens of each link drawn

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "category": self.category,
            "summary": self.summary,
            "anchors": self.anchors,
            "signals": self.signals,
            "anchor_tokens": self.anchor_tokens,
            "signal_tokens": self.signal_tokens,
            "image_extent": self.image_extent,
            "links": [list(link) for link in self.links],
        }


@dataclass
class OverlayFigure:
    """The figure and, per panel, where its boxes landed."""

    figure: Figure
    dpi: float
    size_px: tuple[int, int]  # (width, height) of the canvas when saved at `dpi`
    panels: list[PanelInfo]
    scores_panel: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "dpi": self.dpi,
            "figure_px": list(self.size_px),
            "panels": [p.to_dict() for p in self.panels],
            "scores_panel": self.scores_panel,
            "notes": list(self.notes),
        }


@dataclass
class _Cell:
    """One grid cell: a method's panel, or the heat map with its colorbar."""

    title: Text  # placed once the layout is known
    content_w: int  # pixels: the image (and, for the heat map, its colorbar)
    width: int  # pixels: the content, or a column's minimum width when wider
    title_w: int
    title_h: int


@dataclass(frozen=True)
class _Layout:
    width: int  # canvas pixels
    height: int
    image_w: int
    image_h: int
    image_origins: list[tuple[int, int]]  # (left, top) of each cell's image, pixels from the top-left corner
    title_anchors: list[tuple[float, int]]  # (centre x, bottom y) of each cell's title
    legend_ncols: int
    legend_anchor: tuple[float, int]  # (centre x, top y)
    note: str | None  # the footer, wrapped to the canvas
    note_anchor: tuple[float, int]  # (centre x, top y)
    aspect_score: float = field(default=0.0, compare=False)


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().to("cpu")
        if str(value.dtype) in ("torch.bfloat16", "torch.float16"):
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def _px(inches: float, dpi: float) -> int:
    return max(1, round(inches * dpi))


def drawn_mask(geometry: TokenGeometry, view: View | None) -> np.ndarray:
    """(N,) bool: the tokens of the chosen view (all of them when the backbone has one view)."""
    n = geometry.num_tokens
    if geometry.views is None or view is None:
        return np.ones(n, dtype=bool)
    return geometry.views == _VIEW_CODES[view]


def panel_summary(panel: PanelInput, num_tokens: int, drawn: np.ndarray) -> dict[str, Any]:
    """N, K, output rows, anchor and signal counts and the share of accepted signals among the residual."""
    anchors = panel.anchors
    signals = panel.signals if panel.signals is not None else np.zeros(0, dtype=np.int64)
    residual = num_tokens - int(anchors.size)
    summary: dict[str, Any] = {
        "N": num_tokens,
        "K": panel.keep,
        "tokens_out": int(panel.token_index.size),
        "num_anchors": int(anchors.size),
        "num_signals": int(signals.size),
        "residual": residual,
        "signal_share": (signals.size / residual) if (panel.signals is not None and residual > 0) else None,
        "drawn": {
            "tokens": int(drawn.sum()),
            "anchors": int(drawn[anchors].sum()) if anchors.size else 0,
            "signals": int(drawn[signals].sum()) if signals.size else 0,
        },
    }
    if panel.category == "merging" and panel.assignment is not None:
        merged = (panel.assignment >= 0) & ~np.isin(np.arange(num_tokens), anchors)
        summary["merged"] = int(merged.sum())
    return summary


def _title(panel: PanelInput, summary: dict[str, Any], backbone: str, view_line: str | None) -> str:
    n, k = summary["N"], summary["K"]
    lines = [f"{panel.method} — {backbone}"]
    budget = f"K/N = {k}/{n} ({100 * k / n:.1f}%)"
    if panel.category == "calibration" and summary["signal_share"] is not None:
        budget += f" · signals {summary['num_signals']}/{summary['residual']} ({100 * summary['signal_share']:.1f}%)"
    elif panel.category == "merging" and "merged" in summary:
        budget += f" · merged {summary['merged']}"
    lines.append(budget)
    if view_line:
        lines.append(view_line)
    return "\n".join(lines)


def _display_image(image: np.ndarray, max_w: int, max_h: int) -> np.ndarray:
    """Float RGB in [0, 1], downsampled (Pillow, Lanczos) when much larger than its on-figure size."""
    h, w = image.shape[:2]
    if w > 2 * max_w or h > 2 * max_h:
        from PIL import Image

        tw, th = max(1, min(w, 2 * max_w)), max(1, min(h, 2 * max_h))
        image = np.asarray(Image.fromarray(image).resize((tw, th), Image.Resampling.LANCZOS))
    return image.astype(np.float32) / 255.0


def _box_slices(box: np.ndarray, scale_x: float, scale_y: float, shape: tuple[int, int]) -> tuple[slice, slice]:
    x0, y0, x1, y1 = (float(v) for v in box)
    r0 = min(shape[0], max(0, round(y0 * scale_y)))
    r1 = min(shape[0], max(r0, round(y1 * scale_y)))
    c0 = min(shape[1], max(0, round(x0 * scale_x)))
    c1 = min(shape[1], max(c0, round(x1 * scale_x)))
    return slice(r0, r1), slice(c0, c1)


def _compose(
    base: np.ndarray,
    geometry: TokenGeometry,
    drawn: np.ndarray,
    kept: np.ndarray,
    fills: dict[int, tuple[float, float, float]] | None = None,
) -> np.ndarray:
    """The panel's raster: discarded footprints dimmed, kept footprints as they are, merge fills blended."""
    out = base.copy()
    h, w = out.shape[:2]
    height, width = geometry.image_size
    sx, sy = w / width, h / height
    dim = np.zeros((h, w), dtype=bool)
    for i in np.flatnonzero(drawn & ~kept):
        rows, cols = _box_slices(geometry.boxes[i], sx, sy, (h, w))
        dim[rows, cols] = True
    for i in np.flatnonzero(drawn & kept):
        rows, cols = _box_slices(geometry.boxes[i], sx, sy, (h, w))
        dim[rows, cols] = False
    out[dim] *= DIM
    if fills:
        for token, colour in fills.items():
            rows, cols = _box_slices(geometry.boxes[token], sx, sy, (h, w))
            out[rows, cols] = (1 - MERGE_ALPHA) * out[rows, cols] + MERGE_ALPHA * np.asarray(colour, dtype=np.float32)
    return out


def _score_raster(shape: tuple[int, int], geometry: TokenGeometry, drawn: np.ndarray, scores: np.ndarray) -> np.ndarray:
    h, w = shape
    height, width = geometry.image_size
    raster = np.full((h, w), np.nan, dtype=np.float64)
    for i in np.flatnonzero(drawn):
        rows, cols = _box_slices(geometry.boxes[i], w / width, h / height, (h, w))
        raster[rows, cols] = scores[i]
    return raster


def _unseen_rects(geometry: TokenGeometry) -> list[tuple[float, float, float, float]]:
    """Up to four [x0, y0, x1, y1] strips of the image outside ``seen_box``."""
    height, width = geometry.image_size
    sx0, sy0, sx1, sy1 = geometry.seen_box
    sx0, sx1 = max(0.0, sx0), min(float(width), sx1)
    sy0, sy1 = max(0.0, sy0), min(float(height), sy1)
    rects = [
        (0.0, 0.0, float(width), sy0),
        (0.0, sy1, float(width), float(height)),
        (0.0, sy0, sx0, sy1),
        (sx1, sy0, float(width), sy1),
    ]
    return [r for r in rects if r[2] - r[0] > 0.5 and r[3] - r[1] > 0.5]


def _draw_unseen(ax: Any, geometry: TokenGeometry) -> bool:
    rects = _unseen_rects(geometry)
    for x0, y0, x1, y1 in rects:
        ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, facecolor=UNSEEN_FACE, edgecolor=UNSEEN_HATCH,
                               hatch="///", linewidth=0, zorder=1))  # fmt: skip
    if rects:
        sx0, sy0, sx1, sy1 = geometry.seen_box
        ax.add_patch(Rectangle((sx0, sy0), sx1 - sx0, sy1 - sy0, facecolor="none", edgecolor="white",
                               linestyle=(0, (4, 3)), linewidth=0.8, zorder=1.5))  # fmt: skip
    return bool(rects)


def _stroke_px(geometry: TokenGeometry, drawn: np.ndarray, scale_x: float, scale_y: float) -> float:
    """Outline width in pixels: ~13% of a typical token's on-figure size, 2-3.5 px where tokens allow."""
    boxes = geometry.boxes[drawn]
    if boxes.size == 0:
        return 2.0
    sizes = np.minimum((boxes[:, 2] - boxes[:, 0]) * scale_x, (boxes[:, 3] - boxes[:, 1]) * scale_y)
    typical = float(np.median(sizes))
    width = float(np.clip(0.13 * typical, 2.0, 3.5))
    return min(width, max(1.0, 0.25 * typical))


def _inset_polygons(boxes: np.ndarray, inset_x: float, inset_y: float) -> list[np.ndarray]:
    """Closed rectangles whose stroke (centred on the path) stays inside each box."""
    polys = []
    for x0, y0, x1, y1 in boxes:
        dx = min(inset_x, (x1 - x0) / 4)
        dy = min(inset_y, (y1 - y0) / 4)
        a, b, c, d = x0 + dx, y0 + dy, x1 - dx, y1 - dy
        polys.append(np.array([[a, b], [c, b], [c, d], [a, d]], dtype=np.float64))
    return polys


def _to_figure_px(ax: Any, boxes: np.ndarray, height_px: int) -> list[list[float]]:
    """Data-coordinate boxes -> [x0, y0, x1, y1] in the saved canvas, (0, 0) at the top-left pixel."""
    if boxes.size == 0:
        return []
    corners = np.concatenate([boxes[:, 0:2], boxes[:, 2:4]], axis=0)
    disp = ax.transData.transform(corners)
    n = boxes.shape[0]
    xa, ya = disp[:n, 0], height_px - disp[:n, 1]
    xb, yb = disp[n:, 0], height_px - disp[n:, 1]
    out = np.stack([np.minimum(xa, xb), np.minimum(ya, yb), np.maximum(xa, xb), np.maximum(ya, yb)], axis=1)
    return [[round(float(v), 3) for v in row] for row in out]


def _image_px(geometry: TokenGeometry, dpi: float) -> tuple[int, int]:
    """(width, height) in pixels: the area of an IMAGE_SIDE_IN square, the long side at most IMAGE_LONG_MAX_IN
    unless that leaves the short side under IMAGE_SHORT_MIN_IN (a panorama), never over IMAGE_LONG_CAP_IN."""
    height, width = geometry.image_size
    aspect = max(width / height, height / width)
    long_in = IMAGE_SIDE_IN * math.sqrt(aspect)
    if long_in > IMAGE_LONG_MAX_IN:
        long_in = max(IMAGE_LONG_MAX_IN, min(IMAGE_LONG_CAP_IN, IMAGE_SHORT_MIN_IN * aspect))
    short_in = long_in / aspect
    w_in, h_in = (long_in, short_in) if width >= height else (short_in, long_in)
    return _px(w_in, dpi), _px(h_in, dpi)


def _text_measure(renderer: Any, size: float) -> Callable[[str], float]:
    """Width in pixels of one line of text at `size` points (mathtext where the line has a ``$``)."""
    prop = FontProperties(size=size)

    def measure(line: str) -> float:
        return float(renderer.get_text_width_height_descent(line, prop, ismath="$" in line)[0])

    return measure


def wrap_text(text: str, max_px: float, measure: Callable[[str], float]) -> str:
    """Greedy wrap of each line to `max_px`: at `` · `` separators first, then at spaces (words never split)."""
    return "\n".join(part for line in text.split("\n") for part in _wrap_line(line, max_px, measure))


def _wrap_line(line: str, max_px: float, measure: Callable[[str], float]) -> list[str]:
    if measure(line) <= max_px:
        return [line]
    for sep in (" · ", " "):
        parts = line.split(sep)
        if len(parts) == 1:
            continue
        lines, current = [], parts[0]
        for part in parts[1:]:
            candidate = current + sep + part
            if measure(candidate) <= max_px:
                current = candidate
            else:
                lines.append(current)
                current = part
        lines.append(current)
        if sep == " ":
            return lines
        return [piece for sub in lines for piece in _wrap_line(sub, max_px, measure)]
    return [line]


def _size_px(artist: Any, renderer: Any) -> tuple[int, int]:
    box = artist.get_window_extent(renderer)
    return math.ceil(box.width), math.ceil(box.height)


def _legend(fig: Figure, handles: list[Any], ncols: int) -> Any:
    return fig.legend(handles=handles, loc="upper center", ncols=ncols, frameon=False, fontsize=LEGEND_PT,
                      borderaxespad=0.0, handlelength=1.6, columnspacing=1.4)  # fmt: skip


def _layout(
    cells: list[_Cell], image_w: int, image_h: int, legend_sizes: list[tuple[int, int]], note: str | None,
    note_measure: Callable[[str], float], note_lines: tuple[int, int], dpi: float,
) -> _Layout:  # fmt: skip
    """The grid (number of columns) whose canvas is closest to TARGET_SIDE_RATIO, and where everything goes."""
    best: _Layout | None = None
    count = len(cells)
    for ncols in range(1, count + 1):
        rows = math.ceil(count / ncols)
        if math.ceil(count / rows) != ncols:
            continue  # the same rows with a ragged last one: keep the balanced grid only
        candidate = _grid(cells, ncols, image_w, image_h, legend_sizes, note, note_measure, note_lines, dpi)
        if candidate is None:
            continue
        if best is None or candidate.aspect_score < best.aspect_score:
            best = candidate
    if best is None:  # even one column is wider than ROW_MAX_IN: a single column it is
        best = _grid(cells, 1, image_w, image_h, legend_sizes, note, note_measure, note_lines, dpi, force=True)
    assert best is not None
    return best


def _grid(
    cells: list[_Cell], ncols: int, image_w: int, image_h: int, legend_sizes: list[tuple[int, int]],
    note: str | None, note_measure: Callable[[str], float], note_lines: tuple[int, int], dpi: float, *,
    force: bool = False,
) -> _Layout | None:  # fmt: skip
    count = len(cells)
    rows = math.ceil(count / ncols)
    margin, gap_x, gap_y = _px(MARGIN_IN, dpi), _px(GAP_X_IN, dpi), _px(GAP_Y_IN, dpi)
    title_pad = _px(TITLE_PAD_IN, dpi)
    col_w = [max(cells[i].width for i in range(c, count, ncols)) for c in range(ncols)]
    grid_w = sum(col_w) + gap_x * (ncols - 1)
    if not force and ncols > 1 and grid_w > _px(ROW_MAX_IN, dpi):
        return None
    row_title = [max(cells[i].title_h for i in range(r * ncols, min(count, (r + 1) * ncols))) for r in range(rows)]
    row_h = [t + title_pad + image_h for t in row_title]
    grid_h = sum(row_h) + gap_y * (rows - 1)
    legend_ncols, legend_w, legend_h = 0, 0, 0
    if legend_sizes:
        room = max(grid_w, legend_sizes[0][0])
        legend_ncols = max(k for k in range(1, len(legend_sizes) + 1) if legend_sizes[k - 1][0] <= room)
        legend_w, legend_h = legend_sizes[legend_ncols - 1]
    inner_w = max(grid_w, legend_w)
    wrapped = wrap_text(note, inner_w, note_measure) if note else None
    note_h = note_lines[0] + wrapped.count("\n") * note_lines[1] if wrapped else 0
    legend_top = grid_h + (_px(LEGEND_PAD_IN, dpi) if legend_sizes else 0)
    note_top = legend_top + legend_h + (_px(NOTE_PAD_IN, dpi) if wrapped else 0)
    content_h = note_top + note_h
    natural_w, natural_h = inner_w + 2 * margin, content_h + 2 * margin
    width = max(natural_w, math.ceil(natural_h / MAX_SIDE_RATIO))
    height = max(natural_h, math.ceil(width / MAX_SIDE_RATIO))
    aspect = natural_w / natural_h
    outside = not 1 / MAX_SIDE_RATIO <= aspect <= MAX_SIDE_RATIO
    score = abs(math.log(aspect / TARGET_SIDE_RATIO)) + (10.0 if outside else 0.0)
    ox, oy = (width - inner_w) // 2, (height - content_h) // 2
    grid_left = ox + (inner_w - grid_w) // 2
    # Images of a column share their left edge (a heat map's colorbar hangs on the right); each title is
    # centred on its image, kept inside its column.
    col_content = [max(cells[i].content_w for i in range(c, count, ncols)) for c in range(ncols)]
    origins, anchors = [], []
    for i, cell in enumerate(cells):
        r, c = divmod(i, ncols)
        col_left = grid_left + sum(col_w[:c]) + gap_x * c
        top = oy + sum(row_h[:r]) + gap_y * r + row_title[r] + title_pad
        left = col_left + (col_w[c] - col_content[c]) // 2
        origins.append((left, top))
        half = cell.title_w / 2
        centre = min(max(left + image_w / 2, col_left + half), col_left + col_w[c] - half)
        anchors.append((centre, top - title_pad))
    centre = ox + inner_w / 2
    return _Layout(width, height, image_w, image_h, origins, anchors, legend_ncols, (centre, oy + legend_top),
                   wrapped, (centre, oy + note_top), score)  # fmt: skip


def _image_axes(fig: Figure, layout: _Layout, slot: int, geometry: TokenGeometry) -> Any:
    left, top = layout.image_origins[slot]
    ax = _axes_px(fig, layout, left, top, layout.image_w, layout.image_h)
    height, img_width = geometry.image_size
    ax.set_xlim(0, img_width)
    ax.set_ylim(height, 0)
    ax.set_aspect("auto")
    ax.set_axis_off()
    return ax


def _axes_px(fig: Figure, layout: _Layout, left: int, top: int, width: int, height: int) -> Any:
    bottom = layout.height - top - height
    return fig.add_axes((left / layout.width, bottom / layout.height, width / layout.width, height / layout.height))


def _axes_extent(ax: Any, geometry: TokenGeometry, height_px: int) -> list[float]:
    height, width = geometry.image_size
    return _to_figure_px(ax, np.array([[0.0, 0.0, float(width), float(height)]]), height_px)[0]


def _merge_fills(panel: PanelInput, drawn: np.ndarray) -> dict[int, tuple[float, float, float]]:
    if panel.assignment is None:
        return {}
    palette = matplotlib.colormaps["tab20"]
    return {int(i): tuple(palette(int(panel.assignment[i]) % 20)[:3])  # type: ignore[misc]
            for i in np.flatnonzero(drawn & (panel.assignment >= 0))}  # fmt: skip


def _checked_image(image: np.ndarray, geometry: TokenGeometry, panels: Sequence[PanelInput], dpi: float) -> np.ndarray:
    """`image` as an array, once it, the panels and the dpi fit together (ValueError otherwise)."""
    image = np.asarray(image)
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"image must be an (H, W, 3) uint8 array, got {image.shape} {image.dtype}")
    if tuple(image.shape[:2]) != tuple(geometry.image_size):
        raise ValueError(f"image is {image.shape[1]}x{image.shape[0]} but the tokens' image_size is "
                         f"{geometry.image_size[1]}x{geometry.image_size[0]} (width x height)")  # fmt: skip
    if not panels:
        raise ValueError("overlay_figure needs at least one panel")
    if dpi <= 0:
        raise ValueError(f"dpi must be positive, got {dpi}")
    n = geometry.num_tokens
    for p in panels:
        if p.assignment is not None and p.assignment.shape[0] != n:
            raise ValueError(f"{p.method}: assignment has {p.assignment.shape[0]} entries, the geometry {n} tokens")
    return image


def _drawn_view(geometry: TokenGeometry, view: View | None) -> tuple[np.ndarray, str | None]:
    """(the tokens drawn, the titles' line naming the view or None for a one-view backbone)."""
    effective_view = None if geometry.views is None else view or "high"
    drawn = drawn_mask(geometry, effective_view)
    if effective_view is None:
        return drawn, None
    name = "high-resolution" if effective_view == "high" else "base"
    return drawn, f"{name} view: {int(drawn.sum())} of {geometry.num_tokens} tokens drawn"


def _title_cells(fig: Figure, renderer: Any, contents: list[tuple[str, int]], dpi: float) -> list[_Cell]:
    """A cell per (title, content width): the title wrapped to its column and measured."""
    column_min = _px(COLUMN_MIN_IN, dpi)
    title_measure = _text_measure(renderer, TITLE_PT)
    cells = []
    for text, content_w in contents:
        width = max(content_w, column_min)
        artist = fig.text(0, 0, wrap_text(text, width, title_measure), fontsize=TITLE_PT, ha="center",
                          va="bottom", linespacing=LINE_SPACING)  # fmt: skip
        cells.append(_Cell(artist, content_w, width, *_size_px(artist, renderer)))
    return cells


def _legend_sizes(fig: Figure, renderer: Any, handles: list[Any]) -> list[tuple[int, int]]:
    """(width, height) in pixels of the legend in 1, 2, ... columns."""
    sizes = []
    for k in range(1, len(handles) + 1):
        trial = _legend(fig, handles, k)
        sizes.append(_size_px(trial, renderer))
        trial.remove()
    return sizes


def _note_lines(fig: Figure, renderer: Any, note: str | None) -> tuple[int, int]:
    """Height of one line of the footer, and what each further line adds (0, 0 without a footer)."""
    if not note:
        return 0, 0
    probe = fig.text(0, 0, "Ag", fontsize=NOTE_PT, linespacing=LINE_SPACING)
    first = _size_px(probe, renderer)[1]
    probe.set_text("Ag\nAg")
    lines = (first, _size_px(probe, renderer)[1] - first)
    probe.remove()
    return lines


def _lay_out(
    fig: Figure, geometry: TokenGeometry, titles: list[str], scores_title: str | None, handles: list[Any],
    note: str | None, dpi: float,
) -> _Layout:  # fmt: skip
    """Measure titles, legend and footer (their size in pixels is set by the dpi alone), choose the grid, size
    the canvas and place the titles."""
    renderer = FigureCanvasAgg(fig).get_renderer()
    image_w, image_h = _image_px(geometry, dpi)
    contents = [(title, image_w) for title in titles]
    if scores_title is not None:
        contents.append((scores_title, image_w + _px(CBAR_GAP_IN + CBAR_W_IN + CBAR_LABELS_IN, dpi)))
    cells = _title_cells(fig, renderer, contents, dpi)
    legend_sizes = _legend_sizes(fig, renderer, handles)
    note_lines = _note_lines(fig, renderer, note)
    layout = _layout(cells, image_w, image_h, legend_sizes, note, _text_measure(renderer, NOTE_PT), note_lines,
                     dpi)  # fmt: skip
    fig.set_size_inches(layout.width / dpi, layout.height / dpi)
    for cell, (x, y) in zip(cells, layout.title_anchors, strict=True):
        cell.title.set_position((x / layout.width, 1 - y / layout.height))
    return layout


@dataclass(frozen=True)
class _Canvas:
    """What every panel draws on: the displayed image, the drawn tokens and the box outlines' width."""

    base: np.ndarray  # float RGB of the image as displayed
    drawn: np.ndarray  # (N,) bool
    stroke_pt: float
    inset_x: float  # data units that keep an outline inside its footprint
    inset_y: float

    @classmethod
    def of(cls, image: np.ndarray, geometry: TokenGeometry, drawn: np.ndarray, layout: _Layout, dpi: float) -> _Canvas:
        height, width = geometry.image_size
        scale_x, scale_y = layout.image_w / width, layout.image_h / height
        stroke = _stroke_px(geometry, drawn, scale_x, scale_y)
        base = _display_image(image, layout.image_w, layout.image_h)
        return cls(base, drawn, stroke * 72.0 / dpi, stroke / 2 / scale_x, stroke / 2 / scale_y)


def _panel_tokens(panel: PanelInput, drawn: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(drawn anchors, drawn signals, (N,) bool of the tokens shown undimmed)."""
    anchors = panel.anchors
    anchors = anchors[drawn[anchors]] if anchors.size else anchors
    signals = panel.signals if panel.signals is not None else np.zeros(0, dtype=np.int64)
    signals = signals[drawn[signals]] if signals.size else signals
    kept = np.zeros(drawn.shape[0], dtype=bool)
    kept[anchors] = True
    kept[signals] = True
    if panel.category == "merging" and panel.assignment is not None:
        kept |= panel.assignment >= 0
    return anchors, signals, kept


def _outline(ax: Any, boxes: np.ndarray, canvas: _Canvas, colour: str, zorder: float) -> None:
    """Box outlines drawn inside each footprint."""
    ax.add_collection(PolyCollection(_inset_polygons(boxes, canvas.inset_x, canvas.inset_y), facecolors="none",
                                     edgecolors=colour, linewidths=canvas.stroke_pt, joinstyle="miter", snap=False,
                                     zorder=zorder))  # fmt: skip


def _draw_panel(
    fig: Figure, layout: _Layout, slot: int, panel: PanelInput, summary: dict[str, Any], geometry: TokenGeometry,
    canvas: _Canvas, links: bool,
) -> PanelInfo:  # fmt: skip
    """One method's panel in grid cell `slot`, and where its boxes landed."""
    ax = _image_axes(fig, layout, slot, geometry)
    height, width = geometry.image_size
    anchors, signals, kept = _panel_tokens(panel, canvas.drawn)
    fills = _merge_fills(panel, canvas.drawn) if panel.category == "merging" and panel.assignment is not None else None
    raster = _compose(canvas.base, geometry, canvas.drawn, kept, fills)
    ax.imshow(raster, extent=(0, width, height, 0), aspect="auto", interpolation="antialiased", zorder=0)
    _draw_unseen(ax, geometry)
    drawn_links = strongest_links(panel, signals, canvas.drawn) if links else []
    if drawn_links:
        centres = (geometry.boxes[:, 0:2] + geometry.boxes[:, 2:4]) / 2
        ax.add_collection(LineCollection([[centres[s], centres[a]] for s, a in drawn_links], colors=GREEN,
                                         linewidths=max(0.4, canvas.stroke_pt / 3), alpha=0.8, zorder=2))  # fmt: skip
    if signals.size:
        _outline(ax, geometry.boxes[signals], canvas, GREEN, 3)
    if anchors.size:
        _outline(ax, geometry.boxes[anchors], canvas, RED, 4)
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    return PanelInfo(
        method=panel.method,
        category=panel.category,
        summary=summary,
        anchor_tokens=[int(i) for i in anchors],
        signal_tokens=[int(i) for i in signals],
        anchors=_to_figure_px(ax, geometry.boxes[anchors], layout.height),
        signals=_to_figure_px(ax, geometry.boxes[signals], layout.height),
        image_extent=_axes_extent(ax, geometry, layout.height),
        links=drawn_links,
    )


def _draw_legend_and_note(fig: Figure, layout: _Layout, handles: list[Any]) -> None:
    if handles:
        legend = _legend(fig, handles, layout.legend_ncols)
        x, y = layout.legend_anchor
        legend.set_bbox_to_anchor((x / layout.width, 1 - y / layout.height), transform=fig.transFigure)
    if layout.note:
        x, y = layout.note_anchor
        fig.text(x / layout.width, 1 - y / layout.height, layout.note, ha="center", va="top", fontsize=NOTE_PT,
                 color=NOTE_COLOUR, linespacing=LINE_SPACING)  # fmt: skip


@pinned_fonts()
def overlay_figure(
    image: np.ndarray,
    geometry: TokenGeometry,
    panels: Sequence[PanelInput],
    *,
    backbone: str,
    view: View | None = "high",
    show_scores: bool = False,
    links: bool = False,
    note: str | None = None,
    dpi: float = 150.0,
) -> OverlayFigure:
    """Panels on the original image, one per method, plus an optional heat map of scores, in a grid.

    ``image`` is the original (H, W, 3) uint8 picture; ``geometry`` the tokens' footprints in it.
    ``view`` picks LLaVA-NeXT's base or high-resolution tokens (ignored, with a note, for one-view
    backbones). ``show_scores`` adds a heat map of the first panel's scores that has them (psi_bar for
    CaRe); ``links`` draws a thin line from signals to the anchor they mostly feed: the strongest signal of
    each anchor (highest c_r), at most :data:`LINKS_MAX` (a note says how many are drawn). ``note`` (e.g. the
    demo backbone's warning) is a footer wrapped to the canvas. See the module docstring for the layout.
    """
    image = _checked_image(image, geometry, panels, dpi)
    n = geometry.num_tokens
    drawn, view_line = _drawn_view(geometry, view)
    notes: list[str] = []
    scored = next((p for p in panels if p.scores is not None and p.scores.shape[0] == n), None)
    if show_scores and scored is None:
        notes.append("no method here has per-token scores; the score panel is left out")
    shown = scored if show_scores else None  # the panel whose scores the heat map shows
    scores_title, scores_label = _scores_title(shown, backbone, view_line) if shown is not None else (None, None)

    summaries = [panel_summary(p, n, drawn) for p in panels]
    titles = [_title(p, s, backbone, view_line) for p, s in zip(panels, summaries, strict=True)]
    has_signals = any(p.signals is not None for p in panels)
    unseen = bool(_unseen_rects(geometry))
    handles = _legend_handles({p.category for p in panels}, has_signals, unseen, links and has_signals)
    fig = Figure(figsize=(4.0, 4.0), dpi=dpi, facecolor="white")
    layout = _lay_out(fig, geometry, titles, scores_title, handles, note, dpi)

    canvas = _Canvas.of(image, geometry, drawn, layout, dpi)
    infos = [
        _draw_panel(fig, layout, slot, panel, summary, geometry, canvas, links)
        for slot, (panel, summary) in enumerate(zip(panels, summaries, strict=True))
    ]
    scores_info = None
    if shown is not None and scores_label is not None:
        scores_info = _draw_scores(fig, layout, len(panels), geometry, canvas.base, drawn, shown, scores_label, dpi)
    _draw_legend_and_note(fig, layout, handles)
    if links:
        notes += [f"{info.method}: {len(info.links)} links for the {summary['drawn']['signals']} signals shown: "
                  f"each anchor's strongest signal (highest c_r), at most {LINKS_MAX}"
                  for info, summary in zip(infos, summaries, strict=True) if summary["drawn"]["signals"]]  # fmt: skip
    return OverlayFigure(fig, float(dpi), (layout.width, layout.height), infos, scores_info, notes)


def strongest_links(panel: PanelInput, signals: np.ndarray, drawn: np.ndarray) -> list[tuple[int, int]]:
    """(signal, anchor) token pairs to link: per drawn anchor, the drawn signal that feeds it with the highest
    confidence c_r (the lowest index among equals, or where c_r is unknown), strongest first, at most
    :data:`LINKS_MAX` (every signal's link would cover the image: 459 on InternVL3 at K = 64)."""
    if panel.assignment is None or not signals.size:
        return []
    best: dict[int, tuple[float, int]] = {}  # anchor -> (-c_r, signal): the smallest is the strongest
    for s in (int(i) for i in signals if drawn[i]):
        row = int(panel.assignment[s])
        if not 0 <= row < panel.token_index.size:
            continue
        anchor = int(panel.token_index[row])
        if anchor < 0 or not drawn[anchor]:
            continue
        c_r = float(panel.confidence[s]) if panel.confidence is not None else math.nan
        key = (-c_r if math.isfinite(c_r) else math.inf, s)
        if anchor not in best or key < best[anchor]:
            best[anchor] = key
    ranked = sorted((key, anchor) for anchor, key in best.items())
    return [(key[1], anchor) for key, anchor in ranked[:LINKS_MAX]]


def _scores_title(panel: PanelInput, backbone: str, view_line: str | None) -> tuple[str, str]:
    """The heat map's title and the JSON label of its scores."""
    is_psi = _is_psi_bar(panel.method)
    label = "psi_bar" if is_psi else "scores"
    heading = r"$\bar{\psi}$ (psi_bar)" if is_psi else "scores"
    lines = [f"{heading} — {panel.method}", backbone]
    if view_line:
        lines.append(view_line)
    return "\n".join(lines), label


def _draw_scores(
    fig: Figure, layout: _Layout, slot: int, geometry: TokenGeometry, base: np.ndarray, drawn: np.ndarray,
    panel: PanelInput, label: str, dpi: float,
) -> dict[str, Any]:  # fmt: skip
    assert panel.scores is not None
    left, top = layout.image_origins[slot]
    ax = _axes_px(fig, layout, left, top, layout.image_w, layout.image_h)
    height, img_width = geometry.image_size
    ax.set_axis_off()
    grey = base.mean(axis=2, keepdims=True).repeat(3, axis=2) * 0.6 + 0.4
    ax.imshow(grey, extent=(0, img_width, height, 0), aspect="auto", interpolation="antialiased", zorder=0)
    scores = panel.scores
    finite = scores[drawn & np.isfinite(scores)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    raster = _score_raster(base.shape[:2], geometry, drawn, scores)
    mappable = ax.imshow(np.ma.masked_invalid(raster), extent=(0, img_width, height, 0), aspect="auto",
                         interpolation="nearest", cmap=SCORE_CMAP, vmin=lo, vmax=hi if hi > lo else lo + 1e-12,
                         alpha=0.8, zorder=0.5)  # fmt: skip
    _draw_unseen(ax, geometry)
    ax.set_xlim(0, img_width)
    ax.set_ylim(height, 0)
    cax = _axes_px(fig, layout, left + layout.image_w + _px(CBAR_GAP_IN, dpi), top, _px(CBAR_W_IN, dpi),
                   layout.image_h)  # fmt: skip
    bar = fig.colorbar(mappable, cax=cax, format=FuncFormatter(lambda v, _pos: f"{v:.3g}"))
    bar.ax.yaxis.set_major_locator(MaxNLocator(nbins=max(1, min(5, int(layout.image_h / (0.3 * dpi))))))
    bar.ax.tick_params(labelsize=TICK_PT)
    return {
        "method": panel.method,
        "label": label,
        "min": lo,
        "max": hi,
        "image_extent": _axes_extent(ax, geometry, layout.height),
    }


def _legend_handles(categories: set[str], has_signals: bool, unseen: bool, links: bool) -> list[Any]:
    names = []
    if "calibration" in categories:
        names.append("calibration anchor")
    if "selection" in categories:
        names.append("kept token")
    if "merging" in categories:
        names.append("representative token")
    handles: list[Any] = [Patch(facecolor="none", edgecolor=RED, linewidth=1.5, label=" / ".join(names))]
    if has_signals:
        handles.append(Patch(facecolor="none", edgecolor=GREEN, linewidth=1.5, label="calibration signal"))
    if links:
        handles.append(Line2D([], [], color=GREEN, linewidth=0.8, label="strongest signal → its anchor"))
    if "merging" in categories:
        palette = matplotlib.colormaps["tab20"]
        handles.append(Patch(facecolor=palette(2), alpha=0.7, edgecolor="none",
                             label="merged (colour = output token)"))  # fmt: skip
    handles.append(Patch(facecolor=(DIM * 0.5,) * 3, edgecolor="none", label="discarded (dimmed)"))
    if unseen:
        handles.append(Patch(facecolor=UNSEEN_FACE, edgecolor=UNSEEN_HATCH, hatch="///", linewidth=0,
                             label="not seen by the model"))  # fmt: skip
    return handles
