"""Start-up time of the commands that need no model: `care --help`, `--version`, `methods`, `flops`.

    python benchmarks/bench_startup.py [--reps 7]

Each command runs as a fresh process (the console script's own entry point); the table shows the median and
the best wall time, and whether torch or transformers were imported. Writes a new dated JSON file under
benchmarks/results/ (never an existing one).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _results import check_new, stamp, write_result
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = (
    ("--help",),
    ("--version",),
    ("methods",),
    ("methods", "--json"),
    ("flops", "--backbone", "llava-next"),
    ("flops", "--backbone", "llava-next", "--keep", "160", "--json"),
)
HEAVY = ("torch", "transformers")
# Runs the CLI as the console script does, then reports which heavy modules the process imported.
PROBE = (
    "import sys\n"
    "from care_cli.app import main\n"
    "code = main(sys.argv[1:])\n"
    "sys.stdout.flush()\n"
    f"print('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)\n"
    "raise SystemExit(code)\n"
)


def run_once(args: tuple[str, ...]) -> tuple[float, int, list[str]]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})  # fmt: skip
    elapsed = (time.perf_counter() - start) * 1e3
    heavy_line = [line for line in proc.stderr.splitlines() if line.startswith("HEAVY=")]
    heavy = [m for m in heavy_line[-1].removeprefix("HEAVY=").split(",") if m] if heavy_line else ["?"]
    return elapsed, proc.returncode, heavy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    check_new(args.out)
    console = Console()
    rows = []
    for command in COMMANDS:
        run_once(command)  # warm the file cache
        samples, codes, heavy = [], set(), set()
        for _ in range(args.reps):
            ms, code, imported = run_once(command)
            samples.append(ms)
            codes.add(code)
            heavy.update(imported)
        rows.append({"command": "care " + " ".join(command), "median_ms": round(statistics.median(samples), 1),
                     "best_ms": round(min(samples), 1), "exit_codes": sorted(codes), "heavy_imports": sorted(heavy),
                     "under_1s": statistics.median(samples) < 1000})  # fmt: skip
    table = Table(title=f"Start-up, fresh process, {args.reps} runs each", title_justify="left")
    for col in ("command", "median ms", "best ms", "exit", "torch / transformers imported", "< 1 s"):
        table.add_column(col, justify="left" if col == "command" else "right")
    for row in rows:
        table.add_row(row["command"], f"{row['median_ms']:.0f}", f"{row['best_ms']:.0f}",
                      ",".join(map(str, row["exit_codes"])), ", ".join(row["heavy_imports"]) or "none",
                      "yes" if row["under_1s"] else "NO")  # fmt: skip
    console.print(table)
    payload = {"date": stamp(), "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
               "python": platform.python_version(), "reps": args.reps, "rows": rows}  # fmt: skip
    console.print(f"wrote {write_result(payload, 'cpu-bench_startup', args.out)}")


if __name__ == "__main__":
    main()
