"""Helpers shared by the backbone tests."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image


def noise_image(height: int, width: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def hub_key(key: str) -> str:
    """A transformers 5.x saved key -> the hub's 4.x layout (llava-hf checkpoints)."""
    if key.startswith("model."):  # 5.x module path, in case save_pretrained ever writes it
        key = key[len("model.") :]
        if key.startswith("language_model."):
            key = "language_model.model." + key[len("language_model.") :]
    if key.startswith("lm_head."):
        key = "language_model." + key
    if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
        key = "vision_tower.vision_model." + key[len("vision_tower.") :]
    return key
