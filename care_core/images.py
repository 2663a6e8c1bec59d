"""Image loading with every guard a user's files need: any mode, EXIF orientation, corrupt or huge files.

Reading is the only I/O here: the library never writes files. Errors are :class:`ImageError`, one line
naming the path.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from care_core.errors import CareError, ImageError, LargeImageWarning, one_line

__all__ = ["MAX_PIXELS_VARIABLE", "load_image", "max_image_pixels", "to_rgb"]

#: the environment variable that sets the largest image, in pixels, :func:`load_image` decodes
MAX_PIXELS_VARIABLE = "CARE_MAX_IMAGE_PIXELS"

_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})
_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
# Exceptions Pillow's decoders raise for corrupt or truncated data.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)
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


class _PillowGuard:
    """Pillow's own decompression-bomb check, switched off while :func:`load_image` decodes (it applies the same
    limits itself, in its own words, with a way to raise them).

    Pillow reads its limit only from the process-wide ``Image.MAX_IMAGE_PIXELS``, and loader threads decode in
    parallel: the first load to start saves the limit and sets None, the last to finish restores it, so the caller's
    setting is back once no load runs. :meth:`limit` is the caller's setting at any time.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loads = 0
        self._saved: int | None = None

    def limit(self) -> int | None:
        """The caller's ``Image.MAX_IMAGE_PIXELS`` (Pillow warns above it and refuses above twice it)."""
        with self._lock:
            return self._saved if self._loads else Image.MAX_IMAGE_PIXELS

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        with self._lock:
            if not self._loads:
                self._saved = Image.MAX_IMAGE_PIXELS
                Image.MAX_IMAGE_PIXELS = None
            self._loads += 1
        try:
            yield
        finally:
            with self._lock:
                self._loads -= 1
                if not self._loads:
                    Image.MAX_IMAGE_PIXELS = self._saved


_PILLOW_GUARD = _PillowGuard()


def max_image_pixels() -> int | None:
    """The largest image, in pixels, :func:`load_image` decodes: ``$CARE_MAX_IMAGE_PIXELS``, else where Pillow's own
    guard refuses (twice ``PIL.Image.MAX_IMAGE_PIXELS``: 178,956,970 by default); None: no limit (Pillow's set to
    None). CareError for a value that is not a whole number >= 1."""
    text = os.environ.get(MAX_PIXELS_VARIABLE, "").strip()
    if not text:
        pillow = _PILLOW_GUARD.limit()
        return None if pillow is None else 2 * pillow
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        value = 0
    if value < 1:
        raise CareError(f"{MAX_PIXELS_VARIABLE} must be a whole number of pixels, at least 1; got {one_line(text)!r}")
    return value


def _check_pixels(name: str, size: tuple[int, int], limit: int | None) -> None:
    """ImageError above ``limit`` pixels; LargeImageWarning above Pillow's warning size (within the limit)."""
    width, height = size
    pixels = max(1, width) * max(1, height)
    if limit is not None and pixels > limit:
        raise ImageError(f"{name}: {pixels:,} pixels ({width}×{height}) exceed the limit of {limit:,}, a guard "
                         f"against decompression bombs; to open it, set {MAX_PIXELS_VARIABLE}={pixels}")  # fmt: skip
    large = _PILLOW_GUARD.limit()
    if large is not None and pixels > large:
        megabytes = 3 * pixels / 1e6  # the decoded 8-bit RGB image alone
        warnings.warn(f"{name}: {pixels:,} pixels ({width}×{height}), a large image: decoding it takes time and at "
                      f"least {megabytes:,.0f} MB of memory", LargeImageWarning, stacklevel=3)  # fmt: skip


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

    Raises ImageError with a one-line message naming the path for anything that is not a readable image, and for an
    image over :func:`max_image_pixels`; warns (LargeImageWarning) above Pillow's warning size.
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

    limit = max_image_pixels()
    try:
        with _strict_truncation(), _PILLOW_GUARD.off(), Image.open(p) as im:
            _check_pixels(name, im.size, limit)  # from the header, before anything is decoded
            im.load()
            return to_rgb(_orient(im))
    except ImageError:
        raise
    except MemoryError:
        raise ImageError(f"{name}: not enough memory to decode the image") from None
    except _DECODE_ERRORS as exc:
        raise ImageError(f"{name}: {_decode_problem(exc)}") from None
