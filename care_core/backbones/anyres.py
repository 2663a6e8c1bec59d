"""LLaVA-NeXT's anyres crops, which LLaVA-NeXT and LLaVA-OneVision share (docs/design/backbones.md §LLaVA-NeXT): the
base view and the high-resolution crops of one image through the tower in one pass, packed in the order of the model's
own ``pack_image_features`` without ``image_newline`` rows, with each token's crop, patch, box and position.

A family composes it: :class:`AnyresCrops` is built from the adapter's model, processor and memo plus the two things
that differ between the families, the tower (``features``: CLIP with its CLS dropped, or SigLIP) and the packing
(``pack``: the model's ``pack_image_features`` as the family calls it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._memo import Memos
from ..errors import ModelLoadError
from .base import ImageTokens, VLMAdapter, is_all_tokens
from .geometry import clip_boxes, crop_geometry, grid_crop_boxes
from .llava_modules import crop_tokens, llava_inner

#: a family's tower: crops (C, 3, S, S) -> their patch features (C, P, d_v), what the model hands its projector
PatchFeatures = Callable[[torch.Tensor], torch.Tensor]
#: a family's packing: per-crop values (crops, P, 1) and the image's ``image_sizes`` -> the packed rows (N, 1),
#: no newline rows (the model's own ``pack_image_features``, pooling out of reach)
PackIds = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: rows (..., N, d) of all N tokens -> the model's own sequence of them (newline rows, and OneVision's pooling)
OwnSequence = Callable[[ImageTokens, torch.Tensor], torch.Tensor]


def check_anyres_model(model: Any, name: str) -> None:
    """ModelLoadError unless the model has the anyres parts: ``image_grid_pinpoints`` and an ``image_newline``."""
    if not isinstance(getattr(model.config, "image_grid_pinpoints", None), list):
        raise ModelLoadError(f"{name}: the model config has no image_grid_pinpoints")
    if not hasattr(llava_inner(model), "image_newline"):
        raise ModelLoadError(f"{name}: the model has no image_newline parameter")


def collate_crops(adapter: VLMAdapter, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """An anyres adapter's ``collate``: crops zero-padded to the most any image has, as the processor pads a list of
    images; the pixels joined on the model's device (each image's copied into its slice of one zeroed batch: on the
    CPU the join is a copy of the batch while the GPU waits)."""
    shapes = [part["pixel_values"].shape for part in parts]  # (images, crops, 3, S, S) each
    first = parts[0]["pixel_values"]
    size = (sum(int(shape[0]) for shape in shapes), max(int(shape[1]) for shape in shapes), *first.shape[2:])
    pixel_values = torch.zeros(size, dtype=first.dtype, device=adapter.device)
    row = 0
    for part, shape in zip(parts, shapes, strict=True):  # pinned by the prefetcher: each copy is queued
        pixel_values[row : row + shape[0], : shape[1]].copy_(part["pixel_values"], non_blocking=True)
        row += int(shape[0])
    return {"pixel_values": pixel_values, "image_sizes": torch.cat([p["image_sizes"] for p in parts])}


def real_crops(model: Any, pixel_values: torch.Tensor, image_sizes: torch.Tensor, name: str) -> torch.Tensor:
    """(crops, 3, S, S): the real crops of one image's processor output (base view first), the padding crops of a
    batch dropped."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    cfg = model.config
    count = image_size_to_num_patches(image_sizes[0], cfg.image_grid_pinpoints, cfg.vision_config.image_size)
    if pixel_values.dim() != 5 or pixel_values.shape[1] < count:
        raise ModelLoadError(
            f"{name}: the image processor gave pixel_values {tuple(pixel_values.shape)} but the model "
            f"expects {count} crops; do the processor's and the model's image_grid_pinpoints agree?"
        )
    return pixel_values[0, :count]


def anyres_fed_rows(
    tokens: ImageTokens, rows: torch.Tensor, kept: torch.Tensor | None, own: OwnSequence
) -> torch.Tensor:
    """The visual rows the language model receives: the model's own sequence (``own``) when the rows are all N tokens
    in packed order, so K = N reproduces the standard path; else the rows as given (no newline rows)."""
    if is_all_tokens(kept, int(rows.shape[-2]), tokens.num_tokens):
        return own(tokens, rows)
    return rows


def _size_hw(size: Any, key_h: str = "height", key_w: str = "width") -> tuple[int, int] | None:
    h = size.get(key_h) if isinstance(size, dict) else getattr(size, key_h, None)
    w = size.get(key_w) if isinstance(size, dict) else getattr(size, key_w, None)
    return (int(h), int(w)) if h and w else None


def _shortest_edge(size: Any) -> int | None:
    value = size.get("shortest_edge") if isinstance(size, dict) else getattr(size, "shortest_edge", None)
    return int(value) if value else None


def crop_boxes(model: Any, image_processor: Any, height: int, width: int, crops: int, name: str) -> torch.Tensor:
    """(crops, P, 4) every crop patch's [x0, y0, x1, y1] in original pixels (unclipped), crop 0 = base."""
    from transformers.image_processing_utils import get_patch_output_size, select_best_resolution
    from transformers.image_utils import ChannelDimension

    ip = image_processor
    vc = model.config.vision_config
    side, patch = vc.image_size // vc.patch_size, vc.patch_size
    tower_hw = (int(vc.image_size), int(vc.image_size))
    local = grid_crop_boxes(side, side, patch)  # (P, 4) in the tower's input pixels
    # LlavaNextImageProcessor: the base view is resized to (size.height, size.width), or a square of
    # size.shortest_edge; canvas tiles are crop_size.height wide (else the base side); every view then
    # goes through the ordinary resize + centre crop to the tower's input (an identity at 336 px)
    base_hw = _size_hw(ip.size)
    if base_hw is None:
        edge = _shortest_edge(ip.size)
        if edge is None:
            raise ModelLoadError(f"{name}: cannot interpret the image processor's size {ip.size!r}")
        base_hw = (edge, edge)
    crop_hw = _size_hw(getattr(ip, "crop_size", None) or {})
    tile = crop_hw[0] if crop_hw else base_hw[0]
    base = crop_geometry(base_hw[0], base_hw[1], ip, tower_hw).crop_to_original(local)
    base[:, 0::2] *= width / base_hw[1]
    base[:, 1::2] *= height / base_hw[0]
    out = [base]
    if crops > 1:
        pinpoints = [list(p) for p in ip.image_grid_pinpoints]
        canvas_h, canvas_w = select_best_resolution((height, width), pinpoints)
        dummy = np.empty((1, height, width), dtype=np.uint8)
        new_h, new_w = get_patch_output_size(dummy, (canvas_h, canvas_w), input_data_format=ChannelDimension.FIRST)
        pad_top, pad_left = (canvas_h - new_h) // 2, (canvas_w - new_w) // 2  # _get_padding_size, both backends
        per_tile = crop_geometry(tile, tile, ip, tower_hw).crop_to_original(local)
        tiles_w = canvas_w // tile
        for k in range(1, crops):
            ty, tx = divmod(k - 1, tiles_w)  # divide_to_patches: row-major
            b = per_tile.clone()
            b[:, 0::2] = (b[:, 0::2] + tx * tile - pad_left) * (width / new_w)
            b[:, 1::2] = (b[:, 1::2] + ty * tile - pad_top) * (height / new_h)
            out.append(b)
    return torch.stack(out)


def crop_layout(
    model: Any, image_sizes: torch.Tensor, crops: int, pack: PackIds
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """(crop_index, patch_index, hires_grid) of every packed token, from the family's ``pack`` of per-crop ids."""
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape

    vc = model.config.vision_config
    per = crop_tokens(vc)
    side = vc.image_size // vc.patch_size
    ids = torch.arange(crops * per, dtype=torch.float64).view(crops, per, 1)
    flat = pack(ids, image_sizes)[:, 0].round().long().cpu()
    crop_index, patch_index = flat // per, flat % per
    hires = crop_index > 0
    if not bool(hires.any()):
        return crop_index, patch_index, (0, 0)
    _, crops_w = get_anyres_image_grid_shape(image_sizes[0], model.config.image_grid_pinpoints, vc.image_size)
    rows = (crop_index[hires] - 1) // crops_w * side + patch_index[hires] // side
    cols = (crop_index[hires] - 1) % crops_w * side + patch_index[hires] % side
    grid = (int(rows.unique().numel()), int(cols.unique().numel()))
    if grid[0] * grid[1] != int(hires.sum()):
        raise RuntimeError(f"the high-resolution tokens do not form a {grid[0]}x{grid[1]} grid")
    return crop_index, patch_index, grid


@dataclass(frozen=True)
class AnyresCrops:
    """One adapter's anyres encoding, built on each call from its current parts (nothing here outlives the call but
    ``cache``, the adapter's own geometry memos)."""

    model: Any
    processor: Any
    name: str
    cache: Memos
    features: PatchFeatures
    pack: PackIds

    def encode(self, processed: Mapping[str, Any], sizes: Sequence[tuple[int, int]]) -> list[ImageTokens]:
        """Base-view + unpadded high-resolution pre-projector tokens per image; the real crops of all images
        in one tower pass."""
        pixel_values, image_sizes = processed["pixel_values"], processed["image_sizes"]
        if pixel_values.dim() != 5 or pixel_values.shape[0] != len(sizes) or image_sizes.shape[0] != len(sizes):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} and image_sizes {tuple(image_sizes.shape)} "
                             f"do not hold the crops of {len(sizes)} images")  # fmt: skip
        crops = [self.image_crops(pixel_values[i : i + 1], image_sizes[i : i + 1]) for i in range(len(sizes))]
        with torch.no_grad():
            per_crop = self.features(torch.cat(crops))  # (crops, P, d_v)
        per_image = per_crop.split([int(c.shape[0]) for c in crops])
        return [self.tokens(per_image[i], pixel_values[i : i + 1, : crops[i].shape[0]], image_sizes[i : i + 1],
                            sizes[i]) for i in range(len(sizes))]  # fmt: skip

    def batch_features(self, pixel_values: torch.Tensor, reference: ImageTokens) -> torch.Tensor:
        """(B, N, d_v) packed pre-projector features of B images sharing ``reference``'s geometry (same size: same
        crops and packing), ``pixel_values`` (B, 1, crops, 3, S, S) their processor outputs; with gradients where
        enabled."""
        pixel_values = pixel_values.flatten(0, 1)
        batch, crops = int(pixel_values.shape[0]), int(pixel_values.shape[1])
        per_crop = self.features(pixel_values.flatten(0, 1))
        per_crop = per_crop.view(batch, crops, *per_crop.shape[1:])
        dev = per_crop.device
        return per_crop[:, reference.model_inputs["crop_index"].to(dev), reference.model_inputs["patch_index"].to(dev)]

    def image_crops(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
        """:func:`real_crops` of one image, its crop count kept per image size and crops given (working it out is
        Python per image while the GPU waits)."""
        key = (_sizes_key(image_sizes), int(pixel_values.shape[1]))

        def count_crops() -> tuple[int]:
            return (int(real_crops(self.model, pixel_values, image_sizes, self.name).shape[0]),)

        (count,) = self.cache.recall("crops", key, count_crops)
        return pixel_values[0, :count]

    def tokens(
        self, per_crop: torch.Tensor, pixel_values: torch.Tensor, image_sizes: torch.Tensor, size: tuple[int, int]
    ) -> ImageTokens:
        """One image's packed tokens from its crops' features (crops, P, d_v), and their geometry."""
        height, width = size
        crop_index, patch_index, hires_grid, boxes, _ = self.geometry(image_sizes, per_crop.shape[0], size)
        on_device = self.on_device(image_sizes, per_crop.shape[0], size, per_crop.device)
        features = per_crop[on_device[0], on_device[1]]
        crop_index, patch_index = crop_index.clone(), patch_index.clone()  # the caller's own: the kept ones stay
        return ImageTokens(
            features=features,
            positions=on_device[2].clone(),
            boxes=boxes.clone(),
            image_size=(height, width),
            seen_box=(0.0, 0.0, float(width), float(height)),
            grid=None,
            model_inputs={
                "pixel_values": pixel_values,
                "image_sizes": image_sizes,
                "image_size": (height, width),
                "crop_index": crop_index,
                "patch_index": patch_index,
                "hires_grid": hires_grid,
            },
            views=(crop_index > 0).long(),
        )

    def geometry(self, image_sizes: torch.Tensor, crops: int, size: tuple[int, int]) -> tuple[Any, ...]:
        """(crop_index, patch_index, hires_grid, boxes, positions) of one image's packed tokens (CPU), which depend
        on its size and crops only: kept per size (:data:`GEOMETRY_CACHE_SIZE`), since a data set repeats a few
        sizes and working them out costs milliseconds of Python per image while the GPU waits. The kept tensors
        themselves: a caller clones what it hands out or changes."""
        key = (size, _sizes_key(image_sizes), int(crops))
        return self.cache.recall("geometry", key, lambda: self._geometry(image_sizes, crops, size))

    def _geometry(self, image_sizes: torch.Tensor, crops: int, size: tuple[int, int]) -> tuple[Any, ...]:
        """:meth:`geometry` worked out."""
        height, width = size
        crop_index, patch_index, hires_grid = crop_layout(self.model, image_sizes, crops, self.pack)
        boxes_per_crop = crop_boxes(self.model, self.processor.image_processor, height, width, crops, self.name)
        boxes = clip_boxes(boxes_per_crop[crop_index, patch_index], height, width)  # original pixels
        centre_x = (boxes[:, 0] + boxes[:, 2]) / 2 / width
        centre_y = (boxes[:, 1] + boxes[:, 3]) / 2 / height
        positions = torch.stack([centre_y, centre_x], dim=1).to(torch.float32)
        return crop_index, patch_index, hires_grid, boxes.to(torch.float32), positions

    def on_device(self, image_sizes: torch.Tensor, crops: int, size: tuple[int, int], device: torch.device) -> tuple[
            torch.Tensor, ...]:  # fmt: skip
        """(crop_index, patch_index, positions) of :meth:`geometry` on ``device``, kept beside it: copied once per
        size, not once per image (each copy from the host is a call the driving thread waits on)."""
        key = (str(device), size, _sizes_key(image_sizes), int(crops))

        def placed() -> tuple[torch.Tensor, ...]:
            crop_index, patch_index, _, _, positions = self.geometry(image_sizes, crops, size)
            return crop_index.to(device), patch_index.to(device), positions.to(device)

        return self.cache.recall("device", key, placed)


def _sizes_key(image_sizes: torch.Tensor) -> tuple[int, ...]:
    """An image's ``image_sizes`` row (CPU) as a key."""
    return tuple(int(v) for v in image_sizes.reshape(-1).tolist())
