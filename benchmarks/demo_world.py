"""The synthetic shapes world as the demo benchmarks and ``scripts/train_demo`` use it: the background photos,
the held-out questions, the PIL image processor training used, and methods configured as ``care csr`` does.

The world itself (scenes, questions, answers) is ``care_core.synthetic``; what is here is how this repository's
benchmarks and training script draw from it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks.common import EXAMPLES

TRAIN_SPLIT = 0  # the split seed the shipped demo was trained on
HELDOUT_SPLIT = 1  # the split seed every held-out figure is measured on
PHOTOS = ("astronaut.jpg", "chelsea.jpg", "coffee.jpg")  # the backgrounds of the scenes


def load_photos() -> list[Any]:
    from PIL import Image

    return [Image.open(EXAMPLES / name).convert("RGB") for name in PHOTOS]


def heldout_items(count: int, size: tuple[int, int] | None = None) -> list[tuple[int, str, str, str]]:
    """The held-out questions: (scene index, question, answer, type), types balanced (split seed 1); ``size``: every
    scene drawn at that (height, width) (None: the world's mix, the standard held-out set)."""
    from care_core.synthetic import iter_questions

    pairs = iter_questions(HELDOUT_SPLIT, count, photos=load_photos(), size=size)
    return [(scene.index, qa.question, qa.answer, qa.type) for scene, qa in pairs]


def use_pil_image_processor(adapter: Any) -> None:
    """Give ``adapter`` the PIL CLIP processor: the one the package uses without torchvision and the one training
    used (where torchvision is installed, AutoProcessor picks the torchvision one, whose resize differs slightly).
    Other processors (LLaVA-NeXT's anyres one also has a ``crop_size``) are left alone."""
    ip = adapter.processor.image_processor
    name = type(ip).__name__
    if not name.startswith("CLIPImageProcessor") or name.endswith("Pil"):
        return
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    adapter.processor.image_processor = CLIPImageProcessorPil(
        size=dict(ip.size), crop_size=dict(ip.crop_size), do_center_crop=ip.do_center_crop
    )


def configured_method(name: str, seed: int) -> Any:
    """The named method at its defaults, with ``seed`` wherever it draws random numbers (as ``care csr``)."""
    from care_core import CaReConfig
    from care_core.methods import build_method, method_class

    fields = {f.name for f in dataclasses.fields(method_class(name))}  # type: ignore[arg-type]
    options: dict[str, Any] = {}
    if "seed" in fields:
        options["seed"] = seed
    if "config" in fields:
        options["config"] = CaReConfig(seed=seed)
    return build_method(name, **options)
