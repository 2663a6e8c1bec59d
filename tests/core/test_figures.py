"""CSR-against-budget curves: one line and one 95% band per method, at the kept share, all inside the canvas."""

from __future__ import annotations

import math

from matplotlib.collections import PolyCollection

from care_core.figures import csr_budget_curves


def _rows() -> list[dict[str, object]]:
    rows = []
    for m, method in enumerate(("care", "visionzip", "random")):
        for pct in (50.0, 5.0, 20.0):  # out of order: the line must be drawn in kept-share order
            rows.append({"method": method, "budget": f"ratio {pct / 100:g}", "mean": 60 + pct / 2 + m,
                         "ci95": 1.5, "kept_pct": pct})  # fmt: skip
    return rows


def test_lines_bands_and_axes() -> None:
    fig = csr_budget_curves(_rows(), title="CSR on tiny-llava", note="demo backbone: random weights " * 6)
    ax = fig.axes[0]
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["care", "visionzip", "random"]
    for m, line in enumerate(lines):
        assert list(line.get_xdata()) == [5.0, 20.0, 50.0]
        assert list(line.get_ydata()) == [60 + 2.5 + m, 60 + 10 + m, 60 + 25 + m]
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 3
    for band, line in zip(bands, lines, strict=True):
        ys = band.get_paths()[0].vertices[:, 1]
        assert math.isclose(ys.max() - max(line.get_ydata()), 1.5, abs_tol=1e-9)
    assert len({line.get_color() for line in lines}) == 3
    low, high = ax.get_ylim()
    assert low > 0 and high >= 85 + 2 + 1.5  # close values: the axis is zoomed, and says so
    assert "axis from" in ax.get_ylabel()


def test_every_text_is_inside_the_canvas() -> None:
    rows = [{**r, "method": f"{r['method']}-{i}"} for i in range(4) for r in _rows()]  # 12 methods
    fig = csr_budget_curves(rows, title="A long title " * 12, note="a long footer " * 20)
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()
    width, height = fig.canvas.get_width_height()
    texts = [t for t in fig.findobj(lambda a: hasattr(a, "get_text") and a.get_visible()) if t.get_text()]
    assert texts
    for text in texts:
        box = text.get_window_extent(renderer)
        assert box.x0 >= -0.5 and box.y0 >= -0.5 and box.x1 <= width + 0.5 and box.y1 <= height + 0.5, text
