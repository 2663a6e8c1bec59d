"""Shared fixtures: the four random-or-trained demos built once per session, plus a tiny LLaVA saved to a folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from care_core.backbones import (
    LlavaAdapter,
    LlavaNextAdapter,
    Qwen2_5_VLAdapter,
    Qwen3VLAdapter,
    ensure_demo,
    load_backbone,
)
from care_core.backbones._hf import quiet_transformers
from care_core.backbones.internvl3.adapter import InternVLAdapter
from care_core.backbones.llava_1_5.demo import build_tiny_llava


@pytest.fixture(scope="module", autouse=True)
def _tiny_models_on_one_thread(one_thread: None) -> None:
    """Every backbone test module runs on one intra-op thread (tests/conftest.py's ``one_thread``)."""


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
def next_demo(demo_home: Path) -> LlavaNextAdapter:
    adapter = load_backbone("tiny-llava-next", home=demo_home)
    assert isinstance(adapter, LlavaNextAdapter)
    return adapter


@pytest.fixture(scope="session")
def qwen_demo(demo_home: Path) -> Qwen2_5_VLAdapter:
    adapter = load_backbone("tiny-qwen2.5-vl", home=demo_home)
    assert isinstance(adapter, Qwen2_5_VLAdapter)
    return adapter


@pytest.fixture(scope="session")
def qwen3_demo(demo_home: Path) -> Qwen3VLAdapter:
    adapter = load_backbone("tiny-qwen3-vl", home=demo_home)
    assert isinstance(adapter, Qwen3VLAdapter)
    return adapter


@pytest.fixture(scope="session")
def internvl_demo(demo_home: Path) -> InternVLAdapter:
    adapter = load_backbone("tiny-internvl3", home=demo_home)
    assert isinstance(adapter, InternVLAdapter)
    return adapter


@pytest.fixture(scope="session")
def demos(
    demo: LlavaAdapter,
    next_demo: LlavaNextAdapter,
    qwen_demo: Qwen2_5_VLAdapter,
    qwen3_demo: Qwen3VLAdapter,
    internvl_demo: InternVLAdapter,
) -> dict[str, Any]:
    return {"tiny-llava": demo, "tiny-llava-next": next_demo, "tiny-qwen2.5-vl": qwen_demo, "tiny-qwen3-vl": qwen3_demo,
            "tiny-internvl3": internvl_demo}  # fmt: skip


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


@pytest.fixture
def count_calls() -> Iterator[Any]:
    """count(module) -> a list whose length is the number of forward calls of `module`; hooks removed after."""
    handles = []

    def count(module: torch.nn.Module) -> list[int]:
        calls: list[int] = []
        handles.append(module.register_forward_pre_hook(lambda m, a: calls.append(1)))
        return calls

    yield count
    for handle in handles:
        handle.remove()
