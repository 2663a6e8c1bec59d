"""`care reduce --model PATH`: a saved tiny LLaVA-1.5 (5.x and hub 4.x key layouts) gives the same result
as the same weights in memory run through the library."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from care_cli.io import load_image
from care_core import CaReConfig, care_reduce
from care_core.backbones import LlavaAdapter
from care_core.backbones._hf import quiet_transformers
from care_core.backbones.llava_1_5.demo import build_tiny_llava
from tests.backbones._helpers import hub_key


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[LlavaAdapter, Path, Path]:
    from transformers import AutoProcessor

    model, processor = build_tiny_llava(seed=7)
    folder = tmp_path_factory.mktemp("tiny_llava_cli")
    with quiet_transformers():
        model.save_pretrained(str(folder))
        processor.save_pretrained(str(folder))
        processor = AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    legacy = tmp_path_factory.mktemp("tiny_llava_cli_4x") / "model"
    shutil.copytree(folder, legacy)
    state = load_file(str(folder / "model.safetensors"))
    save_file({hub_key(k): v for k, v in state.items()}, str(legacy / "model.safetensors"), metadata={"format": "pt"})
    return LlavaAdapter(model, processor, name="in-memory"), folder, legacy


@pytest.mark.parametrize("layout", ["folder", "hub-4x"])
def test_model_path_matches_weights_in_memory(care, photo: Path, saved_tiny, layout: str) -> None:
    memory, folder, legacy = saved_tiny
    path = folder if layout == "folder" else legacy
    summary = care("reduce", photo, "--model", path, "--keep", "50", "--device", "cpu", "--json").json()
    assert summary["backbone"]["demo"] is False and summary["backbone"]["note"] is None
    tokens = memory.encode_image(load_image(photo))
    expected = care_reduce(tokens.features, memory.projector, tokens.positions, keep=50, config=CaReConfig())
    assert summary["N"] == 576 and summary["K"] == 50
    assert summary["anchor_order"] == expected.anchor_order.tolist()
    assert summary["signals"] == expected.signals.tolist()


@pytest.mark.parametrize("depth", ["as made", "deep"])
def test_model_path_human_output_has_no_demo_note(care, photo: Path, saved_tiny, tmp_path: Path, depth: str) -> None:
    """The folder is shown whole (wrapped, not cut) however long the temporary path is."""
    _, folder, _ = saved_tiny
    if depth == "deep":
        folder = Path(shutil.copytree(folder, tmp_path / ("a-long-folder-name-" * 4) / "tiny_llava_model"))
    run = care("reduce", photo, "--model", folder, "--keep", "10")
    assert run.code == 0, run.err
    assert "demo backbone" not in run.out and "…" not in run.out
    unboxed = re.sub(r"[\s│┃]", "", run.out)  # a value wrapped over several table lines reads as one string
    assert re.sub(r"\s", "", str(folder)) in unboxed
