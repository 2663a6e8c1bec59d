"""``care flops`` from a Qwen3-VL ``config.json`` (model_type ``qwen3_vl``). Torch-free (transformers fills the
config's defaults)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from care_core.architecture import BackboneSpec, VisionSpec
from care_core.backbones.common_specs import qwen_merger
from care_core.backbones.families import BackboneFamily
from care_core.backbones.qwen2_5_vl.flops_config import qwen_config, qwen_vit, with_pixel_budget

from .record import BUDGETS, DEFAULT_IMAGE, DEFAULT_TOKENS, MAX_PIXELS, MIN_PIXELS, NOTE


def spec_from_config(raw: Mapping[str, Any], path: Path, family: BackboneFamily) -> BackboneSpec:
    """The full-attention ViT with deepstack mergers on one merged grid; N at a 1024×1024 image."""
    config, lm = qwen_config(raw, path)
    vit, out = qwen_vit(config, path)
    deepstack = tuple(int(i) for i in config.vision_config.deepstack_visual_indexes)
    vision = VisionSpec(kind="qwen3-vit", full_attention_layers=tuple(range(vit["layers"])), out_hidden=out,
                        deepstack_layers=deepstack, **vit)  # fmt: skip
    projector = qwen_merger(out, vision.hidden, vision.spatial_merge_size, kind="qwen3-vl merger")
    spec = BackboneSpec(f"config:{path}", f"{family.display} (config)", family.name, lm, projector, vision,
                        DEFAULT_TOKENS, NOTE, DEFAULT_IMAGE, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                        paper_budgets=BUDGETS, source=str(path))  # fmt: skip
    return with_pixel_budget(spec, path)
