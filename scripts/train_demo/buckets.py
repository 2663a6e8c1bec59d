"""The token geometries of the training pool. The adapter encodes every image size differently (LLaVA-NeXT's and
LLaVA-OneVision's crops, the Qwen families' patch grids, InternVL3's tiles), and a batch must share one geometry; so
the pool's sizes are grouped into buckets, one per geometry (sizes whose blank images the adapter encodes alike share
one: ``tiny-llava``'s every size, InternVL3's 336x336 and 448x448), and each step draws its batch from one bucket,
chosen with probability proportional to the bucket's share of the pool's scenes (:func:`pick_bucket`). Everything a
bucket needs (its feed: ids, rows, rope positions, newline rows of a reference image; its normaliser; its tokens'
position classes) is built once at start-up."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .feed import Feed
from .pool import Normaliser

#: position classes of the dense loss along each axis (the LLaVA-1.5 grid's 24 rows and columns)
POSITION_BINS = 24


@dataclass
class Geometry:
    """One bucket's token geometry: the image sizes that give it, the feed built on the adapter's encoding of a blank
    image of the first of them, the normaliser of their processor outputs, and each token's row and column class on
    a 24 x 24 grid of ``ImageTokens.positions``."""

    sizes: list[tuple[int, int]]  # (height, width)
    feed: Feed
    normalise: Normaliser
    bins: torch.Tensor  # (2, N): IGNORED where the dense loss asks no row and column

    @property
    def n(self) -> int:
        return self.feed.n

    @property
    def name(self) -> str:
        """``336x336, 448x448``: the bucket's sizes, as the log names it."""
        return ", ".join(f"{h}x{w}" for h, w in self.sizes)

    def describe(self) -> str:
        """``336x336, 448x448: N = 256`` (the log's line per bucket)."""
        return f"{self.name}: N = {self.n}"


def _digest(*tensors: torch.Tensor) -> str:
    sha = hashlib.sha256()
    for tensor in tensors:
        value = tensor.detach().cpu().contiguous()
        sha.update(f"{value.dtype}{tuple(value.shape)}".encode())
        sha.update(value.numpy().tobytes())
    return sha.hexdigest()


def _key(tokens: Any, normalise: Normaliser) -> tuple[Any, ...]:
    """What a batch's images must share: the processor output's layout and normalisation (the normaliser's maps),
    the tokens (count, positions, views, raster grid) and the adapter's geometry inputs (its ``model_inputs`` tensors
    other than the pixels: crop and patch indices, the Qwen patch grid, InternVL3's tile count)."""
    inputs = sorted((k, v) for k, v in tokens.model_inputs.items() if torch.is_tensor(v) and k != "pixel_values")
    views = () if tokens.views is None else (tokens.views,)
    return (
        tokens.num_tokens,
        tokens.grid,
        _digest(normalise.offset, normalise.scale, tokens.positions, *views),
        tuple((k, _digest(v)) for k, v in inputs),
    )


#: what the dense loss's row and column classes ask: every token, or the tokens of the view that shows the whole
#: image (``ImageTokens.views`` 0: LLaVA-NeXT's and LLaVA-OneVision's base view), whose tower sees where they lie; a
#: crop's tower sees only its crop, and where two or four crops share its local positions, their global row and
#: column cannot be told apart (the other tokens' classes are ignored: ``IGNORED``)
POSITION_TARGETS = ("all", "base-view")
IGNORED = -100  # F.cross_entropy's default ignore_index


def position_bins(tokens: Any, targets: str = "all") -> torch.Tensor:
    """(2, N) row and column class of each token on a 24 x 24 grid of ``tokens.positions``; with ``targets``
    "base-view", :data:`IGNORED` for tokens outside view 0 (where the tokens have views and some are in view 0)."""
    bins = (tokens.positions.cpu() * POSITION_BINS).floor().clamp(0, POSITION_BINS - 1).long().T
    views = tokens.views
    if targets == "base-view" and views is not None and bool((views == 0).any()):
        bins = bins.masked_fill((views.cpu() != 0)[None], IGNORED)
    return bins


def token_geometries(
    adapter: Any,
    image_processor: Any,
    sizes: list[tuple[int, int]],
    device: torch.device,
    position_targets: str = "all",
) -> tuple[list[Geometry], dict[tuple[int, int], np.ndarray]]:
    """The buckets of ``sizes`` (in the order of their first size; normalisers on ``device``) and, per size, each
    token's centre (x, y) in original pixels: the middle of the adapter's ``boxes``. ``position_targets``: one of
    :data:`POSITION_TARGETS` (:func:`position_bins`)."""
    from PIL import Image

    geometries: list[Geometry] = []
    keys: list[tuple[Any, ...]] = []
    centres: dict[tuple[int, int], np.ndarray] = {}
    for height, width in dict.fromkeys(sizes):
        tokens = adapter.encode_image(Image.new("RGB", (width, height)))
        centres[(height, width)] = ((tokens.boxes[:, :2] + tokens.boxes[:, 2:]) / 2).numpy()
        normalise = Normaliser(image_processor, (height, width), device)
        key = _key(tokens, normalise)
        if key in keys:
            geometries[keys.index(key)].sizes.append((height, width))
            continue
        keys.append(key)
        bins = position_bins(tokens, position_targets)
        geometries.append(Geometry([(height, width)], Feed(adapter, tokens), normalise, bins))
    return geometries, centres


def warm_scenes(scenes: list[int], geometries: list[Geometry], size: tuple[int, int] | None) -> list[int]:
    """``scenes`` (per bucket) with every bucket but ``size``'s emptied: the draw of a warm-up step (``size`` None:
    ``scenes`` as they are)."""
    if size is None:
        return scenes
    return [n if size in g.sizes else 0 for n, g in zip(scenes, geometries, strict=True)]


def pick_bucket(gen: torch.Generator, scenes: list[int]) -> int:
    """The bucket of a step: bucket i with probability ``scenes[i] / sum(scenes)`` (one uniform draw u of ``gen``:
    the first i whose cumulative share exceeds u; a bucket without scenes is never drawn)."""
    u = float(torch.rand((), generator=gen)) * sum(scenes)
    total = 0
    for index, count in enumerate(scenes):
        total += count
        if u < total:
            return index
    return max(i for i, count in enumerate(scenes) if count)  # u rounded up to the total
