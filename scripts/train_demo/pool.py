"""The training scenes, drawn by worker processes: each scene's processor output as uint8 (normalised later on the
device) and, per visual token, the colour and shape of the object under the token's centre (from the adapter's own
token geometry, ``ImageTokens.boxes``); one tensor per bucket of token geometry (:mod:`.buckets`)."""

from __future__ import annotations

import multiprocessing as mp
import signal
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from benchmarks.demo_world import TRAIN_SPLIT, load_photos
from care_core.synthetic import COLOURS, SHAPES, label_image, make_scene, scene_size

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

    def to(self, store: torch.device) -> Pool:
        """The pool with its tensors on ``store`` (on the CPU, a CPU pool's own tensors: no copy)."""
        return replace(self, pixels=[p.to(store) for p in self.pixels], labels=[lab.to(store) for lab in self.labels])


@dataclass
class Drawn:
    """A drawn pool and the seconds its drawing took (``--replicas``: drawn once, before the runs start)."""

    pool: Pool
    seconds: float


def _rows(sizes: list[tuple[int, int]], bucket_of: dict[tuple[int, int], int]) -> tuple[list[int], ...]:
    """Per scene its bucket and its row in the bucket's tensors (scenes in index order), and per bucket its scenes."""
    bucket = [bucket_of[size] for size in sizes]
    filled = [0] * (max(bucket_of.values()) + 1)
    row = []
    for b in bucket:
        row.append(filled[b])
        filled[b] += 1
    return bucket, row, filled


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
    """Draw the scenes on ``workers`` forked processes into one tensor per bucket on ``store``. ``size``: every
    scene's (height, width) (None: the world's mix); ``centres``: per image size, the (N, 2) token centres (x, y) in
    original pixels; ``bucket_of``: per image size, its bucket.

    Each scene's size is known before it is drawn (:func:`~care_core.synthetic.scene_size`), so every bucket's tensor
    is laid out once and each scene written into its row as it arrives: the host holds the pool at most once, and
    not at all with the pool on the GPU. (Gathering the scenes first and stacking them after took about twice the
    pool in host memory: 1.9x measured, so InternVL3's 82 GB pool did not fit a 128 GB host.)"""
    _worker.update(ip=image_processor, size=size, centres=centres)  # inherited by the forked workers
    chunk = max(1, min(64, scenes // (4 * workers)))
    sizes = [size or scene_size(TRAIN_SPLIT, index) for index in range(scenes)]
    bucket, row, filled = _rows(sizes, bucket_of)
    pixels: list[torch.Tensor | None] = [None] * len(filled)
    labels: list[torch.Tensor | None] = [None] * len(filled)
    qas: list[tuple[int, str, str]] = []
    types: list[str] = []
    with mp.get_context("fork").Pool(workers, initializer=_init_worker) as pool:
        for index, array, label, questions, drawn in pool.imap(_make, range(scenes), chunksize=chunk):
            b = bucket[index]
            assert drawn == sizes[index], f"scene {index} was drawn at {drawn}, not at its scene_size {sizes[index]}"
            into, labels_into = pixels[b], labels[b]
            if into is None or labels_into is None:  # the bucket's first scene gives its tensors' shapes
                into = pixels[b] = torch.empty((filled[b], *array.shape), dtype=torch.uint8, device=store)
                labels_into = labels[b] = torch.empty((filled[b], *label.shape), dtype=torch.uint8, device=store)
            elif tuple(into.shape[1:]) != array.shape:
                raise UsageError(f"scene {index}'s processor output {array.shape} differs from that of the first "
                                 f"{drawn[0]}x{drawn[1]} scene, {tuple(into.shape[1:])}")  # fmt: skip
            into[row[index]] = torch.from_numpy(array)
            labels_into[row[index]] = torch.from_numpy(label)
            qas.extend((index, q, a) for q, a, _ in questions)
            types.extend(t for _, _, t in questions)
            advance(1)
    empty = torch.empty(0, dtype=torch.uint8, device=store)
    return Pool([empty if p is None else p for p in pixels], [empty if lab is None else lab for lab in labels], qas,
                types, bucket, row)  # fmt: skip


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
