"""The InternVL3 family's record: its facts, demos, ``care flops`` spec and lmms-eval id (torch-free)."""

from __future__ import annotations

from care_core.backbones.families import OPTIONAL_WEIGHTS, BackboneFamily, DemoBackbone, FullSizeModel

_DEMO = "care_core.backbones.internvl3.demo"
_INTERNVL_GEOMETRY = (
    "InternVL3 geometry (InternViT 448/14, pixel shuffle 0.5: 256 tokens per tile, 1-12 tiles + thumbnail)"
)

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
    full_size=FullSizeModel(image_side_px=672, builder=f"{_DEMO}:build_full_size"),
)  # fmt: skip
