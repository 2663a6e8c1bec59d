"""Rich rendering and --json output; the only place that writes to the terminal.

Every table goes through :func:`print_table`, which keeps it readable at the console's width (the terminal's,
80 when piped): names and figures are never cut or wrapped, text wraps, and the title and caption wrap at the
console's width, not the table's. A table wider than the console is printed in parts that each repeat its key
columns; where even one part cannot fit, each row is printed as a block of ``header  value`` lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rich import box as boxes
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text


def _width_when_piped() -> int | None:
    """80 columns when stdout is not a terminal (a pipe, a file, CI) and COLUMNS is not set; else None, so that
    rich asks the terminal (it would otherwise take the width of whichever of stdin/stderr is a terminal)."""
    if os.environ.get("COLUMNS", "").isdigit():
        return None
    try:
        return None if sys.stdout.isatty() else 80
    except (AttributeError, ValueError):  # a closed or replaced stdout
        return 80


stdout = Console(soft_wrap=False, width=_width_when_piped())
stderr = Console(stderr=True)

TEXT_MIN_WIDTH = 16  # a wrapping column narrower than this reads as letter pairs


@dataclass(frozen=True)
class Column:
    """One table column: ``name`` and ``number`` cells are shown whole on one line (names left, figures right);
    ``text`` cells wrap. ``key`` columns identify a row and are repeated in every part of a split table."""

    header: str
    kind: Literal["name", "number", "text"] = "number"
    key: bool = False
    style: str | None = None


def _width(text: str) -> int:
    return max(cell_len(line) for line in text.split("\n"))


def _needed(column: Column, cells: Sequence[str]) -> int:
    """The width a column needs: whole cells and header lines for names and figures, some room for text."""
    widest = max([_width(column.header)] + [_width(cell) for cell in cells])
    return min(widest, TEXT_MIN_WIDTH) if column.kind == "text" else widest


def _fits(needed: Sequence[int]) -> int:
    """Total width of a table with these column widths: padding 1 each side, a rule between and at the edges."""
    return sum(needed) + 3 * len(needed) + 1


def table_parts(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int) -> list[list[int]] | None:
    """The column indices of each part of the table at ``width``: one part when it fits, several that repeat
    the key columns when it does not, None when the key columns and any one other column cannot fit."""
    needed = [_needed(c, [row[i] for row in rows]) for i, c in enumerate(columns)]
    if _fits(needed) <= width:
        return [list(range(len(columns)))]
    keys = [i for i, c in enumerate(columns) if c.key]
    parts: list[list[int]] = []
    current: list[int] = []
    for i in (i for i, c in enumerate(columns) if not c.key):
        if _fits([needed[j] for j in keys + current + [i]]) <= width:
            current.append(i)
            continue
        if not current:
            return None
        parts.append(current)
        current = [i]
    parts.append(current)
    return [sorted(keys + part) for part in parts]


def print_table(
    title: str | None,
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    *,
    caption: str | None = None,
    caption_style: str | None = None,
    row_styles: Sequence[str | None] | None = None,
    sections: Sequence[bool] | None = None,
    box: boxes.Box | None = boxes.HEAVY_HEAD,
    console: Console | None = None,
) -> None:
    """Print a table readable at the console's width; nothing in it is cut (see the module docstring)."""
    console = console or stdout
    parts = table_parts(columns, rows, console.width)
    if parts is None:
        _print_records(console, title, columns, rows)
    for number, part in enumerate(parts or []):
        if title is not None:  # at the console's width: a narrow table must not wrap its title
            console.print(Text(title if number == 0 else f"{title} (continued)", style="table.title"))
        table = Table(box=box)
        for i in part:
            column = columns[i]
            whole = column.kind != "text"
            table.add_column(column.header, justify="right" if column.kind == "number" else "left",
                             no_wrap=whole, overflow="fold", style=column.style,
                             min_width=_needed(column, [row[i] for row in rows]) if whole else None)  # fmt: skip
        for r, row in enumerate(rows):
            if sections is not None and sections[r]:
                table.add_section()
            table.add_row(*[row[i] for i in part], style=row_styles[r] if row_styles is not None else None)
        console.print(table)
    if caption:  # under the table (its last part), at the console's width rather than the table's
        console.print(Text(caption, style=caption_style or "table.caption"))


def _print_records(
    console: Console, title: str | None, columns: Sequence[Column], rows: Sequence[Sequence[str]]
) -> None:
    """Each row as a block: its key cells on one line, then one ``header  value`` line per other column."""
    from rich.padding import Padding

    if title:
        console.print(Text(title, style="table.title"))
    keys = [i for i, c in enumerate(columns) if c.key] or [0]
    for row in rows:
        console.print(Text("  ".join(row[i] for i in keys), style="bold cyan"))
        details = [(columns[i].header.replace("\n", " "), row[i]) for i in range(len(columns)) if i not in keys]
        console.print(Padding(key_value_table(None, details), (0, 0, 0, 2)))


def print_notices(notices: list[str]) -> None:
    """The backbone loader's one-line notices (e.g. a damaged cached demo restored), on stderr."""
    for notice in notices:
        stderr.print(f"[yellow]note:[/] {notice}", highlight=False, soft_wrap=True)  # one line, however long


def print_warning(text: str) -> None:
    """One ``warning:`` line on stderr (the library's warnings about the user's input, e.g. a very large image)."""
    stderr.print(Text.assemble(("warning:", "yellow"), " ", text), highlight=False, soft_wrap=True)


def print_json(payload: dict[str, Any]) -> None:
    """Exactly one JSON object on stdout (plain write: no rich markup or wrapping)."""
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    sys.stdout.flush()


def key_value_table(title: str | None, rows: list[tuple[str, str]], caption: str | None = None) -> Table:
    """Labels (whole) beside values that wrap: paths and lists are folded onto more lines, never cut."""
    table = Table(title=title, show_header=False, caption=caption, caption_style="bold yellow", title_justify="left",
                  box=boxes.HEAVY_HEAD if title else None, padding=(0, 1) if title else (0, 2, 0, 0))  # fmt: skip
    table.add_column(style="bold cyan", no_wrap=True, min_width=max((cell_len(k) for k, _ in rows), default=1))
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, value)
    return table


def timings_table(timings_ms: dict[str, float]) -> None:
    """Print the time per stage."""
    rows = [[name, f"{value:,.1f}"] for name, value in timings_ms.items()]
    print_table("Time per stage", [Column("stage", "name", key=True, style="cyan"), Column("ms")], rows,
                row_styles=["bold" if name == "total" else None for name in timings_ms])  # fmt: skip


def short_list(values: list[int], limit: int = 24) -> str:
    """The values, or the first ``limit`` of them and how many there are (--json has them all)."""
    if len(values) <= limit:
        return ", ".join(map(str, values)) or "—"
    return ", ".join(map(str, values[:limit])) + f" (the first {limit} of {len(values)}; --json lists all)"


@contextlib.contextmanager
def status(message: str, quiet: bool = False) -> Iterator[None]:
    """A spinner on stderr while something slow runs; nothing at all when quiet or stderr is not a terminal."""
    if quiet or not stderr.is_terminal:
        yield
        return
    with stderr.status(message):
        yield


def progress(label: str, quiet: bool = False, unit: str = "pairs") -> Any:
    """A rich progress bar on stderr with items/s and ETA (disabled when quiet or stderr is not a terminal)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    class Speed(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("" if speed is None else f"{speed:.2f} {unit}/s", style="progress.data.speed")

    return Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), Speed(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.description}"), console=stderr,
                    transient=True, disable=quiet or not stderr.is_terminal)  # fmt: skip
