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
        raise UserError(f"{option} {name}: folder {one_line(parent)} is not writable")
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
