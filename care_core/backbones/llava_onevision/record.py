"""The LLaVA-OneVision family's record: its facts, demos, ``care flops`` spec and lmms-eval id (torch-free)."""

from __future__ import annotations

from care_core.backbones.families import OPTIONAL_WEIGHTS, BackboneFamily, DemoBackbone, FullSizeModel

_DEMO = "care_core.backbones.llava_onevision.demo"
_ONEVISION_GEOMETRY = "LLaVA-OneVision geometry (SigLIP-384/14, no CLS, anyres_max_9 pinpoints, 3645 tokens at 768x768)"

FAMILY = BackboneFamily(
    name="llava-onevision", rank=60, display="LLaVA-OneVision", model_types=("llava_onevision",),
    adapter="care_core.backbones.llava_onevision.adapter:LlavaOnevisionAdapter", has_cls_token=False, single_grid=False,
    crops=True, flops_spec="llava-onevision-7b", lmms_eval_model="care_llava",
    demos=(
        DemoBackbone("tiny-llava-onevision", 1, "llava-onevision", f"{_DEMO}:build_tiny_llava_onevision",
                     f"{_ONEVISION_GEOMETRY}, " + OPTIONAL_WEIGHTS, weights="tiny-llava-onevision.safetensors",
                     trained_builder=f"{_DEMO}:build_trained_tiny_llava_onevision"),
        DemoBackbone("tiny-llava-onevision-random", 1, "llava-onevision", f"{_DEMO}:build_tiny_llava_onevision",
                     f"{_ONEVISION_GEOMETRY}, tiny random weights; demo only"),
    ),
    full_size=FullSizeModel(image_side_px=768, builder=f"{_DEMO}:build_full_size"),
)  # fmt: skip
