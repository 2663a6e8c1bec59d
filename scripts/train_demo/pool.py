"""The training scenes, drawn by worker processes: each scene's processor output as uint8 (normalised later on the
device) and, per visual token, the colour and shape of the object under the token's centre (from the adapter's own
token geometry, ``ImageTokens.boxes``)."""

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


def _make(index: int) -> tuple[int, np.ndarray, np.ndarray, list[tuple[str, str, str]]]:
    scene = make_scene(TRAIN_SPLIT, index, size=_worker["size"], photos=_worker["photos"])
    pixels = raw_pixels(_worker["ip"], scene.image)
    labels = token_labels(scene, _worker["centres"][(scene.image.height, scene.image.width)])
    return index, pixels, labels, [(q.question, q.answer, q.type) for q in scene.questions]


@dataclass
class Pool:
    """Scenes 0..S-1 of the training split: processor outputs (S, ...) uint8, token labels (S, 2, N) uint8 and the
    questions (scene, question, answer)."""

    pixels: torch.Tensor
    labels: torch.Tensor
    qas: list[tuple[int, str, str]]


def make_pool(
    scenes: int,
    workers: int,
    image_processor: Any,
    size: tuple[int, int] | None,
    centres: dict[tuple[int, int], np.ndarray],
    advance: Callable[[int], None],
) -> Pool:
    """Draw the scenes on ``workers`` forked processes. ``size``: every scene's (height, width) (None: the world's
    mix); ``centres``: per image size, the (N, 2) token centres (x, y) in original pixels."""
    _worker.update(ip=image_processor, size=size, centres=centres)  # inherited by the forked workers
    chunk = max(1, min(64, scenes // (4 * workers)))
    pixels: np.ndarray | None = None
    labels: np.ndarray | None = None
    qas: list[tuple[int, str, str]] = []
    with mp.get_context("fork").Pool(workers, initializer=_init_worker) as pool:
        for index, array, label, questions in pool.imap(_make, range(scenes), chunksize=chunk):
            if pixels is None or labels is None:
                pixels = np.empty((scenes, *array.shape), dtype=np.uint8)
                labels = np.empty((scenes, *label.shape), dtype=np.uint8)
            if array.shape != pixels.shape[1:]:
                raise UsageError(f"scene {index}'s processor output {array.shape} differs from scene 0's "
                                 f"{pixels.shape[1:]}: this backbone trains on one image size (--size)")  # fmt: skip
            pixels[index], labels[index] = array, label
            qas.extend((index, q, a) for q, a, _ in questions)
            advance(1)
    assert pixels is not None and labels is not None
    return Pool(torch.from_numpy(pixels), torch.from_numpy(labels), qas)


class Normaliser:
    """uint8 processor outputs -> the processor's own normalised values, as one affine map per element measured on
    the processor itself (a black and a white image of the training size): no copy of its mean, std or layout."""

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
