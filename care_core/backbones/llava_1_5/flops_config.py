"""``care flops`` from a LLaVA-1.5 ``config.json`` (model_type ``llava``), and the LLaVA tower and projector the
LLaVA-NeXT and LLaVA-OneVision readers share. Torch-free (transformers fills the config's defaults)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from care_core.architecture import BackboneSpec, LanguageModelSpec, ProjectorSpec, VisionSpec
from care_core.backbones.common_specs import llava_projector
from care_core.backbones.config_reading import (
    check_complete,
    hf_config,
    lm_spec,
    missing_named_text,
    missing_vision,
    positive,
)
from care_core.backbones.families import BackboneFamily

from .record import PAPER_BUDGETS


def llava_parts(config: Any, lm: LanguageModelSpec, path: Path, kind: str = "clip",
                cls_token: bool = True) -> tuple[VisionSpec, ProjectorSpec]:  # fmt: skip
    """A LLaVA config's vision tower (``kind``; ``cls_token``: whether strategy "full" hands on a CLS) and its
    two-layer projector on the selected feature layers."""
    feature_layer = config.vision_feature_layer
    n_layers = len(feature_layer) if isinstance(feature_layer, (list, tuple)) else 1
    vc = config.vision_config
    v_hidden = positive(vc.hidden_size, "vision_config.hidden_size", path)
    image, patch = positive(vc.image_size, "image_size", path), positive(vc.patch_size, "patch_size", path)
    full = config.vision_feature_select_strategy == "full"
    per_crop = (image // patch) ** 2 + (1 if full and cls_token else 0)
    vision = VisionSpec(kind=kind, layers=positive(vc.num_hidden_layers, "vision num_hidden_layers", path),
                        hidden=v_hidden, intermediate=positive(vc.intermediate_size, "vision intermediate", path),
                        heads=positive(vc.num_attention_heads, "vision heads", path), patch_size=patch,
                        image_size=image, feature_tokens=per_crop)  # fmt: skip
    return vision, llava_projector(lm.hidden, token_dim=v_hidden * n_layers)


def llava_config(raw: Mapping[str, Any], path: Path) -> tuple[Any, LanguageModelSpec]:
    """A LLaVA-style config checked for the sizes it must state, read by transformers, and its language model."""
    check_complete(raw, path, missing_vision(raw) + missing_named_text(raw))
    config = hf_config(raw, path)
    return config, lm_spec(config.text_config, path)


def spec_from_config(raw: Mapping[str, Any], path: Path, family: BackboneFamily) -> BackboneSpec:
    """One fixed view of the CLIP tower: N = its patch tokens, the paper's budgets."""
    config, lm = llava_config(raw, path)
    vision, projector = llava_parts(config, lm, path)
    image, per_crop = vision.image_size, vision.feature_tokens
    return BackboneSpec(f"config:{path}", f"{family.display} (config)", family.name, lm, projector, vision, per_crop,
                        f"one {image}×{image} view: {per_crop} tokens", (image, image), paper_budgets=PAPER_BUDGETS,
                        source=str(path))  # fmt: skip
