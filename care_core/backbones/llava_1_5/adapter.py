"""LLaVA-1.5 (`LlavaForConditionalGeneration`, transformers 5.24) seen through :class:`VLMAdapter`.

Visual tokens: the 576 patch tokens of CLIP layer ``config.vision_feature_layer`` (-2) with the CLS
token dropped (strategy ``"default"``), exactly what the model hands its projector. The HF CLIP
processor resizes the shortest edge to 336 and centre-crops 336x336, so for a non-square image the
24x24 grid covers only the central square; ``ImageTokens.boxes`` / ``seen_box`` say so in original
pixels (see :mod:`care_core.backbones.geometry` for the exact rounding).

`transformers` is imported lazily (inside functions) so that ``import care_core`` stays fast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ...kernels.dispatch import KernelGate
from ..base import ImageTokens
from ..chat_adapter import ChatAdapter
from ..geometry import crop_geometry, grid_image_tokens
from ..llava_modules import (
    CLIP_PATCH_START,
    adapter_crop_tokens,
    check_clip_llava,
    llava_language_model,
    llava_projector,
    llava_vision_tower,
    patch_features,
)
from ..probes import clip_vision_probes

LLAVA15_FALLBACK_PROMPT = "USER: {image}\n{question} ASSISTANT:"


class LlavaAdapter(ChatAdapter):
    """Adapter for LLaVA-1.5 checkpoints (``model_type == "llava"``)."""

    family = "llava-1.5"
    model_class = "LlavaForConditionalGeneration"
    FALLBACK_PROMPT = LLAVA15_FALLBACK_PROMPT

    def __init__(self, model: torch.nn.Module, processor: Any, *, name: str, is_demo: bool = False) -> None:
        super().__init__(model, processor, name=name, is_demo=is_demo)
        self._tower_gate = KernelGate("auto")  # the tower's fused kernels that cannot be built here, for this adapter
        check_clip_llava(self, model, processor, name)

    # ------------------------------------------------------------------ modules
    _vision_tower = property(llava_vision_tower)
    projector = property(llava_projector)
    num_image_tokens = property(adapter_crop_tokens)

    # ------------------------------------------------------------------ vision
    def collate(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """The crops joined on the model's device (on the CPU the join is a copy of the batch while the GPU waits;
        each copy is queued without waiting for the GPU, which a blocking copy would do once per image)."""
        return {"pixel_values": torch.cat([part["pixel_values"].to(self.device, non_blocking=True) for part in parts])}

    def encode_processed(self, processed: Mapping[str, Any], sizes: Sequence[tuple[int, int]]) -> list[ImageTokens]:
        """576 pre-projector tokens per image and their geometry, the crops of all images in one tower pass.

        ``features`` (N, d_v) are on the model's device in its dtype; ``positions`` (N, 2) float32 on
        the same device, ``((row + 0.5) / 24, (col + 0.5) / 24)``; ``boxes`` (N, 4) float32 on the CPU,
        each patch's footprint in original pixels; ``model_inputs`` holds the image's ``pixel_values`` (CPU),
        ``image_size`` and the :class:`CropGeometry`.
        """
        pixel_values = processed["pixel_values"]
        if pixel_values.dim() != 4 or pixel_values.shape[0] != len(sizes):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not hold one crop for each of {len(sizes)} "
                             "images")  # fmt: skip
        cfg = self.model.config
        with torch.no_grad():
            features = self._patch_features(pixel_values)  # (B, N, d_v)

        patch = int(cfg.vision_config.patch_size)
        crop_h, crop_w = int(pixel_values.shape[-2]), int(pixel_values.shape[-1])
        rows, cols = crop_h // patch, crop_w // patch
        if rows * cols != features.shape[1]:
            raise RuntimeError(
                f"vision tower gave {features.shape[1]} patch tokens for a {crop_h}x{crop_w} input "
                f"with patch {patch} ({rows}x{cols} expected)"
            )
        ip = self.processor.image_processor
        tokens = []
        for i, (height, width) in enumerate(sizes):
            geom = crop_geometry(height, width, ip, (crop_h, crop_w))
            model_inputs = {"pixel_values": pixel_values[i : i + 1], "image_size": (height, width),
                            "crop_geometry": geom}  # fmt: skip
            tokens.append(grid_image_tokens(features[i], geom, rows, cols, patch, model_inputs,
                                            cache=self._geometry_cache))  # fmt: skip
        return tokens

    def _patch_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(crops, 576, d_v): CLIP's patch tokens of ``vision_feature_layer``, its CLS dropped (strategy "default")."""
        return patch_features(self.model, pixel_values, CLIP_PATCH_START, self._tower_gate)

    def batch_features(self, pixel_values: torch.Tensor, reference: ImageTokens) -> torch.Tensor:
        """(B, N, d_v) pre-projector features of B images sharing ``reference``'s geometry, ``pixel_values`` their
        processor outputs stacked (B, 1, 3, 336, 336); with gradients where enabled (what training feeds)."""
        return self._patch_features(pixel_values.flatten(0, 1))

    # ------------------------------------------------------------------ language model
    _language_model = property(llava_language_model)

    # ------------------------------------------------------------------ probes
    def _vision_probes(self, tokens: ImageTokens, names: set[str]) -> dict[str, Any]:
        layer = self.model.config.vision_feature_layer
        return clip_vision_probes(self._vision_tower, tokens.model_inputs["pixel_values"], layer, names)
