"""The image side, chat format and model wiring that the Qwen families share: one image processor
(``Qwen2VLImageProcessor``: ``smart_resize`` to multiples of patch x merge pixels, no crop or pad) whose merged 2x2
patch groups are the visual tokens, in the raster order of the merged grid (docs/design/backbones.md §Qwen2.5-VL,
§Qwen3-VL); the checks and ``model.model`` accessors their adapters share.

Plain functions and constants a family's adapter calls or assigns (composition, not a shared parent class).
"""

from __future__ import annotations

from typing import Any

import torch

from .._memo import Memos
from ..errors import ModelLoadError
from .base import ImageTokens
from .chat_adapter import ChatAdapter
from .geometry import CropGeometry, grid_image_tokens
from .module_attrs import model_config

#: the prompt when neither the processor nor the tokenizer has a chat template (Qwen2.5-VL's, its system line included)
QWEN_FALLBACK_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|>{image}<|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"
)
#: transformers' ``smart_resize`` (``models/qwen2_vl/image_processing*_qwen2_vl.py``, the image processor of both Qwen
#: families) raises for a long side over 200 times the short one; it has no constant to read, so the limit is written
#: here once and ``VLMAdapter.check_image`` refuses such an image before the processor runs
QWEN_MAX_ASPECT_RATIO = 200.0


def check_qwen_parts(adapter: ChatAdapter, model: Any, processor: Any, name: str) -> None:
    """What every Qwen adapter's constructor checks first: the processor's parts, its patch and merge sizes, and the
    image token (ModelLoadError naming ``name``)."""
    adapter._check_processor(processor, name)
    check_merge_sizes(model, processor, name)
    adapter._set_image_token(getattr(model_config(model), "image_token_id", None))


def inner_model(adapter: ChatAdapter) -> Any:
    """The multimodal model (``model.model``, transformers 5.x): its ``visual`` tower and ``language_model``."""
    return adapter.model.model


def inner_language_model(adapter: ChatAdapter) -> torch.nn.Module:
    """The decoder the language-model probe hooks (``model.model.language_model``)."""
    return inner_model(adapter).language_model


def check_merge_sizes(model: Any, processor: Any, name: str) -> None:
    """ModelLoadError when the image processor's patch or merge size is not the model's (its placeholder count and the
    tower's merged grid would disagree)."""
    vc = model_config(model).vision_config
    ip = processor.image_processor
    for attr, want in (("patch_size", vc.patch_size), ("merge_size", vc.spatial_merge_size)):
        got = getattr(ip, attr, want)
        if int(got) != int(want):
            raise ModelLoadError(f"{name}: image processor {attr} {got} does not match the model's {want}")


def merge_unit(model: torch.nn.Module) -> int:
    """Patches per merged token: the vision config's ``spatial_merge_size`` squared."""
    return int(model_config(model).vision_config.spatial_merge_size) ** 2


def check_packed_patches(pixel_values: torch.Tensor, thw: torch.Tensor, images: int) -> None:
    """ValueError unless ``thw`` has one (t, h, w) row per image and they count every row of ``pixel_values``."""
    if thw.dim() != 2 or thw.shape[0] != images or int(thw.prod(-1).sum()) != pixel_values.shape[0]:
        raise ValueError(f"image_grid_thw {tuple(thw.shape)} and pixel_values {tuple(pixel_values.shape)} do not "
                         f"hold the patches of {images} images")  # fmt: skip


def collate_patches(adapter: ChatAdapter, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """A Qwen adapter's ``collate``: patch rows packed image after image, as the processor packs a list of images (on
    the model's device)."""
    device = adapter.device
    return {"pixel_values": torch.cat([part["pixel_values"].to(device, non_blocking=True) for part in parts]),
            "image_grid_thw": torch.cat([part["image_grid_thw"] for part in parts])}  # fmt: skip


def merged_grid_tokens(
    features: torch.Tensor,
    pixel_values: torch.Tensor,
    thw: torch.Tensor,
    size: tuple[int, int],
    vision_config: Any,
    cache: Memos,
) -> ImageTokens:
    """One image's merged tokens (N, unit * d_v) and their geometry: each token a (patch * merge)-pixel block of the
    resized image, mapped linearly back to original pixels; ``model_inputs`` holds ``pixel_values``,
    ``image_grid_thw`` and ``image_size``. ``cache``: the adapter's geometry memos."""
    height, width = size
    t, gh, gw = (int(v) for v in thw[0].tolist())
    merge = int(vision_config.spatial_merge_size)
    rows, cols = gh // merge, gw // merge
    if t != 1 or rows * cols != features.shape[0]:
        raise RuntimeError(f"vision tower gave {features.shape[0]} merged tokens for grid_thw {thw[0].tolist()}")
    block = int(vision_config.patch_size) * merge
    geom = CropGeometry(height, width, rows * block, cols * block, 0, 0, rows * block, cols * block)
    model_inputs = {"pixel_values": pixel_values, "image_grid_thw": thw, "image_size": (height, width)}
    return grid_image_tokens(features, geom, rows, cols, block, model_inputs, cache=cache)
