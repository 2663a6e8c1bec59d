"""Data-set runs: items sharded over processes, results appended to per-rank JSONL shards, resume, manifest, merge.

The processes are started by torchrun (:func:`launch` starts it in-process; ``torchrun`` or ``accelerate launch``
work too): each reads RANK / WORLD_SIZE / LOCAL_RANK from the environment, takes every WORLD_SIZE-th item
(:meth:`DatasetRun.shard`, lmms-eval's convention) and appends each finished item's records to its own shard as
whole, fsync'ed lines. :meth:`DatasetRun.merge` waits for every process and reads every shard on rank 0. A run
killed at any moment loses at most the items in flight: a resumed run reads the shards (ignoring a torn last line,
which it cuts before appending) and :meth:`DatasetRun.done_keys` says which results exist. An item that failed
alone (a bad sample) can be recorded with :meth:`DatasetRun.append_failures`, so that a resumed run knows it
(:meth:`DatasetRun.failures`) and need not compute it again. A manifest records what makes results comparable; a
folder written with another setup is refused. The manifest and the shards are created with mode 0644 (less what
the umask removes).

This is the only module of care that starts, joins or ends a process group (the demo builder only reads its
rank, :func:`care_core.backbones.demo.group_rank`)::

    with DatasetRun("runs/csr", manifest={"model": "tiny-llava"}, resume=True) as run:
        pipe = ReductionPipeline.from_pretrained("tiny-llava", device=run.device("auto"))
        run.start()
        done = run.done_keys()
        for item in run.shard(items):
            ...
            run.append(records)
        merged = run.merge()  # every record of every process, on rank 0 ({} elsewhere)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
import statistics
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from care_core.errors import CareError

MANIFEST = "manifest.json"
FORMAT = "care.csr-run/1"
SHARD_GLOB = "shard-*.jsonl"
#: the record fields that name one result of a CSR run
CSR_KEY = ("pair_id", "method", "budget")
#: the field of a failure record: the one-line error of an item that failed alone (a shard line with the item's
#: first key field, the item's own fields and this one, and no result)
FAILED = "failed"
#: permission bits of the files a run writes (the process umask applies)
FILE_MODE = 0o644

T = TypeVar("T")
Key = tuple[Any, ...]


class RunFolderError(CareError):
    """The output folder of a data-set run cannot be used (a file, another run, another setup)."""


@dataclass(frozen=True)
class World:
    """This process's place among the processes torchrun (or accelerate) started; (0, 1) alone."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> World:
        def number(name: str, default: int) -> int:
            try:
                return int(os.environ.get(name, default))
            except ValueError:
                return default

        return cls(rank=number("RANK", 0), size=max(1, number("WORLD_SIZE", 1)), local_rank=number("LOCAL_RANK", 0))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def take(self, items: Sequence[T]) -> list[T]:
        """This rank's share: every size-th item, starting at rank (the lmms-eval convention)."""
        return list(items[self.rank :: self.size])

    def device(self, device: str) -> str:
        """``device`` for this process: with several processes, ``auto``/``cuda`` become ``cuda:LOCAL_RANK``."""
        return process_device(device, world_size=self.size, local_rank=self.local_rank)


def process_device(device: str = "auto", *, world_size: int | None = None, local_rank: int | None = None) -> str:
    """This process's device -- the one answer to "which GPU is mine". With several processes (``world_size`` > 1;
    by default WORLD_SIZE, as torchrun and accelerate set it) on a machine with CUDA, "auto" and "cuda" become
    ``cuda:{local_rank}`` (by default LOCAL_RANK; modulo the number of GPUs, so more processes than GPUs share
    them); anything else ("cpu", an explicit "cuda:N", one process) is ``device`` as given
    (:func:`care_core.backbones.loading.resolve_device` then checks it)."""
    import torch

    launched = World.from_env()
    size = launched.size if world_size is None else world_size
    if size <= 1 or device not in ("auto", "cuda") or not torch.cuda.is_available():
        return device
    rank = launched.local_rank if local_rank is None else local_rank
    return f"cuda:{rank % torch.cuda.device_count()}"  # more processes than GPUs: they share them in turn


class Processes:
    """The process group of a launch (a context manager): started on entry, ended on exit if it started it.

    NCCL where every process has a GPU of its own, gloo otherwise (CPU processes); nothing at all alone.
    """

    def __init__(self, world: World | None = None, backend: str | None = None) -> None:
        self.world = world or World.from_env()
        self.backend = backend
        self._owned = False

    def __enter__(self) -> Processes:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if self.world.size == 1:
            return
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            return
        backend = self.backend
        if backend is None:
            enough = torch.cuda.is_available() and torch.cuda.device_count() >= self.world.size
            backend = "nccl" if enough else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(self.world.local_rank)
            dist.init_process_group("nccl", device_id=torch.device("cuda", self.world.local_rank))
        else:
            dist.init_process_group(backend)
        self._owned = True

    def barrier(self) -> None:
        """Wait for every process of the launch."""
        if self.world.size > 1:
            import torch.distributed as dist

            dist.barrier()

    def gather(self, value: Any) -> list[Any]:
        """``value`` of every process, in rank order (picklable values)."""
        if self.world.size == 1:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world.size
        dist.all_gather_object(out, value)
        return out

    def close(self) -> None:
        if not self._owned:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self._owned = False


def pair_id(line: int | None, image: Path | str, question: str) -> str:
    """Stable id of an image-question pair: its line number and a hash of the image path and question."""
    digest = hashlib.sha256(f"{Path(image).expanduser().resolve()}\0{question}".encode()).hexdigest()[:16]
    return f"{line or 0}-{digest}"


def read_shards(folder: Path, key: Sequence[str] = CSR_KEY) -> dict[Key, dict[str, Any]]:
    """Every complete result line of every shard (a torn last line, from a killed run, is ignored)."""
    return {tuple(record[k] for k in key): record for record in _shard_lines(folder)
            if FAILED not in record and set(key) <= record.keys()}  # fmt: skip


def read_failures(folder: Path, field: str = CSR_KEY[0]) -> dict[Any, dict[str, Any]]:
    """Every failure record of every shard, by the item's ``field`` (the last one recorded for an item)."""
    return {record[field]: record for record in _shard_lines(folder) if FAILED in record and field in record}


def _shard_lines(folder: Path) -> Iterator[dict[str, Any]]:
    """The complete JSON-object lines of every shard, in shard then line order."""
    if not folder.is_dir():
        return
    for shard in sorted(folder.glob(SHARD_GLOB)):
        for line in shard.read_bytes().split(b"\n"):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the line a killed process was writing
            if isinstance(record, dict):
                yield record


class Shard:
    """One rank's append-only results file: whole lines, written with one call each and fsync'ed."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.path = folder / f"shard-{rank:03d}.jsonl"
        self._repair()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)

    def _repair(self) -> None:
        """Cut a torn last line left by a killed process, so new lines start on a line of their own."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self.path, "r+b") as handle:
                handle.truncate(data.rfind(b"\n") + 1)
                handle.flush()
                os.fsync(handle.fileno())

    def append(self, records: Iterable[Mapping[str, Any]]) -> None:
        data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode()
        if data:
            os.write(self._fd, data)
            os.fsync(self._fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def check_folder(folder: Path, manifest: Mapping[str, Any], resume: bool, run_format: str = FORMAT) -> None:
    """RunFolderError for a folder that is a file, holds another run (without ``resume``) or a run of another setup
    (a manifest whose entries differ from ``manifest``'s)."""
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"{{output_dir}} {folder}: is a file, expected a folder")
    path = folder / MANIFEST
    if not path.exists():
        if folder.exists() and any(folder.glob(SHARD_GLOB)):
            raise RunFolderError(f"{{output_dir}} {folder}: has result shards but no {MANIFEST}; use another folder")
        return
    if not resume:
        raise RunFolderError(f"{{output_dir}} {folder}: holds a run already; pass {{resume}} to continue it, or use "
                             "another folder")  # fmt: skip
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RunFolderError(f"{{output_dir}} {folder}: unreadable {MANIFEST} ({exc})") from None
    if not isinstance(saved, dict) or saved.get("format") != run_format:
        raise RunFolderError(f"{{output_dir}} {folder}: {MANIFEST} is not a {run_format} run")
    for key, value in manifest.items():
        if saved.get(key) != value:
            raise RunFolderError(f"{{output_dir}} {folder}: its results were computed with "
                                 f"{_difference(key, saved.get(key), value)}; they cannot be mixed (use another "
                                 "{output_dir})")  # fmt: skip


def _difference(key: str, old: Any, new: Any) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        changed = [f"{k}={old.get(k)!r} (now {new.get(k)!r})" for k in sorted(set(old) | set(new))
                   if old.get(k) != new.get(k)]  # fmt: skip
        return ("other hyperparameters: " if key == "config" else f"another {key}: ") + ", ".join(changed)
    return f"{key} {old!r} (now {new!r})"


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` through a temporary sibling (created with :data:`FILE_MODE`, as the shards are: a
    NamedTemporaryFile would be 0600), fsync'ed and renamed into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class DatasetRun:
    """A resumable data-set run that the caller owns: its folder, this process's shard and the process group.

    ``output_dir`` None keeps results in memory (nothing to resume; :meth:`merge` gathers them on rank 0).
    ``manifest``: what must match for results of two runs to be mixed (JSON values); ``key``: the record fields
    that name one result. The folder is checked on construction (before anything slow); entering starts the
    process group, :meth:`start` writes the manifest and opens this process's shard.
    """

    def __init__(
        self,
        output_dir: Path | str | None,
        *,
        manifest: Mapping[str, Any] | None = None,
        resume: bool = False,
        key: Sequence[str] = CSR_KEY,
        run_format: str = FORMAT,
        processes: Processes | None = None,
    ) -> None:
        self.folder = Path(output_dir).expanduser() if output_dir is not None else None
        self.manifest = dict(manifest or {})
        self.key = tuple(key)
        self.run_format = run_format
        self.processes = processes or Processes()
        self._shard: Shard | None = None
        self._fresh: dict[Key, dict[str, Any]] = {}
        self._failed: dict[Any, dict[str, Any]] = {}
        if self.folder is not None:
            check_folder(self.folder, self.manifest, resume, run_format)

    @property
    def world(self) -> World:
        return self.processes.world

    def __enter__(self) -> DatasetRun:
        self.processes.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._shard is not None:
            self._shard.close()
            self._shard = None
        self.processes.close()

    def device(self, device: str) -> str:
        return self.world.device(device)

    def start(self, **extra: Any) -> None:
        """Write the manifest (rank 0, first run only; ``extra`` entries are recorded, not compared) and open this
        process's shard; every process has done so when it returns."""
        self.processes.barrier()  # every process has checked the folder before any writes to it
        if self.folder is None:
            return
        if self.world.is_main and not (self.folder / MANIFEST).exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            payload = {"format": self.run_format, **self.manifest, **extra}
            _write_atomic(self.folder / MANIFEST, json.dumps(payload, indent=2) + "\n")
        self.processes.barrier()
        self._shard = Shard(self.folder, self.world.rank)

    def shard(self, items: Sequence[T]) -> list[T]:
        """This process's share of ``items``: every P-th item (P processes), starting at its rank."""
        return self.world.take(items)

    def records(self) -> dict[Key, dict[str, Any]]:
        """Every saved result, by key: the folder's shards (all processes), or this run's records in memory."""
        if self.folder is None:
            return dict(self._fresh)
        return read_shards(self.folder, self.key)

    def done_keys(self) -> set[Key]:
        """The keys of the results already saved (a resumed run computes only the others)."""
        return set(self.records())

    def append(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Save finished results (one item's records at once: whole lines, fsync'ed)."""
        rows = [dict(r) for r in records]
        if self.folder is not None:
            if self._shard is None:
                raise RuntimeError("call start() before append()")
            self._shard.append(rows)
        self._fresh.update((tuple(r[k] for k in self.key), r) for r in rows)

    def append_failures(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Save failure records (items that failed alone): each names its item by the first key field and says
        what went wrong in :data:`FAILED`."""
        rows = [dict(r) for r in records]
        if any(FAILED not in r or self.key[0] not in r for r in rows):
            raise ValueError(f"a failure record needs the fields {self.key[0]!r} and {FAILED!r}")
        if self.folder is not None and rows:
            if self._shard is None:
                raise RuntimeError("call start() before append_failures()")
            self._shard.append(rows)
        self._failed.update((r[self.key[0]], r) for r in rows)

    def failures(self) -> dict[Any, dict[str, Any]]:
        """Every saved failure record, by item (the folder's shards, or this run's in memory)."""
        return dict(self._failed) if self.folder is None else read_failures(self.folder, self.key[0])

    def merge(self) -> dict[Key, dict[str, Any]]:
        """Wait for every process; on rank 0 every saved result by key, elsewhere {}.

        Without a folder the processes send their records to rank 0 instead (nothing is saved)."""
        if self.folder is None and self.world.size > 1:
            parts = self.processes.gather(self._fresh)
            return {k: v for part in parts for k, v in part.items()} if self.world.is_main else {}
        self.processes.barrier()  # every shard is complete
        return self.records() if self.world.is_main else {}


def csr_summary(
    results: Sequence[Mapping[str, Any]], methods: Sequence[str], budgets: Sequence[str]
) -> list[dict[str, Any]]:
    """Per method x budget, in the order given: mean, population std, count of 100 x CSR, the half-width of its 95%
    confidence interval (normal approximation, sample std; 0 for one pair) and the mean kept share (100 K / N)."""
    rows = []
    for name in methods:
        for budget in budgets:
            chosen = [r for r in results if r["method"] == name and r["budget"] == budget]
            if not chosen:
                continue
            values = [r["csr"] for r in chosen]
            n = len(values)
            ci95 = 1.96 * statistics.stdev(values) / math.sqrt(n) if n > 1 else 0.0
            rows.append({"method": name, "budget": budget, "mean": statistics.fmean(values),
                         "std": statistics.pstdev(values) if n > 1 else 0.0, "n": n, "ci95": ci95,
                         "kept_pct": statistics.fmean(100 * r["K"] / r["N"] for r in chosen)})  # fmt: skip
    return rows


def launch(module: str, argv: Sequence[str], num_processes: int) -> int:
    """Run ``python -m MODULE ARGV`` in ``num_processes`` processes on this machine through torchrun; their exit
    code (2 if any process exited 2). KeyboardInterrupt when the launch was interrupted (Ctrl-C, SIGTERM)."""
    # A few CPU threads per process: the per-sample CPU work (image preprocessing) gains little from more, and
    # idle OpenMP workers that spin compete with the other processes' Python threads (on 2 x H200 with 32 cores,
    # LLaVA-NeXT-7B: 16 threads per process made each process ~8% slower than alone; 4 threads, no slower).
    threads = str(max(1, min(4, (os.cpu_count() or 1) // num_processes)))
    # LOGLEVEL: torchrun's own logger, read when it is imported
    with scoped_environ(LOGLEVEL="CRITICAL", OMP_NUM_THREADS=threads, keep_set=True), _quiet_launcher():
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import get_args_parser, run

        args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={num_processes}", "--module",
                                             module, *argv])  # fmt: skip
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            run(args)
        except SignalException as exc:
            raise KeyboardInterrupt from exc
        except ChildFailedError as exc:
            codes = [f.exitcode for f in exc.failures.values() if f.exitcode]
            if any(code in (130, -2) for code in codes):  # a child stopped by Ctrl-C
                raise KeyboardInterrupt from exc
            return 2 if 2 in codes else (codes[0] if codes else 1)
    return 0


@contextlib.contextmanager
def scoped_environ(keep_set: bool = False, **values: str) -> Iterator[None]:
    """Environment variables set for the block and restored after it (``keep_set``: leave those already set)."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if not (keep_set and saved[name] is not None):
                os.environ[name] = value
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


@contextlib.contextmanager
def _quiet_launcher() -> Iterator[None]:
    """torchrun's own log lines (e.g. "failed (exitcode: 2)") off the terminal for the launch, levels restored."""
    import logging

    import torch.distributed.run  # noqa: F401  (creates its loggers)

    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith("torch.distributed")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
