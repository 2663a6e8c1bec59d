"""Embedded demo backbones: built once, cached, checked and restored (the builders are each family's).

Which demos exist, their versions and builders are the family registry's (:mod:`care_core.backbones.families`);
each family's builders live in its folder (``care_core.backbones.<family>.demo``, their shared parts in
:mod:`care_core.backbones.tiny_parts`). A demo is built once into ``<care home>/demo/<name>-v<version>/`` with
``save_pretrained`` (model and processor) and then loaded through exactly the same code path as any real checkpoint
folder. Its token counts, shapes and module layout are the real model family's, so every command works end to end
without a download.

``tiny-llava`` ships trained weights (``demo_weights/tiny-llava.safetensors``, float16, sha256 in
``demo_weights/manifest.json``; trained by ``scripts/train_demo`` on the synthetic shapes world of
:mod:`care_core.synthetic`): it answers one-word questions about coloured shapes; so does ``tiny-llava-next``, whose
file is installed too. ``tiny-qwen2.5-vl``, ``tiny-qwen3-vl``, ``tiny-qwen3.5``, ``tiny-gemma3``, ``tiny-internvl3``
and ``tiny-llava-onevision`` load their trained weights (wider skeletons,
:data:`~care_core.backbones.tiny_parts.TRAINED_SIZES`) from the files the manifest lists; a demo whose file the
manifest does not list is left out of the lists and refused on load until its file is installed. The ``-random`` demos
have seeded random weights and meaningless answers. Every demo folder holds a marker (``care_demo.json``) with the
weight file's sha256, checked on each load: a damaged cached copy is restored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError
from ._hf import quiet_transformers
from .families import MANIFEST as MANIFEST  # re-exported: the registry defines where the weights ship
from .families import RANDOM_DEMO_NOTE, TRAINED_DEMO_NOTE, DemoBackbone, demo_backbones, unshipped_reason
from .families import WEIGHTS_DIR as WEIGHTS_DIR
from .families import read_manifest as read_manifest
from .families import weights_dir as weights_dir

MARKER = "care_demo.json"
WEIGHTS_FILE = "model.safetensors"

#: demo name -> demo, from the family registry (each family's record names its demos and their builders)
DEMO_BACKBONES: dict[str, DemoBackbone] = demo_backbones()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shipped_weights(spec: DemoBackbone) -> tuple[Path, dict[str, Any]]:
    """The shipped weight file of a trained demo and its manifest entry, checked (ModelLoadError if unusable)."""
    assert spec.weights is not None
    path = weights_dir() / spec.weights
    entry = read_manifest().get(spec.weights)
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
        raise ModelLoadError(f"{spec.name}: no entry for {spec.weights} in {weights_dir() / MANIFEST}; reinstall care")
    if not path.is_file() or file_sha256(path) != entry["sha256"]:
        raise ModelLoadError(
            f"{spec.name}: the weights shipped with care ({path}) are missing or damaged; reinstall care"
        )
    return path, entry


def demo_marker(spec: DemoBackbone, sha256: str | None = None) -> dict[str, Any]:
    return {
        "name": spec.name,
        "version": spec.version,
        "family": spec.family,
        "seed": spec.seed,
        "weights": "trained on synthetic shapes" if spec.trained else "random weights",
        "description": spec.description,
        "note": spec.note,
        "sha256": sha256,
    }


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The folder's ``care_demo.json`` (None when absent or unreadable)."""
    try:
        marker = json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def marker_note(marker: dict[str, Any]) -> str:
    """The demo note a marker stands for (older markers carry none: their demos had random weights)."""
    note = marker.get("note")
    if isinstance(note, str) and note:
        return note
    return TRAINED_DEMO_NOTE if "trained" in str(marker.get("weights", "")) else RANDOM_DEMO_NOTE


def weights_problem(folder: Path, marker: dict[str, Any]) -> str | None:
    """Why the folder's weight file does not match the hash its marker records (None: it matches, or no hash)."""
    expected = marker.get("sha256")
    if not isinstance(expected, str):
        return None
    path = Path(folder) / WEIGHTS_FILE
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    wanted = marker.get("bytes")
    if isinstance(wanted, int) and size < wanted:
        return f"truncated ({size} of {wanted} bytes)"
    if file_sha256(path) != expected:
        return "corrupt (sha256 mismatch)"
    return None


def outdated(spec: DemoBackbone, marker: dict[str, Any]) -> str | None:
    """Why a cached trained demo is not the one this care ships (None: it is, or the demo is random).

    The marker's hash only says the cached file is what was cached; a care whose shipped weights were retrained
    (a new manifest entry) must not keep answering with the old ones, so a trained demo's marker must also carry
    the manifest's sha256."""
    if spec.weights is None:
        return None
    entry = read_manifest().get(spec.weights)  # none listed: a random demo (an optional file not installed)
    shipped = entry.get("sha256") if isinstance(entry, dict) else None
    cached = marker.get("sha256")
    if shipped is None or cached == shipped:
        return None
    return f"another release's (sha256 {str(cached)[:12]}, this care ships {str(shipped)[:12]})"


def _is_built(folder: Path, spec: DemoBackbone) -> bool:
    marker = read_marker(folder)
    return marker is not None and marker.get("name") == spec.name and marker.get("version") == spec.version


@dataclass(frozen=True)
class DemoInstall:
    """Where a demo lives, and what happened on the way (one-line notices for the user)."""

    folder: Path
    notices: tuple[str, ...] = ()


def install_demo(name: str, home: Path) -> DemoInstall:
    """Build demo ``name`` under ``home/demo/`` unless a complete, intact copy is there; return where it is.

    A trained demo is the spec's architecture saved with ``save_pretrained`` (config, processor) whose
    ``model.safetensors`` is a byte copy of the shipped weights (sha256 from ``demo_weights/manifest.json``);
    a random one is built from its seed. The marker records the weight file's sha256, checked on every call:
    a truncated, edited or missing weight file is rebuilt (restored) and reported in ``notices``. The build
    goes to a temporary sibling folder renamed into place with ``os.replace``, so a concurrent process sees
    no folder, or a complete one. A demo whose optional trained weights are not shipped yet is refused
    (ModelLoadError, one line).
    """
    spec = demo_backbones()[name]
    if not spec.shipped:
        raise ModelLoadError(unshipped_reason(spec))
    root = Path(home) / "demo"
    target = root / spec.folder_name
    notices: list[str] = []
    marker = read_marker(target) if _is_built(target, spec) else None
    if marker is not None:
        damage, older = weights_problem(target, marker), outdated(spec, marker)
        if damage is None and older is None:
            return DemoInstall(target)
        source = "the copy shipped with care" if spec.trained else f"seed {spec.seed}"
        done = f"restored from {source}" if damage else f"replaced by {source}"
        notices.append(f"{spec.name}: cached weights in {target} were {damage or older}; {done}")
    if _other_rank_builds():
        _wait_until_intact(target, spec)
        return DemoInstall(target, tuple(notices))
    _build_into(spec, root, target)
    return DemoInstall(target, tuple(notices))


def group_rank() -> int | None:
    """This process's rank in an initialised process group, or None where there is none (no import of
    torch.distributed unless something else imported it: then no group can exist)."""
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    return int(dist.get_rank()) if dist.is_available() and dist.is_initialized() else None


def _other_rank_builds() -> bool:
    """True in a process group's rank > 0: there transformers' save_pretrained writes nothing (only rank 0
    saves), so rank 0 builds the demo and the other ranks wait for it."""
    return group_rank() not in (None, 0)


def _wait_until_intact(target: Path, spec: DemoBackbone, timeout_s: float = 900.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not _intact(target, spec):
        if time.monotonic() > deadline:
            raise ModelLoadError(f"{spec.name}: rank 0 did not finish building {target} in {timeout_s:.0f} s")
        time.sleep(0.2)


def _intact(folder: Path, spec: DemoBackbone) -> bool:
    marker = read_marker(folder) if _is_built(folder, spec) else None
    return (marker is not None and (folder / "config.json").is_file() and weights_problem(folder, marker) is None
            and outdated(spec, marker) is None)  # fmt: skip


def _build_into(spec: DemoBackbone, root: Path, target: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.folder_name}.tmp-", dir=root))
    try:
        with quiet_transformers():
            model, processor = spec.build(spec.seed)
            model.save_pretrained(str(tmp))
            processor.save_pretrained(str(tmp))
        if spec.trained:
            source, _ = shipped_weights(spec)
            shutil.copyfile(source, tmp / WEIGHTS_FILE)
        weights = tmp / WEIGHTS_FILE
        if not ((tmp / "config.json").is_file() and weights.is_file()):
            raise ModelLoadError(f"{spec.name}: building the demo in {tmp} wrote no config.json or weights")
        marker = {**demo_marker(spec, file_sha256(weights)), "bytes": weights.stat().st_size}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        if target.exists() and not _intact(target, spec):
            # a stale, damaged or half-deleted folder: move it aside, then replace it
            stale = Path(tempfile.mkdtemp(prefix=f".{spec.folder_name}.stale-", dir=root))
            with contextlib.suppress(OSError):
                os.replace(target, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _intact(target, spec):  # lost a race to a process that built it: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_demo(name: str, home: Path) -> Path:
    """:func:`install_demo`'s folder (notices dropped)."""
    return install_demo(name, home).folder
