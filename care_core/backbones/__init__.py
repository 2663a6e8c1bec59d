"""Backbone adapters (one per model family), the family registry, offline loading and the embedded demos.

The names below are imported on first use, so that ``care_core.backbones.families`` (the family registry, read
by ``care --help``) imports without torch; `transformers` is imported only when a model is built or loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from care_core._lazy import lazy_exports

if TYPE_CHECKING:
    from .base import ImageTokens, VLMAdapter
    from .demo import DEMO_BACKBONES, ensure_demo
    from .families import (
        BackboneFamily,
        DemoBackbone,
        FullSizeModel,
        backbone_family,
        register_family,
        unregister_family,
    )
    from .internvl3.adapter import InternVLAdapter
    from .llava_1_5.adapter import LlavaAdapter
    from .llava_next.adapter import LlavaNextAdapter
    from .llava_onevision.adapter import LlavaOnevisionAdapter
    from .loading import care_home, hf_hub_cache, load_backbone
    from .qwen2_5_vl.adapter import Qwen2_5_VLAdapter, QwenMergerProjector
    from .qwen3_vl.adapter import Qwen3VLAdapter, Qwen3VLMergerProjector

_HOMES = {
    "ImageTokens": "base",
    "VLMAdapter": "base",
    "DEMO_BACKBONES": "demo",
    "ensure_demo": "demo",
    "BackboneFamily": "families",
    "DemoBackbone": "families",
    "FullSizeModel": "families",
    "backbone_family": "families",
    "register_family": "families",
    "unregister_family": "families",
    "InternVLAdapter": "internvl3.adapter",
    "LlavaAdapter": "llava_1_5.adapter",
    "LlavaNextAdapter": "llava_next.adapter",
    "LlavaOnevisionAdapter": "llava_onevision.adapter",
    "care_home": "loading",
    "hf_hub_cache": "loading",
    "load_backbone": "loading",
    "Qwen2_5_VLAdapter": "qwen2_5_vl.adapter",
    "QwenMergerProjector": "qwen2_5_vl.adapter",
    "Qwen3VLAdapter": "qwen3_vl.adapter",
    "Qwen3VLMergerProjector": "qwen3_vl.adapter",
}

__all__ = [
    "DEMO_BACKBONES",
    "BackboneFamily",
    "DemoBackbone",
    "FullSizeModel",
    "ImageTokens",
    "InternVLAdapter",
    "LlavaAdapter",
    "LlavaNextAdapter",
    "LlavaOnevisionAdapter",
    "Qwen2_5_VLAdapter",
    "Qwen3VLAdapter",
    "Qwen3VLMergerProjector",
    "QwenMergerProjector",
    "VLMAdapter",
    "backbone_family",
    "care_home",
    "ensure_demo",
    "hf_hub_cache",
    "load_backbone",
    "register_family",
    "unregister_family",
]

__getattr__ = lazy_exports(__name__, _HOMES)
