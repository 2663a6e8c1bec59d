"""The Qwen2.5-VL family's record: its facts, demos, ``care flops`` specs and lmms-eval id (torch-free).

Sources of the ``care flops`` numbers (each checked against a stored copy of the hub file):
- Qwen2.5-VL-7B ``Qwen/Qwen2.5-VL-7B-Instruct/config.json``: L=28, H=3584, I=18944, 28 heads, 4 KV heads,
  vocab 152064; ``vision_config``: depth 32, hidden 1280, intermediate 3420, 16 heads, out_hidden_size 3584,
  patch 14, spatial_merge_size 2, window_size 112, fullatt_block_indexes [7, 15, 23, 31], temporal_patch_size 2.
  Merger ``Qwen2_5_VLPatchMerger``: RMSNorm(1280) -> view(-1, 5120) -> Linear(5120, 5120) -> GELU ->
  Linear(5120, out).
- Qwen2.5-VL-3B ``Qwen/Qwen2.5-VL-3B-Instruct/config.json``: L=36, H=2048, I=11008, 16 heads, 2 KV heads,
  vocab 151936, out_hidden_size 2048 (vision tower as the 7B).
- Qwen2.5-VL processor (``preprocessor_config.json``): min_pixels 3136, max_pixels 12845056.

Its ``care flops`` config reader is here too (:func:`spec_from_config`); the adapter is ``adapter.py``, the demo
builders ``demo.py``.
"""

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
from care_core.backbones.families import OPTIONAL_WEIGHTS, BackboneFamily, DemoBackbone, FullSizeModel

_DEMO = "care_core.backbones.qwen2_5_vl.demo"
_QWEN25_GEOMETRY = "Qwen2.5-VL geometry (patch 14, 2x2 merge, window 112, hub pixel budget)"

QWEN_VIT = VisionSpec(kind="qwen2.5-vit", layers=32, hidden=1280, intermediate=3420, heads=16, patch_size=14,
                      temporal_patch_size=2, spatial_merge_size=2, window_size=112,
                      full_attention_layers=(7, 15, 23, 31))  # fmt: skip
QWEN25_3B = LanguageModelSpec(layers=36, hidden=2048, intermediate=11008, heads=16, kv_heads=2, vocab=151936)
QWEN25_7B = LanguageModelSpec(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152064)
MIN_PIXELS, MAX_PIXELS = 3136, 12845056
#: the paper's N (Table S1 caption) and its budgets (K) there
PAPER_TOKENS, PAPER_BUDGETS = 1110, (222, 111)
NOTE = "Qwen2.5-VL: the paper's representative sample of 1110 merged tokens (Table S1 caption)"
QWEN25_VL_3B = BackboneSpec(
    "qwen2.5-vl-3b", "Qwen2.5-VL-3B", "qwen2.5-vl", QWEN25_3B, qwen_merger(2048), QWEN_VIT,
    PAPER_TOKENS, NOTE, None, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, paper_budgets=PAPER_BUDGETS,
    source="Qwen/Qwen2.5-VL-3B-Instruct config.json",
    aliases=("qwen2.5-vl-3b-instruct", "qwen/qwen2.5-vl-3b-instruct", "qwen25-vl-3b"),
)  # fmt: skip
QWEN25_VL_7B = BackboneSpec(
    "qwen2.5-vl-7b", "Qwen2.5-VL-7B", "qwen2.5-vl", QWEN25_7B, qwen_merger(3584), QWEN_VIT,
    PAPER_TOKENS, NOTE, None, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, paper_budgets=PAPER_BUDGETS,
    paper_key="Qwen2.5-VL-7B", source="Qwen/Qwen2.5-VL-7B-Instruct config.json",
    aliases=("qwen2.5-vl-7b-instruct", "qwen/qwen2.5-vl-7b-instruct", "qwen25-vl"),
)  # fmt: skip

FAMILY = BackboneFamily(
    name="qwen2.5-vl", rank=30, display="Qwen2.5-VL", model_types=("qwen2_5_vl",),
    adapter="care_core.backbones.qwen2_5_vl.adapter:Qwen2_5_VLAdapter",
    has_cls_token=False, single_grid=True, crops=False,
    flops_spec="qwen2.5-vl-7b", lmms_eval_model="care_qwen2_5_vl",
    demos=(
        DemoBackbone("tiny-qwen2.5-vl", 1, "qwen2.5-vl", f"{_DEMO}:build_tiny_qwen2_5_vl",
                     f"{_QWEN25_GEOMETRY}, " + OPTIONAL_WEIGHTS,
                     weights="tiny-qwen2.5-vl.safetensors", trained_builder=f"{_DEMO}:build_trained_tiny_qwen2_5_vl"),
        DemoBackbone("tiny-qwen2.5-vl-random", 1, "qwen2.5-vl", f"{_DEMO}:build_tiny_qwen2_5_vl",
                     f"{_QWEN25_GEOMETRY}, tiny random weights; demo only"),
    ),
    flops_specs=(QWEN25_VL_3B, QWEN25_VL_7B),
    flops_config="care_core.backbones.qwen2_5_vl:spec_from_config",
    full_size=FullSizeModel(image_side_px=1008, builder=f"{_DEMO}:build_full_size"),
)  # fmt: skip


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
