"""LLaVA-OneVision (`LlavaOnevisionForConditionalGeneration`, transformers 5.21-5.24) seen through :class:`VLMAdapter`.

Visual tokens (docs/design/backbones.md §LLaVA-OneVision): the base view's 729 SigLIP patch tokens (384 px / 14 =
27x27, no CLS), then the unpadded high-resolution grid of the anyres crops **before** the model's bilinear pooling,
in the order of the model's own ``pack_image_features``, **without** ``image_newline`` rows: N = 729 + rows * cols
(3645 for 768x768, 4779 for 500x800). The features are SigLIP ``hidden_states[vision_feature_layer]`` (-1: the last
layer before ``post_layernorm``), strategy "full" (nothing dropped), per crop, then packed; the projector is the
model's per-token MLP (linear_1 -> GELU -> linear_2).

Pooling. When ``ratio = sqrt(rows * cols / (9 * 27^2)) > 1.1`` (large images: more than about 11 crops' worth of
unpadded grid) the model bilinearly pools the *projected* grid to ``int(rows // ratio) x int(cols // ratio)`` before
adding the newline rows. Projecting does not commute with that pooling, so no pre-projector token reproduces a pooled
row. N is therefore the grid before pooling: every token is one real 14 px patch of one crop, CaRe's responses go
through the per-token projector exactly, and ``boxes`` are exact. When the rows are exactly all N tokens in packed
order, the model's own sequence is rebuilt from them (pooling and newline rows included, through the model's own
``pack_image_features``), so K = N reproduces the standard path for every image size; K < N rows are fed as they are
(never pooled), so beyond ratio 1.1 a reduced sequence holds unpooled rows where the model's own has pooled ones.

Geometry: the processor's anyres steps are LLaVA-NeXT's (aspect-preserving resize into the canvas
``select_best_resolution`` picks, centred zero padding, row-major 384 px crops; the base view squashed to 384x384),
so the boxes come from :func:`care_core.backbones.anyres.crop_boxes`; ``views`` is 0 for base-view tokens and 1 for
high-resolution ones; ``model_inputs`` holds NeXT's keys plus ``pooled_grid`` (the grid the model's own sequence
has after pooling; equal to ``hires_grid`` at ratio <= 1.1).

Probes. SigLIP has no CLS token: the CLS-defined vision probes are not offered (methods needing them refuse with a
one-line MethodError). ``question`` and ``language_model`` (all N tokens, no newline rows) are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from transformers import LlavaOnevisionProcessor, ProcessorMixin

from ...kernels.dispatch import KernelGate
from .._hf import quiet_transformers
from ..anyres import AnyresCrops, anyres_fed_rows, check_anyres_model, collate_crops
from ..base import ImageTokens, check_kept, is_all_tokens
from ..chat_adapter import ChatAdapter
from ..geometry import anyres_max_crops, onevision_pooled_grid
from ..llava_modules import (
    SIGLIP_PATCH_START,
    adapter_crop_tokens,
    check_feature_strategy,
    llava_inner,
    llava_language_model,
    llava_projector,
    llava_vision_tower,
    patch_features,
)

LLAVA_ONEVISION_FALLBACK_PROMPT = "<|im_start|>user {image}\n{question}<|im_end|>\n<|im_start|>assistant\n"
NO_CLS = "LLaVA-OneVision's SigLIP tower has no CLS token"
#: a crop budget no image reaches: ``pack_image_features`` then never pools (used to read the unpooled layout)
_NO_POOLING = "anyres_max_1000000"


class CareLlavaOnevisionProcessor(LlavaOnevisionProcessor):
    """``LlavaOnevisionProcessor`` without the video processor (whose classes need torchvision): images only.

    ``ProcessorMixin`` derives the sub-processors from the ``__init__`` signature, so this one is an image processor
    + tokenizer processor with the same image outputs and placeholder counts; it loads a hub folder or one it saved.
    """

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        num_image_tokens: int | None = None,
        vision_feature_select_strategy: str | None = None,
        chat_template: Any = None,
        image_token: str = "<image>",
        video_token: str = "<video>",
        vision_aspect_ratio: str = "anyres_max_9",
        **kwargs: Any,
    ) -> None:
        self.num_image_tokens = num_image_tokens
        self.vision_feature_select_strategy = vision_feature_select_strategy
        self.image_token = getattr(tokenizer, "image_token", None) or image_token
        self.video_token = getattr(tokenizer, "video_token", None) or video_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        self.vision_aspect_ratio = vision_aspect_ratio
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


class LlavaOnevisionAdapter(ChatAdapter):
    """Adapter for LLaVA-OneVision checkpoints (``model_type == "llava_onevision"``); see the module docstring."""

    family = "llava-onevision"
    model_class = "LlavaOnevisionForConditionalGeneration"
    image_only_processor = "care_core.backbones.llava_onevision.adapter:CareLlavaOnevisionProcessor"
    FALLBACK_PROMPT = LLAVA_ONEVISION_FALLBACK_PROMPT
    probe_notes: ClassVar[dict[str, str]] = {
        "language_model": "the N unpooled tokens without image_newline rows",
    }

    def __init__(self, model: torch.nn.Module, processor: Any, *, name: str, is_demo: bool = False) -> None:
        super().__init__(model, processor, name=name, is_demo=is_demo)
        self._tower_gate = KernelGate("auto")  # the tower's fused kernels that cannot be built here, for this adapter
        cfg = model.config
        strategy = check_feature_strategy(cfg, name, "full")  # "default" would drop a real patch: SigLIP has no CLS
        self._check_processor(processor, name)
        check_anyres_model(model, name)
        self.max_crops = anyres_max_crops(str(getattr(cfg, "vision_aspect_ratio", "anyres_max_9")))
        if getattr(processor, "num_image_tokens", None) is None:
            processor.num_image_tokens = self.num_image_tokens
        if getattr(processor, "vision_feature_select_strategy", None) is None:
            processor.vision_feature_select_strategy = strategy
        self._set_image_token(getattr(cfg, "image_token_id", None))

    # ------------------------------------------------------------------ modules
    _vision_tower = property(llava_vision_tower)
    projector = property(llava_projector)
    num_image_tokens = property(adapter_crop_tokens)
    _language_model = property(llava_language_model)

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset({"question", "language_model"})

    def why_probe_missing(self, probe: str) -> str:
        return NO_CLS

    # ------------------------------------------------------------------ vision
    collate = collate_crops

    def _anyres(self) -> AnyresCrops:
        """The anyres encoding with SigLIP's patch features and the model's packing with pooling out of reach."""
        return AnyresCrops(self.model, self.processor, self.name, self._geometry_cache, self._patch_features,
                           self._packed_ids)  # fmt: skip

    def encode_processed(self, processed: Mapping[str, Any], sizes: Sequence[tuple[int, int]]) -> list[ImageTokens]:
        """LLaVA-NeXT's packed tokens and geometry per image (the real crops of all images in one tower pass), plus
        the grid the model's own sequence has after pooling (``pooled_grid``)."""
        tokens = self._anyres().encode(processed, sizes)
        for image in tokens:
            rows, cols = image.model_inputs["hires_grid"]
            side = self.model.config.vision_config.image_size // self.model.config.vision_config.patch_size
            pooled = onevision_pooled_grid(rows, cols, side, self.max_crops) if rows else (0, 0)
            image.model_inputs["pooled_grid"] = pooled
        return tokens

    def batch_features(self, pixel_values: torch.Tensor, reference: ImageTokens) -> torch.Tensor:
        """(B, N, d_v) packed pre-projector features of B images sharing ``reference``'s geometry (same size: same
        crops and packing), ``pixel_values`` (B, 1, crops, 3, 384, 384) their processor outputs; with gradients where
        enabled."""
        return self._anyres().batch_features(pixel_values, reference)

    def _patch_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(crops, 729, d_v): SigLIP's rows of ``vision_feature_layer``, all of them (strategy "full", no CLS)."""
        return patch_features(self.model, pixel_values, SIGLIP_PATCH_START, self._tower_gate)

    def _packed_ids(self, ids: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
        """The model's own ``pack_image_features`` on per-crop ids with pooling out of reach (the unpooled grid, no
        newline rows): the crop/patch order and the unpadded grid (:func:`~care_core.backbones.anyres.crop_layout`)."""
        with quiet_transformers():
            packed, _ = llava_inner(self.model).pack_image_features(
                [ids], image_sizes, image_newline=None, vision_aspect_ratio=_NO_POOLING
            )
        return packed[0]

    # ------------------------------------------------------------------ language model
    def _with_newlines(self, tokens: ImageTokens, rows: torch.Tensor) -> torch.Tensor:
        """All N projected tokens (..., N, d) -> the model's own sequence: the rows put back at their crops' patches
        and packed by the model's ``pack_image_features`` (unpad, bilinear pooling where the model pools, newline
        rows); leading dimensions: a batch of images sharing ``tokens``' geometry."""
        inputs = tokens.model_inputs
        for key in ("crop_index", "patch_index", "image_sizes", "pixel_values"):
            if key not in inputs:
                raise ValueError(f"tokens.model_inputs has no {key}; use ImageTokens from encode_image")
        inner = llava_inner(self.model)
        lead, width = rows.shape[:-2], rows.shape[-1]
        images = rows.reshape(-1, rows.shape[-2], width)
        crop, patch = inputs["crop_index"].to(rows.device), inputs["patch_index"].to(rows.device)
        per = self.num_image_tokens
        count = int(inputs["pixel_values"].shape[1])  # the image's crops, base view included
        crops = rows.new_zeros(images.shape[0], count, per, width)  # the padding band stays 0: unpad drops it
        crops[:, crop, patch] = images
        sizes = inputs["image_sizes"].reshape(1, 2).expand(images.shape[0], 2)
        aspect = str(getattr(self.model.config, "vision_aspect_ratio", "anyres_max_9"))
        with quiet_transformers():
            packed, _ = inner.pack_image_features(
                list(crops), sizes, image_newline=inner.image_newline, vision_aspect_ratio=aspect
            )
        return torch.stack(packed).to(rows.dtype).reshape(*lead, -1, width)

    def fed_rows(self, tokens: ImageTokens, rows: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
        """The model's own sequence when the rows are all N tokens in packed order, else the rows as given."""
        return anyres_fed_rows(tokens, rows, kept, self._with_newlines)

    def visual_tokens_fed(self, tokens: ImageTokens, rows: int, kept: torch.Tensor | None = None) -> int:
        kept = check_kept(kept, int(rows), tokens.num_tokens)
        if not is_all_tokens(kept, int(rows), tokens.num_tokens):
            return int(rows)
        grid_rows, grid_cols = tokens.model_inputs.get("hires_grid", (0, 0))
        if not grid_rows:  # a lone base view: one newline at the end
            return int(rows) + 1
        pooled_rows, pooled_cols = tokens.model_inputs["pooled_grid"]
        base = int(rows) - grid_rows * grid_cols
        return base + pooled_rows * (pooled_cols + 1)  # one newline per (pooled) high-res row

    def _vision_probes(self, tokens: ImageTokens, names: set[str]) -> dict[str, Any]:
        raise NotImplementedError(NO_CLS)  # not offered: capabilities holds no vision probe
