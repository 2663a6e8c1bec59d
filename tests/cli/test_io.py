"""Tests for care_cli.io: image loading in every mode users have, error messages, safe output writing."""

from __future__ import annotations

import os
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from safetensors import safe_open
from safetensors.torch import load_file

from care_cli.errors import UserError
from care_cli.io import (
    atomic_write_bytes,
    atomic_write_text,
    check_output_path,
    load_image,
    save_safetensors_atomic,
)
from care_core import images as care_images
from care_core.errors import CareError, ImageError, LargeImageWarning

RED = (255, 0, 0)
WHITE = (255, 255, 255)


def _pixel(im: Image.Image, xy: tuple[int, int]) -> tuple[int, ...]:
    """One pixel as a tuple of ints."""
    value = im.getpixel(xy)
    assert isinstance(value, tuple)
    return tuple(int(v) for v in value)


def _close(a: tuple[int, ...], b: tuple[int, ...], tol: int = 12) -> bool:
    """Channel-wise closeness for lossy formats."""
    return all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


def _check_rgb(im: Image.Image, size: tuple[int, int]) -> None:
    assert isinstance(im, Image.Image)
    assert im.mode == "RGB"
    assert im.size == size


def _user_error(path: Path) -> str:
    """Run load_image expecting a UserError; check it is one line naming the file; return it."""
    with pytest.raises(ImageError) as info:
        load_image(path)
    message = str(info.value)
    assert "\n" not in message
    assert path.name in message
    return message


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png(width: int, height: int, bit_depth: int, color_type: int, raw: bytes) -> bytes:
    """A minimal PNG file with correct CRCs (raw: filtered scanlines, compressed here)."""
    header = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(raw))
        + _png_chunk(b"IEND", b"")
    )


# --------------------------------------------------------------------------- image modes


def test_rgb_png_any_aspect(tmp_path: Path) -> None:
    arr = np.zeros((7, 13, 3), dtype=np.uint8)
    arr[2, 5] = (10, 200, 30)
    path = tmp_path / "wide.png"
    Image.fromarray(arr).save(path)
    im = load_image(path)
    _check_rgb(im, (13, 7))
    assert _pixel(im, (5, 2)) == (10, 200, 30)
    assert _pixel(im, (0, 0)) == (0, 0, 0)


def test_str_path_accepted(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    Image.new("RGB", (3, 4), RED).save(path)
    _check_rgb(load_image(str(path)), (3, 4))


@pytest.mark.parametrize(
    ("mode", "value", "expected"),
    [("L", 77, (77, 77, 77)), ("1", 1, WHITE), ("1", 0, (0, 0, 0))],
)
def test_grayscale_modes(tmp_path: Path, mode: str, value: int, expected: tuple[int, int, int]) -> None:
    path = tmp_path / f"gray_{mode}_{value}.png"
    Image.new(mode, (5, 3), value).save(path)
    im = load_image(path)
    _check_rgb(im, (5, 3))
    assert _pixel(im, (4, 2)) == expected


def test_la_composited_over_white(tmp_path: Path) -> None:
    im = Image.new("LA", (4, 2), (0, 255))
    im.putpixel((1, 0), (0, 0))  # fully transparent black -> white
    im.putpixel((2, 0), (0, 128))  # half transparent black -> mid gray
    path = tmp_path / "la.png"
    im.save(path)
    out = load_image(path)
    _check_rgb(out, (4, 2))
    assert _pixel(out, (0, 0)) == (0, 0, 0)
    assert _pixel(out, (1, 0)) == WHITE
    assert _close(_pixel(out, (2, 0)), (127, 127, 127), tol=2)


def test_rgba_composited_over_white(tmp_path: Path) -> None:
    im = Image.new("RGBA", (3, 1), (0, 0, 255, 255))
    im.putpixel((1, 0), (0, 0, 255, 0))
    im.putpixel((2, 0), (255, 0, 0, 128))
    path = tmp_path / "rgba.png"
    im.save(path)
    out = load_image(path)
    _check_rgb(out, (3, 1))
    assert _pixel(out, (0, 0)) == (0, 0, 255)
    assert _pixel(out, (1, 0)) == WHITE
    assert _close(_pixel(out, (2, 0)), (255, 127, 127), tol=2)


def test_palette_without_transparency(tmp_path: Path) -> None:
    im = Image.new("P", (4, 4), 1)
    im.putpalette([0, 0, 0, 10, 20, 30] + [0] * (256 * 3 - 6))
    path = tmp_path / "pal.png"
    im.save(path)
    out = load_image(path)
    _check_rgb(out, (4, 4))
    assert _pixel(out, (3, 3)) == (10, 20, 30)


@pytest.mark.parametrize("ext", ["png", "gif"])
def test_palette_with_transparency(tmp_path: Path, ext: str) -> None:
    im = Image.new("P", (4, 4), 1)
    im.putpalette([0, 0, 0, 10, 20, 30] + [0] * (256 * 3 - 6))
    im.putpixel((0, 0), 0)
    path = tmp_path / f"pal_trns.{ext}"
    im.save(path, transparency=0)
    out = load_image(path)
    _check_rgb(out, (4, 4))
    assert _pixel(out, (0, 0)) == WHITE
    assert _pixel(out, (3, 3)) == (10, 20, 30)


def test_palette_with_alpha_palette(tmp_path: Path) -> None:
    # A PNG palette image whose tRNS gives partial alpha per entry.
    raw = b"\x00\x00\x01"
    data = (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 1, 8, 3, 0, 0, 0))
        + _png_chunk(b"PLTE", bytes([255, 0, 0, 0, 0, 255]))
        + _png_chunk(b"tRNS", bytes([0, 255]))
        + _png_chunk(b"IDAT", zlib.compress(raw))
        + _png_chunk(b"IEND", b"")
    )
    path = tmp_path / "pal_alpha.png"
    path.write_bytes(data)
    out = load_image(path)
    _check_rgb(out, (2, 1))
    assert _pixel(out, (0, 0)) == WHITE
    assert _pixel(out, (1, 0)) == (0, 0, 255)


def test_gray_and_rgb_with_trns_key(tmp_path: Path) -> None:
    gray = Image.new("L", (2, 1), 7)
    gray.putpixel((1, 0), 50)
    path = tmp_path / "l_trns.png"
    gray.save(path, transparency=7)
    out = load_image(path)
    assert _pixel(out, (0, 0)) == WHITE
    assert _pixel(out, (1, 0)) == (50, 50, 50)

    rgb = Image.new("RGB", (2, 1), (1, 2, 3))
    rgb.putpixel((1, 0), (9, 8, 7))
    path = tmp_path / "rgb_trns.png"
    rgb.save(path, transparency=(1, 2, 3))
    out = load_image(path)
    assert _pixel(out, (0, 0)) == WHITE
    assert _pixel(out, (1, 0)) == (9, 8, 7)


@pytest.mark.parametrize("fmt", ["JPEG", "TIFF"])
def test_cmyk(tmp_path: Path, fmt: str) -> None:
    im = Image.new("CMYK", (16, 16), (0, 0, 0, 0))
    im.paste((0, 255, 255, 0), (0, 0, 8, 8))  # magenta + yellow = red
    path = tmp_path / f"cmyk.{fmt.lower()}"
    im.save(path, format=fmt)
    with Image.open(path) as check:
        assert check.mode == "CMYK"
    out = load_image(path)
    _check_rgb(out, (16, 16))
    assert _close(_pixel(out, (12, 12)), WHITE)
    assert _close(_pixel(out, (3, 3)), RED, tol=20)


def test_cmyk_adobe_inverted_jpeg_is_marked(tmp_path: Path) -> None:
    # Pillow writes CMYK JPEGs with an Adobe marker (inverted CMYK); reading back must not invert colours.
    path = tmp_path / "adobe.jpg"
    Image.new("CMYK", (8, 8), (0, 0, 0, 255)).save(path)
    with Image.open(path) as check:
        assert "adobe" in check.info
    assert _close(_pixel(load_image(path), (4, 4)), (0, 0, 0))


_SIXTEEN = np.array([[0, 32896, 65535, 257]], dtype=np.uint16)
_EXPECTED_8 = [0, 128, 255, 1]


def _assert_gray_row(im: Image.Image, expected: list[int]) -> None:
    _check_rgb(im, (len(expected), 1))
    for x, value in enumerate(expected):
        assert _pixel(im, (x, 0)) == (value, value, value)


def test_sixteen_bit_png_gray(tmp_path: Path) -> None:
    path = tmp_path / "gray16.png"
    Image.fromarray(_SIXTEEN).save(path)
    with Image.open(path) as check:
        assert check.mode in {"I;16", "I"}
    _assert_gray_row(load_image(path), _EXPECTED_8)


@pytest.mark.parametrize(("mode", "dtype"), [("I;16", "<u2"), ("I;16B", ">u2"), ("I;16L", "<u2")])
def test_sixteen_bit_tiff_modes(tmp_path: Path, mode: str, dtype: str) -> None:
    im = Image.frombytes(mode, (4, 1), _SIXTEEN.astype(dtype).tobytes())
    path = tmp_path / f"gray16_{mode.replace(';', '_')}.tiff"
    im.save(path)
    with Image.open(path) as check:
        assert check.mode.startswith("I;16")
    _assert_gray_row(load_image(path), _EXPECTED_8)


def test_sixteen_bit_modes_in_memory() -> None:
    # Modes a file may not round-trip to (I;16L) go through the same conversion.
    for mode, dtype in [("I;16L", "<u2"), ("I;16B", ">u2"), ("I;16", "<u2")]:
        im = Image.frombytes(mode, (4, 1), _SIXTEEN.astype(dtype).tobytes())
        _assert_gray_row(care_images.to_rgb(im), _EXPECTED_8)


def test_int32_mode_i(tmp_path: Path) -> None:
    path = tmp_path / "int32.tiff"
    Image.fromarray(_SIXTEEN.astype(np.int32)).save(path)
    with Image.open(path) as check:
        assert check.mode == "I"
    _assert_gray_row(load_image(path), _EXPECTED_8)


def test_int32_wider_than_sixteen_bits_scaled_by_max(tmp_path: Path) -> None:
    path = tmp_path / "int32_wide.tiff"
    Image.fromarray(np.array([[-5, 0, 120000, 200000]], dtype=np.int32)).save(path)
    _assert_gray_row(load_image(path), [0, 0, 153, 255])


def test_sixteen_bit_gray_with_trns(tmp_path: Path) -> None:
    path = tmp_path / "gray16_trns.png"
    Image.fromarray(np.array([[0, 1000, 65535]], dtype=np.uint16)).save(path, transparency=1000)
    _assert_gray_row(load_image(path), [0, 255, 255])


def test_sixteen_bit_rgb_png(tmp_path: Path) -> None:
    raw = b"\x00" + struct.pack(">6H", 65535, 0, 32896, 0, 65535, 0)
    path = tmp_path / "rgb16.png"
    path.write_bytes(_png(2, 1, 16, 2, raw))
    out = load_image(path)
    _check_rgb(out, (2, 1))
    assert _close(_pixel(out, (0, 0)), (255, 0, 128), tol=1)
    assert _pixel(out, (1, 0)) == (0, 255, 0)


def test_sixteen_bit_rgba_png(tmp_path: Path) -> None:
    raw = b"\x00" + struct.pack(">8H", 0, 0, 0, 0, 0, 0, 65535, 65535)
    path = tmp_path / "rgba16.png"
    path.write_bytes(_png(2, 1, 16, 6, raw))
    out = load_image(path)
    _check_rgb(out, (2, 1))
    assert _pixel(out, (0, 0)) == WHITE
    assert _pixel(out, (1, 0)) == (0, 0, 255)


def test_float_unit_range_scaled(tmp_path: Path) -> None:
    path = tmp_path / "float01.tiff"
    Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32)).save(path)
    with Image.open(path) as check:
        assert check.mode == "F"
    _assert_gray_row(load_image(path), [0, 128, 255])


def test_float_wide_range_clipped(tmp_path: Path) -> None:
    path = tmp_path / "float_wide.tiff"
    Image.fromarray(np.array([[-3.0, 12.4, 300.0, np.nan]], dtype=np.float32)).save(path)
    _assert_gray_row(load_image(path), [0, 12, 255, 0])


def _oriented_image(path: Path, orientation: int) -> None:
    """A 40x20 (stored) image, white with a red 8x8 block in the stored top-left, with EXIF Orientation."""
    im = Image.new("RGB", (40, 20), WHITE)
    im.paste(RED, (0, 0, 8, 8))
    exif = Image.Exif()
    exif[0x0112] = orientation
    if path.suffix == ".jpg":
        im.save(path, exif=exif, quality=95)
    else:
        im.save(path, exif=exif)


# Where the stored top-left block ends up once displayed, as (size, centre of the block).
_ORIENTATIONS = {
    1: ((40, 20), (4, 4)),
    3: ((40, 20), (35, 15)),  # rotate 180: bottom-right
    6: ((20, 40), (15, 4)),  # rotate 90 clockwise: top-right
    8: ((20, 40), (4, 35)),  # rotate 90 counter-clockwise: bottom-left
}


@pytest.mark.parametrize("ext", ["jpg", "png"])
@pytest.mark.parametrize("orientation", sorted(_ORIENTATIONS))
def test_exif_orientation(tmp_path: Path, ext: str, orientation: int) -> None:
    path = tmp_path / f"orient{orientation}.{ext}"
    _oriented_image(path, orientation)
    size, marker = _ORIENTATIONS[orientation]
    out = load_image(path)
    _check_rgb(out, size)
    assert _close(_pixel(out, marker), RED, tol=30)
    width, height = size
    # The other three corners stay white.
    for corner in [(2, 2), (width - 3, 2), (2, height - 3), (width - 3, height - 3)]:
        if abs(corner[0] - marker[0]) > 8 or abs(corner[1] - marker[1]) > 8:
            assert _close(_pixel(out, corner), WHITE, tol=30)


def test_multiframe_gif_first_frame(tmp_path: Path) -> None:
    path = tmp_path / "anim.gif"
    frames = [Image.new("RGB", (6, 4), colour) for colour in (RED, (0, 0, 255), (0, 255, 0))]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=50, loop=0)
    with Image.open(path) as check:
        assert getattr(check, "n_frames", 1) == 3
    out = load_image(path)
    _check_rgb(out, (6, 4))
    assert _pixel(out, (3, 2)) == RED


def test_multipage_tiff_first_page(tmp_path: Path) -> None:
    path = tmp_path / "pages.tiff"
    first = Image.new("RGB", (5, 5), (0, 0, 255))
    second = Image.new("L", (9, 9), 200)
    first.save(path, save_all=True, append_images=[second])
    out = load_image(path)
    _check_rgb(out, (5, 5))
    assert _pixel(out, (0, 0)) == (0, 0, 255)


def test_result_is_independent_of_file(tmp_path: Path) -> None:
    path = tmp_path / "x.png"
    Image.new("RGB", (4, 4), RED).save(path)
    out = load_image(path)
    path.unlink()
    assert _pixel(out, (1, 1)) == RED


# --------------------------------------------------------------------------- errors


def test_missing_file(tmp_path: Path) -> None:
    assert "no such file" in _user_error(tmp_path / "nope.png")


def test_directory(tmp_path: Path) -> None:
    folder = tmp_path / "folder.png"
    folder.mkdir()
    assert "directory" in _user_error(folder)


def test_text_file_renamed_png(tmp_path: Path) -> None:
    path = tmp_path / "notes.png"
    path.write_text("this is not an image\nsecond line\n")
    assert "not an image" in _user_error(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jpg"
    path.write_bytes(b"")
    assert "empty" in _user_error(path)


def _noise(size: tuple[int, int]) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.mark.parametrize("ext", ["png", "jpg"])
def test_truncated(tmp_path: Path, ext: str) -> None:
    full = tmp_path / f"full.{ext}"
    _noise((64, 48)).save(full)
    data = full.read_bytes()
    path = tmp_path / f"cut.{ext}"
    path.write_bytes(data[: len(data) // 2])
    assert "truncated" in _user_error(path)


@pytest.mark.parametrize("ext", ["png", "jpg"])
def test_truncated_even_if_lenient_flag_set(tmp_path: Path, ext: str, monkeypatch: pytest.MonkeyPatch) -> None:
    full = tmp_path / f"full.{ext}"
    _noise((64, 48)).save(full)
    path = tmp_path / f"cut.{ext}"
    path.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    _user_error(path)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is True  # restored afterwards


def test_loading_images_leaves_truncation_leniency_off() -> None:
    """In a fresh process (lmms-eval, once imported, turns the flag on for the whole process by itself)."""
    import subprocess
    import sys

    code = ("import PIL.ImageFile as f; from care_core.images import load_image; "
            "load_image('examples/astronaut.jpg'); print(f.LOAD_TRUNCATED_IMAGES)")  # fmt: skip
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _bomb(tmp_path: Path) -> Path:
    """A PNG whose header claims 40000x40000 (1.6 G pixels); its data is tiny and never decoded."""
    raw = zlib.compress(b"\x00" * 64)
    data = (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", 40000, 40000, 8, 0, 0, 0, 0))
        + _png_chunk(b"IDAT", raw)
        + _png_chunk(b"IEND", b"")
    )
    path = tmp_path / "bomb.png"
    path.write_bytes(data)
    return path


def test_an_image_over_the_limit_is_refused_in_one_line_saying_how_to_open_it(tmp_path: Path) -> None:
    path = _bomb(tmp_path)
    assert Image.MAX_IMAGE_PIXELS == 89_478_485  # Pillow's default: it refuses above twice that, 178,956,970
    message = _user_error(path)
    assert message == (f"{path}: 1,600,000,000 pixels (40000×40000) exceed the limit of 178,956,970, a guard against "
                       "decompression bombs; to open it, set CARE_MAX_IMAGE_PIXELS=1600000000")  # fmt: skip


@pytest.mark.parametrize(("setting", "opens"), [("3600", True), ("3_600", True), ("3599", False)])
def test_care_max_image_pixels_sets_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, opens: bool
) -> None:
    path = tmp_path / "big.png"
    Image.new("RGB", (60, 60), RED).save(path)  # 3,600 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow would refuse above 2,000
    assert "exceed the limit of 2,000" in _user_error(path)
    monkeypatch.setenv("CARE_MAX_IMAGE_PIXELS", setting)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if opens:
            _check_rgb(load_image(path), (60, 60))
        else:
            assert "exceed the limit of 3,599" in _user_error(path)
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]
    assert Image.MAX_IMAGE_PIXELS == 1000  # the caller's setting, back


@pytest.mark.parametrize("setting", ["many", "0", "-5", "1e9"])
def test_a_bad_care_max_image_pixels_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    path = tmp_path / "small.png"
    Image.new("RGB", (4, 4), RED).save(path)
    monkeypatch.setenv("CARE_MAX_IMAGE_PIXELS", setting)
    with pytest.raises(CareError, match=f"^CARE_MAX_IMAGE_PIXELS must be a whole number of pixels, at least 1; got "
                                        f"'{setting}'$"):  # fmt: skip
        load_image(path)


def test_a_large_image_warns_in_our_words_not_pillows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.png"
    Image.new("RGB", (30, 30), RED).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)  # 900 pixels: between Pillow's warning and its refusal
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = load_image(path)
    _check_rgb(out, (30, 30))
    assert [(w.category, str(w.message)) for w in caught] == [
        (LargeImageWarning, f"{path}: 900 pixels (30×30), a large image: decoding it takes time and at least 0 MB "
                            "of memory")]  # fmt: skip


def test_a_large_image_is_one_warning_line_in_the_cli(care, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.png"
    Image.new("RGB", (400, 400), RED).save(path)  # 160,000 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100_000)
    run = care("reduce", path, "--keep", "8", "--json")
    assert run.code == 0, run.err
    assert run.err == (f"warning: {path}: 160,000 pixels (400×400), a large image: decoding it takes time and at "
                       "least 0 MB of memory\n")  # fmt: skip


def test_loader_threads_leave_pillows_guard_as_the_caller_set_it(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    paths = []
    for i in range(16):
        paths.append(tmp_path / f"{i}.png")
        _noise((64 + i, 48)).save(paths[-1])
    caller_set = Image.MAX_IMAGE_PIXELS
    with ThreadPoolExecutor(max_workers=8) as pool:
        for _ in range(4):
            assert [im.size for im in pool.map(load_image, paths)] == [(64 + i, 48) for i in range(16)]
    assert caller_set == Image.MAX_IMAGE_PIXELS


def test_guard_untouched_by_module() -> None:
    # Pillow's default limit (about 89.5 M pixels); importing care_cli.io must not change it.
    assert Image.MAX_IMAGE_PIXELS == 1024 * 1024 * 1024 // 4 // 3


def _pillow_settings() -> tuple[object, object]:
    return ImageFile.LOAD_TRUNCATED_IMAGES, Image.MAX_IMAGE_PIXELS


@pytest.mark.parametrize("lenient", [False, True])
def test_pillow_settings_unchanged_by_loading(tmp_path: Path, lenient: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Successful loads and every kind of failure leave Pillow's process-wide settings as the caller had them.
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", lenient)
    before = _pillow_settings()
    assert before == (lenient, 1024 * 1024 * 1024 // 4 // 3)
    good = tmp_path / "good.png"
    _noise((16, 12)).save(good)
    cut = tmp_path / "cut.png"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    text = tmp_path / "text.png"
    text.write_text("not an image")
    _check_rgb(load_image(good), (16, 12))
    assert _pillow_settings() == before
    for bad in (cut, tmp_path / "missing.png", text):
        _user_error(bad)
        assert _pillow_settings() == before


def test_to_rgb_is_public_and_returns_a_new_rgb_image() -> None:
    rgb = Image.new("RGB", (2, 1), RED)
    out = care_images.to_rgb(rgb)
    assert out is not rgb
    assert out.mode == "RGB" and _pixel(out, (0, 0)) == RED
    rgba = Image.new("RGBA", (2, 1), (255, 0, 0, 0))
    rgba.putpixel((1, 0), (255, 0, 0, 255))
    out = care_images.to_rgb(rgba)
    assert out.mode == "RGB"
    assert _pixel(out, (0, 0)) == WHITE  # fully transparent: the white background
    assert _pixel(out, (1, 0)) == RED
    assert "to_rgb" in care_images.__all__


def test_to_rgb_rejects_what_is_not_an_image() -> None:
    with pytest.raises(TypeError, match="expected a PIL image, got ndarray"):
        care_images.to_rgb(np.zeros((2, 2, 3), dtype=np.uint8))  # type: ignore[arg-type]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root can read anything")
def test_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "secret.png"
    Image.new("RGB", (2, 2)).save(path)
    path.chmod(0)
    try:
        assert "permission denied" in _user_error(path)
    finally:
        path.chmod(0o644)


def test_unreadable_simulated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Works under root too: the open itself is refused.
    path = tmp_path / "locked.png"
    Image.new("RGB", (2, 2)).save(path)

    def refuse(*args: object, **kwargs: object) -> Image.Image:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(care_images.Image, "open", refuse)
    assert "permission denied" in _user_error(path)


def test_message_is_one_line_for_odd_names(tmp_path: Path) -> None:
    path = tmp_path / "bad\nname.png"
    path.write_text("nope")
    with pytest.raises(ImageError) as info:
        load_image(path)
    assert "\n" not in str(info.value)
    assert "bad name.png" in str(info.value)


# --------------------------------------------------------------------------- output paths


def test_output_new_file_ok(tmp_path: Path) -> None:
    src = tmp_path / "in.png"
    src.write_bytes(b"x")
    out = check_output_path(tmp_path / "out.json", [src], force=False)
    assert out == (tmp_path / "out.json").resolve()


def test_output_same_as_input(tmp_path: Path) -> None:
    src = tmp_path / "in.png"
    src.write_bytes(b"x")
    for force in (False, True):
        with pytest.raises(UserError, match="refusing to overwrite the input"):
            check_output_path(src, [src], force=force)
    assert src.read_bytes() == b"x"


def test_output_same_as_input_other_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sub").mkdir()
    src = tmp_path / "in.png"
    src.write_bytes(b"x")
    monkeypatch.chdir(tmp_path / "sub")
    with pytest.raises(UserError, match="refusing to overwrite the input"):
        check_output_path(Path("../sub/../in.png"), [src], force=True)
    with pytest.raises(UserError, match="refusing to overwrite the input"):
        check_output_path(src, [Path("../in.png")], force=True)


def test_output_symlink_to_input(tmp_path: Path) -> None:
    src = tmp_path / "in.png"
    src.write_bytes(b"x")
    link = tmp_path / "link.png"
    link.symlink_to(src)
    with pytest.raises(UserError, match="refusing to overwrite the input"):
        check_output_path(link, [src], force=True)
    with pytest.raises(UserError, match="refusing to overwrite the input"):
        check_output_path(src, [link], force=True)


def test_output_hard_link_to_input(tmp_path: Path) -> None:
    src = tmp_path / "in.png"
    src.write_bytes(b"x")
    hard = tmp_path / "hard.png"
    os.link(src, hard)
    with pytest.raises(UserError, match="refusing to overwrite the input"):
        check_output_path(hard, [src], force=True)


def test_output_missing_parent(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist") as info:
        check_output_path(tmp_path / "no" / "such" / "out.json", [], force=False)
    assert "out.json" in str(info.value)


def test_output_parent_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a folder"):
        check_output_path(tmp_path / "file" / "out.json", [], force=False)


def test_output_exists_needs_force(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    out.write_text("old")
    with pytest.raises(UserError, match="exists; pass --force to replace it") as info:
        check_output_path(out, [], force=False)
    assert "out.json" in str(info.value)
    assert check_output_path(out, [], force=True) == out.resolve()
    assert out.read_text() == "old"


def test_output_is_directory(tmp_path: Path) -> None:
    folder = tmp_path / "results"
    folder.mkdir()
    for force in (False, True):
        with pytest.raises(UserError, match="directory"):
            check_output_path(folder, [], force=force)


# --------------------------------------------------------------------------- atomic writes


def _leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def test_atomic_write_bytes_and_text(tmp_path: Path) -> None:
    path = tmp_path / "out.bin"
    atomic_write_bytes(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    atomic_write_text(path, "héllo\n")
    assert path.read_text(encoding="utf-8") == "héllo\n"
    assert _leftovers(tmp_path, {"out.bin"}) == []


def test_atomic_write_new_file_mode_follows_umask(tmp_path: Path) -> None:
    path = tmp_path / "new.txt"
    atomic_write_text(path, "x")
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_atomic_write_keeps_existing_mode(tmp_path: Path) -> None:
    path = tmp_path / "keep.txt"
    path.write_text("old")
    path.chmod(0o640)
    atomic_write_text(path, "new")
    assert path.stat().st_mode & 0o777 == 0o640
    assert path.read_text() == "new"


def test_atomic_write_replace_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "out.json"
    path.write_text("old content")

    def boom(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(UserError) as info:
        atomic_write_text(path, "new content")
    assert "out.json" in str(info.value)
    assert "\n" not in str(info.value)
    assert path.read_text() == "old content"
    assert _leftovers(tmp_path, {"out.json"}) == []


def test_atomic_write_other_error_midway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "out.json"
    path.write_text("old content")

    def boom(fd: int) -> None:
        raise RuntimeError("interrupted")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        atomic_write_bytes(path, b"new content")
    assert path.read_text() == "old content"
    assert _leftovers(tmp_path, {"out.json"}) == []


def test_atomic_write_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="cannot write"):
        atomic_write_bytes(tmp_path / "missing" / "out.bin", b"x")


def test_save_safetensors_atomic(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = {
        "plain": torch.ones(2, 2, dtype=torch.bfloat16),
        "transposed": base.t(),  # not contiguous
        "row0": base[0],  # views of one buffer
        "row1": base[1],
        "whole": base,
        "empty": torch.zeros(0),
    }
    path = tmp_path / "out.safetensors"
    save_safetensors_atomic(path, tensors, {"method": "care", "ratio": "0.25"})
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for key, tensor in tensors.items():
        assert torch.equal(loaded[key], tensor.contiguous()), key
        assert loaded[key].dtype == tensor.dtype
    with safe_open(path, framework="pt") as handle:
        assert handle.metadata() == {"method": "care", "ratio": "0.25"}
    assert _leftovers(tmp_path, {"out.safetensors"}) == []
