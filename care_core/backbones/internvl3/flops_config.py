"""``care flops`` from an InternVL ``config.json`` (model_type ``internvl``). Torch-free (transformers fills the
config's defaults)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from care_core.architecture import BackboneSpec, VisionSpec
from care_core.backbones.config_reading import PREPROCESSOR, load_json, positive
from care_core.backbones.families import BackboneFamily
from care_core.backbones.llava_1_5.flops_config import llava_config
from care_core.flops.tokens import visual_tokens

from .record import BUDGET_DIVISORS, DEFAULT_IMAGE, MAX_TILES, internvl_projector


def _side(value: Any) -> Any:
    """A size given as one number or as [height, width] (square here): its first number."""
    return value[0] if isinstance(value, (list, tuple)) else value


def with_counted_tokens(spec: BackboneSpec) -> BackboneSpec:
    """N at the default image (tiles + thumbnail at the spec's tile limit) and the budgets as fractions of it."""
    n = visual_tokens(spec, *(spec.default_image or DEFAULT_IMAGE)).tokens
    return replace(spec, default_tokens=n, paper_budgets=tuple(n // d for d in BUDGET_DIVISORS))


def spec_from_config(raw: Mapping[str, Any], path: Path, family: BackboneFamily) -> BackboneSpec:
    """InternViT on square tiles, pixel shuffle by 1 / downsample_ratio, LayerNorm + MLP; the folder's processor
    ``max_patches`` when it has one."""
    config, lm = llava_config(raw, path)  # InternVL states its sizes as the llava-hf configs do
    vc = config.vision_config
    image = positive(int(_side(vc.image_size)), "image_size", path)
    patch = positive(int(_side(vc.patch_size)), "patch_size", path)
    shuffle = round(1 / float(config.downsample_ratio))
    per_tile = (image // patch // shuffle) ** 2
    v_hidden = positive(vc.hidden_size, "vision hidden_size", path)
    vision = VisionSpec(kind="internvit", layers=positive(vc.num_hidden_layers, "vision num_hidden_layers", path),
                        hidden=v_hidden, intermediate=positive(vc.intermediate_size, "vision intermediate", path),
                        heads=positive(vc.num_attention_heads, "vision heads", path), patch_size=patch,
                        image_size=image, feature_tokens=per_tile)  # fmt: skip
    preprocessor, (height, width) = path.parent / PREPROCESSOR, DEFAULT_IMAGE
    tiles = MAX_TILES
    if preprocessor.is_file():
        tiles = positive(load_json(preprocessor).get("max_patches", tiles), "max_patches", preprocessor)
    spec = BackboneSpec(f"config:{path}", f"{family.display} (config)", family.name, lm,
                        internvl_projector(lm.hidden, v_hidden, shuffle), vision, 0,
                        f"InternVL at {height}×{width}: tiles + thumbnail, {per_tile} tokens each", DEFAULT_IMAGE,
                        max_tiles=tiles, source=str(path))  # fmt: skip
    return with_counted_tokens(spec)
