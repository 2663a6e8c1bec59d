"""`care methods [NAME]`: every registered method with its category and what it does; with NAME, the inputs it
needs, the CaRe hyperparameters it reads (as their flags), the backbones it runs on and its paper (all read from
the method classes; no torch is imported)."""

from __future__ import annotations

import re
from typing import Annotated, Any

import typer

from care_cli import options as opt
from care_cli import render

NameArg = Annotated[
    str | None,
    typer.Argument(help="A method: show its inputs, hyperparameters, backbones and paper.", show_default=False),
]


def method_rows() -> list[dict[str, Any]]:
    from care_core.backbones.families import family_names
    from care_core.config import CaReConfig
    from care_core.methods import method_class, method_names
    from care_core.vocabulary import PROBES

    config_fields = CaReConfig.field_names()
    rows = []
    for name in method_names():
        cls = method_class(name)
        used = [f for f in config_fields if f in cls.hyperparameters]
        rows.append({
            "name": name,
            "aliases": list(cls.aliases),
            "category": cls.category,
            "needs": sorted(cls.needs),
            "needs_described": {k: PROBES[k] for k in sorted(cls.needs)},
            "hyperparameters": used,
            "hyperparameter_flags": [opt.flag_of(f) for f in used],
            "runtime_options": [f for f in config_fields if f in cls.runtime_options],
            "runtime_option_flags": [opt.flag_of(f) for f in config_fields if f in cls.runtime_options],
            "ignores": [f for f in config_fields if f not in cls.hyperparameters | cls.runtime_options],
            "backbones": [family for family in family_names() if cls.serves(family)],
            "not_served": {family: cls.why_not_served(family) for family in family_names() if not cls.serves(family)},
            "score_label": cls.score_label,
            "cost_model": cls.cost_model,
            "paper": cls.paper,
            "summary": _plain(" ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())),
        })  # fmt: skip
    return rows


_SYMBOLS = {"keep": "K"}  # parameters named in docstrings, as the CLI's output writes them


def _plain(text: str) -> str:
    """A docstring sentence as users read it: reStructuredText's literal markup dropped (````keep```` reads K)."""
    return re.sub(r"``(.+?)``", lambda match: _SYMBOLS.get(match.group(1), match.group(1)), text)


def _flags(row: dict[str, Any]) -> str:
    """The hyperparameters a method reads, spelled as the options that set them."""
    return " ".join(row["hyperparameter_flags"]) or "none"


def _not_served(why: dict[str, str | None]) -> str:
    """The families a method cannot run on, grouped by what it needs that they lack."""
    groups: dict[str, list[str]] = {}
    for family, reason in why.items():
        groups.setdefault(reason or "a family trait", []).append(family)
    return "; ".join(f"{', '.join(names)} (it needs {reason})" for reason, names in groups.items()) or "none"


def _listed(values: list[str], families: tuple[str, ...] | None = None) -> str:
    if families is not None and len(values) == len(families):
        return "all (" + ", ".join(values) + ")"
    return ", ".join(values) or "none"


def methods(name: NameArg = None, json_output: opt.Json = False) -> None:
    """List every registered token-reduction method; with NAME, everything about that one."""
    from care_core.backbones.families import family_names
    from care_core.methods import canonical_name

    rows = method_rows()
    if name is not None:
        wanted = canonical_name(name)
        rows = [row for row in rows if row["name"] == wanted]
    if json_output:
        render.print_json({"command": "methods", "backbone_families": family_names(), "methods": rows})
    elif name is not None:
        show_method(rows[0], tuple(family_names()))
    else:
        columns = [render.Column("name", "name", key=True, style="bold cyan"), render.Column("category", "name"),
                   render.Column("what it does", "text")]  # fmt: skip
        cells = [[row["name"] + (f" ({', '.join(row['aliases'])})" if row["aliases"] else ""), row["category"],
                  row["summary"]] for row in rows]  # fmt: skip
        caption = "care methods NAME: the inputs a method needs, the hyperparameters it reads, its backbones and "
        render.print_table("Registered methods", columns, cells, caption=caption + "paper (--json: all methods).")


def show_method(row: dict[str, Any], families: tuple[str, ...]) -> None:
    """One method's details: the same facts as its --json entry, hyperparameters spelled as their flags."""
    needs = "; ".join(f"{key} ({text})" for key, text in row["needs_described"].items())
    details = [
        ("aliases", ", ".join(row["aliases"]) or "none"),
        ("category", row["category"]),
        ("what it does", row["summary"]),
        ("needs", needs or "the visual tokens and the projector only"),
        ("hyperparameters", _flags(row)),
        *[("also reads", f"{flag} (how it runs, not what it computes)") for flag in row["runtime_option_flags"]],
        ("backbones", _listed(row["backbones"], families)),
        ("not on", _not_served(row["not_served"])),
        ("scores", row["score_label"] or "none"),
        ("cost model", row["cost_model"] or "none (care flops cannot count it)"),
        ("paper", row["paper"]),
    ]
    render.stdout.print(render.key_value_table(f"care methods — {row['name']}", details))
