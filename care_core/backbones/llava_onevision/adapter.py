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
so the boxes come from :meth:`LlavaNextAdapter._crop_boxes`; ``views`` is 0 for base-view tokens and 1 for
high-resolution ones; ``model_inputs`` holds NeXT's keys plus ``pooled_grid`` (the grid the model's own sequence
has after pooling; equal to ``hires_grid`` at ratio <= 1.1).

Probes. SigLIP has no CLS token: the CLS-defined vision probes are not offered (methods needing them refuse with a
one-line MethodError). ``question`` and ``language_model`` (all N tokens, no newline rows) are.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers import LlavaOnevisionProcessor, ProcessorMixin

from ...errors import ModelLoadError
from .._hf import quiet_transformers
from ..base import ImageTokens, check_kept, is_all_tokens
from ..chat_adapter import ChatAdapter
from ..geometry import anyres_max_crops, onevision_pooled_grid
from ..llava_1_5.adapter import _inner
from ..llava_next.adapter import LlavaNextAdapter

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


class LlavaOnevisionAdapter(LlavaNextAdapter):
    """Adapter for LLaVA-OneVision checkpoints (``model_type == "llava_onevision"``); see the module docstring."""

    family = "llava-onevision"
    model_class = "LlavaOnevisionForConditionalGeneration"
    image_only_processor = "care_core.backbones.llava_onevision.adapter:CareLlavaOnevisionProcessor"
    FALLBACK_PROMPT = LLAVA_ONEVISION_FALLBACK_PROMPT
    probe_notes: ClassVar[dict[str, str]] = {
        "language_model": "the N unpooled tokens without image_newline rows",
    }
    _patch_start: ClassVar[int] = 0  # SigLIP: no CLS row, strategy "full"

    def __init__(self, model: torch.nn.Module, processor: Any, *, name: str, is_demo: bool = False) -> None:
        # ChatAdapter's, not LLaVA-NeXT's: that one requires strategy "default", which would drop a SigLIP patch
        ChatAdapter.__init__(self, model, processor, name=name, is_demo=is_demo)
        cfg = model.config
        strategy = getattr(cfg, "vision_feature_select_strategy", "full")
        if strategy != "full":  # "default" would drop a real patch: SigLIP has no CLS to drop
            raise ModelLoadError(f"{name}: vision_feature_select_strategy {strategy!r} is not supported (only 'full')")
        self._check_processor(processor, name)
        if not isinstance(getattr(cfg, "image_grid_pinpoints", None), list):
            raise ModelLoadError(f"{name}: the model config has no image_grid_pinpoints")
        if not hasattr(_inner(model), "image_newline"):
            raise ModelLoadError(f"{name}: the model has no image_newline parameter")
        self.max_crops = anyres_max_crops(str(getattr(cfg, "vision_aspect_ratio", "anyres_max_9")))
        if getattr(processor, "num_image_tokens", None) is None:
            processor.num_image_tokens = self.num_image_tokens
        if getattr(processor, "vision_feature_select_strategy", None) is None:
            processor.vision_feature_select_strategy = strategy
        self._set_image_token(getattr(cfg, "image_token_id", None))

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset({"question", "language_model"})

    def why_probe_missing(self, probe: str) -> str:
        return NO_CLS

    # ------------------------------------------------------------------ vision
    def _tokens(
        self, per_crop: torch.Tensor, pixel_values: torch.Tensor, image_sizes: torch.Tensor, size: tuple[int, int]
    ) -> ImageTokens:
        """LLaVA-NeXT's packed tokens and geometry, plus the grid the model's own sequence has after pooling."""
        tokens = super()._tokens(per_crop, pixel_values, image_sizes, size)
        rows, cols = tokens.model_inputs["hires_grid"]
        side = self.model.config.vision_config.image_size // self.model.config.vision_config.patch_size
        pooled = onevision_pooled_grid(rows, cols, side, self.max_crops) if rows else (0, 0)
        tokens.model_inputs["pooled_grid"] = pooled
        return tokens

    def _packed_ids(self, ids: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
        """The model's own ``pack_image_features`` on per-crop ids with pooling out of reach (the unpooled grid, no
        newline rows); NeXT's ``_layout`` reads the crop/patch order and the unpadded grid from it."""
        with quiet_transformers():
            packed, _ = _inner(self.model).pack_image_features(
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
        inner = _inner(self.model)
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
