"""`care visualize`: pixel tests on the saved figures, geometry per backbone, formats and bad input."""

from __future__ import annotations

import itertools
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from care_core.backbones import DEMO_BACKBONES

from .conftest import EXAMPLES


def read_png(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def edge_points(box: list[float]) -> list[tuple[int, int]]:
    """(x, y) of the four edge midpoints, one pixel inside the box."""
    x0, y0, x1, y1 = box
    xm, ym = int((x0 + x1) / 2), int((y0 + y1) / 2)
    return [(int(np.floor(x0)) + 1, ym), (int(np.ceil(x1)) - 2, ym), (xm, int(np.floor(y0)) + 1),
            (xm, int(np.ceil(y1)) - 2)]  # fmt: skip


def assert_edges(png: np.ndarray, boxes: list[list[float]], colour: str) -> None:
    """Every sampled edge pixel is dominated by `colour` (R high and G, B low for red; G for green)."""
    channel = {"red": 0, "green": 1}[colour]
    for box in boxes:
        for x, y in edge_points(box):
            pixel = png[y, x]
            others = np.delete(pixel, channel)
            # <= 72: anti-aliasing tints the edge of a 7 px box (LLaVA-OneVision's high-res patch at 420 px) up to 63
            assert pixel[channel] >= 170 and others.max() <= 72, (colour, box, (x, y), pixel.tolist())


def to_image_px(box: list[float], extent: list[float], height: int, width: int) -> np.ndarray:
    ex0, ey0, ex1, ey1 = extent
    x0, y0, x1, y1 = box
    return np.array([(x0 - ex0) / (ex1 - ex0) * width, (y0 - ey0) / (ey1 - ey0) * height,
                     (x1 - ex0) / (ex1 - ex0) * width, (y1 - ey0) / (ey1 - ey0) * height])  # fmt: skip


def test_one_method_png_edges_match_json(care, photo: Path, tmp_path: Path) -> None:
    out = tmp_path / "care.png"
    run = care("visualize", photo, "--method", "care", "--ratio", "0.1", "--links", "--scores", "--dpi", "120",
               "--out", out, "--json")  # fmt: skip
    assert run.code == 0, run.err
    report = run.json()
    png = read_png(out)
    assert [png.shape[1], png.shape[0]] == report["figure_px"]
    assert report["N"] == 576 and report["K"] == 57 and report["backbone"]["demo"] is True
    (panel,) = report["panels"]
    assert panel["method"] == "care" and len(panel["anchors"]) == 57
    assert len(panel["signals"]) == panel["summary"]["num_signals"] > 0
    assert panel["summary"]["signal_share"] == pytest.approx(panel["summary"]["num_signals"] / (576 - 57))
    assert_edges(png, panel["anchors"], "red")
    assert_edges(png, panel["signals"], "green")
    assert report["scores_panel"]["label"] == "psi_bar"
    ex0, ey0, ex1, ey1 = panel["image_extent"]
    assert 0 <= ex0 < ex1 <= png.shape[1] and 0 <= ey0 < ey1 <= png.shape[0]


def test_four_methods_in_one_call(care, tmp_path: Path) -> None:
    out = tmp_path / "four.png"
    methods = ["care", "prca-only", "zoo-prune", "simple-calib"]
    args = [a for m in methods for a in ("--method", m)]
    run = care("visualize", EXAMPLES / "coffee.jpg", *args, "--keep", "48", "--dpi", "80", "--out", out, "--json")
    assert run.code == 0, run.err
    report = run.json()
    assert [p["method"] for p in report["panels"]] == methods
    png = read_png(out)
    extents = [p["image_extent"] for p in report["panels"]]
    order = sorted(range(len(extents)), key=lambda i: (extents[i][1], extents[i][0]))
    assert order == list(range(len(methods)))  # a grid, row by row, left to right
    for a, b in itertools.combinations(extents, 2):
        assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]  # images never overlap
    for panel in report["panels"]:
        assert len(panel["anchors"]) == 48
        assert_edges(png, panel["anchors"], "red")
        assert_edges(png, panel["signals"], "green")
    assert report["panels"][3]["summary"]["num_signals"] == 576 - 48  # simple-calib injects every residual token


def llava15_footprint(height: int, width: int, row: int, col: int) -> list[float]:
    """Independent replay of the LLaVA-1.5 processor: shortest edge -> 336, centre crop 336, 14 px patches."""
    if width <= height:
        new_w, new_h = 336, int(336 * height / width)
    else:
        new_w, new_h = int(336 * width / height), 336
    top, left = (new_h - 336) // 2, (new_w - 336) // 2
    sx, sy = width / new_w, height / new_h
    return [(col * 14 + left) * sx, (row * 14 + top) * sy, ((col + 1) * 14 + left) * sx, ((row + 1) * 14 + top) * sy]


def adapter_footprint(name: str, height: int, width: int) -> tuple[int, list[float]]:
    """For families without an independent replay yet: the adapter's own box of a drawn token near (0.3, 0.6)."""
    from care_core.backbones import load_backbone

    adapter = load_backbone(name, device="cpu")
    tokens = adapter.encode_image(Image.new("RGB", (width, height)))
    boxes = tokens.boxes.double().numpy()
    views = getattr(tokens, "views", None)
    drawn = np.ones(len(boxes), dtype=bool) if views is None else views.numpy() == 1
    centres = (boxes[:, :2] + boxes[:, 2:]) / 2
    distance = np.hypot(centres[:, 0] - 0.3 * width, centres[:, 1] - 0.6 * height) + np.where(drawn, 0, 1e9)
    index = int(np.argmin(distance))
    return index, boxes[index].tolist()


#: one demo per family (the geometry is the family's; a family's -random demo has its trained demo's geometry)
ONE_PER_FAMILY = sorted({spec.family: name for name, spec in reversed(list(DEMO_BACKBONES.items()))
                         if spec.shipped}.values())  # fmt: skip


@pytest.mark.parametrize("backbone", ONE_PER_FAMILY)
@pytest.mark.parametrize(("width", "height"), [(420, 420), (300, 500), (540, 310)], ids=["square", "tall", "wide"])
def test_known_region_is_boxed_on_the_original(care, tmp_path: Path, backbone: str, width: int, height: int) -> None:
    family = DEMO_BACKBONES[backbone].family
    if family == "llava-1.5":
        row, col = 5, 17
        target, box = row * 24 + col, llava15_footprint(height, width, row, col)
    else:
        target, box = adapter_footprint(backbone, height, width)
    pixels = np.full((height, width, 3), 40, dtype=np.uint8)
    x0, y0, x1, y1 = (round(v) for v in box)
    pixels[y0:y1, x0:x1] = 255
    image = tmp_path / "square.png"
    Image.fromarray(pixels).save(image)
    out = tmp_path / "overlay.png"
    run = care("visualize", image, "--model", backbone, "--method", "prca-only", "--ratio", "1", "--dpi", "120",
               "--out", out, "--json")  # fmt: skip
    assert run.code == 0, run.err
    report = run.json()
    panel = report["panels"][0]
    assert target in panel["anchor_tokens"]
    drawn = panel["anchors"][panel["anchor_tokens"].index(target)]
    extent = panel["image_extent"]
    back = to_image_px(drawn, extent, height, width)
    tolerance = 1.0 + width / (extent[2] - extent[0])
    assert np.allclose(back, box, atol=tolerance), (back.tolist(), box)
    png = read_png(out)
    bx0, by0, bx1, by1 = drawn
    cx, cy = int((bx0 + bx1) / 2), int((by0 + by1) / 2)
    r = max(0, int(min(bx1 - bx0, by1 - by0) / 2) - 3)  # inside the outline, however small the box
    assert png[cy - r : cy + r + 1, cx - r : cx + r + 1].mean() > 200  # the square, under its box
    assert_edges(png, [drawn], "red")
    sx0, sy0, _sx1, _sy1 = report["seen_box"]
    if family == "llava-1.5":
        assert (sx0 > 0 or sy0 > 0) == (width != height)  # a non-square image is cropped
    if sy0 > 5 or sx0 > 5:  # the unseen strip (top or left) is hatched grey, brighter than the image's 40
        strip = [0.0, 0.0, width if sy0 > 5 else sx0, sy0 if sy0 > 5 else height]
        fx = [extent[0] + v / width * (extent[2] - extent[0]) for v in (strip[0], strip[2])]
        fy = [extent[1] + v / height * (extent[3] - extent[1]) for v in (strip[1], strip[3])]
        region = png[int(fy[0]) + 2 : int(fy[1]) - 2, int(fx[0]) + 2 : int(fx[1]) - 2]
        assert region.size and region.mean() > 70


def test_pdf_and_svg_open(care, photo: Path, tmp_path: Path) -> None:
    pdf = tmp_path / "fig.pdf"
    run = care("visualize", photo, "--method", "care", "--method", "zoo-prune", "--keep", "32", "--out", pdf)
    assert run.code == 0, run.err
    assert "wrote" in run.out
    data = pdf.read_bytes()
    assert data.startswith(b"%PDF") and re.search(rb"/Type\s*/Page\b", data)
    svg = tmp_path / "fig.svg"
    run = care("visualize", photo, "--keep", "32", "--scores", "--view", "base", "--out", svg, "--json")
    assert run.code == 0, run.err
    assert ET.parse(svg).getroot().tag.endswith("svg")
    assert any("--view base ignored" in note for note in run.json()["notes"])


@pytest.mark.parametrize("view", ["high", "base"])
def test_view_picks_tokens_of_tiled_backbones(care, photo: Path, tmp_path: Path, monkeypatch, view: str) -> None:
    """Backbones whose ImageTokens carry `views` (LLaVA-NeXT: 0 base, 1 high-res) draw only the chosen view."""
    import torch

    from care_core.backbones.llava_1_5.adapter import LlavaAdapter

    encode = LlavaAdapter.encode_images

    def with_views(self, images):  # type: ignore[no-untyped-def]
        out = encode(self, images)
        for tokens in out:
            tokens.views = torch.arange(tokens.num_tokens) % 2  # a stand-in split of the tokens into two views
        return out

    monkeypatch.setattr(LlavaAdapter, "encode_images", with_views)
    out = tmp_path / "view.png"
    args = ["--view", view] if view == "base" else []
    run = care("visualize", photo, "--keep", "64", *args, "--dpi", "80", "--out", out, "--json")
    assert run.code == 0, run.err
    report = run.json()
    panel = report["panels"][0]
    parity = 0 if view == "base" else 1
    assert report["view"] == view and panel["anchor_tokens"]
    assert all(i % 2 == parity for i in panel["anchor_tokens"] + panel["signal_tokens"])
    assert panel["summary"]["drawn"]["tokens"] == 288 and not report["notes"]
    assert_edges(read_png(out), panel["anchors"], "red")


def test_existing_out_needs_force(care, photo: Path, tmp_path: Path) -> None:
    out = tmp_path / "fig.png"
    out.write_bytes(b"old")
    run = care("visualize", photo, "--keep", "16", "--out", out)
    assert run.code == 2 and "--force" in run.err and out.read_bytes() == b"old"
    run = care("visualize", photo, "--keep", "16", "--out", out, "--force", "--dpi", "60")
    assert run.code == 0, run.err
    assert out.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["{tmp}/missing.jpg", "--keep", "8", "--out", "{tmp}/o.png"], "no such file"),
        (["{photo}", "--ratio", "0", "--out", "{tmp}/o.png"], "--ratio"),
        (["{photo}", "--ratio", "0.1", "--keep", "3", "--out", "{tmp}/o.png"], "not both"),
        (["{photo}", "--out", "{tmp}/o.png"], "budget"),
        (["{photo}", "--method", "carre", "--keep", "8", "--out", "{tmp}/o.png"], "did you mean care"),
        (["{photo}", "--keep", "8", "--out", "{photo}"], "input"),
        (["{photo}", "--keep", "8", "--out", "{tmp}/o.jpg"], ".png, .pdf or .svg"),
        (["{photo}", "--keep", "8", "--out", "{tmp}/nowhere/o.png"], "does not exist"),
        (["{photo}", "--keep", "8"], "--out"),
        (["{photo}", "--keep", "8", "--view", "side", "--out", "{tmp}/o.png"], "--view"),
        (["{photo}", "--keep", "8", "--dpi", "0", "--out", "{tmp}/o.png"], "--dpi"),
        (["{photo}", "--keep", "100000", "--out", "{tmp}/o.png"], "keep"),
    ],
)
def test_bad_input_is_one_line_exit_2(care, photo: Path, tmp_path: Path, args: list[str], needle: str) -> None:
    filled = [a.format(tmp=tmp_path, photo=photo) for a in args]
    run = care("visualize", *filled)
    assert run.code == 2, (run.out, run.err)
    assert run.err.startswith("error: ") and run.err.count("\n") == 1 and needle in run.err, run.err
    assert run.out == ""
    assert not (tmp_path / "o.png").exists()


def assert_nothing_clipped(png: np.ndarray) -> None:
    """The canvas' outer two-pixel frame is white: no text or image runs off the saved figure."""
    frame = np.concatenate([png[:2].reshape(-1, 3), png[-2:].reshape(-1, 3), png[:, :2].reshape(-1, 3),
                            png[:, -2:].reshape(-1, 3)])  # fmt: skip
    assert frame.min() >= 250, "something is drawn on the canvas' outer frame (clipped)"


@pytest.mark.parametrize(("backbone", "view"), [("tiny-llava", None), ("tiny-qwen2.5-vl", None),
                                                 ("tiny-llava-next", "base")])  # fmt: skip
def test_single_panel_default_dpi_is_not_clipped(care, photo: Path, tmp_path: Path, backbone: str,
                                                 view: str | None) -> None:  # fmt: skip
    out = tmp_path / "single.png"
    args = ["--view", view] if view else []
    run = care("visualize", photo, "-k", "64", "--model", backbone, *args, "--out", out, "--json")
    assert run.code == 0, run.err
    report = run.json()
    png = read_png(out)
    assert [png.shape[1], png.shape[0]] == report["figure_px"]
    assert_nothing_clipped(png)
    assert_edges(png, report["panels"][0]["anchors"], "red")


@pytest.mark.parametrize(("width", "height"), [(1600, 300), (300, 1600)], ids=["wide", "tall"])
def test_panorama_figure_is_bounded_and_drawn(care, tmp_path: Path, width: int, height: int) -> None:
    image = tmp_path / "panorama.png"
    Image.fromarray((np.random.default_rng(0).random((height, width, 3)) * 255).astype(np.uint8)).save(image)
    out = tmp_path / "panorama_fig.png"
    run = care("visualize", image, "--model", "tiny-qwen2.5-vl", "--method", "care", "--method", "zoo-prune",
               "--keep", "32", "--scores", "--out", out, "--json")  # fmt: skip
    assert run.code == 0, run.err
    report = run.json()
    png = read_png(out)
    fw, fh = report["figure_px"]
    assert 1 / 3 <= fw / fh <= 3, report["figure_px"]
    assert_nothing_clipped(png)
    for panel in report["panels"]:
        assert_edges(png, panel["anchors"], "red")
        assert_edges(png, panel["signals"], "green")


def test_an_image_taller_than_the_qwen_limit_is_one_line_naming_it(care, tmp_path: Path) -> None:
    thin = tmp_path / "tall.png"
    Image.new("RGB", (10, 2001), (200, 30, 30)).save(thin)  # 200.1:1; Qwen's image processor takes up to 200:1
    out = tmp_path / "tall_fig.png"
    run = care("visualize", thin, "--keep", "8", "--model", "tiny-qwen3-vl", "--out", out)
    assert run.code == 2 and not out.exists()
    assert run.err.startswith(f"error: {thin} (10×2001 px): aspect ratio 200.1:1 exceeds Qwen3-VL's limit of 200:1")
    assert run.err.count("\n") == 1 and "Traceback" not in run.err
