"""care_core.overlays: boxes land where the JSON says, in the right colours, on the original image."""

from __future__ import annotations

import io
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
