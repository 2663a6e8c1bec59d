"""Shared fixtures: the tiny-llava demo built once per session, plus a tiny LLaVA saved to a folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from care_core.backbones import LlavaAdapter, ensure_demo, load_backbone
from care_core.backbones._hf import quiet_transformers
from care_core.backbones.demo import build_tiny_llava


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("backbones_home")
    ensure_demo("tiny-llava", home)
    return home


@pytest.fixture(scope="session")
def demo(demo_home: Path) -> LlavaAdapter:
    adapter = load_backbone(None, home=demo_home)
    assert isinstance(adapter, LlavaAdapter)
    return adapter


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[LlavaAdapter, Path]:
    """A tiny LLaVA (other seed than the demo) in memory, and the same weights saved to a folder."""
    from transformers import AutoProcessor

    model, processor = build_tiny_llava(seed=123)
    folder = tmp_path_factory.mktemp("tiny_llava_folder")
    with quiet_transformers():
        model.save_pretrained(str(folder))
        processor.save_pretrained(str(folder))
        # the processor as a load would see it (with torchvision installed, AutoProcessor picks the
        # torchvision CLIP backend, whose resize differs slightly from the PIL one we built with)
        processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    return LlavaAdapter(model, processor, name="in-memory"), folder
