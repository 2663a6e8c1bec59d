"""Gemma 3 (`Gemma3ForConditionalGeneration`, transformers 5.24) seen through :class:`VLMAdapter`.

Visual tokens (docs/design/backbones.md §Gemma 3): the model resizes the image to 896x896 (aspect ratio not kept, no
crop), runs SigLIP (64x64 patches of 14 px, no CLS) and its projector average-pools the last hidden state 4x4 to a
16x16 grid, then applies RMSNorm (gamma = 1 + w) and one linear map. CaRe's N tokens are the 256 pooled rows the
language model sees (row-major); ``features`` are the pooled SigLIP rows before the norm and the per-token projector
is :class:`Gemma3TokenProjector` (norm + linear: the model's projector without its pooling), so
``projector(features)`` equals the model's image rows bit for bit. Each token covers 56x56 px of the 896 canvas;
``boxes`` map that linearly back into the original image.

Language model. The processor writes ``\\n\\n<start_of_image>`` + 256 ``<image_soft_token>`` + ``<end_of_image>\\n\\n``
per image and marks the placeholders with ``token_type_ids`` = 1; the model builds its mask from those: one
contiguous run of type-1 tokens is one image, whose tokens attend to each other both ways (causal elsewhere; sliding
layers AND a 1-D window on top). The reduced prompt keeps start and end tokens around K placeholders and marks the K
of them type 1, so the K rows form one bidirectional block (the drop-in carries those types onto the caller's
prompt, replacing the processor's full-length ones). Decoding stays eager (``model.generate``): see
:data:`EAGER_REASON`.

Pan-and-scan (crops as extra images) is refused at load for now; SigLIP has no CLS, so the CLS probes are not
offered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, ClassVar

import torch

from ...errors import ModelLoadError
from ...norm_first import NormLinear
from .._hf import quiet_transformers
from ..base import ImageTokens
from ..chat_adapter import ChatAdapter, PromptParts, visual_rows
from ..geometry import clip_boxes, grid_crop_boxes
from ..module_attrs import model_config, submodule, typed_attr

GEMMA3_FALLBACK_PROMPT = "<start_of_turn>user\n{image}{question}<end_of_turn>\n<start_of_turn>model\n"
NO_CLS = "Gemma 3's SigLIP tower has no CLS token"
EAGER_REASON = (
    "Gemma 3's decoder interleaves sliding-window and full-attention layers and its image rows attend to each other "
    "both ways (token_type_ids); the static loop drives neither, so it decodes through model.generate"
)
NO_PAN_AND_SCAN = "pan-and-scan (do_pan_and_scan) is not supported yet; turn it off in the image processor"


class Gemma3TokenProjector(torch.nn.Module):
    """Gemma 3's projector per token: RMSNorm (gamma = 1 + w) then the linear map, on pooled SigLIP rows
    (..., d_v) -> (..., d_t). It holds the model's own norm and weight (shared, not copied).

    The norm is ``Gemma3RMSNorm.forward``'s arithmetic written out with its statistics in float32 *or wider*: for
    float32, float16 and bfloat16 rows the operations are the model's, so the rows equal its own bit for bit; float64
    rows stay float64 (the model's norm would round them to float32, which caps a float64 finite difference at
    float32 precision)."""

    def __init__(self, projector: torch.nn.Module) -> None:
        super().__init__()
        self.norm: torch.nn.Module = submodule(projector, "mm_soft_emb_norm")
        self.weight: torch.nn.Parameter = typed_attr(projector, "mm_input_projection_weight", torch.nn.Parameter)
        self.eps = typed_attr(self.norm, "eps", float)
        # the linear map's widths, named as nn.Linear names them (read by Scorer and the latency gate's floor)
        self.in_features, self.out_features = (int(size) for size in self.weight.shape)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        wide = features.to(torch.promote_types(features.dtype, torch.float32))
        gain = typed_attr(self.norm, "weight", torch.nn.Parameter).to(wide.dtype)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return torch.matmul((normed * (1.0 + gain)).type_as(features), self.weight).type_as(features)

    def norm_linear(self) -> NormLinear | None:
        """This forward for PRCA's fast jvp path (:mod:`care_core.norm_first`): RMSNorm with gamma = 1 + w and the
        norm's epsilon, statistics in at least float32, then the weight as a (d_t, d_v) view, no bias; None for a
        subclass that computes something else."""
        if type(self).forward is not Gemma3TokenProjector.forward:
            return None
        gain = typed_attr(self.norm, "weight", torch.nn.Parameter)
        return NormLinear("rms", 1.0 + gain, None, self.eps, self.weight.T, upcast=True)


class Gemma3Adapter(ChatAdapter):
    """Adapter for Gemma 3 checkpoints (``model_type == "gemma3"``); see the module docstring."""

    family = "gemma3"
    model_class = "Gemma3ForConditionalGeneration"
    FALLBACK_PROMPT = GEMMA3_FALLBACK_PROMPT
    probe_notes: ClassVar[dict[str, str]] = {
        "language_model": "the 256 pooled tokens between <start_of_image> and <end_of_image>, one bidirectional block",
    }

    def __init__(self, model: torch.nn.Module, processor: Any, *, name: str, is_demo: bool = False) -> None:
        super().__init__(model, processor, name=name, is_demo=is_demo)
        self._check_processor(processor, name)
        cfg = model_config(model)
        if getattr(processor.image_processor, "do_pan_and_scan", None):
            raise ModelLoadError(f"{name}: {NO_PAN_AND_SCAN}")
        inner = self.model.model
        self.tokens_per_image = int(cfg.mm_tokens_per_image)
        seq = int(getattr(processor, "image_seq_length", self.tokens_per_image))
        if seq != self.tokens_per_image:
            raise ModelLoadError(f"{name}: the processor writes {seq} placeholders per image, the model gives "
                                 f"{self.tokens_per_image}")  # fmt: skip
        self.side_px = int(cfg.vision_config.image_size)
        self._projector = Gemma3TokenProjector(inner.multi_modal_projector)
        self._set_image_token(getattr(cfg, "image_token_id", None))
        tok = self.tokenizer
        self.start_image = str(tok.convert_ids_to_tokens(int(cfg.boi_token_id)))
        self.end_image = str(tok.convert_ids_to_tokens(int(cfg.eoi_token_id)))

    # ------------------------------------------------------------------ modules
    @property
    def _language_model(self) -> torch.nn.Module:
        return self.model.model.language_model  # type: ignore[no-any-return]

    @property
    def projector(self) -> torch.nn.Module:
        """:class:`Gemma3TokenProjector`: the model's norm + linear on one pooled row at a time."""
        return self._projector

    @property
    def capabilities(self) -> frozenset[str]:
        return frozenset({"question", "language_model"})

    def why_probe_missing(self, probe: str) -> str:
        return NO_CLS

    # ------------------------------------------------------------------ vision
    def collate(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """One 896x896 view per image, joined on the model's device (pan-and-scan is off: no crops)."""
        return {"pixel_values": torch.cat([part["pixel_values"].to(self.device, non_blocking=True) for part in parts])}

    def pooled_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, 256, d_v): SigLIP's last hidden state average-pooled by the model's own pooling, exactly the rows its
        projector normalises (``Gemma3MultiModalProjector.forward`` up to its norm); gradients where enabled."""
        inner = self.model.model
        pool = inner.multi_modal_projector
        param = next(inner.vision_tower.parameters())
        with quiet_transformers():
            hidden = inner.vision_tower(pixel_values=pixel_values.to(param.device, param.dtype)).last_hidden_state
        batch, _, width = hidden.shape
        side = int(pool.patches_per_image)
        grid = hidden.transpose(1, 2).reshape(batch, width, side, side).contiguous()
        return pool.avg_pool(grid).flatten(2).transpose(1, 2)  # type: ignore[no-any-return]

    def encode_processed(self, processed: Mapping[str, Any], sizes: Sequence[tuple[int, int]]) -> list[ImageTokens]:
        """The 256 pooled tokens of every image (one tower pass for all) and their footprints in the image."""
        pixel_values = processed["pixel_values"]
        if pixel_values.dim() != 4 or pixel_values.shape[0] != len(sizes):
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not hold one view for each of {len(sizes)} "
                             "images (pan-and-scan crops are not supported)")  # fmt: skip
        with torch.no_grad():
            features = self.pooled_features(pixel_values)
        return [self._tokens(features[i], pixel_values[i : i + 1], size) for i, size in enumerate(sizes)]

    def batch_features(self, pixel_values: torch.Tensor, reference: ImageTokens) -> torch.Tensor:
        """(B, 256, d_v) pooled features of B images, ``pixel_values`` (B, 1, 3, 896, 896); gradients where enabled."""
        return self.pooled_features(pixel_values.flatten(0, 1))

    def _tokens(self, features: torch.Tensor, pixel_values: torch.Tensor, size: tuple[int, int]) -> ImageTokens:
        """One image's tokens: a 16x16 raster of 56 px cells on the squashed 896 canvas, mapped back linearly."""
        height, width = size
        side = round(self.tokens_per_image**0.5)
        cell = self.side_px // side
        boxes = grid_crop_boxes(side, side, cell)
        boxes[:, 0::2] *= width / self.side_px
        boxes[:, 1::2] *= height / self.side_px
        boxes = clip_boxes(boxes, height, width)
        centre = torch.stack([(boxes[:, 1] + boxes[:, 3]) / 2 / height, (boxes[:, 0] + boxes[:, 2]) / 2 / width], 1)
        return ImageTokens(
            features=features,
            positions=centre.to(device=features.device, dtype=torch.float32),
            boxes=boxes.to(torch.float32),
            image_size=(height, width),
            seen_box=(0.0, 0.0, float(width), float(height)),
            grid=(side, side),
            model_inputs={"pixel_values": pixel_values.cpu(), "image_size": (height, width)},
        )

    # ------------------------------------------------------------------ text
    def _clean_question(self, question: str) -> str:
        for token in (self.image_token, self.start_image, self.end_image):
            question = question.replace(token, "")
        return question

    def prompt(self, question: str) -> str:
        """The chat template's prompt with its one ``<start_of_image>`` standing for the image as one placeholder
        (:meth:`_image_text` writes what the processor expands it to); a leading bos the tokenizer adds itself is
        dropped, as ``apply_chat_template(tokenize=True)`` does."""
        question = self._clean_question(question)
        conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text: Any = None
        if getattr(self.processor, "chat_template", None):
            with quiet_transformers():
                text = self.processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        if isinstance(text, list) and len(text) == 1:
            text = text[0]
        if not isinstance(text, str) or text.count(self.start_image) != 1:
            return self.FALLBACK_PROMPT.format(image=self.image_token, question=question)
        bos = self.tokenizer.bos_token
        if bos and text.startswith(bos) and self.tokenizer("", add_special_tokens=True)["input_ids"]:
            text = text[len(bos) :]
        return text.replace(self.start_image, self.image_token)

    def processor_prompt(self, question: str) -> str:
        """:meth:`prompt` with ``<start_of_image>`` for the image, the token Gemma3Processor expands."""
        return self.prompt(question).replace(self.image_token, self.start_image)

    def _image_text(self, k: int) -> str:
        """What the processor writes for one image, with ``k`` placeholders (``full_image_sequence``)."""
        return f"\n\n{self.start_image}{self.image_token * k}{self.end_image}\n\n"

    # ------------------------------------------------------------------ language model
    def _prompt_parts(
        self,
        question: str,
        tokens: ImageTokens,
        projected: torch.Tensor,
        kept: torch.Tensor | None,
        *,
        probe: bool = False,
    ) -> PromptParts:
        """ChatAdapter's prompt with K placeholders, plus ``token_type_ids`` (1 on exactly those K): the model
        builds the bidirectional image block from them, so the K rows attend to each other both ways."""
        parts = super()._prompt_parts(question, tokens, projected, kept, probe=probe)
        token_types = (parts.input_ids == self.image_token_id).long()
        return replace(parts, extras={**parts.extras, "token_type_ids": token_types})

    def _encoder_outputs(self, rows: torch.Tensor, tokens: ImageTokens, kept: torch.Tensor | None) -> dict[str, Any]:
        """Gemma 3 takes ONE tensor of all rows (its forward calls ``.to`` on ``pooler_output``)."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        return {"image": BaseModelOutputWithPooling(pooler_output=rows)}

    def _prompt_embeddings(self, inputs: dict[str, Any]) -> torch.Tensor:
        """ChatAdapter's, with the placeholders embedded as id 0 first, as the model does for an image token id
        beyond its vocabulary (262144 in the released checkpoints); those rows are replaced anyway."""
        ids = inputs["input_ids"]
        placeholders = ids == self.image_token_id
        embeds = self.model.get_input_embeddings()(ids.masked_fill(placeholders, 0))
        visual = visual_rows(inputs["mm_encoder_outputs"]["image"])
        return embeds.masked_scatter(placeholders.unsqueeze(-1).expand_as(embeds), visual.to(embeds.dtype))

    def graph_generation_reason(self, length: int | None = None) -> str | None:
        """Never graphs: :data:`EAGER_REASON` (on a CUDA device; elsewhere ChatAdapter's device reason)."""
        if self.device.type != "cuda":
            return super().graph_generation_reason(length)
        return EAGER_REASON

    def _graph_reason(self, inputs: Mapping[str, Any], max_new_tokens: int) -> str | None:
        return self.graph_generation_reason(int(inputs["input_ids"].shape[1]) + max_new_tokens)

    # ------------------------------------------------------------------ probes
    def _vision_probes(self, tokens: ImageTokens, names: set[str]) -> dict[str, Any]:
        raise NotImplementedError(NO_CLS)  # not offered: capabilities holds no vision probe
