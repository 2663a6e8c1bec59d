"""Image loading with every guard a user's files need: any mode, EXIF orientation, corrupt or huge files.

Reading is the only I/O here: the library never writes files. Errors are :class:`ImageError`, one line
naming the path.
"""

from __future__ import annotations

import contextlib
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from care_core.errors import ImageError, one_line

__all__ = ["load_image", "to_rgb"]

_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
# Exceptions Pillow's decoders raise for corrupt or truncated data.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)
_BOMB_RE = re.compile(r"\((\d+) pixels\) exceeds limit of (\d+) pixels")
# What an OS error while reaching the file means to the user; the first matching type wins.
_ACCESS_PROBLEMS: tuple[tuple[type[OSError], str], ...] = (
    (FileNotFoundError, "no such file"),
    (PermissionError, "permission denied"),
    (IsADirectoryError, "is a directory, not an image file"),
)


@contextlib.contextmanager
def _strict_truncation() -> Iterator[None]:
    """Make sure truncated files raise while decoding, even if something else enabled leniency.

    Pillow reads this setting only from its module global, so it cannot be passed per call; it is left
    alone when already strict (the default) and otherwise restored on exit, error or not.
    """
    previous = ImageFile.LOAD_TRUNCATED_IMAGES
    if not previous:
        yield
        return
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
        detail = f"image too large ({one_line(exc)})"
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


def to_rgb(im: Image.Image) -> Image.Image:
    """A new 8-bit RGB image from one in any Pillow mode; the library's one RGB converter.

    Transparency (alpha bands, ``tRNS``) is composited over white; 16-bit and 32-bit integer grayscale
    is scaled to 8 bits (value / 257, or by the maximum when wider than 16 bits); float images in
    [0, 1] are scaled to [0, 255], other floats clipped. An RGB image comes back as a copy.
    Raises TypeError for anything that is not a PIL image.
    """
    if not isinstance(im, Image.Image):
        raise TypeError(f"expected a PIL image, got {type(im).__name__}")
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


# The name care_cli.io still imports; to_rgb is the public one.


def _access_problem(exc: OSError) -> str | None:
    """What an OS error while reaching the file means ("no such file", ...), or None for any other."""
    return next((problem for kind, problem in _ACCESS_PROBLEMS if isinstance(exc, kind)), None)


def _decode_problem(exc: Exception) -> str:
    """One-line reason for an error Pillow raised while opening or decoding a file."""
    if isinstance(exc, OSError) and (problem := _access_problem(exc)) is not None:
        return problem
    if isinstance(exc, UnidentifiedImageError):
        return "not an image file Pillow can read"
    return f"cannot decode image, truncated or corrupt ({one_line(exc)})"


def load_image(path: str | Path) -> Image.Image:
    """Load an image file as a fully decoded 8-bit RGB image (first frame, EXIF-oriented).

    Raises ImageError with a one-line message naming the path for anything that is not a readable image.
    """
    name = one_line(path)
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except OSError as exc:
        problem = _access_problem(exc) or f"cannot access file ({one_line(exc.strerror or exc)})"
        raise ImageError(f"{name}: {problem}") from None
    if p.is_dir():
        raise ImageError(f"{name}: is a directory, not an image file")
    if not p.is_file():
        raise ImageError(f"{name}: not a regular file")
    if st.st_size == 0:
        raise ImageError(f"{name}: empty file, not an image")

    try:
        with _strict_truncation(), Image.open(p) as im:
            im.load()
            return to_rgb(_orient(im))
    except ImageError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageError(_bomb_message(name, exc)) from None
    except MemoryError:
        raise ImageError(f"{name}: not enough memory to decode the image") from None
    except _DECODE_ERRORS as exc:
        raise ImageError(f"{name}: {_decode_problem(exc)}") from None
