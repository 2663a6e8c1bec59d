"""Backbone adapters (one per model family), offline loading and the embedded demo builders.

`transformers` is imported only when a model is built or loaded, so importing this package is cheap.
"""

from .base import ImageTokens, VLMAdapter
from .demo import DEMO_BACKBONES, DemoBackbone, ensure_demo
from .llava import LlavaAdapter
from .llava_next import LlavaNextAdapter
from .loading import care_home, hf_hub_cache, load_backbone
from .qwen2_5_vl import Qwen2_5_VLAdapter, QwenMergerProjector

__all__ = [
    "DEMO_BACKBONES",
    "DemoBackbone",
    "ImageTokens",
    "LlavaAdapter",
    "LlavaNextAdapter",
    "Qwen2_5_VLAdapter",
    "QwenMergerProjector",
    "VLMAdapter",
    "care_home",
    "ensure_demo",
    "hf_hub_cache",
    "load_backbone",
]
