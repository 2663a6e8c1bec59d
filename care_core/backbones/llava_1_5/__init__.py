"""The LLaVA-1.5 family's record: its facts, demos, ``care flops`` specs and lmms-eval id (torch-free).

Sources of the ``care flops`` numbers (the CLIP tower, Vicuna and the projector: ``care_core.backbones.common_specs``):
- LLaVA-1.5-7B ``llava-hf/llava-1.5-7b-hf/config.json``: Vicuna-7B-v1.5, CLIP-L/14-336, ``vision_feature_layer: -2``,
  ``vision_feature_select_strategy: "default"``, ``projector_hidden_act: "gelu"``.
- LLaVA-1.5-13B ``llava-hf/llava-1.5-13b-hf``: Vicuna-13B-v1.5, the same tower.

Its ``care flops`` config reader is here too (:func:`spec_from_config`); the adapter is ``adapter.py``, the demo
builders ``demo.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from care_core.architecture import (
    BackboneSpec,
    BackboneSpecError,
    LanguageModelSpec,
    ProjectorSpec,
    VisionSpec,
    hidden_state_indices,
)
from care_core.backbones.common_specs import CLIP_L336, VICUNA_7B, VICUNA_13B, llava_projector
from care_core.backbones.config_reading import (
    check_complete,
    hf_config,
    lm_spec,
    missing_named_text,
    missing_vision,
    positive,
)
from care_core.backbones.families import DEFAULT_DEMO, BackboneFamily, DemoBackbone, FullSizeModel

_DEMO = "care_core.backbones.llava_1_5.demo"
_LLAVA_GEOMETRY = "LLaVA-1.5 geometry (CLIP-336/14, 576 tokens)"

#: the paper's budgets (K) at N = 576
PAPER_BUDGETS = (192, 128, 64)
NOTE = "LLaVA-1.5: 576 patch tokens of one 336×336 view, whatever the image size"
LLAVA_15_7B = BackboneSpec(
    "llava-1.5-7b", "LLaVA-1.5-7B", "llava-1.5", VICUNA_7B, llava_projector(4096), CLIP_L336,
    576, NOTE, (336, 336), paper_budgets=PAPER_BUDGETS, paper_key="LLaVA-1.5-7B",
    source="llava-hf/llava-1.5-7b-hf config.json (Vicuna-7B-v1.5 = LlamaConfig defaults)",
    aliases=("llava15", "llava-v1.5-7b", "llava-hf/llava-1.5-7b-hf", "liuhaotian/llava-v1.5-7b"),
)  # fmt: skip
LLAVA_15_13B = BackboneSpec(
    "llava-1.5-13b", "LLaVA-1.5-13B", "llava-1.5", VICUNA_13B, llava_projector(5120), CLIP_L336,
    576, NOTE, (336, 336), paper_budgets=PAPER_BUDGETS,
    source="llava-hf/llava-1.5-13b-hf config.json (Vicuna-13B-v1.5)",
    aliases=("llava-v1.5-13b", "llava-hf/llava-1.5-13b-hf", "liuhaotian/llava-v1.5-13b"),
)  # fmt: skip

FAMILY = BackboneFamily(
    name="llava-1.5", rank=10, display="LLaVA-1.5", model_types=("llava",),
    adapter="care_core.backbones.llava_1_5.adapter:LlavaAdapter", has_cls_token=True, single_grid=True, crops=False,
    flops_spec="llava-1.5-7b", lmms_eval_model="care_llava",
    demos=(
        DemoBackbone(DEFAULT_DEMO, 3, "llava-1.5", f"{_DEMO}:build_trained_tiny_llava",
                     f"{_LLAVA_GEOMETRY}, tiny weights trained on synthetic shapes (scripts/train_demo); demo only",
                     weights="tiny-llava.safetensors"),
        DemoBackbone("tiny-llava-random", 2, "llava-1.5", f"{_DEMO}:build_tiny_llava",
                     f"{_LLAVA_GEOMETRY}, tiny random weights; demo only"),
    ),
    flops_specs=(LLAVA_15_7B, LLAVA_15_13B),
    flops_config="care_core.backbones.llava_1_5:spec_from_config",
    full_size=FullSizeModel(image_side_px=336, builder=f"{_DEMO}:build_full_size"),
)  # fmt: skip


def _read_indices(feature_layer: Any, layers: int, path: Path) -> list[int]:
    """The hidden states a LLaVA config's ``vision_feature_layer`` reads, as indices (none: BackboneSpecError)."""
    try:
        indices = hidden_state_indices(feature_layer, layers)
    except (TypeError, ValueError) as exc:  # not integers, or out of range
        named = f"{path}: vision_feature_layer {feature_layer!r}"
        raise BackboneSpecError(f"{named} does not name hidden states: {exc}") from exc
    if not indices:
        raise BackboneSpecError(f"{path}: vision_feature_layer {feature_layer!r} names no hidden state")
    return indices


def llava_parts(config: Any, lm: LanguageModelSpec, path: Path, kind: str = "clip",
                cls_token: bool = True) -> tuple[VisionSpec, ProjectorSpec]:  # fmt: skip
    """A LLaVA config's vision tower (``kind``; ``cls_token``: whether strategy "full" hands on a CLS) and its
    two-layer projector on the selected feature layers."""
    vc = config.vision_config
    layers = positive(vc.num_hidden_layers, "vision num_hidden_layers", path)
    read = _read_indices(config.vision_feature_layer, layers, path)
    deepest = max(read)  # the encoder runs up to this layer's output (vision_encoder)
    v_hidden = positive(vc.hidden_size, "vision_config.hidden_size", path)
    image, patch = positive(vc.image_size, "image_size", path), positive(vc.patch_size, "patch_size", path)
    full = config.vision_feature_select_strategy == "full"
    per_crop = (image // patch) ** 2 + (1 if full and cls_token else 0)
    vision = VisionSpec(kind=kind, layers=layers, hidden=v_hidden,
                        intermediate=positive(vc.intermediate_size, "vision intermediate", path),
                        heads=positive(vc.num_attention_heads, "vision heads", path), patch_size=patch,
                        image_size=image, feature_tokens=per_crop,
                        layers_run=None if deepest == layers else deepest)  # fmt: skip
    return vision, llava_projector(lm.hidden, token_dim=v_hidden * len(read))


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
