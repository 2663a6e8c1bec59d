"""The LLaVA-NeXT family's record: its facts, demos, ``care flops`` spec and lmms-eval id (torch-free)."""

from __future__ import annotations

from care_core.backbones.families import OPTIONAL_WEIGHTS, BackboneFamily, DemoBackbone, FullSizeModel

_DEMO = "care_core.backbones.llava_next.demo"
_NEXT_GEOMETRY = "LLaVA-NeXT geometry (CLIP-336/14, anyres pinpoints, 2880 tokens at 672x672)"

FAMILY = BackboneFamily(
    name="llava-next", rank=20, display="LLaVA-NeXT", model_types=("llava_next",),
    adapter="care_core.backbones.llava_next.adapter:LlavaNextAdapter",
    has_cls_token=True, single_grid=False, crops=True,
    flops_spec="llava-next-7b", lmms_eval_model="care_llava",
    demos=(
        DemoBackbone("tiny-llava-next", 1, "llava-next", f"{_DEMO}:build_tiny_llava_next",
                     f"{_NEXT_GEOMETRY}, " + OPTIONAL_WEIGHTS,
                     weights="tiny-llava-next.safetensors", trained_builder=f"{_DEMO}:build_trained_tiny_llava_next"),
        DemoBackbone("tiny-llava-next-random", 1, "llava-next", f"{_DEMO}:build_tiny_llava_next",
                     f"{_NEXT_GEOMETRY}, tiny random weights; demo only"),
    ),
    full_size=FullSizeModel(image_side_px=672, builder=f"{_DEMO}:build_full_size"),
)  # fmt: skip
