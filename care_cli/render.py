"""Rich rendering and --json output; the only place that writes to the terminal."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

DEMO_NOTE = "demo backbone: random weights — its numbers say nothing about a real model"

stdout = Console(soft_wrap=False)
stderr = Console(stderr=True)


def print_json(payload: dict[str, Any]) -> None:
    """Exactly one JSON object on stdout (plain write: no rich markup or wrapping)."""
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    sys.stdout.flush()


class StageClock:
    """Wall-clock milliseconds per named stage; synchronises CUDA so GPU work is counted."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.ms: dict[str, float] = {}
        self.device = torch.device(device) if device is not None else None

    def _sync(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - start) * 1e3


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
