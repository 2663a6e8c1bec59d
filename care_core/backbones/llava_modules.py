"""The parts of a transformers LLaVA-family model (LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision) that their adapters read:
where the model keeps its tower, projector and language model, what the tower hands the projector, and the processor
settings the model implies. Plain functions each of those adapters calls or assigns (composition,
not a shared parent class)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ModelLoadError
from ..kernels.dispatch import KernelGate
from ._hf import quiet_transformers
from .chat_adapter import ChatAdapter
from .probes import clip_encoder_layers
from .vision_encoder import encoder_hidden_states, fast_quick_gelus

#: rows of a CLIP tower's output before its patch tokens: the CLS, which strategy "default" drops
CLIP_PATCH_START = 1
#: SigLIP (LLaVA-OneVision) has no CLS row: strategy "full" keeps every row
SIGLIP_PATCH_START = 0


def llava_inner(model: Any) -> Any:
    """The `LlavaModel` (5.x: ``model.model``); 4.x kept the parts on the top-level module."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "multi_modal_projector"):
        return inner
    return model


def crop_tokens(vision_config: Any) -> int:
    """Patch tokens of one crop at the tower's input size: ``(image_size // patch_size) ** 2``."""
    return int((vision_config.image_size // vision_config.patch_size) ** 2)


def llava_vision_tower(adapter: ChatAdapter) -> torch.nn.Module:
    """The adapter's vision tower (``vision_tower`` of :func:`llava_inner`)."""
    return llava_inner(adapter.model).vision_tower


def llava_projector(adapter: ChatAdapter) -> torch.nn.Module:
    """The adapter's per-token projector (``multi_modal_projector`` of :func:`llava_inner`)."""
    return llava_inner(adapter.model).multi_modal_projector


def llava_language_model(adapter: ChatAdapter) -> torch.nn.Module:
    """The decoder the language-model probe hooks (``language_model`` of :func:`llava_inner`)."""
    return llava_inner(adapter.model).language_model


def adapter_crop_tokens(adapter: ChatAdapter) -> int:
    """Patch tokens of one crop of the adapter's model (:func:`crop_tokens` of its vision config)."""
    return crop_tokens(adapter.model.config.vision_config)


def check_feature_strategy(config: Any, name: str, supported: str) -> str:
    """The model's ``vision_feature_select_strategy`` (``supported`` when unset); ModelLoadError for another one, since
    the adapter's tokens are exactly the rows that one strategy hands the projector."""
    strategy = getattr(config, "vision_feature_select_strategy", supported)
    if strategy != supported:
        raise ModelLoadError(f"{name}: vision_feature_select_strategy {strategy!r} is not supported (only "
                             f"'{supported}')")  # fmt: skip
    return str(strategy)


def align_clip_processor(processor: Any, model: Any) -> None:
    """Make a CLIP-tower processor agree with the model: its patch size, feature strategy and CLS count (which set the
    number of placeholders it writes)."""
    cfg = model.config
    if getattr(processor, "patch_size", None) is None:
        processor.patch_size = cfg.vision_config.patch_size
    if getattr(processor, "vision_feature_select_strategy", None) is None:
        processor.vision_feature_select_strategy = cfg.vision_feature_select_strategy
    # CLIP prepends a CLS token; with strategy "default" the processor must count it (and then
    # drop it) or it emits 575 placeholders for 576 features. A hub checkpoint may say 0.
    tower = llava_inner(model).vision_tower
    embeddings = getattr(tower, "embeddings", None)
    if embeddings is None:  # 4.x layout: CLIPVisionModel.vision_model.embeddings
        embeddings = getattr(getattr(tower, "vision_model", None), "embeddings", None)
    has_cls = embeddings is not None and hasattr(embeddings, "class_embedding")
    processor.num_additional_image_tokens = 1 if has_cls else 0


def check_clip_llava(adapter: ChatAdapter, model: Any, processor: Any, name: str) -> None:
    """What a CLIP-tower LLaVA adapter's constructor checks first (LLaVA-1.5, LLaVA-NeXT): the "default" feature
    strategy, the processor's parts and their settings made to agree with the model, and the image token."""
    check_feature_strategy(model.config, name, "default")
    adapter._check_processor(processor, name)
    align_clip_processor(processor, model)
    adapter._set_image_token(llava_image_token_id(model.config))


def llava_image_token_id(config: Any) -> int | None:
    """The image placeholder's id: ``image_token_id`` (5.x) or ``image_token_index`` (4.x configs); None if neither."""
    image_token_id = getattr(config, "image_token_id", None)
    if image_token_id is None:
        image_token_id = getattr(config, "image_token_index", None)
    return image_token_id


def patch_features(model: Any, pixel_values: torch.Tensor, patch_start: int, gate: KernelGate) -> torch.Tensor:
    """(crops, P, d_v): the tower's patch tokens of layer ``vision_feature_layer`` (several layers concatenated along
    the feature axis), the rows before ``patch_start`` dropped: what the model hands its projector. The encoder stops
    after the deepest layer read, and runs CLIP's QuickGELU by care's kernel where it may (``gate``: the adapter's;
    :mod:`care_core.backbones.vision_encoder`). Gradients flow where enabled (training)."""
    tower = llava_inner(model).vision_tower
    vparam = next(tower.parameters())
    pixels = pixel_values.to(device=vparam.device, dtype=vparam.dtype)
    layers = clip_encoder_layers(tower)
    with quiet_transformers(), fast_quick_gelus(layers, vparam.device, gate):
        states = encoder_hidden_states(tower, pixels, model.config.vision_feature_layer, layers)
    return torch.cat([state[:, patch_start:] for state in states], dim=-1)
