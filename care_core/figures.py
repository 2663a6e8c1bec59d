"""Figures as matplotlib Figure objects (Agg canvas, nothing saved or shown here)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import matplotlib
from matplotlib.figure import Figure


def csr_bar_chart(rows: Sequence[dict[str, Any]], *, title: str, note: str | None = None) -> Figure:
    """Grouped bars of 100 x CSR: one group per budget, one bar per method, std as error bars.

    `rows` hold `method`, `budget`, `mean`, `std` (as `care csr` summarises them), in display order.
    """
    methods = list(dict.fromkeys(r["method"] for r in rows))
    budgets = list(dict.fromkeys(r["budget"] for r in rows))
    lookup = {(r["method"], r["budget"]): r for r in rows}
    width = 0.8 / max(1, len(methods))
    fig = Figure(figsize=(max(6.0, 1.2 + 0.45 * len(methods) * len(budgets)), 4.2), dpi=120)
    ax = fig.add_subplot()
    palette = matplotlib.colormaps["tab20"]
    for i, method in enumerate(methods):
        xs, means, stds = [], [], []
        for j, budget in enumerate(budgets):
            row = lookup.get((method, budget))
            if row is None:
                continue
            xs.append(j - 0.4 + width * (i + 0.5))
            means.append(row["mean"])
            stds.append(row["std"])
        color = palette(i % 20)
        ax.bar(xs, means, width=width * 0.92, yerr=stds, capsize=2, label=method, color=color, edgecolor="black",
               linewidth=0.4)  # fmt: skip
    ax.set_xticks(range(len(budgets)), budgets)
    ax.set_ylabel("CSR (×100)")
    ax.set_ylim(0, 105)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small", ncols=min(4, len(methods)), loc="lower right")
    if note:
        fig.text(0.5, 0.01, note, ha="center", va="bottom", fontsize="small", color="darkred")
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
    return fig
