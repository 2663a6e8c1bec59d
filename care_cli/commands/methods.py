"""`care methods`: every registered method, its category, the inputs it needs and its paper."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from care_cli import options as opt
from care_cli import render


def method_rows() -> list[dict[str, Any]]:
    from care_core.methods import PROBES, method_class, method_names

    rows = []
    for name in method_names():
        cls = method_class(name)
        rows.append({
            "name": name,
            "aliases": list(cls.aliases),
            "category": cls.category,
            "needs": sorted(cls.needs),
            "needs_described": {k: PROBES[k] for k in sorted(cls.needs)},
            "paper": cls.paper,
            "summary": (cls.__doc__ or "").strip().splitlines()[0],
        })  # fmt: skip
    return rows


def methods(json_output: opt.Json = False) -> None:
    """List every registered token-reduction method."""
    rows = method_rows()
    if json_output:
        render.print_json({"command": "methods", "methods": rows})
        return
    table = Table(title="Registered methods", title_justify="left", show_lines=False)
    for col in ("name", "category", "needs", "paper"):
        table.add_column(col, style="bold cyan" if col == "name" else None, overflow="fold")
    for row in rows:
        name = row["name"] + (f" ({', '.join(row['aliases'])})" if row["aliases"] else "")
        table.add_row(name, row["category"], ", ".join(row["needs"]) or "features + projector", row["paper"])
    render.stdout.print(table)
