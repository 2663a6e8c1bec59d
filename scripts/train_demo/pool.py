"""The training scenes, drawn by worker processes: each scene's processor output as uint8 (normalised later on the
device) and, per visual token, the colour and shape of the object under the token's centre (from the adapter's own
token geometry, ``ImageTokens.boxes``); one tensor per bucket of token geometry (:mod:`.buckets`)."""

from __future__ import annotations

import multiprocessing as mp
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from benchmarks.demo_world import TRAIN_SPLIT, load_photos
from care_core.synthetic import COLOURS, SHAPES, label_image, make_scene

_worker: dict[str, Any] = {}


class UsageError(Exception):
    """Options or folders the run cannot use: ``main`` prints ``error: <message>`` and exits with code 2."""


def ignore_ctrl_c() -> None:
    """Workers leave Ctrl-C to the parent (it reaches the whole process group), which stops them cleanly."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _init_worker() -> None:
    ignore_ctrl_c()
    torch.set_num_threads(1)
    _worker["photos"] = load_photos()


def raw_pixels(image_processor: Any, image: Any) -> np.ndarray:
    """The processor's output for one image without rescale and normalisation (its resize, crops, padding and patch
    layout only) as uint8: what the pool keeps; :class:`Normaliser` finishes it on the device."""
    out = image_processor(images=image, return_tensors="np", do_rescale=False, do_normalize=False)
    values = np.asarray(out["pixel_values"])
    return np.clip(np.rint(values), 0, 255).astype(np.uint8)


def token_labels(scene: Any, centres: np.ndarray) -> np.ndarray:
    """(2, N) uint8: 1 + colour and 1 + shape index of the object under each token centre (0: background);
    ``centres`` (N, 2) are (x, y) original pixels."""
    at = np.asarray(label_image(scene))[..., 0]  # (H, W): 1 + object index
    height, width = at.shape
    xs = np.clip(centres[:, 0].astype(np.int64), 0, width - 1)
    ys = np.clip(centres[:, 1].astype(np.int64), 0, height - 1)
    under = at[ys, xs]
    colour, shape = np.zeros_like(under), np.zeros_like(under)
    for i, obj in enumerate(scene.objects):
        colour[under == i + 1] = 1 + list(COLOURS).index(obj.colour)
        shape[under == i + 1] = 1 + SHAPES.index(obj.shape)
    return np.stack([colour, shape]).astype(np.uint8)


def _make(index: int) -> tuple[int, np.ndarray, np.ndarray, list[tuple[str, str, str]], tuple[int, int]]:
    scene = make_scene(TRAIN_SPLIT, index, size=_worker["size"], photos=_worker["photos"])
    size = (scene.image.height, scene.image.width)
    pixels = raw_pixels(_worker["ip"], scene.image)
    labels = token_labels(scene, _worker["centres"][size])
    return index, pixels, labels, [(q.question, q.answer, q.type) for q in scene.questions], size


@dataclass
class Pool:
    """Scenes 0..S-1 of the training split, per bucket (token geometry): processor outputs (S_b, ...) uint8 and token
    labels (S_b, 2, N_b) uint8; the questions (scene, question, answer) with each one's type (``QA.type``) and, per
    scene, its bucket and its row in the bucket's tensors."""

    pixels: list[torch.Tensor]
    labels: list[torch.Tensor]
    qas: list[tuple[int, str, str]]
    types: list[str]
    bucket: list[int]
    row: list[int]


def _stacked(arrays: list[np.ndarray | None], device: torch.device, chunk: int = 256) -> torch.Tensor:
    """One (S_b, ...) tensor on ``device`` from the bucket's arrays, copied a chunk at a time and freed as they go
    (the host holds the pool once, not twice)."""
    if not arrays:
        return torch.empty(0, dtype=torch.uint8, device=device)
    first = arrays[0]
    assert first is not None
    out = torch.empty((len(arrays), *first.shape), dtype=torch.uint8, device=device)
    for start in range(0, len(arrays), chunk):
        part = arrays[start : start + chunk]
        out[start : start + len(part)] = torch.from_numpy(np.stack(part))  # type: ignore[arg-type]
        arrays[start : start + len(part)] = [None] * len(part)
    return out


def make_pool(
    scenes: int,
    workers: int,
    image_processor: Any,
    size: tuple[int, int] | None,
    centres: dict[tuple[int, int], np.ndarray],
    bucket_of: dict[tuple[int, int], int],
    store: torch.device,
    advance: Callable[[int], None],
) -> Pool:
    """Draw the scenes on ``workers`` forked processes and keep them on ``store``, one tensor per bucket. ``size``:
    every scene's (height, width) (None: the world's mix); ``centres``: per image size, the (N, 2) token centres
    (x, y) in original pixels; ``bucket_of``: per image size, its bucket."""
    _worker.update(ip=image_processor, size=size, centres=centres)  # inherited by the forked workers
    chunk = max(1, min(64, scenes // (4 * workers)))
    count = max(bucket_of.values()) + 1
    pixels: list[list[np.ndarray | None]] = [[] for _ in range(count)]
    labels: list[list[np.ndarray | None]] = [[] for _ in range(count)]
    qas: list[tuple[int, str, str]] = []
    types: list[str] = []
    bucket, row = [0] * scenes, [0] * scenes
    with mp.get_context("fork").Pool(workers, initializer=_init_worker) as pool:
        for index, array, label, questions, drawn in pool.imap(_make, range(scenes), chunksize=chunk):
            b = bucket_of[drawn]
            first = pixels[b][0] if pixels[b] else None
            if first is not None and array.shape != first.shape:
                raise UsageError(f"scene {index}'s processor output {array.shape} differs from that of the first "
                                 f"{drawn[0]}x{drawn[1]} scene, {first.shape}")  # fmt: skip
            bucket[index], row[index] = b, len(pixels[b])
            pixels[b].append(array)
            labels[b].append(label)
            qas.extend((index, q, a) for q, a, _ in questions)
            types.extend(t for _, _, t in questions)
            advance(1)
    return Pool([_stacked(p, store) for p in pixels], [_stacked(lab, store) for lab in labels], qas, types, bucket,
                row)  # fmt: skip


class Normaliser:
    """uint8 processor outputs -> the processor's own normalised values, as one affine map per element measured on
    the processor itself (a black and a white image of the bucket's size): no copy of its mean, std or layout."""

    def __init__(self, image_processor: Any, size: tuple[int, int], device: torch.device) -> None:
        from PIL import Image

        def normalised(value: int) -> torch.Tensor:
            image = Image.new("RGB", (size[1], size[0]), (value, value, value))
            out = image_processor(images=image, return_tensors="pt")["pixel_values"]
            return torch.as_tensor(out, dtype=torch.float32)

        black, white = normalised(0), normalised(255)
        self.offset = black.to(device)
        self.scale = ((white - black) / 255).to(device)

    def __call__(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.float() * self.scale + self.offset
