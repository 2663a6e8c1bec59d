"""Result tables of `care csr` and `care eval`, built from their reports and printed through
:func:`care_cli.render.print_table` (readable at 80 columns; figures and names never cut)."""

from __future__ import annotations

from typing import Any

from care_cli import render


def _num(value: Any, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def print_csr(report: dict[str, Any]) -> None:
    """CSR ×100 per method (rows) and budget (columns): mean ± std over the pairs; (n) where the counts differ."""
    budgets = report["budgets"]
    lookup = {(r["method"], r["budget"]): r for r in report["summary"]}
    counts = {r["n"] for r in report["summary"]}
    same_n = len(counts) == 1
    pairs = report["pairs"]
    if same_n and counts == {1}:
        title, cell = f"CSR ×100 — {pairs} pair", "{mean:.2f}"
    elif same_n:
        title, cell = f"CSR ×100 — mean ± std over {pairs} pairs", "{mean:.2f} ± {std:.2f}"
    else:
        title, cell = f"CSR ×100 — mean ± std (n) over {pairs} pairs", "{mean:.2f} ± {std:.2f} ({n})"
    columns = [render.Column("method", "name", key=True, style="bold cyan")]
    columns += [render.Column(b) for b in budgets]
    rows = []
    for name in report["methods"]:
        found = [lookup.get((name, b)) for b in budgets]
        rows.append([name] + ["—" if r is None else cell.format(**r) for r in found])
    render.print_table(title, columns, rows, caption=report["backbone"]["note"], caption_style="bold yellow")


def print_eval(report: dict[str, Any]) -> None:
    """One table per task: the primary metric, its retention against all tokens, tokens and time per sample."""
    backbone = report["backbone"]
    for task, rows in report["tables"].items():
        metric = rows[0]["metric"] if rows else "metric"
        samples = rows[0]["samples"] if rows else 0
        columns = [
            render.Column("method", "name", key=True, style="bold cyan"),
            render.Column("budget", "name", key=True),
            render.Column(metric or "metric"),
            render.Column("retention %"),
            render.Column("visual tokens"),
            render.Column("s / sample"),
        ]
        cells = [[row["method"], row["budget"], _num(row["value"], ".4f"),
                  "—" if row["method"] == "none" else _num(row["retention"], ".1f"),
                  _num(row["visual_tokens"], ".1f"), _num(row["seconds_per_sample"], ".3f")]
                 for row in rows]  # fmt: skip
        render.print_table(f"{task}: {metric}, {samples} samples, {backbone['name']}", columns, cells,
                           caption=backbone["note"], caption_style="bold yellow")  # fmt: skip
