"""The InternVL3 family's record: its facts, demos, ``care flops`` specs and lmms-eval id (torch-free).

Sources of the ``care flops`` numbers: InternVL3-8B (``OpenGVLab/InternVL3-8B-hf``; **no hub file was checked**: the
numbers are the published model card's architecture -- InternViT-300M-448px-V2.5 + Qwen2.5-7B -- and transformers'
``InternVLVisionConfig`` / ``InternVLConfig`` defaults, which are InternViT-300M's): vision 24 layers, hidden 1024,
MLP 4096, 16 heads, image 448, patch 14, CLS, ``downsample_ratio`` 0.5 (pixel shuffle: 256 tokens of 4096 channels
per tile), ``vision_feature_layer`` -1; LM Qwen2.5-7B: L=28, H=3584, I=18944, 28 heads, 4 KV heads; vocab 151674
(unverified: the InternVL3 tokenizer's size; the LM head term alone depends on it). Projector
``InternVLMultiModalProjector``: LayerNorm(4096) -> Linear(4096, 3584) -> GELU -> Linear(3584, 3584). Tiles: the
``GotOcr2ImageProcessor`` class defaults min_patches 1, max_patches 12 (the hub's ``max_patches`` unverified).

Its ``care flops`` config reader is here too (:func:`spec_from_config`); the adapter is ``adapter.py``, the demo
builders ``demo.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from care_core.architecture import BackboneSpec, LanguageModelSpec, ProjectorSpec, VisionSpec
from care_core.backbones.config_reading import PREPROCESSOR, load_json, positive
from care_core.backbones.families import OPTIONAL_WEIGHTS, BackboneFamily, DemoBackbone, FullSizeModel
from care_core.backbones.llava_1_5 import llava_config
from care_core.flops.tokens import visual_tokens

_DEMO = "care_core.backbones.internvl3.demo"
_INTERNVL_GEOMETRY = (
    "InternVL3 geometry (InternViT 448/14, pixel shuffle 0.5: 256 tokens per tile, 1-12 tiles + thumbnail)"
)


def internvl_projector(hidden: int, vit_hidden: int = 1024, shuffle: int = 2) -> ProjectorSpec:
    """InternVL's LayerNorm + MLP on ``shuffle``² pixel-shuffled InternViT features."""
    width = vit_hidden * shuffle * shuffle
    return ProjectorSpec(kind="internvl ln+mlp", token_dim=width, linears=((width, hidden), (hidden, hidden)),
                         layer_norm=width, norm_blocks=1, norm_shift=True)  # fmt: skip


INTERNVIT_300M = VisionSpec(kind="internvit", layers=24, hidden=1024, intermediate=4096, heads=16, patch_size=14,
                            image_size=448, feature_tokens=256)  # fmt: skip
INTERNVL3_8B_LM = LanguageModelSpec(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=151674)
MAX_TILES = 12
#: the image N is counted at (2×2 tiles + thumbnail) and the budgets' fractions of it (not a paper backbone)
DEFAULT_IMAGE, BUDGET_DIVISORS = (672, 672), (5, 10, 20)
INTERNVL3_8B = BackboneSpec(
    "internvl3-8b", "InternVL3-8B", "internvl3", INTERNVL3_8B_LM, internvl_projector(3584), INTERNVIT_300M,
    1280, "InternVL3 at 672×672: 2×2 tiles + thumbnail, 256 pixel-shuffled tokens each (not a paper backbone)",
    DEFAULT_IMAGE, max_tiles=MAX_TILES, paper_budgets=tuple(1280 // d for d in BUDGET_DIVISORS),
    source="OpenGVLab/InternVL3-8B-hf architecture (model card) + transformers InternVL config defaults; "
    "no hub config.json checked",
    aliases=("internvl3-8b-hf", "opengvlab/internvl3-8b-hf", "opengvlab/internvl3-8b"),
)  # fmt: skip

FAMILY = BackboneFamily(
    name="internvl3", rank=50, display="InternVL3", model_types=("internvl",),
    adapter="care_core.backbones.internvl3.adapter:InternVLAdapter", has_cls_token=False, single_grid=False, crops=True,
    flops_spec="internvl3-8b", lmms_eval_model="care_internvl",
    demos=(
        DemoBackbone("tiny-internvl3", 1, "internvl3", f"{_DEMO}:build_tiny_internvl3",
                     f"{_INTERNVL_GEOMETRY}, " + OPTIONAL_WEIGHTS,
                     weights="tiny-internvl3.safetensors", trained_builder=f"{_DEMO}:build_trained_tiny_internvl3"),
        DemoBackbone("tiny-internvl3-random", 1, "internvl3", f"{_DEMO}:build_tiny_internvl3",
                     f"{_INTERNVL_GEOMETRY}, tiny random weights; demo only"),
    ),
    flops_specs=(INTERNVL3_8B,),
    flops_config="care_core.backbones.internvl3:spec_from_config",
    lmms_eval_aliases=("care_internvl3",),
    full_size=FullSizeModel(image_side_px=672, builder=f"{_DEMO}:build_full_size"),
)  # fmt: skip


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
