"""File output for the CLI: checked output paths and atomic writes (image loading lives in care_core.images)."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from care_cli.errors import UserError
from care_core.errors import one_line
from care_core.images import load_image

if TYPE_CHECKING:
    import torch

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "check_distinct_outputs",
    "check_output_folder",
    "check_output_path",
    "load_image",
    "save_safetensors_atomic",
]


def check_output_path(
    out: Path,
    inputs: Sequence[Path],
    force: bool,
    *,
    option: str = "--out",
    suffixes: Sequence[str] | None = None,
) -> Path:
    """Validate an output path and return it resolved.

    Refuses a directory, a missing or unwritable parent folder, any input file, anything that is not a regular file
    (a device node, a FIFO, a socket: ``--force`` never replaces those), a file name whose extension does
    not match the format written (``suffixes``), and an existing file unless ``force``.
    """
    name = one_line(out)
    target = Path(out).expanduser().resolve()
    if target.is_dir():
        raise UserError(f"{option} {name}: is a directory; give a file name for the output")
    parent = target.parent
    if not parent.exists():
        raise UserError(f"{option} {name}: folder {one_line(parent)} does not exist")
    if not parent.is_dir():
        raise UserError(f"{option} {name}: {one_line(parent)} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{option} {name}: folder {one_line(parent)} {_unwritable(parent)}")
    for given in inputs:
        source = Path(given).expanduser().resolve()
        same = source == target
        if not same and source.exists() and target.exists():
            try:
                same = os.path.samefile(source, target)
            except OSError:
                same = False
        if same:
            raise UserError(f"{option} {name}: is the input {one_line(given)}; refusing to overwrite the input")
    if suffixes is not None and Path(out).suffix.lower() not in suffixes:
        shown = " or ".join(", ".join(suffixes).rsplit(", ", 1))
        raise UserError(f"{option} {name}: the file name must end in {shown} (the format written)")
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    except OSError as exc:
        raise UserError(f"{option} {name}: cannot check it ({one_line(exc.strerror or exc)})") from None
    if not stat.S_ISREG(mode):
        raise UserError(f"{option} {name}: exists and is not a regular file; refusing to replace it")
    if not force:
        raise UserError(f"{option} {name}: exists; pass --force to replace it")
    return target


def check_output_folder(
    folder: Path, *, option: str = "--output-dir", folders: Sequence[str] = (), files: Sequence[str] = ()
) -> Path:
    """Validate a folder a run writes into (created later with its missing parents, as ``mkdir -p``) and return it
    resolved.

    The folder, or else the nearest part of its path that exists, must be a folder this process may write in: a
    path below a regular file, or on a read-only file system, is refused (``os.access`` reports a read-only mount
    for root too). ``folders`` and ``files``: names inside it that the run writes; one that exists must be of that
    kind and writable.
    """
    name = one_line(folder)
    target = Path(folder).expanduser().resolve()
    existing = next(p for p in (target, *target.parents) if os.path.lexists(p))
    if existing == target and not target.is_dir():
        raise UserError(f"{option} {name}: is a file, expected a folder")
    if not existing.is_dir():
        raise UserError(f"{option} {name}: cannot be created, {one_line(existing)} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == target else "cannot be created, "
        raise UserError(f"{option} {name}: {where}folder {one_line(existing)} {_unwritable(existing)}")
    for entry, want_folder in [*((f, True) for f in folders), *((f, False) for f in files)]:
        path = target / entry
        if not os.path.lexists(path):
            continue
        if path.is_dir() != want_folder:
            kind = "a folder" if want_folder else "a file"
            raise UserError(f"{option} {name}: {one_line(path)} is in the way (the run writes {kind} there)")
        if not os.access(path, os.W_OK | (os.X_OK if want_folder else 0)):
            raise UserError(f"{option} {name}: {one_line(path)} {_unwritable(path)}")
    return target


def _unwritable(path: Path) -> str:
    """How to say that ``os.access`` refused writing at ``path``: naming a read-only file system where it is one."""
    try:
        read_only = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # AttributeError: no statvfs (Windows)
        read_only = False
    return "is not writable (read-only file system)" if read_only else "is not writable"


def check_distinct_outputs(outputs: dict[str, Path | None]) -> None:
    """Refuse two options that name the same output file (e.g. ``--csv a.png --plot a.png``)."""
    seen: dict[Path, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        key = Path(path).expanduser().resolve()
        if key in seen:
            raise UserError(f"{seen[key]} and {option} name the same file {one_line(path)}; give each its own")
        seen[key] = option


def _new_file_mode(path: Path) -> int:
    """Permission bits for the written file: keep an existing file's, else the umask default."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _fsync_dir(folder: Path) -> None:
    """Best-effort fsync of a folder so the rename itself is durable."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write data to path atomically: temporary file in the same folder, fsync, then os.replace.

    On failure the temporary file is removed and any existing file at path is left untouched.
    """
    target = Path(path)
    folder = target.parent
    mode = _new_file_mode(target)
    tmp_name: str | None = None
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{target.name}.", suffix=".tmp", delete=False) as handle:
            tmp_name = handle.name
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp_name, mode)
        os.replace(tmp_name, target)
        tmp_name = None
    except OSError as exc:
        raise UserError(f"{one_line(target)}: cannot write ({one_line(exc.strerror or exc)})") from exc
    finally:
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
    _fsync_dir(folder)


def atomic_write_text(path: Path, text: str, encoding: str = "utf-8") -> None:
    """Write text to path atomically (see atomic_write_bytes)."""
    atomic_write_bytes(path, text.encode(encoding))


def save_safetensors_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Save tensors (moved to CPU, contiguous, unshared) with string metadata as a safetensors file."""
    from safetensors.torch import save as safetensors_save

    prepared: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for key, tensor in tensors.items():
        t = tensor.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        # safetensors refuses tensors that share memory or view part of a larger buffer: copy those.
        if storage.data_ptr() in seen_storage or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
            storage = t.untyped_storage()
        if t.numel() > 0:
            seen_storage.add(storage.data_ptr())
        prepared[key] = t
    data = safetensors_save(prepared, metadata=dict(metadata))
    atomic_write_bytes(path, data)
