"""`care methods`: every registered method, its category, the inputs it needs, the CaRe hyperparameters it
reads, the backbones it runs on and its paper (all read from the method classes; no torch is imported)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from care_cli import options as opt
from care_cli import render


def method_rows() -> list[dict[str, Any]]:
    from care_core.backbones.families import family_names
    from care_core.config import CaReConfig
    from care_core.methods import PROBES, method_class, method_names

    config_fields = CaReConfig.field_names()
    rows = []
    for name in method_names():
        cls = method_class(name)
        rows.append({
            "name": name,
            "aliases": list(cls.aliases),
            "category": cls.category,
            "needs": sorted(cls.needs),
            "needs_described": {k: PROBES[k] for k in sorted(cls.needs)},
            "hyperparameters": [f for f in config_fields if f in cls.hyperparameters],
            "ignores": [f for f in config_fields if f not in cls.hyperparameters],
            "backbones": [family for family in family_names() if cls.serves(family)],
            "score_label": cls.score_label,
            "cost_model": cls.cost_model,
            "paper": cls.paper,
            "summary": (cls.__doc__ or "").strip().splitlines()[0],
        })  # fmt: skip
    return rows


def _uses(row: dict[str, Any]) -> str:
    if not row["hyperparameters"]:
        return "—"
    if not row["ignores"]:
        return "all"
    return ", ".join(row["hyperparameters"])


def methods(json_output: opt.Json = False) -> None:
    """List every registered token-reduction method."""
    from care_core.backbones.families import family_names

    rows = method_rows()
    if json_output:
        render.print_json({"command": "methods", "backbone_families": family_names(), "methods": rows})
        return
    table = Table(
        title="Registered methods",
        title_justify="left",
        show_lines=False,
        caption="CaRe hyperparameters: the CaReConfig fields (and CLI options) the method reads; it ignores the "
        "others. '—' = none.",
        caption_justify="left",
    )
    for col in ("name", "category", "needs", "CaRe hyperparameters", "backbones", "paper"):
        folds = col in ("needs", "CaRe hyperparameters", "paper")
        table.add_column(col, style="bold cyan" if col == "name" else None, overflow="fold", no_wrap=not folds)
    for row in rows:
        name = row["name"] + (f" ({', '.join(row['aliases'])})" if row["aliases"] else "")
        backbones = "all" if len(row["backbones"]) == len(family_names()) else ", ".join(row["backbones"])
        needs = ", ".join(row["needs"]) or "features + projector"
        table.add_row(name, row["category"], needs, _uses(row), backbones, row["paper"])
    render.stdout.print(table)
