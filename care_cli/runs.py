"""Data-set runs of `care csr`: pairs sharded over processes, per-rank JSONL shards, resume, merge.

The processes are started by torchrun (``care csr --num-processes N`` runs it for you; ``torchrun`` or
``accelerate launch -m care_cli csr …`` work too): each reads RANK / WORLD_SIZE / LOCAL_RANK from the
environment, takes every WORLD_SIZE-th pair, and appends each finished pair to its own shard as whole,
fsync'ed lines. Rank 0 waits for the others and merges every shard of the folder into the report. A run
killed at any moment loses at most the pairs in flight: ``--resume`` reads the shards (ignoring a torn last
line), and computes only the (pair, method, budget) results that are missing. A manifest records what
makes results comparable (model, dtype, hyperparameters); a folder written with others is refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from care_cli.errors import UserError
from care_core.backbones.families import DEFAULT_DEMO

MANIFEST = "manifest.json"
FORMAT = "care.csr-run/1"
SHARD_GLOB = "shard-*.jsonl"


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

        size = max(1, number("WORLD_SIZE", 1))
        return cls(rank=number("RANK", 0), size=size, local_rank=number("LOCAL_RANK", 0))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def take(self, items: list[Any]) -> list[Any]:
        """This rank's share: every size-th item, starting at rank (the lmms-eval convention)."""
        return items[self.rank :: self.size]


def pair_id(line: int | None, image: Path, question: str) -> str:
    """Stable id of a pair: its line number and a hash of the image path and question."""
    digest = hashlib.sha256(f"{Path(image).expanduser().resolve()}\0{question}".encode()).hexdigest()[:16]
    return f"{line or 0}-{digest}"


def result_key(record: dict[str, Any]) -> tuple[str, str, str]:
    return record["pair_id"], record["method"], record["budget"]


def identity(model: str | None, dtype: str, config: dict[str, Any]) -> dict[str, Any]:
    """What must match for results of two runs to be mixed."""
    shown = model or DEFAULT_DEMO
    folder = Path(shown).expanduser()
    if folder.exists():
        shown = str(folder.resolve())
    return {"model": shown, "dtype": dtype, "config": config}


def check_folder(folder: Path, ident: dict[str, Any], resume: bool) -> None:
    """Refuse a folder that is a file, holds another run (without --resume) or a run of another setup."""
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--output-dir {folder}: is a file, expected a folder")
    manifest = folder / MANIFEST
    if not manifest.exists():
        if folder.exists() and any(folder.glob(SHARD_GLOB)):
            raise UserError(f"--output-dir {folder}: has result shards but no {MANIFEST}; use another folder")
        return
    if not resume:
        raise UserError(
            f"--output-dir {folder}: holds a run already; pass --resume to continue it, or use another folder"
        )
    try:
        saved = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"--output-dir {folder}: unreadable {MANIFEST} ({exc})") from None
    if saved.get("format") != FORMAT:
        raise UserError(f"--output-dir {folder}: {MANIFEST} is not a care csr run")
    for key in ("model", "dtype", "config"):
        if saved.get(key) != ident[key]:
            what = _difference(key, saved.get(key), ident[key])
            raise UserError(f"--output-dir {folder}: its results were computed with {what}; "
                            "they cannot be mixed (use another --output-dir)")  # fmt: skip


def _difference(key: str, old: Any, new: Any) -> str:
    if key == "config" and isinstance(old, dict) and isinstance(new, dict):
        changed = [f"{k}={old.get(k)!r} (now {new.get(k)!r})" for k in sorted(set(old) | set(new))
                   if old.get(k) != new.get(k)]  # fmt: skip
        return "other hyperparameters: " + ", ".join(changed)
    return f"{key} {old!r} (now {new!r})"


def write_manifest(folder: Path, ident: dict[str, Any], backbone: dict[str, Any]) -> None:
    from care_cli.io import atomic_write_text

    folder.mkdir(parents=True, exist_ok=True)
    if (folder / MANIFEST).exists():
        return
    payload = {"format": FORMAT, **ident, "backbone": {k: backbone[k] for k in ("name", "family", "demo")}}
    atomic_write_text(folder / MANIFEST, json.dumps(payload, indent=2) + "\n")


def read_shards(folder: Path) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Every complete result line of every shard (a torn last line, from a killed run, is ignored)."""
    done: dict[tuple[str, str, str], dict[str, Any]] = {}
    if not folder.is_dir():
        return done
    for shard in sorted(folder.glob(SHARD_GLOB)):
        for line in shard.read_bytes().split(b"\n"):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # the line a killed process was writing
            if isinstance(record, dict) and {"pair_id", "method", "budget"} <= record.keys():
                done[result_key(record)] = record
    return done


class Shard:
    """One rank's append-only results file: whole lines, written with one call each and fsync'ed."""

    def __init__(self, folder: Path, rank: int) -> None:
        self.path = folder / f"shard-{rank:03d}.jsonl"
        self._repair()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

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

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        data = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode()
        if data:
            os.write(self._fd, data)
            os.fsync(self._fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


def barrier(world: World) -> None:
    """Wait for every process of the launch (gloo: works beside CPU and GPU ranks alike; no data travels)."""
    if world.size == 1:
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    dist.barrier()


def finish(world: World) -> None:
    if world.size == 1:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def shard(folder: Path, world: World) -> Iterator[Shard]:
    handle = Shard(folder, world.rank)
    try:
        yield handle
    finally:
        handle.close()
