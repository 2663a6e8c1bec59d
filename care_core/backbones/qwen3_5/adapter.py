"""Qwen3.5 (`Qwen3_5ForConditionalGeneration`, transformers 5.24, dense ``qwen3_5``) seen through :class:`VLMAdapter`.

Visual tokens as Qwen3-VL's (the same tower and merger classes): one per merged 2x2 group of 16-pixel patches, in the
raster order of the merged grid; ``features`` row i is the group's four pre-merger patch vectors (4 * d_v) from the
tower's last hidden state, and the projector is the tower's merger (LayerNorm per patch, then the MLP on the group),
Qwen3-VL's :class:`~care_core.backbones.qwen3_vl.adapter.Qwen3VLMergerProjector` (so the exact fast derivative of
:mod:`care_core.norm_first` applies). There is no DeepStack: the K rows are all the language model receives of the
image, through ``mm_encoder_outputs`` (the :class:`ChatAdapter` default container).

Positions: the kept rows get the (t, h, w) multimodal-rope positions of their tokens from ``get_rope_index`` of the
unreduced prompt (:mod:`care_core.backbones.mrope`, shared with Qwen2.5-VL and Qwen3-VL).

The decoder mixes Gated DeltaNet linear-attention layers (a convolution state and a recurrent state, no keys and
values) with full-attention layers. The reduced prompt is a shorter sequence run through the model's own forward, so
those states are the model's own for the K rows; a batch is left-padded (:func:`collate_left_padded`), and padded
rows, zeroed by the model before its linear layers, leave a zero starting state zero. Decoding is ``model.generate``:
the static CUDA-graph loop drives no linear-attention layer
(:func:`~care_core.backbones.static_generation.unsupported_reason` says so).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from .. import mrope, qwen_vl
from .._hf import quiet_transformers
from ..base import ImageTokens
from ..chat_adapter import ChatAdapter, PromptParts
from ..probes import VISION_PROBES
from ..qwen3_vl.adapter import Qwen3VLMergerProjector
from ..vision_rotary import fast_vision_rotary, modeling_module


class Qwen3_5Adapter(ChatAdapter):
    """Adapter for Qwen3.5 checkpoints (``model_type == "qwen3_5"``); see the module docstring."""

    family = "qwen3.5"
    FALLBACK_PROMPT = qwen_vl.QWEN_FALLBACK_PROMPT
    model_class = "Qwen3_5ForConditionalGeneration"
    image_only_processor = "care_core.backbones.qwen_processor:CareQwen3VLProcessor"  # Qwen3.5 uses Qwen3VLProcessor
    max_aspect_ratio: ClassVar[float | None] = qwen_vl.QWEN_MAX_ASPECT_RATIO  # smart_resize refuses beyond it
    # the positions travel with the prompt, so the loop's refusal is about the decoder, not about extra inputs
    static_inputs: ClassVar[frozenset[str]] = mrope.MROPE_STATIC_INPUTS
    row_positions = staticmethod(mrope.row_positions)

    def __init__(self, model: torch.nn.Module, processor: Any, *, name: str, is_demo: bool = False) -> None:
        super().__init__(model, processor, name=name, is_demo=is_demo)
        qwen_vl.check_qwen_parts(self, model, processor, name)
        self._projector = Qwen3VLMergerProjector(self._inner.visual.merger)
        #: (question, image grid thw) -> the full prompt's rope positions (CPU), :meth:`rope_positions`
        self._rope_cache: mrope.RopeCache = {}

    # ------------------------------------------------------------------ modules
    _inner = property(qwen_vl.inner_model)
    _language_model = property(qwen_vl.inner_language_model)

    @property
    def projector(self) -> torch.nn.Module:
        return self._projector

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset({"question"})

    def why_probe_missing(self, probe: str) -> str:
        if probe in VISION_PROBES:
            return f"{self.display} has no CLS token"
        return f"{self.display}'s first decoder layers are Gated DeltaNet linear attention, with no attention map"

    # ------------------------------------------------------------------ vision
    collate = qwen_vl.collate_patches

    def _tower(self, pixel_values: torch.Tensor, thw: torch.Tensor) -> torch.Tensor:
        """(sum N, unit * d_v) merged-token features of the packed patches (the tower's last hidden state, already in
        raster order of each merged grid), one tower pass; gradients where enabled. The tower's per-image attention
        loop runs as transformers has it (care's packed attention does not list this tower yet)."""
        visual = self._inner.visual
        vparam = next(visual.parameters())
        with quiet_transformers(), fast_vision_rotary(modeling_module(visual), vparam.device):
            out = visual(pixel_values.to(device=vparam.device, dtype=vparam.dtype), grid_thw=thw.to(vparam.device))
        unit = qwen_vl.merge_unit(self.model)
        hidden = out.last_hidden_state  # processor order: each 2x2 group is 4 consecutive rows
        return hidden.reshape(-1, unit * hidden.shape[-1])

    def encode_processed(self, processed: Mapping[str, Any], sizes: Sequence[tuple[int, int]]) -> list[ImageTokens]:
        """Merged-token pre-projector features (N, 4 d_v) per image with their geometry: the packed patches of all
        images through the tower once (attention stays within each image)."""
        pixel_values, thw = processed["pixel_values"], processed["image_grid_thw"]
        qwen_vl.check_packed_patches(pixel_values, thw, len(sizes))
        with torch.no_grad():
            features = self._tower(pixel_values, thw)
        unit = qwen_vl.merge_unit(self.model)
        counts = [int(n) // unit for n in thw.prod(-1).tolist()]
        per_image, pixels = features.split(counts), pixel_values.split([n * unit for n in counts])
        vc = self.model.config.vision_config
        return [qwen_vl.merged_grid_tokens(per_image[i], pixels[i], thw[i : i + 1], size, vc, self._geometry_cache)
                for i, size in enumerate(sizes)]  # fmt: skip

    def batch_features(self, pixel_values: torch.Tensor, reference: ImageTokens) -> torch.Tensor:
        """(B, N, unit * d_v) pre-projector features of B images sharing ``reference``'s geometry (same grid_thw),
        ``pixel_values`` (B, patches, C * T * P * P) their processor outputs: one tower pass, with gradients where
        enabled (what ``scripts/train_demo`` trains through)."""
        batch = int(pixel_values.shape[0])
        thw = reference.model_inputs["image_grid_thw"].expand(batch, -1)
        return self._tower(pixel_values.flatten(0, 1), thw).view(batch, reference.num_tokens, -1)

    # ------------------------------------------------------------------ language model
    def full_positions(self, question: str, tokens: ImageTokens) -> dict[str, torch.Tensor]:
        """The prompt with all N image placeholders and its rope ``positions``
        (:func:`~care_core.backbones.mrope.full_positions`)."""
        return mrope.full_positions(self, self._rope_cache, question, tokens)

    def rope_positions(self, question: str, tokens: ImageTokens) -> tuple[torch.Tensor, int]:
        """(3, L) rope positions of the prompt with all N placeholders, kept per (question, image grid), and the first
        placeholder's place (:func:`~care_core.backbones.mrope.rope_positions`)."""
        return mrope.rope_positions(self, self._rope_cache, question, tokens)

    def _prompt_parts(
        self,
        question: str,
        tokens: ImageTokens,
        projected: torch.Tensor,
        kept: torch.Tensor | None,
        *,
        probe: bool = False,
    ) -> PromptParts:
        """K placeholders, each with the mrope position of its token (``kept``; -1: the last image token's)."""
        return mrope.mrope_prompt_parts(self, self._rope_cache, question, tokens, projected, kept)

    _model_inputs = mrope.mrope_model_inputs  # mm_token_type_ids and position_ids too
