"""How many visual tokens N an image of H×W pixels gives, counted the way each backbone's processor counts.

- LLaVA-1.5: one shortest-edge-336 resize + centre crop, so always (336/14)² = 576.
- LLaVA-NeXT (anyres): the base view (576) + the high-resolution grid after `unpad_image`, **without** the
  `image_newline` rows (design). The best resolution comes from `select_best_resolution` over the pinpoints.
- LLaVA-OneVision: the same count (base 729, SigLIP 384/14, no CLS) of the grid **before** the model's bilinear
  pooling (ratio > 1.1); ``detail`` adds the pooled grid and the rows the model's own sequence has.
- Qwen2.5-VL: `smart_resize` to multiples of patch·merge (28) within [min_pixels, max_pixels], then one token
  per merged 2×2 group: (H'/28)·(W'/28). Qwen3-VL: the same with 16 px patches, multiples of 32: (H'/32)·(W'/32).

- InternVL3: `get_optimal_tiled_canvas` picks (cols, rows) tiles of 448 px with 1 <= cols·rows <= max_tiles, the
  ratio closest to W/H (ties: more tiles while the image area exceeds half their area); a thumbnail is added when
  there is more than one tile; 256 pixel-shuffled tokens per tile and thumbnail.

The arithmetic mirrors transformers' own (`select_best_resolution`, `unpad_image`, `smart_resize`), including
its float expressions: exact rational arithmetic disagrees with the processor for a few sizes (1165×582 picks
672×336 in transformers, 1008×336 exactly), and the processor is what decides N.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from care_core.architecture import BackboneSpec, ImageLayout
from care_core.backbones.geometry import onevision_pooled_grid
from care_core.errors import CareError


class ImageSizeError(CareError):
    """A malformed or impossible image size."""


@dataclass(frozen=True)
class TokenCount:
    tokens: int
    crops: int = 1  # vision-tower passes (LLaVA-NeXT: base + tiles)
    grid: tuple[int, int] | None = None  # token grid (Qwen: merged rows × cols; NeXT: unpadded high-res grid)
    detail: dict[str, Any] = field(default_factory=dict)


def parse_image_size(text: str) -> tuple[int, int]:
    """'672x672', '500×800' or '500,800' -> (height, width)."""
    match = re.fullmatch(r"\s*(\d+)\s*[x×X,]\s*(\d+)\s*", text)
    if not match:
        raise ImageSizeError(f"must be HEIGHTxWIDTH in pixels (e.g. 672x672), got {text!r}", parameter="image_size")
    height, width = int(match.group(1)), int(match.group(2))
    if height < 1 or width < 1:
        raise ImageSizeError(f"needs positive sides, got {height}x{width}", parameter="image_size")
    return height, width


def select_best_resolution(height: int, width: int, pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """transformers' rule: the pinpoint (height, width) with the most effective pixels, then the least waste."""
    best: tuple[int, int] | None = None
    max_effective, min_wasted = 0, math.inf
    for pin_h, pin_w in pinpoints:
        scale = min(pin_w / width, pin_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_w * pin_h - effective
        if effective > max_effective or (effective == max_effective and wasted < min_wasted):
            max_effective, min_wasted, best = effective, wasted, (pin_h, pin_w)
    assert best is not None
    return best


def unpadded_grid(height: int, width: int, grid_h: int, grid_w: int) -> tuple[int, int]:
    """transformers' `unpad_image` on a (grid_h, grid_w) feature map of an image of height×width."""
    if width / height > grid_w / grid_h:
        new_height = int(round(height * (grid_w / width), 7))
        padding = (grid_h - new_height) // 2
        return grid_h - 2 * padding, grid_w
    new_width = int(round(width * (grid_h / height), 7))
    padding = (grid_w - new_width) // 2
    return grid_h, grid_w - 2 * padding


def llava_next_tokens(height: int, width: int, spec: BackboneSpec) -> TokenCount:
    side, patch = spec.vision.image_size, spec.vision.patch_size
    per_side = side // patch
    best_h, best_w = select_best_resolution(height, width, spec.grid_pinpoints)
    tiles_h, tiles_w = best_h // side, best_w // side
    rows, cols = unpadded_grid(height, width, tiles_h * per_side, tiles_w * per_side)
    base = spec.vision.feature_tokens
    detail = {"best_resolution": [best_h, best_w], "tiles": [tiles_h, tiles_w], "base_tokens": base,
              "high_res_grid": [rows, cols], "newline_tokens_excluded": rows}  # fmt: skip
    # LLaVA-OneVision: N is the grid before the model's pooling (docs/design/backbones.md §LLaVA-OneVision)
    if spec.max_crops:
        pooled_rows, pooled_cols = onevision_pooled_grid(rows, cols, per_side, spec.max_crops)
        detail.update(pooled_grid=[pooled_rows, pooled_cols],
                      model_visual_rows=base + pooled_rows * (pooled_cols + 1))  # fmt: skip
    return TokenCount(base + rows * cols, crops=1 + tiles_h * tiles_w, grid=(rows, cols), detail=detail)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL `smart_resize` (same expressions, same Python rounding)."""
    if max(height, width) / min(height, width) > 200:
        raise ImageSizeError(f"Qwen2.5-VL and Qwen3-VL need an aspect ratio below 200, got {height}x{width}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_tokens(height: int, width: int, spec: BackboneSpec) -> TokenCount:
    factor = spec.vision.patch_size * spec.vision.spatial_merge_size
    new_h, new_w = smart_resize(height, width, factor, spec.min_pixels, spec.max_pixels)
    rows, cols = new_h // factor, new_w // factor
    detail = {"resized": [new_h, new_w], "patch_grid": [new_h // spec.vision.patch_size,
                                                       new_w // spec.vision.patch_size]}  # fmt: skip
    return TokenCount(rows * cols, grid=(rows, cols), detail=detail)


def tiled_canvas(height: int, width: int, tile: int, max_tiles: int, min_tiles: int = 1) -> tuple[int, int]:
    """transformers' GotOcr2 ``get_optimal_tiled_canvas`` (same loop, same float comparisons): (cols, rows)."""
    grids = sorted(((w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1)
                    if min_tiles <= w * h <= max_tiles), key=lambda g: g[0] * g[1])  # fmt: skip
    aspect, area = width / height, width * height
    best_diff, best = math.inf, (1, 1)
    for grid in grids:
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best_diff, best = diff, grid
        elif diff == best_diff and area > 0.5 * tile * tile * grid[0] * grid[1]:
            best = grid
    return best


def internvl_tokens(height: int, width: int, spec: BackboneSpec) -> TokenCount:
    cols, rows = tiled_canvas(height, width, spec.vision.image_size, spec.max_tiles)
    tiles = cols * rows
    crops = tiles + (1 if tiles > 1 else 0)
    detail = {"tiles": [rows, cols], "thumbnail": tiles > 1, "tokens_per_tile": spec.vision.feature_tokens}
    return TokenCount(crops * spec.vision.feature_tokens, crops=crops, detail=detail)


def one_view_tokens(height: int, width: int, spec: BackboneSpec) -> TokenCount:
    """One fixed view (LLaVA-1.5): the tower's feature tokens, whatever the image size."""
    side = spec.vision.image_size
    per_side = side // spec.vision.patch_size
    return TokenCount(spec.vision.feature_tokens, grid=(per_side, per_side),
                      detail={"note": f"resized to {side} on the short side and centre-cropped"})  # fmt: skip


#: how N is counted for each way a processor cuts an image (BackboneSpec.image_layout)
TOKEN_COUNTERS: dict[ImageLayout, Callable[[int, int, BackboneSpec], TokenCount]] = {
    "one_view": one_view_tokens,
    "anyres": llava_next_tokens,  # a base view + anyres crops (LLaVA-NeXT, LLaVA-OneVision)
    "tiles": internvl_tokens,  # dynamic square tiles + thumbnail (InternVL3)
    "merged_grid": qwen_tokens,  # one merged grid within a pixel budget (Qwen2.5-VL, Qwen3-VL)
}


def visual_tokens(spec: BackboneSpec, height: int, width: int) -> TokenCount:
    """N for one image of height×width pixels on this backbone."""
    if height < 1 or width < 1:
        raise ImageSizeError(f"image size must be positive, got {height}x{width}")
    return TOKEN_COUNTERS[spec.image_layout](height, width, spec)


def squarest_grid(n: int) -> tuple[int, int]:
    """rows × cols = n with rows <= cols as close as possible (used when only N is known)."""
    rows = math.isqrt(n)
    while n % rows:
        rows -= 1
    return rows, n // rows
