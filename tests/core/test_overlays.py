"""care_core.overlays: boxes land where the JSON says, in the right colours, on the original image."""

from __future__ import annotations

import io
import itertools
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from PIL import Image

from care_core.overlays import GREEN, RED, PanelInput, TokenGeometry, overlay_figure

RED_RGB = np.array([255, 0, 0])
GREEN_RGB = np.array([int(GREEN[i : i + 2], 16) for i in (1, 3, 5)])


def grid_geometry(height: int, width: int, rows: int = 12, views: bool = False) -> TokenGeometry:
    """A LLaVA-1.5-like centre-square grid (square of side min(H, W)); with `views`, a 2x2 base view first."""
    side = min(height, width)
    left, top = (width - side) / 2, (height - side) / 2
    p = side / rows
    cells = [(r, c) for r in range(rows) for c in range(rows)]
    boxes = [[left + c * p, top + r * p, left + (c + 1) * p, top + (r + 1) * p] for r, c in cells]
    codes = [1] * len(boxes)
    if views:
        q = side / 2
        base = [[left + c * q, top + r * q, left + (c + 1) * q, top + (r + 1) * q] for r in range(2) for c in range(2)]
        boxes, codes = base + boxes, [0] * 4 + codes
    return TokenGeometry(np.array(boxes, dtype=np.float64), (height, width), (left, top, left + side, top + side),
                         np.array(codes) if views else None)  # fmt: skip


def calibration_panel(n: int, anchors: list[int], signals: list[int], name: str = "care") -> PanelInput:
    anchors_t = np.array(sorted(anchors))
    assignment = np.full(n, -1)
    assignment[anchors_t] = np.arange(anchors_t.size)
    for s in signals:
        assignment[s] = 0
    scores = np.linspace(0.0, 1.0, n)
    return PanelInput(name, "calibration", anchors_t.size, anchors_t, assignment, np.array(sorted(signals)), scores)


def save_png(drawing) -> np.ndarray:  # type: ignore[no-untyped-def]
    buffer = io.BytesIO()
    drawing.figure.savefig(buffer, format="png", dpi=drawing.dpi)
    return np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")).astype(int)


def edge_points(box: list[float]) -> list[tuple[int, int]]:
    """(x, y) of the four edge midpoints, one pixel inside the box."""
    x0, y0, x1, y1 = box
    xm, ym = int((x0 + x1) / 2), int((y0 + y1) / 2)
    return [(int(np.floor(x0)) + 1, ym), (int(np.ceil(x1)) - 2, ym), (xm, int(np.floor(y0)) + 1),
            (xm, int(np.ceil(y1)) - 2)]  # fmt: skip


def assert_edges(png: np.ndarray, boxes: list[list[float]], colour: np.ndarray) -> None:
    for box in boxes:
        for x, y in edge_points(box):
            assert np.abs(png[y, x] - colour).max() <= 30, (box, (x, y), png[y, x].tolist())


def to_image_px(box: list[float], extent: list[float], height: int, width: int) -> np.ndarray:
    ex0, ey0, ex1, ey1 = extent
    x0, y0, x1, y1 = box
    return np.array([(x0 - ex0) / (ex1 - ex0) * width, (y0 - ey0) / (ey1 - ey0) * height,
                     (x1 - ex0) / (ex1 - ex0) * width, (y1 - ey0) / (ey1 - ey0) * height])  # fmt: skip


@pytest.mark.parametrize("dpi", [72, 100, 150])
def test_edges_are_red_and_green_at_the_reported_pixels(dpi: int) -> None:
    rng = np.random.default_rng(0)
    image = (rng.random((180, 300, 3)) * 255).astype(np.uint8)
    geometry = grid_geometry(180, 300)
    n = geometry.num_tokens
    panel = calibration_panel(n, anchors=[0, 5, 13, 14, 77, 143], signals=[1, 6, 15, 26, 78, 142])
    selection = PanelInput("prca-only", "selection", 6, panel.token_index, None, None, None)
    drawing = overlay_figure(image, geometry, [panel, selection], backbone="test", links=True, show_scores=True,
                             dpi=dpi, note="demo backbone: random weights")  # fmt: skip
    png = save_png(drawing)
    assert (png.shape[1], png.shape[0]) == drawing.size_px
    for info in drawing.panels:
        assert len(info.anchors) == 6
        assert_edges(png, info.anchors, RED_RGB)
        assert_edges(png, info.signals, GREEN_RGB)
    assert drawing.panels[0].signal_tokens == [1, 6, 15, 26, 78, 142]
    assert drawing.panels[1].signals == []
    assert drawing.panels[0].summary["signal_share"] == pytest.approx(6 / (n - 6))
    assert drawing.scores_panel is not None and drawing.scores_panel["label"] == "psi_bar"


def test_boxes_map_back_to_the_token_footprints_in_the_original_image() -> None:
    height, width = 240, 160  # tall: the grid covers a centred square, top and bottom unseen
    geometry = grid_geometry(height, width)
    image = np.full((height, width, 3), 40, dtype=np.uint8)
    target = 3 * 12 + 9
    x0, y0, x1, y1 = (round(v) for v in geometry.boxes[target])
    image[y0:y1, x0:x1] = 255
    panel = PanelInput("prca-only", "selection", 1, np.array([target]), None, None, None)
    drawing = overlay_figure(image, geometry, [panel], backbone="test", dpi=120)
    info = drawing.panels[0]
    assert info.anchor_tokens == [target]
    back = to_image_px(info.anchors[0], info.image_extent, height, width)
    tolerance = 1.0 + width / (info.image_extent[2] - info.image_extent[0])
    assert np.allclose(back, geometry.boxes[target], atol=tolerance)
    png = save_png(drawing)
    bx0, by0, bx1, by1 = info.anchors[0]
    inner = png[int(by0) + 5 : int(by1) - 4, int(bx0) + 5 : int(bx1) - 4]
    assert inner.mean() > 200  # the bright square is under its box
    # the area above the crop is hatched grey, not the dark image
    ex0, ey0, ex1, _ = info.image_extent
    unseen_y1 = ey0 + geometry.seen_box[1] / height * (info.image_extent[3] - ey0)
    strip = png[int(ey0) + 2 : int(unseen_y1) - 2, int(ex0) + 2 : int(ex1) - 2]
    assert strip.mean() > 70
    # a discarded token is dimmed: darker than the 40 of the image
    ox0, oy0, ox1, oy1 = to_figure(geometry.boxes[0], info.image_extent, height, width)
    assert png[int(oy0) + 3 : int(oy1) - 3, int(ox0) + 3 : int(ox1) - 3].mean() < 25


def to_figure(box: np.ndarray, extent: list[float], height: int, width: int) -> list[float]:
    ex0, ey0, ex1, ey1 = extent
    sx, sy = (ex1 - ex0) / width, (ey1 - ey0) / height
    return [ex0 + box[0] * sx, ey0 + box[1] * sy, ex0 + box[2] * sx, ey0 + box[3] * sy]


def test_views_select_high_or_base_tokens() -> None:
    geometry = grid_geometry(200, 200, views=True)
    n = geometry.num_tokens
    image = np.zeros((200, 200, 3), dtype=np.uint8)
    panel = calibration_panel(n, anchors=[0, 10, 40], signals=[1, 20])  # 0, 1: base view; others high
    high = overlay_figure(image, geometry, [panel], backbone="test", view="high", dpi=100)
    base = overlay_figure(image, geometry, [panel], backbone="test", view="base", dpi=100)
    assert high.panels[0].anchor_tokens == [10, 40] and high.panels[0].signal_tokens == [20]
    assert base.panels[0].anchor_tokens == [0] and base.panels[0].signal_tokens == [1]
    assert high.panels[0].summary["drawn"]["tokens"] == n - 4
    assert_edges(save_png(base), base.panels[0].anchors, RED_RGB)
    flat = grid_geometry(200, 200)
    single = overlay_figure(image, flat, [calibration_panel(flat.num_tokens, [3], [4])], backbone="t", view="base")
    assert single.panels[0].anchor_tokens == [3]  # one-view backbones ignore the view


def test_merging_colours_members_and_outlines_representatives() -> None:
    geometry = grid_geometry(120, 120)
    n = geometry.num_tokens
    image = np.full((120, 120, 3), 128, dtype=np.uint8)
    assignment = np.full(n, -1)
    assignment[[0, 1, 2]] = 0
    assignment[[50, 51]] = 1
    panel = PanelInput("tome", "merging", 2, np.array([1, 51]), assignment, None, None)
    drawing = overlay_figure(image, geometry, [panel], backbone="test", dpi=150)
    info = drawing.panels[0]
    assert info.anchor_tokens == [1, 51] and info.summary["merged"] == 3
    png = save_png(drawing)
    assert_edges(png, info.anchors, RED_RGB)
    member = to_figure(geometry.boxes[0], info.image_extent, 120, 120)
    centre = png[int((member[1] + member[3]) / 2), int((member[0] + member[2]) / 2)]
    assert np.ptp(centre) > 20  # tinted by the group colour, not grey
    dropped = to_figure(geometry.boxes[100], info.image_extent, 120, 120)
    assert png[int((dropped[1] + dropped[3]) / 2), int((dropped[0] + dropped[2]) / 2)].max() < 60


def test_figure_size_is_deterministic_and_vector_formats_open() -> None:
    geometry = grid_geometry(90, 160)
    rng = np.random.default_rng(1)
    panel = calibration_panel(geometry.num_tokens, [2, 3], [4])
    a = overlay_figure((rng.random((90, 160, 3)) * 255).astype(np.uint8), geometry, [panel], backbone="x", dpi=90)
    b = overlay_figure(np.zeros((90, 160, 3), dtype=np.uint8), geometry, [panel], backbone="x", dpi=90)
    assert a.size_px == b.size_px and a.panels[0].anchors == b.panels[0].anchors
    pdf, svg = io.BytesIO(), io.BytesIO()
    a.figure.savefig(pdf, format="pdf", dpi=a.dpi)
    a.figure.savefig(svg, format="svg", dpi=a.dpi)
    assert pdf.getvalue().startswith(b"%PDF") and b"/Type /Page" in pdf.getvalue()
    assert ET.fromstring(svg.getvalue()).tag.endswith("svg")


def test_bad_inputs_are_value_errors() -> None:
    geometry = grid_geometry(50, 50)
    panel = calibration_panel(geometry.num_tokens, [1], [2])
    with pytest.raises(ValueError, match="image_size"):
        overlay_figure(np.zeros((40, 50, 3), dtype=np.uint8), geometry, [panel], backbone="x")
    with pytest.raises(ValueError, match="uint8"):
        overlay_figure(np.zeros((50, 50), dtype=np.uint8), geometry, [panel], backbone="x")
    with pytest.raises(ValueError, match="at least one panel"):
        overlay_figure(np.zeros((50, 50, 3), dtype=np.uint8), geometry, [], backbone="x")


def test_red_is_pure_red() -> None:
    assert RED == "#ff0000"


# --- layout: every figure looks like a paper figure ------------------------------

DEMO_NOTE = "demo backbone: random weights — its numbers say nothing about a real model"
MIN_FONT_PT = 8.0


def srgb_to_lab(colour: object) -> np.ndarray:
    """CIELAB (D65) of an sRGB colour (any matplotlib colour spec), for ΔE76 distances."""
    from matplotlib.colors import to_rgb

    c = np.array(to_rgb(colour), dtype=np.float64)
    linear = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    m = np.array([[0.4124564, 0.3575761, 0.1804375], [0.2126729, 0.7151522, 0.0721750],
                  [0.0193339, 0.1191920, 0.9503041]])  # fmt: skip
    xyz = m @ linear / np.array([0.95047, 1.0, 1.08883])
    eps = (6 / 29) ** 3
    f = np.where(xyz > eps, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def delta_e(a: object, b: object) -> float:
    return float(np.linalg.norm(srgb_to_lab(a) - srgb_to_lab(b)))


def test_lab_conversion_matches_known_values() -> None:
    assert np.allclose(srgb_to_lab("#ffffff"), [100, 0, 0], atol=0.05)
    assert np.allclose(srgb_to_lab("#ff0000"), [53.24, 80.09, 67.20], atol=0.05)
    assert np.allclose(srgb_to_lab("#0000ff"), [32.30, 79.19, -107.86], atol=0.05)


def drawn_texts(fig) -> list:  # type: ignore[no-untyped-def]
    """Visible, non-empty text artists that are drawn: figure texts, legend texts, titles, axis labels."""
    texts = [t for t in fig.texts]
    for legend in fig.legends:
        texts.extend(legend.get_texts())
    for ax in fig.axes:
        texts.extend([ax.title, ax._left_title, ax._right_title])
        if ax.get_legend() is not None:
            texts.extend(ax.get_legend().get_texts())
        if ax.axison:
            texts.extend([ax.xaxis.label, ax.yaxis.label])
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def assert_inside_canvas(fig) -> None:  # type: ignore[no-untyped-def]
    """Every text artist, every legend and the tight bounding box of everything lie inside the canvas."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width, height = fig.canvas.get_width_height()
    for text in drawn_texts(fig):
        box = text.get_window_extent(renderer)
        assert box.x0 >= -0.5 and box.y0 >= -0.5 and box.x1 <= width + 0.5 and box.y1 <= height + 0.5, (
            text.get_text(), box.bounds, (width, height))  # fmt: skip
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    for legend in legends:
        box = legend.get_window_extent(renderer)
        assert box.x0 >= -0.5 and box.y0 >= -0.5 and box.x1 <= width + 0.5 and box.y1 <= height + 0.5, box.bounds
    tight = fig.get_tightbbox(renderer)
    dpi = fig.dpi
    assert tight.x0 * dpi >= -0.5 and tight.y0 * dpi >= -0.5, tight.bounds
    assert tight.x1 * dpi <= width + 0.5 and tight.y1 * dpi <= height + 0.5, (tight.bounds, width, height)


def assert_font_sizes(fig) -> None:  # type: ignore[no-untyped-def]
    from matplotlib.text import Text

    for text in fig.findobj(Text):
        if text.get_visible() and text.get_text().strip():
            assert text.get_fontsize() >= MIN_FONT_PT, (text.get_text(), text.get_fontsize())


def overlaps(a, b, tol: float = 0.5) -> bool:  # type: ignore[no-untyped-def]
    return a.x0 < b.x1 - tol and b.x0 < a.x1 - tol and a.y0 < b.y1 - tol and b.y0 < a.y1 - tol


def assert_no_text_on_images(drawing) -> None:  # type: ignore[no-untyped-def]
    """Titles, legend and footer never cover an image (or colorbar), nor each other."""
    fig = drawing.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = drawn_texts(fig)
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    boxes += [("legend", legend.get_window_extent(renderer)) for legend in fig.legends]
    for name, box in boxes:
        for ax in fig.axes:
            assert not overlaps(box, ax.bbox), (name, box.bounds, ax.bbox.bounds)
    separate = [(t.get_text(), t.get_window_extent(renderer)) for t in fig.texts]
    separate += [("legend", legend.get_window_extent(renderer)) for legend in fig.legends]
    separate += [(ax.title.get_text(), ax.title.get_window_extent(renderer)) for ax in fig.axes if ax.title.get_text()]
    for (na, a), (nb, b) in itertools.combinations(separate, 2):
        assert not overlaps(a, b), (na, nb, a.bounds, b.bounds)


def random_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)


def panels_for(geometry: TokenGeometry, count: int) -> list[PanelInput]:
    n = geometry.num_tokens
    names = ["care", "prca-only", "zoo-prune", "divprune", "tome", "simple-calib"]
    out: list[PanelInput] = []
    for i in range(count):
        anchors = sorted({(7 * j + 3 * i) % n for j in range(max(2, n // 12))})
        signals = sorted({(11 * j + 5 + i) % n for j in range(max(1, n // 20))} - set(anchors))
        if names[i] == "tome":
            assignment = np.full(n, -1)
            assignment[np.array(anchors)] = np.arange(len(anchors))
            assignment[np.array(signals)] = 0
            out.append(PanelInput("tome", "merging", len(anchors), np.array(anchors), assignment, None, None))
        elif names[i] in ("zoo-prune", "divprune"):
            out.append(PanelInput(names[i], "selection", len(anchors), np.array(anchors), None, None,
                                  np.linspace(0, 1, n)))  # fmt: skip
        else:
            out.append(calibration_panel(n, anchors, signals, name=names[i]))
    return out


def check_layout(drawing) -> None:  # type: ignore[no-untyped-def]
    assert_inside_canvas(drawing.figure)
    assert_font_sizes(drawing.figure)
    assert_no_text_on_images(drawing)
    assert tuple(drawing.figure.canvas.get_width_height()) == drawing.size_px
    png = save_png(drawing)
    assert (png.shape[1], png.shape[0]) == drawing.size_px
    frame = np.concatenate([png[:2].reshape(-1, 3), png[-2:].reshape(-1, 3), png[:, :2].reshape(-1, 3),
                            png[:, -2:].reshape(-1, 3)])  # fmt: skip
    assert frame.min() >= 250, "something is drawn on the canvas' outer frame (clipped)"
    for info in drawing.panels:
        assert_edges(png, info.anchors, RED_RGB)
        assert_edges(png, info.signals, GREEN_RGB)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize(("scores", "links"), [(False, False), (True, False), (False, True), (True, True)])
def test_multi_panel_layouts_fit_the_canvas(count: int, scores: bool, links: bool) -> None:
    geometry = grid_geometry(200, 300)
    drawing = overlay_figure(random_image(200, 300), geometry, panels_for(geometry, count), backbone="tiny-llava",
                             show_scores=scores, links=links, note=DEMO_NOTE)  # fmt: skip
    check_layout(drawing)
    width, height = drawing.size_px
    assert 1 / 3 <= width / height <= 3, drawing.size_px


def test_many_panels_wrap_into_rows() -> None:
    geometry = grid_geometry(200, 200)
    drawing = overlay_figure(random_image(200, 200), geometry, panels_for(geometry, 6), backbone="t",
                             show_scores=True, note=DEMO_NOTE)  # fmt: skip
    tops = sorted({round(p.image_extent[1]) for p in drawing.panels})
    assert len(tops) >= 2  # more than one row
    width, height = drawing.size_px
    assert width / height <= 3


@pytest.mark.parametrize(("width", "height"), [(1600, 300), (300, 1600)], ids=["wide", "tall"])
@pytest.mark.parametrize("count", [1, 4])
def test_panoramas_are_readable_and_bounded(width: int, height: int, count: int) -> None:
    geometry = grid_geometry(height, width)
    drawing = overlay_figure(random_image(height, width), geometry, panels_for(geometry, count), backbone="t",
                             show_scores=True, links=True, note=DEMO_NOTE)  # fmt: skip
    check_layout(drawing)
    fw, fh = drawing.size_px
    assert 1 / 3 <= fw / fh <= 3, drawing.size_px
    for info in drawing.panels:
        ex0, ey0, ex1, ey1 = info.image_extent
        assert min(ex1 - ex0, ey1 - ey0) >= 1.0 * drawing.dpi  # the short side is at least an inch
        assert info.anchors and min(b[2] - b[0] for b in info.anchors) >= 4  # tokens still drawn


def backbone_geometry(name: str, height: int, width: int) -> TokenGeometry:
    from care_core.backbones import load_backbone

    adapter = load_backbone(name, device="cpu")
    return TokenGeometry.from_tokens(adapter.encode_image(Image.new("RGB", (width, height))))


@pytest.mark.parametrize(("backbone", "view"), [("tiny-llava", None), ("tiny-qwen2.5-vl", None),
                                                 ("tiny-llava-next", "high"), ("tiny-llava-next", "base")])  # fmt: skip
def test_single_panel_of_each_backbone_fits(backbone: str, view: str | None) -> None:
    geometry = backbone_geometry(backbone, 512, 512)
    drawing = overlay_figure(random_image(512, 512), geometry, panels_for(geometry, 1), backbone=backbone,
                             view=view or "high", note=DEMO_NOTE)  # fmt: skip
    check_layout(drawing)
    # not mostly white: the image takes a good share of the canvas
    ex0, ey0, ex1, ey1 = drawing.panels[0].image_extent
    width, height = drawing.size_px
    assert (ex1 - ex0) * (ey1 - ey0) >= 0.5 * width * height


def test_canvas_follows_the_documented_rule() -> None:
    """The canvas does not depend on the image's resolution, only on its aspect ratio and the panels."""
    small, large = grid_geometry(150, 200), grid_geometry(600, 800)
    a = overlay_figure(random_image(150, 200), small, panels_for(small, 2), backbone="t", note=DEMO_NOTE)
    b = overlay_figure(random_image(600, 800), large, panels_for(large, 2), backbone="t", note=DEMO_NOTE)
    assert a.size_px == b.size_px
    one = overlay_figure(random_image(200, 200), grid_geometry(200, 200), panels_for(grid_geometry(200, 200), 1),
                         backbone="t", dpi=150)  # fmt: skip
    ex0, ey0, ex1, ey1 = one.panels[0].image_extent
    assert (round(ex1 - ex0), round(ey1 - ey0)) == (480, 480)  # a square image is 3.2 in a side
    assert one.size_px[0] == 480 + 2 * round(0.1 * 150)


# --- the CSR bar chart ------------------------------------------------------------------------------------


def csr_rows(methods: list[str], budgets: list[str], lo: float, hi: float, std: float = 0.8) -> list[dict]:
    rng = np.random.default_rng(3)
    return [{"method": m, "budget": b, "mean": float(rng.uniform(lo, hi)), "std": std, "n": 5}
            for m in methods for b in budgets]  # fmt: skip


def bar_patches(fig) -> list:  # type: ignore[no-untyped-def]
    ax = fig.axes[0]
    return [p for c in ax.containers if hasattr(c, "patches") for p in c.patches]


@pytest.mark.parametrize("count", [3, 8, 16])
def test_csr_chart_fits_and_its_legend_covers_no_bar(count: int) -> None:
    from care_core.figures import csr_bar_chart
    from care_core.methods import method_names

    methods = method_names()[:count]
    fig = csr_bar_chart(csr_rows(methods, ["ratio 0.11", "K=64", "K=128"], 5, 98),
                        title="CSR ×100 on tiny-llava (12 pairs)", note=DEMO_NOTE)  # fmt: skip
    assert_inside_canvas(fig)
    assert_font_sizes(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 1
    legend_box = legends[0].get_window_extent(renderer)
    for bar in bar_patches(fig):
        assert not overlaps(legend_box, bar.get_window_extent(renderer)), "the legend covers a bar"
    note = [t for t in fig.texts if "random weights" in t.get_text()]
    assert note, "the demo note is on the chart"


def test_csr_method_colours_are_distinct() -> None:
    from care_core.figures import csr_bar_chart
    from care_core.methods import method_names

    methods = method_names()
    fig = csr_bar_chart(csr_rows(methods, ["K=64"], 20, 80), title="t")
    styles = {}
    for container in fig.axes[0].containers:
        if hasattr(container, "patches"):
            patch = container.patches[0]
            styles[container.get_label()] = (patch.get_facecolor()[:3], patch.get_hatch() or "")
    assert set(styles) == set(methods)
    assert len(set(styles.values())) == len(methods)  # colour and hatch tell every method apart
    items = list(styles.items())
    for (ma, (ca, ha)), (mb, (cb, hb)) in itertools.combinations(items, 2):
        if ha == hb:
            assert delta_e(ca, cb) >= 20, (ma, mb, delta_e(ca, cb))
    first = [colour for _, (colour, hatch) in items if not hatch]
    assert len(first) >= 8  # at least eight methods get plain, distinct colours
    for colour in first:
        assert delta_e(colour, RED) >= 20 and delta_e(colour, GREEN) >= 20
    assert delta_e(styles["care"][0], styles["visionzip"][0]) >= 20 or styles["care"][1] != styles["visionzip"][1]


def test_csr_axis_shows_close_values() -> None:
    from care_core.figures import csr_bar_chart

    rows = csr_rows(["care", "zoo-prune", "visionzip"], ["K=64", "K=128"], 40, 45, std=0.5)
    fig = csr_bar_chart(rows, title="t")
    lo, hi = fig.axes[0].get_ylim()
    data_lo = min(r["mean"] - r["std"] for r in rows)
    data_hi = max(r["mean"] + r["std"] for r in rows)
    assert 0 < lo <= data_lo and hi >= data_hi
    assert hi - lo <= 3 * (data_hi - data_lo), (lo, hi)
    spread = csr_rows(["care", "zoo-prune", "visionzip"], ["K=64"], 5, 90)
    assert csr_bar_chart(spread, title="t").axes[0].get_ylim()[0] == 0


# --- links, legend, fonts ----------------------------------------------------------------------------------


def test_links_are_each_anchors_strongest_signal_and_capped() -> None:
    """On 256 tokens: 120 anchors, 136 signals with known c_r, several per anchor. Drawn: per anchor its signal of
    the highest c_r, the LINKS_MAX strongest of those (hand-ranked here), and a note says how many."""
    from matplotlib.collections import LineCollection

    from care_core.overlays import LINKS_MAX

    geometry = grid_geometry(256, 256, rows=16)
    n = geometry.num_tokens
    anchors = np.arange(0, 240, 2)
    signals = np.array(sorted(set(range(n)) - set(anchors.tolist())))
    rng = np.random.default_rng(5)
    assignment = np.full(n, -1)
    assignment[anchors] = np.arange(anchors.size)
    assignment[signals] = rng.permutation(np.arange(signals.size) % anchors.size)  # every anchor fed, 16 twice
    confidence = np.full(n, np.nan)
    confidence[signals] = rng.random(signals.size)
    panel = PanelInput("care", "calibration", anchors.size, anchors, assignment, signals, None, confidence)
    best: dict[int, int] = {}
    for s in signals.tolist():
        a = int(anchors[assignment[s]])
        if a not in best or confidence[s] > confidence[best[a]]:
            best[a] = s
    expected = sorted(((s, a) for a, s in best.items()), key=lambda link: -confidence[link[0]])[:LINKS_MAX]
    assert len(best) > LINKS_MAX  # the cap matters here

    drawing = overlay_figure(random_image(256, 256), geometry, [panel], backbone="t", links=True)
    assert drawing.panels[0].links == expected
    segments = [seg for c in drawing.figure.axes[0].collections if isinstance(c, LineCollection)
                for seg in c.get_segments()]  # fmt: skip
    assert len(segments) == LINKS_MAX
    assert any(f"{LINKS_MAX} links for the {signals.size} signals shown" in note for note in drawing.notes)
    plain = overlay_figure(random_image(256, 256), geometry, [panel], backbone="t")
    assert plain.panels[0].links == [] and not any("links" in note for note in plain.notes)


def test_legend_names_anchors_and_signals_alike() -> None:
    geometry = grid_geometry(200, 200)
    drawing = overlay_figure(random_image(200, 200), geometry, panels_for(geometry, 1), backbone="t", links=True)
    labels = [text.get_text() for text in drawing.figure.legends[0].get_texts()]
    assert labels[:3] == ["calibration anchor", "calibration signal", "strongest signal → its anchor"], labels


def test_every_text_of_a_figure_is_in_one_font_whatever_the_rc() -> None:
    """Built and drawn under a matplotlibrc that asks for serif text: titles, legend, footer, the heat map's
    colour-bar tick labels (made while drawing) and the CSR charts' ticks are all in DejaVu Sans."""
    import matplotlib
    from matplotlib import font_manager
    from matplotlib.text import Text

    from care_core.figures import csr_bar_chart, csr_budget_curves

    geometry = grid_geometry(200, 300)
    with matplotlib.rc_context({"font.family": "serif", "mathtext.fontset": "cm"}):
        figures = [
            overlay_figure(
                random_image(200, 300),
                geometry,
                panels_for(geometry, 1),
                backbone="t",
                show_scores=True,
                note=DEMO_NOTE,
            ).figure,
            csr_bar_chart(csr_rows(["care", "random"], ["K=64"], 20, 80), title="t"),
            csr_budget_curves(
                [
                    {**r, "ci95": 1.0, "kept_pct": 10.0 * (i + 1)}
                    for i, r in enumerate(csr_rows(["care"], ["K=8", "K=16", "K=32"], 20, 80))
                ],
                title="t",
            ),
        ]
        for figure in figures:
            figure.canvas.draw()
            texts = [t for t in figure.findobj(Text) if t.get_visible() and t.get_text().strip()]
            ticks = [t for ax in figure.axes for t in ax.get_yticklabels() if t.get_text()]
            assert ticks
            fonts = {font_manager.findfont(t.get_fontproperties()).rsplit("/", 1)[-1] for t in texts + ticks}
            assert fonts == {"DejaVuSans.ttf"}, fonts
            assert all(t.get_fontproperties().get_math_fontfamily() == "dejavusans" for t in texts)
