"""LLaVA-1.5 (`LlavaForConditionalGeneration`, transformers 5.24) seen through :class:`VLMAdapter`.

Visual tokens: the 576 patch tokens of CLIP layer ``config.vision_feature_layer`` (-2) with the CLS
token dropped (strategy ``"default"``), exactly what the model hands its projector. The HF CLIP
processor resizes the shortest edge to 336 and centre-crops 336x336, so for a non-square image the
24x24 grid covers only the central square; ``ImageTokens.boxes`` / ``seen_box`` say so in original
pixels (see :mod:`care_core.backbones.geometry` for the exact rounding).

`transformers` is imported lazily (inside functions) so that ``import care_core`` stays fast.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from ..errors import MethodError, ModelLoadError, QuestionError
from ._hf import quiet_transformers
from .base import ImageTokens, VLMAdapter
from .geometry import clip_boxes, crop_geometry, grid_crop_boxes, grid_positions
from .probes import (
    DEFAULT_PROBE_QUESTION,
    VISION_PROBES,
    LanguageModelRun,
    attention_implementation,
    clip_vision_probes,
)

LLAVA15_FALLBACK_PROMPT = "USER: {image}\n{question} ASSISTANT:"


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    """The `LlavaModel` (5.x: ``model.model``); 4.x kept the parts on the top-level module."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "multi_modal_projector"):
        return inner
    return model


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB as the HF processors make it (``convert_to_rgb``): transparency composited on white."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


class LlavaAdapter(VLMAdapter):
    """Adapter for LLaVA-1.5 checkpoints (``model_type == "llava"``)."""

    family = "llava-1.5"
    model_types = ("llava",)

    def __init__(self, model: torch.nn.Module, processor: Any, *, name: str, is_demo: bool = False) -> None:
        self.model = model
        self.processor = processor
        self.name = name
        self.is_demo = is_demo
        cfg = model.config
        strategy = getattr(cfg, "vision_feature_select_strategy", "default")
        if strategy != "default":
            raise ModelLoadError(
                f"{name}: vision_feature_select_strategy {strategy!r} is not supported (only 'default')"
            )
        for attr in ("tokenizer", "image_processor"):
            if getattr(processor, attr, None) is None:
                raise ModelLoadError(f"{name}: the processor has no {attr}; the model folder is incomplete")
        self._fix_processor()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_folder(
        cls,
        folder: Path,
        *,
        name: str,
        is_demo: bool = False,
        device: torch.device,
        dtype: torch.dtype | str,
    ) -> LlavaAdapter:
        """Load model + processor from a local folder (never the network). Errors propagate raw."""
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        kwargs: dict[str, Any] = {"local_files_only": True, "dtype": dtype}
        if device.type != "cpu":
            kwargs["device_map"] = device
        with quiet_transformers():
            try:
                processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
            except Exception as exc:
                detail = " ".join(str(exc).split()).split(". ")[0]
                raise ModelLoadError(
                    f"cannot load the processor (tokenizer, image processor config) from {folder}: "
                    f"{type(exc).__name__}: {detail}"
                ) from exc
            model = LlavaForConditionalGeneration.from_pretrained(str(folder), **kwargs)
            model = model.to(device).eval()
            model.requires_grad_(False)
        return cls(model, processor, name=name, is_demo=is_demo)

    def _fix_processor(self) -> None:
        """Make the processor agree with the model (placeholder count, patch size, image token)."""
        cfg = self.model.config
        proc = self.processor
        vt = self._vision_tower
        if getattr(proc, "patch_size", None) is None:
            proc.patch_size = cfg.vision_config.patch_size
        if getattr(proc, "vision_feature_select_strategy", None) is None:
            proc.vision_feature_select_strategy = cfg.vision_feature_select_strategy
        # CLIP prepends a CLS token; with strategy "default" the processor must count it (and then
        # drop it) or it emits 575 placeholders for 576 features. A hub checkpoint may say 0.
        embeddings = getattr(vt, "embeddings", None)
        if embeddings is None:  # 4.x layout: CLIPVisionModel.vision_model.embeddings
            embeddings = getattr(getattr(vt, "vision_model", None), "embeddings", None)
        has_cls = embeddings is not None and hasattr(embeddings, "class_embedding")
        proc.num_additional_image_tokens = 1 if has_cls else 0
        tok = proc.tokenizer
        image_token_id = getattr(cfg, "image_token_id", None)
        if image_token_id is None:
            image_token_id = cfg.image_token_index
        self.image_token_id = int(image_token_id)
        image_token = tok.convert_ids_to_tokens(self.image_token_id)
        if not isinstance(image_token, str) or not image_token:
            raise ModelLoadError(f"{self.name}: the tokenizer has no token for image_token_id {image_token_id}")
        self.image_token = image_token

    # ------------------------------------------------------------------ modules
    @property
    def _vision_tower(self) -> torch.nn.Module:
        return _inner(self.model).vision_tower

    @property
    def projector(self) -> torch.nn.Module:
        return _inner(self.model).multi_modal_projector

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer

    @property
    def num_image_tokens(self) -> int:
        vc = self.model.config.vision_config
        return (vc.image_size // vc.patch_size) ** 2

    # ------------------------------------------------------------------ vision
    def encode_image(self, image: Image.Image) -> ImageTokens:
        """576 pre-projector tokens of ``image`` and their geometry.

        ``features`` (N, d_v) are on the model's device in its dtype; ``positions`` (N, 2) float32 on
        the same device, ``((row + 0.5) / 24, (col + 0.5) / 24)``; ``boxes`` (N, 4) float32 on the CPU,
        each patch's footprint in original pixels; ``model_inputs`` holds the processor's
        ``pixel_values`` (CPU), ``image_size`` and the :class:`CropGeometry`.
        """
        if not isinstance(image, Image.Image):
            raise TypeError(f"expected a PIL image, got {type(image).__name__}")
        image = _to_rgb(image)
        width, height = image.size
        ip = self.processor.image_processor
        with quiet_transformers():
            pixel_values = ip(images=image, return_tensors="pt")["pixel_values"]
        vt = self._vision_tower
        vparam = next(vt.parameters())
        pv = pixel_values.to(device=vparam.device, dtype=vparam.dtype)
        cfg = self.model.config
        layer = cfg.vision_feature_layer
        with torch.no_grad(), quiet_transformers():
            out = vt(pixel_values=pv, output_hidden_states=layer, return_dict=True)
        layers = [layer] if isinstance(layer, int) else list(layer)
        # strategy "default": drop CLS; several layers are concatenated along the feature axis
        features = torch.cat([out.hidden_states[i][0, 1:] for i in layers], dim=-1)

        patch = int(cfg.vision_config.patch_size)
        crop_h, crop_w = int(pixel_values.shape[-2]), int(pixel_values.shape[-1])
        rows, cols = crop_h // patch, crop_w // patch
        if rows * cols != features.shape[0]:
            raise RuntimeError(
                f"vision tower gave {features.shape[0]} patch tokens for a {crop_h}x{crop_w} input "
                f"with patch {patch} ({rows}x{cols} expected)"
            )
        geom = crop_geometry(height, width, ip, (crop_h, crop_w))
        boxes = clip_boxes(geom.crop_to_original(grid_crop_boxes(rows, cols, patch)), height, width)
        positions = grid_positions(rows, cols).to(device=features.device, dtype=torch.float32)
        return ImageTokens(
            features=features,
            positions=positions,
            boxes=boxes.to(torch.float32),
            image_size=(height, width),
            seen_box=geom.seen_box(),
            grid=(rows, cols),
            model_inputs={"pixel_values": pixel_values, "image_size": (height, width), "crop_geometry": geom},
        )

    # ------------------------------------------------------------------ text
    def question_embeddings(self, question: str) -> torch.Tensor:
        tok = self.tokenizer
        ids: list[int] = []
        if question.strip():
            ids = tok(question, add_special_tokens=False)["input_ids"]
        drop = {int(i) for i in tok.all_special_ids} | {self.image_token_id}
        keep = [int(i) for i in ids if int(i) not in drop]
        if not keep:
            raise QuestionError(f'question "{question}" has no tokens the language model can embed')
        emb = self.model.get_input_embeddings()
        with torch.no_grad():
            return emb(torch.tensor(keep, dtype=torch.long, device=emb.weight.device))

    def prompt(self, question: str) -> str:
        """The model's chat prompt for one image + ``question`` (one image placeholder)."""
        question = question.replace(self.image_token, "")
        conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        for owner in (self.processor, self.tokenizer):
            if not getattr(owner, "chat_template", None):
                continue
            try:
                with quiet_transformers():
                    text = owner.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            except Exception:
                continue
            if isinstance(text, list):
                text = text[0] if len(text) == 1 else None
            if isinstance(text, str) and text.count(self.image_token) == 1:
                return text
        return LLAVA15_FALLBACK_PROMPT.format(image=self.image_token, question=question)

    def _encode_prompt(self, question: str, k: int) -> dict[str, torch.Tensor]:
        """Tokenise the prompt with exactly ``k`` image placeholders (no processor expansion)."""
        head, tail = self.prompt(question).split(self.image_token, 1)
        text = head + self.image_token * k + tail
        enc = self.tokenizer(text, return_tensors="pt")
        n = int((enc["input_ids"] == self.image_token_id).sum())
        if n != k:
            raise RuntimeError(f"prompt tokenised to {n} image placeholders, expected {k}")
        return {key: enc[key].to(self.device) for key in ("input_ids", "attention_mask")}

    def _mm_inputs(self, projected: torch.Tensor) -> dict[str, Any]:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        hidden = self.model.config.text_config.hidden_size
        if projected.dim() != 2 or projected.shape[0] < 1 or projected.shape[1] != hidden:
            raise ValueError(f"projected must be (K >= 1, {hidden}); got {tuple(projected.shape)}")
        emb = self.model.get_input_embeddings().weight
        projected = projected.detach().to(device=emb.device, dtype=emb.dtype)
        return {"image": BaseModelOutputWithPooling(pooler_output=[projected])}

    def language_model_logits(self, question: str, tokens: ImageTokens, projected: torch.Tensor) -> torch.Tensor:
        mm = self._mm_inputs(projected)
        enc = self._encode_prompt(question, int(projected.shape[0]))
        with torch.no_grad(), quiet_transformers():
            out = self.model(**enc, mm_encoder_outputs=mm)
        return out.logits[0]

    def generate(self, question: str, tokens: ImageTokens, projected: torch.Tensor, max_new_tokens: int = 32) -> str:
        mm = self._mm_inputs(projected)
        enc = self._encode_prompt(question, int(projected.shape[0]))
        if max_new_tokens < 1:
            return ""
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        with torch.no_grad(), quiet_transformers():
            out = self.model.generate(
                **enc,
                mm_encoder_outputs=mm,
                max_new_tokens=int(max_new_tokens),
                do_sample=False,
                num_beams=1,
                pad_token_id=pad,
            )
        new = out[0, enc["input_ids"].shape[1] :]
        return tok.decode(new, skip_special_tokens=True).strip()

    # ------------------------------------------------------------------ probes
    def probe_inputs(self, tokens: ImageTokens, names: Iterable[str], question: str | None = None) -> dict[str, Any]:
        """The requested probes (see ``care_core.methods.base.PROBES``) for the image of ``tokens``.

        Vision probes (``cls_attention``, ``attention_logits``, ``keys``, ``hidden_with_cls``,
        ``last_layer_qk``) come from one pass of the vision tower over ``tokens.model_inputs
        ["pixel_values"]``, stopped as soon as the last hooked value is captured; the tower keeps its
        attention implementation (see :func:`~care_core.backbones.probes.clip_vision_probes` for shapes
        and dtypes). ``question`` is :meth:`question_embeddings`; ``language_model`` is a
        :class:`~care_core.backbones.probes.LanguageModelRun` on the prompt with ``question`` (or
        "Describe the image.") and all N projected visual tokens, fed like :meth:`language_model_logits`.
        """
        from ..methods.base import PROBES

        wanted = list(dict.fromkeys(names))
        unknown = [n for n in wanted if n not in PROBES]
        if unknown:
            raise MethodError(f"unknown probe(s) {unknown}; known: {sorted(PROBES)}")
        if "question" in wanted and question is None:
            raise QuestionError("the 'question' probe needs a question")
        out: dict[str, Any] = {}
        vision = {n for n in wanted if n in VISION_PROBES}
        if vision:
            pixel_values = tokens.model_inputs.get("pixel_values")
            if pixel_values is None:
                raise ValueError("tokens.model_inputs has no pixel_values; use ImageTokens from encode_image")
            layer = self.model.config.vision_feature_layer
            out.update(clip_vision_probes(self._vision_tower, pixel_values, layer, vision))
        if "question" in wanted:
            out["question"] = self.question_embeddings(question)  # type: ignore[arg-type]
        if "language_model" in wanted:
            out["language_model"] = self.language_model_probe(tokens, question)
        return {n: out[n] for n in wanted}

    def language_model_probe(self, tokens: ImageTokens, question: str | None = None) -> LanguageModelRun:
        """A LanguageModelProbe on the prompt with ``question`` and all N projected visual tokens."""
        if question is None or not question.strip():
            question = DEFAULT_PROBE_QUESTION
        with torch.no_grad():
            projected = self.projector(tokens.features)
        mm = self._mm_inputs(projected)
        enc = self._encode_prompt(question, int(projected.shape[0]))
        model = self.model
        language_model = _inner(model).language_model
        image_token_id = self.image_token_id
        visual = mm["image"].pooler_output[0]

        def forward() -> Any:
            return model(**enc, mm_encoder_outputs=mm, use_cache=False)

        def embeddings() -> torch.Tensor:
            ids = enc["input_ids"]
            embeds = model.get_input_embeddings()(ids)
            mask = (ids == image_token_id).unsqueeze(-1).expand_as(embeds)
            return embeds.masked_scatter(mask, visual.to(embeds.dtype))[0]

        return LanguageModelRun(
            forward=forward,
            input_ids=enc["input_ids"],
            image_token_id=image_token_id,
            embeddings=embeddings,
            attention_modules=[layer.self_attn for layer in language_model.layers],
            eager=lambda: attention_implementation(model, {"text_config": "eager"}),
        )
