"""File input and output for the CLI: robust image loading and safe, atomic output writing."""

from __future__ import annotations

import contextlib
import os
import re
import struct
import tempfile
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError
from safetensors.torch import save as safetensors_save

from care_cli.errors import UserError

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "check_output_path",
    "load_image",
    "save_safetensors_atomic",
]

_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
# Exceptions Pillow's decoders raise for corrupt or truncated data.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)
_BOMB_RE = re.compile(r"\((\d+) pixels\) exceeds limit of (\d+) pixels")


def _one_line(text: object) -> str:
    """Collapse any whitespace (newlines included) so a message stays on one line."""
    return " ".join(str(text).split())


@contextlib.contextmanager
def _strict_truncation() -> Iterator[None]:
    """Make sure truncated files raise while decoding, even if something else enabled leniency."""
    previous = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        yield
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = previous


def _bomb_message(name: str, exc: Exception) -> str:
    """One-line message for Pillow's DecompressionBombError."""
    match = _BOMB_RE.search(str(exc))
    if match:
        pixels, limit = match.groups()
        detail = f"image too large ({pixels} pixels > limit {limit})"
    else:
        detail = f"image too large ({_one_line(exc)})"
    return f"{name}: {detail}; Pillow's decompression-bomb guard refused it"


def _sixteen_bit_to_rgb(im: Image.Image) -> Image.Image:
    """Scale a 16-bit (or 32-bit integer) grayscale image to 8-bit RGB, compositing tRNS over white."""
    raw = np.asarray(im).astype(np.float64)
    values = np.clip(raw, 0.0, None)
    peak = float(values.max()) if values.size else 0.0
    # 16-bit data maps value/257 (65535 -> 255); wider "I" data is scaled by its own maximum.
    scaled = values / 257.0 if peak <= 65535.0 else values * (255.0 / peak)
    gray = np.clip(np.rint(scaled), 0, 255).astype(np.uint8)
    transparency = im.info.get("transparency")
    if isinstance(transparency, int):
        gray[raw == transparency] = 255
    return Image.fromarray(gray, mode="L").convert("RGB")


def _float_to_rgb(im: Image.Image) -> Image.Image:
    """Map a float image to 8-bit RGB: [0, 1] data is scaled to [0, 255], anything else is clipped."""
    values = np.nan_to_num(np.asarray(im, dtype=np.float64), nan=0.0, posinf=255.0, neginf=0.0)
    if values.size and float(values.max()) <= 1.0:
        values = values * 255.0
    gray = np.clip(np.rint(values), 0, 255).astype(np.uint8)
    return Image.fromarray(gray, mode="L").convert("RGB")


def _to_rgb(im: Image.Image) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB; transparency is composited over white."""
    if im.mode in _SIXTEEN_BIT_MODES:
        return _sixteen_bit_to_rgb(im)
    if im.mode == "F":
        return _float_to_rgb(im)
    if im.mode in _ALPHA_MODES or im.has_transparency_data:
        source = im.convert("LA") if im.mode == "La" else im
        rgba = source.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if im.mode == "RGB":
        return im.copy()
    return im.convert("RGB")


def _orient(im: Image.Image) -> Image.Image:
    """Apply the EXIF Orientation tag; a broken EXIF block is ignored rather than fatal."""
    try:
        oriented = ImageOps.exif_transpose(im)
    except (*_DECODE_ERRORS, KeyError, TypeError):
        return im
    return oriented if oriented is not None else im


def load_image(path: str | Path) -> Image.Image:
    """Load an image file as a fully decoded 8-bit RGB image (first frame, EXIF-oriented).

    Raises UserError with a one-line message naming the path for anything that is not a readable image.
    """
    name = _one_line(path)
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except FileNotFoundError:
        raise UserError(f"{name}: no such file") from None
    except PermissionError:
        raise UserError(f"{name}: permission denied") from None
    except OSError as exc:
        raise UserError(f"{name}: cannot access file ({_one_line(exc.strerror or exc)})") from None
    if p.is_dir():
        raise UserError(f"{name}: is a directory, not an image file")
    if not p.is_file():
        raise UserError(f"{name}: not a regular file")
    if st.st_size == 0:
        raise UserError(f"{name}: empty file, not an image")

    try:
        with _strict_truncation(), Image.open(p) as im:
            im.load()
            return _to_rgb(_orient(im))
    except UserError:
        raise
    except FileNotFoundError:
        raise UserError(f"{name}: no such file") from None
    except PermissionError:
        raise UserError(f"{name}: permission denied") from None
    except IsADirectoryError:
        raise UserError(f"{name}: is a directory, not an image file") from None
    except Image.DecompressionBombError as exc:
        raise UserError(_bomb_message(name, exc)) from None
    except UnidentifiedImageError:
        raise UserError(f"{name}: not an image file Pillow can read") from None
    except MemoryError:
        raise UserError(f"{name}: not enough memory to decode the image") from None
    except _DECODE_ERRORS as exc:
        raise UserError(f"{name}: cannot decode image, truncated or corrupt ({_one_line(exc)})") from None


def check_output_path(out: Path, inputs: Sequence[Path], force: bool) -> Path:
    """Validate an output path and return it resolved.

    Refuses a directory, a missing parent folder, any input file, and an existing file unless force.
    """
    name = _one_line(out)
    target = Path(out).expanduser().resolve()
    if target.is_dir():
        raise UserError(f"{name}: is a directory; give a file name for the output")
    parent = target.parent
    if not parent.exists():
        raise UserError(f"{name}: folder {_one_line(parent)} does not exist")
    if not parent.is_dir():
        raise UserError(f"{name}: {_one_line(parent)} is not a folder")
    for given in inputs:
        source = Path(given).expanduser().resolve()
        same = source == target
        if not same and source.exists() and target.exists():
            try:
                same = os.path.samefile(source, target)
            except OSError:
                same = False
        if same:
            raise UserError(f"{name}: is the input {_one_line(given)}; refusing to overwrite the input")
    if target.exists() and not force:
        raise UserError(f"{name}: exists; pass --force to replace it")
    return target


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
        raise UserError(f"{_one_line(target)}: cannot write ({_one_line(exc.strerror or exc)})") from exc
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
