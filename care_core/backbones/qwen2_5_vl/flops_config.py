"""``care flops`` from a Qwen2.5-VL ``config.json`` (model_type ``qwen2_5_vl``), and the ViT dims and pixel budget
the Qwen3-VL reader shares. Torch-free (transformers fills the config's defaults)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from care_core.architecture import BackboneSpec, LanguageModelSpec, VisionSpec
from care_core.backbones.common_specs import qwen_merger
from care_core.backbones.config_reading import (
    PREPROCESSOR,
    check_complete,
    hf_config,
    lm_spec,
    load_json,
    missing_text_sizes,
    missing_vision,
    positive,
)
from care_core.backbones.families import BackboneFamily

from .record import MAX_PIXELS, MIN_PIXELS, NOTE, PAPER_BUDGETS, PAPER_TOKENS


def qwen_config(raw: Mapping[str, Any], path: Path) -> tuple[Any, LanguageModelSpec]:
    """A Qwen-style config (text sizes in text_config or at the top) checked, read by transformers, and its LM."""
    check_complete(raw, path, missing_vision(raw, ()) + missing_text_sizes(raw))
    config = hf_config(raw, path)
    return config, lm_spec(config.text_config, path)


def qwen_vit(config: Any, path: Path) -> tuple[dict[str, Any], int]:
    """The Qwen ViT's dims both generations share, as VisionSpec keywords, and the merger's output width."""
    vc = config.vision_config
    merge = positive(vc.spatial_merge_size, "spatial_merge_size", path)
    v_hidden = positive(vc.hidden_size, "vision hidden_size", path)
    out = positive(vc.out_hidden_size, "out_hidden_size", path)
    depth = positive(vc.depth, "vision depth", path)
    shared: dict[str, Any] = {"layers": depth, "hidden": v_hidden, "spatial_merge_size": merge,
              "intermediate": positive(vc.intermediate_size, "vision intermediate_size", path),
              "heads": positive(vc.num_heads, "vision num_heads", path),
              "patch_size": positive(vc.patch_size, "vision patch_size", path),
              "in_channels": getattr(vc, "in_channels", 3) or 3,
              "temporal_patch_size": getattr(vc, "temporal_patch_size", 2) or 2}  # fmt: skip
    return shared, out


def with_pixel_budget(spec: BackboneSpec, path: Path) -> BackboneSpec:
    """Use the folder's processor pixel limits when it has them (min/max_pixels or size.{shortest,longest}_edge)."""
    preprocessor = path.parent / PREPROCESSOR
    if not preprocessor.is_file():
        return spec
    data = load_json(preprocessor)
    raw_size = data.get("size")
    size: dict[str, Any] = raw_size if isinstance(raw_size, dict) else {}
    low = data.get("min_pixels", size.get("shortest_edge", spec.min_pixels))
    high = data.get("max_pixels", size.get("longest_edge", spec.max_pixels))
    return replace(spec, min_pixels=positive(low, "min_pixels", preprocessor),
                   max_pixels=positive(high, "max_pixels", preprocessor))  # fmt: skip


def spec_from_config(raw: Mapping[str, Any], path: Path, family: BackboneFamily) -> BackboneSpec:
    """The windowed ViT on one merged grid within the processor's pixel budget; the paper's N and budgets."""
    config, lm = qwen_config(raw, path)
    vit, out = qwen_vit(config, path)
    vc = config.vision_config
    vision = VisionSpec(kind="qwen2.5-vit", window_size=getattr(vc, "window_size", 112) or 112,
                        full_attention_layers=tuple(getattr(vc, "fullatt_block_indexes", ()) or ()), **vit)  # fmt: skip
    projector = qwen_merger(out, vision.hidden, vision.spatial_merge_size)
    spec = BackboneSpec(f"config:{path}", f"{family.display} (config)", family.name, lm, projector, vision,
                        PAPER_TOKENS, NOTE, None, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                        paper_budgets=PAPER_BUDGETS, source=str(path))  # fmt: skip
    return with_pixel_budget(spec, path)
