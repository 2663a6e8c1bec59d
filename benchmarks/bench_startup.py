"""Start-up time of the commands that need no model: `care --help`, `--version`, `methods`, `flops`.

    python -m benchmarks.bench_startup [--reps 7]     # from the repository root
    python -m benchmarks.bench_startup --quick        # 2 runs of each command
    python -m benchmarks.bench_startup --docs         # no run: docs/performance.md's table from the newest result

Each command runs as a fresh process (the console script's own entry point); the table shows the median and
the best wall time, and whether torch or transformers were imported. Writes its JSON into --results-dir (default:
a new scratch folder) and, only when asked, to --out.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    PERFORMANCE_DOC,
    ROOT,
    ResultsWriter,
    commit_label,
    host,
    make_parser,
    print_table,
    render_newest,
    run_main,
    say,
    source_state,
    stamp,
)

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


def measure(command: tuple[str, ...], reps: int) -> dict[str, Any]:
    run_once(command)  # warm the file cache
    samples, codes, heavy = [], set(), set()
    for _ in range(reps):
        ms, code, imported = run_once(command)
        samples.append(ms)
        codes.add(code)
        heavy.update(imported)
    return {"command": "care " + " ".join(command), "median_ms": round(statistics.median(samples), 1),
            "best_ms": round(min(samples), 1), "exit_codes": sorted(codes), "heavy_imports": sorted(heavy),
            "under_1s": statistics.median(samples) < 1000}  # fmt: skip


#: the block of docs/performance.md rendered from the newest committed result (``--docs``)
DOC_FILE = PERFORMANCE_DOC
BEGIN, END = ("<!-- startup:begin (python -m benchmarks.bench_startup --docs) -->", "<!-- startup:end -->")


def render_markdown(results: dict[str, Any], name: str) -> str:
    """The docs' block for a result named ``name``: each command's median and best ms and its heavy imports."""
    lines = ["| command | median ms | best ms | torch / transformers imported |", "| --- | ---: | ---: | --- |"]
    for r in results["rows"]:
        heavy = ", ".join(r["heavy_imports"]) or "none"
        lines.append(f"| `{r['command']}` | {r['median_ms']:.0f} | {r['best_ms']:.0f} | {heavy} |")
    machine = results.get("machine", {})
    commit = commit_label(results["source"]) if "source" in results else "not recorded"
    lines += ["", f"{results['reps']} fresh processes a command on a {machine.get('cpu_count', '?')}-core machine. "
              f"Source: `benchmarks/results/{name}` (`python -m benchmarks.bench_startup`, "
              f"commit {commit})."]  # fmt: skip
    return "\n".join(lines) + "\n"


def write_docs(root: Path = ROOT) -> bool:
    """Rewrite :data:`DOC_FILE`'s block from the newest committed result; returns whether it changed."""
    return render_newest(root, "*-cpu-bench_startup.json", DOC_FILE, (BEGIN, END), render_markdown)


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, quick="2 runs of each command (about 25 s on a 2-core CPU)",
                         duration="7 runs of 6 commands: about 1 minute on a 2-core CPU")  # fmt: skip
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--docs", action="store_true",
                        help="no run: rewrite docs/performance.md's table from the newest result")  # fmt: skip
    args = parser.parse_args(argv)
    if args.docs:
        say(f"{'rewrote' if write_docs() else 'unchanged:'} the start-up block of {ROOT / DOC_FILE}")
        return
    writer = ResultsWriter(args, "cpu-bench_startup")
    reps = 2 if args.quick else args.reps
    rows = [measure(command, reps) for command in COMMANDS]
    cells = [(r["command"], f"{r['median_ms']:.0f}", f"{r['best_ms']:.0f}", ",".join(map(str, r["exit_codes"])),
              ", ".join(r["heavy_imports"]) or "none", "yes" if r["under_1s"] else "NO") for r in rows]  # fmt: skip
    header = ("command", "median ms", "best ms", "exit", "torch / transformers imported", "< 1 s")
    print_table(f"Start-up, fresh process, {reps} runs each", header, cells)
    writer.finish({"date": stamp(), "machine": host(), "source": source_state(), "reps": reps, "rows": rows})


if __name__ == "__main__":
    run_main(main)
