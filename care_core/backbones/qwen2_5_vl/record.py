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
"""

from __future__ import annotations

from care_core.architecture import BackboneSpec, LanguageModelSpec, VisionSpec
from care_core.backbones.common_specs import qwen_merger
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
    flops_config="care_core.backbones.qwen2_5_vl.flops_config:spec_from_config",
    full_size=FullSizeModel(image_side_px=1008, builder=f"{_DEMO}:build_full_size"),
)  # fmt: skip
