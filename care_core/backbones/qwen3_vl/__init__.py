"""The Qwen3-VL family's record: its facts, demos, ``care flops`` specs and lmms-eval id (torch-free).

Sources of the ``care flops`` numbers: Qwen3-VL-8B ``Qwen/Qwen3-VL-8B-Instruct``: **not checked against a stored copy
of the hub file** (none was found). From transformers' ``Qwen3VLVisionConfig`` class defaults (5.21-5.24): vision
depth 27, hidden 1152, intermediate 4304, 16 heads, patch 16, spatial_merge_size 2, temporal_patch_size 2,
deepstack_visual_indexes (8, 16, 24), full attention in every block (no windows), MLP Linear -> GELU -> Linear (not
SwiGLU). Unverified hub values: text L=36, H=4096, I=12288, 32 heads, 8 KV heads, head_dim 128, vocab 151936, vision
out_hidden_size 4096 (the class default is 3584), processor pixel budget 65536..16777216. A real config.json through
``care flops --backbone <folder>`` gives exact dims. Merger ``Qwen3VLVisionPatchMerger``: LayerNorm(1152) ->
view(-1, 4608) -> Linear(4608, 4608) -> GELU -> Linear(4608, out); each deepstack merger is the same MLP after a
LayerNorm(4608).

Its ``care flops`` config reader is here too (:func:`spec_from_config`); the adapter is ``adapter.py``, the demo
builders ``demo.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from care_core.architecture import BackboneSpec, LanguageModelSpec, VisionSpec
from care_core.backbones.common_specs import qwen_merger
from care_core.backbones.families import OPTIONAL_WEIGHTS, BackboneFamily, DemoBackbone, FullSizeModel
from care_core.backbones.qwen2_5_vl import qwen_config, qwen_vit, with_pixel_budget

_DEMO = "care_core.backbones.qwen3_vl.demo"
_QWEN3_GEOMETRY = (
    "Qwen3-VL geometry (patch 16, 2x2 merge, resize factor 32, deepstack at 2 of 4 vision blocks, hub pixel budget)"
)

QWEN3_VIT = VisionSpec(kind="qwen3-vit", layers=27, hidden=1152, intermediate=4304, heads=16, patch_size=16,
                       temporal_patch_size=2, spatial_merge_size=2, full_attention_layers=tuple(range(27)),
                       deepstack_layers=(8, 16, 24), out_hidden=4096)  # fmt: skip
QWEN3_8B = LanguageModelSpec(layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, vocab=151936,
                             head_dim=128)  # fmt: skip
MIN_PIXELS, MAX_PIXELS = 65536, 16777216  # unverified hub budget (see the module docstring)
#: N of a 1024×1024 image and the budgets there (20 % and 10 %: there is no paper setting for Qwen3-VL)
DEFAULT_IMAGE, DEFAULT_TOKENS, BUDGETS = (1024, 1024), 1024, (204, 102)
NOTE = "Qwen3-VL at 1024×1024: a 32×32 merged grid (not a paper setting; budgets 20 % and 10 % of N)"
QWEN3_VL_8B = BackboneSpec(
    "qwen3-vl-8b", "Qwen3-VL-8B", "qwen3-vl", QWEN3_8B, qwen_merger(4096, 1152, kind="qwen3-vl merger"),
    QWEN3_VIT, DEFAULT_TOKENS, f"{NOTE}; text sizes, out_hidden_size and pixel budget unverified", DEFAULT_IMAGE,
    min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, paper_budgets=BUDGETS,
    source="transformers Qwen3VLVisionConfig defaults; text sizes, out_hidden_size and pixel budget "
           "unverified (no stored copy of Qwen/Qwen3-VL-8B-Instruct config.json)",
    aliases=("qwen3-vl-8b-instruct", "qwen/qwen3-vl-8b-instruct", "qwen3vl-8b"),
)  # fmt: skip

FAMILY = BackboneFamily(
    name="qwen3-vl", rank=40, display="Qwen3-VL", model_types=("qwen3_vl",),
    adapter="care_core.backbones.qwen3_vl.adapter:Qwen3VLAdapter", has_cls_token=False, single_grid=True, crops=False,
    flops_spec="qwen3-vl-8b", lmms_eval_model="care_qwen3_vl",
    demos=(
        DemoBackbone("tiny-qwen3-vl", 1, "qwen3-vl", f"{_DEMO}:build_tiny_qwen3_vl",
                     f"{_QWEN3_GEOMETRY}, " + OPTIONAL_WEIGHTS,
                     weights="tiny-qwen3-vl.safetensors", trained_builder=f"{_DEMO}:build_trained_tiny_qwen3_vl"),
        DemoBackbone("tiny-qwen3-vl-random", 1, "qwen3-vl", f"{_DEMO}:build_tiny_qwen3_vl",
                     f"{_QWEN3_GEOMETRY}, tiny random weights; demo only"),
    ),
    flops_specs=(QWEN3_VL_8B,),
    flops_config="care_core.backbones.qwen3_vl:spec_from_config",
    full_size=FullSizeModel(image_side_px=1024, builder=f"{_DEMO}:build_full_size"),
)  # fmt: skip


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
