"""``care flops`` from a LLaVA-OneVision ``config.json`` (model_type ``llava_onevision``). Torch-free (transformers
fills the config's defaults)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from care_core.architecture import BackboneSpec
from care_core.backbones.families import BackboneFamily
from care_core.backbones.geometry import anyres_max_crops
from care_core.backbones.llava_1_5.flops_config import llava_config, llava_parts
from care_core.backbones.llava_next.flops_config import pinpoints, with_default_image


def spec_from_config(raw: Mapping[str, Any], path: Path, family: BackboneFamily) -> BackboneSpec:
    """The SigLIP tower (no CLS, so strategy "full" keeps exactly the patches) on anyres crops, pooled beyond the
    config's ``anyres_max_<crops>``."""
    config, lm = llava_config(raw, path)
    vision, projector = llava_parts(config, lm, path, kind="siglip", cls_token=False)
    pins = pinpoints(config, path)
    max_crops = anyres_max_crops(str(getattr(config, "vision_aspect_ratio", "anyres_max_9")))
    spec = BackboneSpec(f"config:{path}", f"{family.display} (config)", family.name, lm, projector, vision, 0, "",
                        None, pins, max_crops=max_crops, source=str(path))  # fmt: skip
    return with_default_image(spec, family.display)
