"""The LLaVA-1.5 family's record: its facts, demos, ``care flops`` spec and lmms-eval id (torch-free)."""

from __future__ import annotations

from care_core.backbones.families import DEFAULT_DEMO, BackboneFamily, DemoBackbone, FullSizeModel

_DEMO = "care_core.backbones.llava_1_5.demo"
_LLAVA_GEOMETRY = "LLaVA-1.5 geometry (CLIP-336/14, 576 tokens)"

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
    full_size=FullSizeModel(image_side_px=336, builder=f"{_DEMO}:build_full_size"),
)  # fmt: skip
