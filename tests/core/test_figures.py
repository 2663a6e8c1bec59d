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


def test_one_pair_has_no_band_and_the_label_says_so() -> None:
    rows = [{**row, "n": 1, "ci95": 0.0} for row in _rows()]
    ax = csr_budget_curves(rows, title="CSR on tiny-llava (1 pair)").axes[0]
    assert not [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert "one pair" in ax.get_ylabel() and "CI" not in ax.get_ylabel()
    pooled = csr_budget_curves([{**row, "n": 12} for row in _rows()], title="t").axes[0]
    assert len([c for c in pooled.collections if isinstance(c, PolyCollection)]) == 3
    assert "mean ± 95% CI" in pooled.get_ylabel()


def test_bars_say_what_their_error_bars_are() -> None:
    from matplotlib.container import ErrorbarContainer

    from care_core.figures import csr_bar_chart

    rows = [{"method": m, "budget": b, "mean": 50.0 + i, "std": 2.0, "n": 8} for i, m in enumerate(("care", "random"))
            for b in ("K=64", "K=128")]  # fmt: skip
    ax = csr_bar_chart(rows, title="t").axes[0]
    bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    assert len(bars) == 2 and "mean ± std over pairs" in ax.get_ylabel()
    spans = sorted(round(float(seg[1, 1] - seg[0, 1]), 9) for c in bars for seg in c.lines[2][0].get_segments())
    assert spans == [4.0] * 4  # ± 2 around each mean
    one = csr_bar_chart([{**row, "n": 1, "std": 0.0} for row in rows], title="t").axes[0]
    assert not [c for c in one.containers if isinstance(c, ErrorbarContainer)]
    assert "one pair" in one.get_ylabel() and "±" not in one.get_ylabel()
