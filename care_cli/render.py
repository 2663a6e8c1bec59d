"""Rich rendering and --json output; the only place that writes to the terminal."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.table import Table

stdout = Console(soft_wrap=False)
stderr = Console(stderr=True)


def print_notices(notices: list[str]) -> None:
    """The backbone loader's one-line notices (e.g. a damaged cached demo restored), on stderr."""
    for notice in notices:
        stderr.print(f"[yellow]note:[/] {notice}", highlight=False, soft_wrap=True)  # one line, however long


def print_json(payload: dict[str, Any]) -> None:
    """Exactly one JSON object on stdout (plain write: no rich markup or wrapping)."""
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    sys.stdout.flush()


def key_value_table(title: str, rows: list[tuple[str, str]], caption: str | None = None) -> Table:
    table = Table(title=title, show_header=False, caption=caption, caption_style="bold yellow", title_justify="left")
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    return table


def timings_table(timings_ms: dict[str, float]) -> Table:
    table = Table(title="Time per stage", title_justify="left")
    table.add_column("stage", style="cyan")
    table.add_column("ms", justify="right")
    for name, value in timings_ms.items():
        style = "bold" if name == "total" else None
        table.add_row(name, f"{value:,.1f}", style=style)
    return table


def short_list(values: list[int], limit: int = 24) -> str:
    if len(values) <= limit:
        return ", ".join(map(str, values)) or "—"
    return ", ".join(map(str, values[:limit])) + f", … ({len(values)} in all)"


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
    from rich.text import Text

    class Speed(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("" if speed is None else f"{speed:.2f} {unit}/s", style="progress.data.speed")

    return Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), Speed(), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.description}"), console=stderr,
                    transient=True, disable=quiet or not stderr.is_terminal)  # fmt: skip
