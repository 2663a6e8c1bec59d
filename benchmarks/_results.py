"""Where benchmark results go: a new dated JSON file under benchmarks/results/, never an existing one."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def stamp() -> str:
    return dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")


def check_new(out: Path | None) -> None:
    """Refuse an explicit --out that exists, before the benchmark spends any time."""
    if out is not None and out.exists():
        raise SystemExit(f"error: {out} exists; benchmarks write new files only")


def write_result(payload: dict[str, Any], name: str, out: Path | None = None) -> Path:
    """Write ``payload`` to ``out`` or to ``results/<stamp>-<name>.json``; "x" mode: never replace a file."""
    path = out or RESULTS / f"{stamp()}-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "x", encoding="utf-8") as handle:
        handle.write(json.dumps(payload, indent=2) + "\n")
    return path
