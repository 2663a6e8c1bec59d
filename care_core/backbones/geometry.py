"""Where each visual token's pixels come from in the original image.

The Hugging Face image processors resize, then (optionally) centre-crop, then cut the crop into
``patch x patch`` squares. This module replays that geometry with the processor's own size
arithmetic (transformers 5.24, ``image_processing_backends.PilBackend`` / ``TorchvisionBackend``):

* resize ``{"shortest_edge": s}`` -> ``get_resize_output_image_size(..., default_to_square=False)``:
  the short side becomes ``s`` and the long side ``int(s * long / short)`` (truncated, not rounded);
* resize ``{"height": h, "width": w}`` -> exactly ``(h, w)``; ``shortest_edge`` + ``longest_edge`` and
  ``max_height`` + ``max_width`` use transformers' own helpers;
* PIL's resize maps the image's full extent onto the output's full extent, so a resized pixel edge
  ``x'`` lies at ``x' * W / W'`` in the original image (independent per axis);
* centre crop (``image_transforms.center_crop``, PIL backend): ``top = (H' - ch) // 2``,
  ``left = (W' - cw) // 2`` (floor division; negative when the crop is larger than the image and zero
  padding is added, in which case the crop origin still sits at that resized coordinate). The
  torchvision backend uses ``int((H' - ch) / 2)``, the same for ``H' >= ch``; it pads
  ``(ch - H') // 2`` before when the crop is larger, which differs by one pixel for odd gaps.

Everything here is plain arithmetic on sizes; no pixels are touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._lazy import torch
from .._memo import Memos
from ..errors import CareError

if TYPE_CHECKING:
    from .base import ImageTokens

#: image geometries whose token layout an adapter keeps (a data set has a few hundred sizes at most)
GEOMETRY_CACHE_SIZE = 256


@dataclass(frozen=True)
class CropGeometry:
    """How a ``(crop_h, crop_w)`` processor input relates to the original ``(height, width)`` image."""

    height: int  # original image
    width: int
    resized_height: int  # after the processor's resize
    resized_width: int
    top: int  # crop origin in resized pixels (may be negative: zero padding)
    left: int
    crop_height: int  # size of what the vision tower sees
    crop_width: int

    @property
    def scale_y(self) -> float:
        """Original pixels per resized pixel along y."""
        return self.height / self.resized_height

    @property
    def scale_x(self) -> float:
        return self.width / self.resized_width

    def crop_to_original(self, boxes: torch.Tensor) -> torch.Tensor:
        """Map ``[x0, y0, x1, y1]`` rectangles in crop pixels to original-image pixels (unclipped)."""
        out = boxes.to(torch.float64).clone()
        out[..., 0::2] = (out[..., 0::2] + self.left) * self.scale_x
        out[..., 1::2] = (out[..., 1::2] + self.top) * self.scale_y
        return out

    def seen_box(self) -> tuple[float, float, float, float]:
        """The crop's footprint ``[x0, y0, x1, y1]`` in original pixels, clipped to the image."""
        full = torch.tensor([0.0, 0.0, float(self.crop_width), float(self.crop_height)], dtype=torch.float64)
        box = self.crop_to_original(full)
        x0, y0, x1, y1 = (float(v) for v in box.tolist())
        return (max(0.0, x0), max(0.0, y0), min(float(self.width), x1), min(float(self.height), y1))


#: the ratio above which LLaVA-OneVision bilinearly pools its high-resolution grid (``pack_image_features``)
ONEVISION_POOL_ABOVE = 1.1


def anyres_max_crops(vision_aspect_ratio: str) -> int:
    """The crop budget of a LLaVA-OneVision ``vision_aspect_ratio`` ("anyres_max_9" -> 9), parsed as the model does."""
    try:
        return int(vision_aspect_ratio.strip("anyres_max_"))  # noqa: B005  (the model strips this character set)
    except ValueError:
        raise CareError(f"vision_aspect_ratio {vision_aspect_ratio!r} is not of the form anyres_max_<crops>") from None


def onevision_pooled_grid(rows: int, cols: int, side: int, max_crops: int) -> tuple[int, int]:
    """The (rows, cols) LLaVA-OneVision's ``pack_image_features`` hands the language model for an unpadded
    high-resolution grid of rows×cols (``side``: patches per crop side): bilinearly pooled to
    ``int(rows // ratio) × int(cols // ratio)`` when ``ratio = sqrt(rows·cols / (max_crops·side²)) > 1.1``,
    else unchanged (transformers' expressions, float floor division included)."""
    ratio = math.sqrt(rows * cols / (max_crops * side**2))
    if ratio > ONEVISION_POOL_ABOVE:
        return int(rows // ratio), int(cols // ratio)
    return rows, cols


def _size_get(size: Any, key: str) -> Any:
    if size is None:
        return None
    if isinstance(size, dict):
        return size.get(key)
    return getattr(size, key, None)


def resized_size(height: int, width: int, image_processor: Any) -> tuple[int, int]:
    """``(H', W')`` the processor's resize step produces for an ``(height, width)`` image."""
    if not getattr(image_processor, "do_resize", True):
        return height, width
    size = getattr(image_processor, "size", None)
    shortest = _size_get(size, "shortest_edge")
    longest = _size_get(size, "longest_edge")
    max_h, max_w = _size_get(size, "max_height"), _size_get(size, "max_width")
    h, w = _size_get(size, "height"), _size_get(size, "width")
    if shortest and longest:
        from transformers.image_transforms import get_size_with_aspect_ratio

        new = get_size_with_aspect_ratio((height, width), shortest, longest)
    elif shortest:
        # Same arithmetic as transformers.image_transforms.get_resize_output_image_size with
        # default_to_square=False and no max_size: the long side is truncated with int().
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = int(shortest), int(shortest * long / short)
        new = (new_long, new_short) if width <= height else (new_short, new_long)
    elif max_h and max_w:
        from transformers.image_utils import get_image_size_for_max_height_width

        new = get_image_size_for_max_height_width((height, width), max_h, max_w)
    elif h and w:
        new = (h, w)
    else:
        raise ValueError(f"cannot interpret the image processor's resize size {size!r}")
    return int(new[0]), int(new[1])


def _is_torchvision_backend(image_processor: Any) -> bool:
    return any(cls.__name__ == "TorchvisionBackend" for cls in type(image_processor).__mro__)


def crop_geometry(height: int, width: int, image_processor: Any, crop_hw: tuple[int, int]) -> CropGeometry:
    """Geometry of one image through ``image_processor``; ``crop_hw`` is the pixel_values' (H, W)."""
    rh, rw = resized_size(height, width, image_processor)
    ch, cw = int(crop_hw[0]), int(crop_hw[1])
    if getattr(image_processor, "do_center_crop", False):
        if _is_torchvision_backend(image_processor):
            # TorchvisionBackend.center_crop: pad (crop - size) // 2 before, then int((size - crop) / 2)
            top = -((ch - rh) // 2) if ch > rh else (rh - ch) // 2
            left = -((cw - rw) // 2) if cw > rw else (rw - cw) // 2
        else:
            top, left = (rh - ch) // 2, (rw - cw) // 2
    else:
        if (rh, rw) != (ch, cw):
            raise ValueError(f"processor output {ch}x{cw} does not match its resize {rh}x{rw} and there is no crop")
        top = left = 0
    return CropGeometry(height, width, rh, rw, top, left, ch, cw)


def grid_positions(rows: int, cols: int) -> torch.Tensor:
    """(rows*cols, 2) normalised raster-order centres ``((row + 0.5) / rows, (col + 0.5) / cols)``."""
    r = (torch.arange(rows, dtype=torch.float64) + 0.5) / rows
    c = (torch.arange(cols, dtype=torch.float64) + 0.5) / cols
    rr, cc = torch.meshgrid(r, c, indexing="ij")
    return torch.stack([rr.reshape(-1), cc.reshape(-1)], dim=1)


def grid_crop_boxes(rows: int, cols: int, patch: int) -> torch.Tensor:
    """(rows*cols, 4) raster-order ``[x0, y0, x1, y1]`` patch squares in crop pixels."""
    ys = torch.arange(rows, dtype=torch.float64) * patch
    xs = torch.arange(cols, dtype=torch.float64) * patch
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    x0, y0 = xx.reshape(-1), yy.reshape(-1)
    return torch.stack([x0, y0, x0 + patch, y0 + patch], dim=1)


def clip_boxes(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    out = boxes.clone()
    out[..., 0::2] = out[..., 0::2].clamp(0.0, float(width))
    out[..., 1::2] = out[..., 1::2].clamp(0.0, float(height))
    return out


def grid_image_tokens(
    features: torch.Tensor,
    geom: CropGeometry,
    rows: int,
    cols: int,
    patch: int,
    model_inputs: dict[str, Any],
    *,
    cache: Memos | None = None,
) -> ImageTokens:
    """ImageTokens of one raster grid of `patch`-pixel cells over `geom`'s model canvas, in original pixels.

    ``cache``: an adapter's memos of per-geometry work (at most :data:`GEOMETRY_CACHE_SIZE` grids): the boxes,
    positions and seen box depend on the geometry only, and a data set repeats a few image sizes, while working
    them out costs about 0.15 ms of host time per image. Each image gets its own copies.
    """
    from .base import ImageTokens

    def worked_out() -> tuple[torch.Tensor, torch.Tensor, tuple[float, float, float, float]]:
        boxes = clip_boxes(geom.crop_to_original(grid_crop_boxes(rows, cols, patch)), geom.height, geom.width)
        return boxes.to(torch.float32), grid_positions(rows, cols).to(torch.float32), geom.seen_box()

    key = (geom, rows, cols, patch)
    boxes, positions, seen_box = worked_out() if cache is None else cache.recall("grid", key, worked_out)
    return ImageTokens(
        features=features,
        # a host tensor: a blocking copy to the GPU would wait for the queued work (the tower), once per image
        positions=positions.to(features.device, copy=True, non_blocking=True),
        boxes=boxes.clone(),
        image_size=(geom.height, geom.width),
        seen_box=seen_box,
        grid=(rows, cols),
        model_inputs=model_inputs,
    )
