"""The Qwen3-VL family's record: its facts, demos, ``care flops`` spec and lmms-eval id (torch-free)."""

from __future__ import annotations

from care_core.backbones.families import OPTIONAL_WEIGHTS, BackboneFamily, DemoBackbone, FullSizeModel

_DEMO = "care_core.backbones.qwen3_vl.demo"
_QWEN3_GEOMETRY = (
    "Qwen3-VL geometry (patch 16, 2x2 merge, resize factor 32, deepstack at 2 of 4 vision blocks, hub pixel budget)"
)

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
    full_size=FullSizeModel(image_side_px=1024, builder=f"{_DEMO}:build_full_size"),
)  # fmt: skip
