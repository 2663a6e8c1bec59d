"""What every benchmark shares: its arguments, where its results go, its tables, its clock and its device.

Results: every benchmark writes its JSON into ``--results-dir`` (default: a new scratch folder from
:mod:`tempfile`, outside the repository, printed at the end); it writes a second copy to ``--out FILE`` only when
asked (``--out benchmarks/results/<name>.json`` to commit one), and never over an existing file. Tables are rich
tables of at most :data:`TABLE_WIDTH` columns: a table too wide is split into parts that repeat its key columns,
so that no number is ever cut.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RESULTS = Path(__file__).resolve().parent / "results"  # the committed results: written only through --out
TABLE_WIDTH = 80
#: issue #22's multi-GPU targets: N processes (one GPU each) >= this many times one, same batch size
PROCESS_TARGETS = {2: 1.8, 4: 3.5}
KEY_COLUMN_MAX = 30  # a key column wider than this wraps (text only: value columns never wrap)

console = Console(width=TABLE_WIDTH, highlight=False)


# ----------------------------------------------------------------------------------------- arguments
def make_parser(doc: str, *, quick: str, duration: str, device: str | None = None) -> argparse.ArgumentParser:
    """The benchmark's parser with ``--quick``, ``--results-dir``, ``--out`` and (``device`` given) ``--device``.

    ``doc``: the module docstring (the description); ``quick``: what ``--quick`` measures and how long it takes;
    ``duration``: how long the full run takes (shown under the options).
    """
    parser = argparse.ArgumentParser(
        description=doc, epilog=f"Duration: {duration}", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument(
        "--results-dir", type=Path, default=None, help="folder of the results JSON (default: a new scratch folder)"
    )
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the results to this new file, e.g. benchmarks/results/<name>.json "
                        "(refused if it exists)")  # fmt: skip
    if device is not None:
        parser.add_argument("--device", default=device, help=f"cpu, cuda or cuda:N (default: {device})")
    return parser


def comma_list(text: str) -> list[str]:
    """A comma-separated option's items, stripped, empty ones dropped (``"1, auto,"`` -> ``["1", "auto"]``)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def at_least_one(option: str, value: int) -> int:
    """``value`` of a count option such as ``--reps``; an error line (exit 2) where it is below 1."""
    if value < 1:
        raise fail(f"{option} must be at least 1, got {value}")
    return value


def demos_option(text: str, known: Sequence[str], quick: bool) -> tuple[str, ...]:
    """The ``--demos`` names of a comma-separated ``text`` (the first of ``known`` alone with ``--quick``); an error
    line (exit 2) for a name not among ``known``."""
    demos = tuple(known[:1]) if quick else tuple(comma_list(text))
    if unknown := sorted(set(demos) - set(known)):
        raise fail(f"--demos: {', '.join(unknown)} not among {', '.join(known)}")
    return demos


def fail(message: str) -> SystemExit:
    """Print ``error: message`` on stderr; the SystemExit (code 2) to raise."""
    print(f"error: {message}", file=sys.stderr)
    return SystemExit(2)


def pick_device(name: str) -> Any:
    """``name`` as a torch.device ("auto": CUDA where there is one); an error line when CUDA is asked for but absent."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if problem := missing_cuda(name):
        raise fail(problem)
    return device


def missing_cuda(name: str) -> str | None:
    """Why ``--device name`` cannot run here: CUDA asked for where none is visible (None: it can)."""
    import torch

    if name.split(":")[0] == "cuda" and not torch.cuda.is_available():
        return f"--device {name}: no CUDA device here (use --device cpu)"
    return None


def free_device_memory(device: Any) -> None:
    """Collect a dropped model's objects and, on CUDA, hand their cached blocks back (before the next model)."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------- results
def stamp() -> str:
    return dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")


def host() -> dict[str, Any]:
    """The machine and the versions a result was measured with."""
    from care_cli.versions import versions

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "versions": versions()}  # fmt: skip


def source_state() -> dict[str, Any]:
    """The commit the code was measured at and whether the tree differed from it: ``CARE_SOURCE_COMMIT`` and
    ``CARE_SOURCE_DIRTY`` where whoever copied the tree set them (a copy's own git folder may name another commit
    than the files hold, as on a device machine), else ``git``."""
    if os.environ.get("CARE_SOURCE_COMMIT"):
        dirty = os.environ.get("CARE_SOURCE_DIRTY")
        return {"commit": os.environ["CARE_SOURCE_COMMIT"], "dirty": None if dirty is None else dirty == "1",
                "from": "environment"}  # fmt: skip
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True, check=True)  # fmt: skip
        return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip()), "from": "git"}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None, "from": "unknown (no git folder, no CARE_SOURCE_COMMIT)"}


def median_wall_ms(step: Callable[[], Any], reps: int, cuda: bool) -> float:
    """The median host wall ms of ``reps`` calls of ``step``, each started on an idle device (``cuda``: synchronised
    first) and ended when ``step`` returns (its result on the host)."""
    seconds = []
    for _ in range(reps):
        if cuda:
            import torch

            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return 1e3 * statistics.median(seconds)


def newest_file(folder: Path, pattern: str) -> Path | None:
    """The newest of ``folder``'s results matching ``pattern`` (their names start with the date, so the last in
    order); None where there is none."""
    found = sorted(folder.glob(pattern))
    return found[-1] if found else None


def commit_label(source: dict[str, Any]) -> str:
    """A result's ``source`` as a docs block names it: the commit's first 10 characters, and whether the tree was
    dirty."""
    return (source.get("commit") or "?")[:10] + (" with uncommitted changes" if source.get("dirty") else "")


def replace_block(path: Path, begin: str, end: str, block: str) -> bool:
    """Replace what lies between the ``begin`` and ``end`` markers of ``path`` by ``block`` (a rendered result);
    returns whether the file changed. A file without both markers fails in one line."""
    text = path.read_text(encoding="utf-8")
    if begin not in text or end not in text:
        raise fail(f"{path.name} has no rendered block ({begin} ... {end})")
    head, rest = text.split(begin, 1)
    new = head + begin + "\n" + block + end + rest.split(end, 1)[1]
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


#: the performance reference whose tables the benchmarks' ``--docs`` commands render
PERFORMANCE_DOC = "docs/performance.md"


def render_newest(
    root: Path, pattern: str, doc_file: str, markers: tuple[str, str], render: Callable[[dict[str, Any], str], str]
) -> bool:
    """Rewrite the block between ``markers`` of ``root / doc_file`` as ``render(result, file name)`` renders the
    newest committed result matching ``pattern`` (``root/benchmarks/results``); whether the file changed. No such
    result fails in one line."""
    newest = newest_file(root / "benchmarks" / "results", pattern)
    if newest is None:
        raise fail(f"no committed result (benchmarks/results/{pattern}) to render")
    block = render(json.loads(newest.read_text(encoding="utf-8")), newest.name)
    return replace_block(root / doc_file, *markers, block)


class ResultsWriter:
    """Where one run's JSON goes: ``<results dir>/<stamp>-<name>.json``, and ``--out`` when given.

    The ``--out`` file is checked when the writer is made (before the benchmark spends any time) and written
    in "x" mode at the end: an existing file is never replaced. :meth:`save` may be called as often as the
    benchmark likes (it rewrites the scratch copy only), so an interrupted run keeps what it finished.
    """

    def __init__(self, args: argparse.Namespace, name: str) -> None:
        self.out: Path | None = args.out
        if self.out is not None and self.out.exists():
            raise fail(f"{self.out} exists; benchmarks write new files only (name another --out)")
        folder = args.results_dir or Path(tempfile.mkdtemp(prefix="care-bench-"))
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{stamp()}-{name}.json"

    def save(self, payload: dict[str, Any]) -> Path:
        text = json.dumps(payload, indent=1, default=str) + "\n"
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(self.path)
        return self.path

    def finish(self, payload: dict[str, Any]) -> list[Path]:
        """Write the final results (scratch copy, then ``--out``) and say where they are."""
        written = [self.save(payload)]
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            with open(self.out, "x", encoding="utf-8") as handle:
                handle.write(json.dumps(payload, indent=1, default=str) + "\n")
            written.append(self.out)
        for path in written:
            console.print(f"wrote {path}", soft_wrap=True)
        return written


# ----------------------------------------------------------------------------------------- tables
def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: floats to ``digits`` decimals, None and NaN as a dash."""
    if value is None or (isinstance(value, float) and value != value):
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return " / ".join(fmt(v, digits) for v in value)
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _width(header: str, cells: Sequence[str], cap: int | None) -> int:
    """The column's width: its longest cell line or header word (a header may wrap at its spaces)."""
    longest_word = max((len(w) for w in header.split()), default=1)
    if cap is None:  # a value column: short headers stay on one line
        longest_word = max(longest_word, min(len(header), 12))
    width = max([longest_word, *(len(line) for c in cells for line in c.splitlines() or [""])])
    return min(width, cap) if cap else width


def _parts(widths: Sequence[int], keys: int) -> list[list[int]]:
    """Column indices of each part: the key columns, then as many value columns as fit in TABLE_WIDTH."""
    base = 1 + sum(w + 3 for w in widths[:keys])
    parts: list[list[int]] = [[]]
    used = base
    for i in range(keys, len(widths)):
        if parts[-1] and used + widths[i] + 3 > TABLE_WIDTH:
            parts.append([])
            used = base
        parts[-1].append(i)
        used += widths[i] + 3
    return parts


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]], *, keys: int = 1) -> None:
    """Rows as rich tables of at most 80 columns, the first ``keys`` columns (text, may wrap) in every part."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [_width(h, [r[i] for r in cells if i < len(r)], KEY_COLUMN_MAX if i < keys else None)
              for i, h in enumerate(header)]  # fmt: skip
    parts = _parts(widths, keys)
    for number, part in enumerate(parts, 1):
        suffix = f" ({number}/{len(parts)})" if len(parts) > 1 else ""
        table = Table(title=title + suffix, title_justify="left")
        for i in range(keys):
            table.add_column(header[i], overflow="fold", min_width=widths[i], max_width=widths[i])
        for i in part:
            table.add_column(header[i], justify="right", overflow="fold", min_width=widths[i], max_width=widths[i])
        for row in cells:
            padded = row + [""] * (len(header) - len(row))
            table.add_row(*padded[:keys], *(padded[i] for i in part))
        console.print(table)


def child_result(command: list[str], out: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """The JSON object a child process (``command``, run from the repository root) wrote to ``out``; where it exited
    with an error or wrote nothing, ``identity`` with the error (the parent's run goes on with its other children)."""
    done = subprocess.run(command, check=False, cwd=ROOT)
    if done.returncode != 0 or not out.exists():
        return {**identity, "error": f"its process exited with code {done.returncode}"}
    return dict(json.loads(out.read_text(encoding="utf-8")))


def run_main(main: Callable[[], None]) -> None:
    """A benchmark module's entry point: ``main()``, and Ctrl-C ends it with exit code 130 and no traceback (a
    benchmark that saves as it goes, :meth:`ResultsWriter.save`, keeps what it finished)."""
    try:
        main()
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def say(message: str) -> None:
    """One progress line, wrapped at 80 columns."""
    console.print(message, markup=False)


# ----------------------------------------------------------------------------------------- timing
class Clock:
    """Wall time of work on ``device`` in ms: CUDA events on a GPU, ``perf_counter`` on the CPU."""

    def __init__(self, device: Any) -> None:
        self.cuda = getattr(device, "type", str(device)) == "cuda"

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def mark(self) -> Any:
        """A point in the device's work: a recorded CUDA event on a GPU, ``perf_counter`` on the CPU."""
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def between_ms(self, start: Any, end: Any) -> float:
        """ms from mark ``start`` to mark ``end`` (on a GPU, once ``end`` has happened: :meth:`wait`)."""
        return float(start.elapsed_time(end)) if self.cuda else (end - start) * 1e3

    def wait(self, mark: Any) -> None:
        """Block until the device has reached ``mark``."""
        if self.cuda:
            mark.synchronize()

    def once(self, fn: Callable[[], Any]) -> float:
        start = self.mark()
        fn()
        end = self.mark()
        self.wait(end)
        return self.between_ms(start, end)

    def median(self, fn: Callable[[], Any], reps: int = 5, warmup: int = 1, budget_ms: float = 4000.0) -> float:
        """Median of ``reps`` timed runs after ``warmup`` untimed ones; fewer reps when one run is slow."""
        first = None
        for _ in range(warmup):
            first = self.once(fn)
        if first is not None and first * reps > budget_ms:
            reps = max(1, int(budget_ms // max(first, 1e-3)))
        return statistics.median(self.once(fn) for _ in range(reps))

    @contextlib.contextmanager
    def stage_timer(self, sink: dict[str, float]) -> Iterator[Callable[[str], contextlib.AbstractContextManager]]:
        """A ``care_reduce`` stage_timer writing each stage's ms into ``sink`` when the block ends."""
        events: dict[str, tuple[Any, Any]] = {}

        @contextlib.contextmanager
        def timer(name: str) -> Iterator[None]:
            start = self.mark()
            yield
            events[name] = (start, self.mark())

        yield timer
        self.sync()
        for name, (start, end) in events.items():
            sink[name] = self.between_ms(start, end)

    def median_stages(self, fn: Callable[[Callable], Any], reps: int) -> dict[str, float]:
        """Per-stage medians of ``fn(stage_timer)`` over ``reps`` runs after one warm-up, with their ``total``."""
        samples: dict[str, list[float]] = {}
        for rep in range(reps + 1):
            sink: dict[str, float] = {}
            with self.stage_timer(sink) as timer:
                total = self.once(partial(fn, timer))
            if rep == 0:
                continue
            sink["total"] = total
            for key, value in sink.items():
                samples.setdefault(key, []).append(value)
        return {key: statistics.median(values) for key, values in samples.items()}
