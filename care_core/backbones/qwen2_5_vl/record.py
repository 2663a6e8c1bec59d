"""The Qwen2.5-VL family's record: its facts, demos, ``care flops`` spec and lmms-eval id (torch-free)."""

from __future__ import annotations

from care_core.backbones.families import OPTIONAL_WEIGHTS, BackboneFamily, DemoBackbone, FullSizeModel

_DEMO = "care_core.backbones.qwen2_5_vl.demo"
_QWEN25_GEOMETRY = "Qwen2.5-VL geometry (patch 14, 2x2 merge, window 112, hub pixel budget)"

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
    full_size=FullSizeModel(image_side_px=1008, builder=f"{_DEMO}:build_full_size"),
)  # fmt: skip
