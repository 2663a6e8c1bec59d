"""load_backbone: demo build and reuse, local folders (5.x and hub 4.x key layouts), the offline HF
cache, dtype/device handling and every user-facing error."""

from __future__ import annotations

import json
import shutil
import socket
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from care_core.backbones import DEMO_BACKBONES, LlavaAdapter, care_home, ensure_demo, load_backbone
from care_core.backbones.demo import MARKER
from care_core.backbones.loading import resolve_dtype
from care_core.errors import ModelLoadError

from ._helpers import hub_key, noise_image, same_weights

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def assert_same_outputs(a: LlavaAdapter, b: LlavaAdapter) -> None:
    image = noise_image(400, 300, seed=11)
    ta, tb = a.encode_image(image), b.encode_image(image)
    assert torch.equal(ta.features, tb.features)
    assert torch.equal(ta.boxes, tb.boxes) and torch.equal(ta.positions, tb.positions)
    with torch.no_grad():
        assert torch.equal(a.projector(ta.features), b.projector(tb.features))
    assert torch.equal(a.question_embeddings("what colour?"), b.question_embeddings("what colour?"))


# ---------------------------------------------------------------------------------------------- demo
def test_demo_default_and_marker(demo: LlavaAdapter, demo_home: Path) -> None:
    folder = demo_home / "demo" / DEMO_BACKBONES["tiny-llava"].folder_name
    assert demo.name == "tiny-llava" and demo.is_demo and demo.family == "llava-1.5"
    marker = json.loads((folder / MARKER).read_text())
    assert marker["name"] == "tiny-llava" and marker["version"] == DEMO_BACKBONES["tiny-llava"].version
    assert marker["weights"] == "trained on synthetic shapes" and "seed" in marker and "sha256" in marker
    # loaded from the folder through the ordinary from_pretrained path
    assert Path(demo.model.name_or_path) == folder
    assert demo.model.config.vision_config.image_size == 336 and demo.model.config.vision_config.patch_size == 14
    assert demo.processor.num_additional_image_tokens == 1
    assert not any(p.requires_grad for p in demo.model.parameters())
    assert not demo.model.training
    assert "tiny-llava" in DEMO_BACKBONES


def test_demo_is_reused_not_rebuilt(demo_home: Path) -> None:
    folder = demo_home / "demo" / DEMO_BACKBONES["tiny-llava"].folder_name
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    adapter = load_backbone("tiny-llava", home=demo_home)
    assert adapter.is_demo
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    names = [p.name for p in (demo_home / "demo").iterdir()]
    assert DEMO_BACKBONES["tiny-llava"].folder_name in names
    assert not [n for n in names if n.startswith(".")]  # no temp leftovers


def test_demo_build_is_deterministic_and_keeps_global_rng(demo_home: Path, tmp_path: Path) -> None:
    torch.manual_seed(1234)
    state = torch.random.get_rng_state()
    folder = ensure_demo("tiny-llava", tmp_path)
    assert torch.equal(torch.random.get_rng_state(), state)
    a = load_file(str(folder / "model.safetensors"))
    b = load_file(str(demo_home / "demo" / DEMO_BACKBONES["tiny-llava"].folder_name / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_demo_concurrent_builds_and_stale_folder(tmp_path: Path) -> None:
    stale = tmp_path / "demo" / DEMO_BACKBONES["tiny-llava"].folder_name
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{ half written")  # an interrupted old build: no marker
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(ensure_demo("tiny-llava", tmp_path))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [stale, stale]
    assert (stale / MARKER).is_file()
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == [DEMO_BACKBONES["tiny-llava"].folder_name]
    assert load_backbone("tiny-llava", home=tmp_path).num_image_tokens == 576


def test_care_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CARE_HOME", str(tmp_path / "x"))
    assert care_home() == tmp_path / "x"
    monkeypatch.delenv("CARE_HOME")
    assert care_home().name == "care"


def test_demo_home_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CARE_HOME", str(tmp_path))
    adapter = load_backbone()
    assert adapter.is_demo and (tmp_path / "demo" / DEMO_BACKBONES["tiny-llava"].folder_name / MARKER).is_file()


def test_loading_prints_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    adapter = load_backbone("tiny-llava", home=tmp_path)
    tokens = adapter.encode_image(noise_image(200, 260))
    with torch.no_grad():
        adapter.generate("hi", tokens, adapter.projector(tokens.features[:8]), max_new_tokens=2)
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


# -------------------------------------------------------------------------------------------- folders
def test_folder_loads_like_the_same_weights_in_memory(tiny_pair, no_network) -> None:
    memory, folder = tiny_pair
    adapter = load_backbone(folder)
    assert isinstance(adapter, LlavaAdapter) and not adapter.is_demo and adapter.name == str(folder)
    assert same_weights(adapter.model, memory.model)
    assert_same_outputs(adapter, memory)
    assert load_backbone(str(folder)).name == str(folder)


def test_hub_4x_key_layout_loads(tiny_pair, tmp_path: Path, no_network) -> None:
    memory, folder = tiny_pair
    legacy = tmp_path / "legacy"
    shutil.copytree(folder, legacy)
    state = load_file(str(folder / "model.safetensors"))
    renamed = {hub_key(k): v for k, v in state.items()}
    assert any(k.startswith("vision_tower.vision_model.") for k in renamed)
    assert any(k.startswith("language_model.model.") for k in renamed)
    assert any(k.startswith("language_model.lm_head.") for k in renamed)
    assert any(k.startswith("multi_modal_projector.") for k in renamed)
    assert set(renamed) != set(state)
    save_file(renamed, str(legacy / "model.safetensors"), metadata={"format": "pt"})
    adapter = load_backbone(legacy)
    assert same_weights(adapter.model, memory.model)
    assert_same_outputs(adapter, memory)


def test_processor_with_zero_additional_tokens_is_fixed(tiny_pair, tmp_path: Path) -> None:
    _, folder = tiny_pair
    copy = tmp_path / "zero"
    shutil.copytree(folder, copy)
    cfg_path = copy / "processor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_additional_image_tokens"] = 0
    cfg.pop("patch_size", None)
    cfg_path.write_text(json.dumps(cfg))
    adapter = load_backbone(copy)
    assert adapter.processor.num_additional_image_tokens == 1 and adapter.processor.patch_size == 14
    image = noise_image(300, 300)
    inputs = adapter.processor(text=adapter.prompt("q"), images=image, return_tensors="pt")
    assert int((inputs["input_ids"] == adapter.image_token_id).sum()) == 576


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (None, torch.float32),
        ("float64", torch.float64),
        ("bfloat16", torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_dtype(tiny_pair, dtype, expected) -> None:
    _, folder = tiny_pair
    adapter = load_backbone(folder, dtype=dtype)
    assert adapter.dtype == expected
    tokens = adapter.encode_image(noise_image(336, 336))
    assert tokens.features.dtype == expected


def test_dtype_names() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype(None, cpu) == torch.float32 and resolve_dtype(None, cuda) == torch.bfloat16
    assert resolve_dtype("auto", cpu) == "auto" and resolve_dtype("float16", cpu) == torch.float16
    assert load_backbone("tiny-llava", dtype="auto").dtype == torch.float32
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        resolve_dtype("int7", cpu)


# ------------------------------------------------------------------------------------------ HF cache
def fake_hf_cache(root: Path, repo_id: str, source: Path) -> Path:
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / SNAPSHOT
    shutil.copytree(source, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return snap


def test_repo_id_resolves_in_local_cache(tiny_pair, tmp_path: Path, monkeypatch, no_network) -> None:
    memory, folder = tiny_pair
    cache = tmp_path / "hub"
    snap = fake_hf_cache(cache, "some-org/tiny-llava-1.5", folder)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    adapter = load_backbone("some-org/tiny-llava-1.5")
    assert adapter.name == "some-org/tiny-llava-1.5" and not adapter.is_demo
    assert Path(adapter.model.name_or_path) == snap
    assert same_weights(adapter.model, memory.model)


def test_repo_id_via_hf_home(tiny_pair, tmp_path: Path, monkeypatch, no_network) -> None:
    _, folder = tiny_pair
    fake_hf_cache(tmp_path / "hfhome" / "hub", "org/name", folder)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert load_backbone("org/name").name == "org/name"


def test_uncached_repo_id(tmp_path: Path, monkeypatch, no_network) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ModelLoadError) as info:
        load_backbone("llava-hf/llava-1.5-7b-hf")
    msg = str(info.value)
    assert "local Hugging Face cache" in msg and str(tmp_path / "empty-hub") in msg
    assert "hf download llava-hf/llava-1.5-7b-hf" in msg and "--model PATH" in msg


# --------------------------------------------------------------------------------------------- errors
def test_file_instead_of_folder(tmp_path: Path) -> None:
    f = tmp_path / "weights.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="is a file, expected a model folder"):
        load_backbone(f)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"is not a model folder \(no config.json\)"):
        load_backbone(tmp_path)


def test_corrupt_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_backbone(tmp_path)


def test_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(
        ModelLoadError,
        match=r"unsupported model type bert \(supported: gemma3, internvl, llava, llava_next, llava_onevision, "
        r"qwen2_5_vl, qwen3_5, qwen3_vl\)",
    ):
        load_backbone(tmp_path)


@pytest.mark.parametrize("broken", ["missing", "corrupt"])
def test_missing_or_corrupt_weights(tiny_pair, tmp_path: Path, broken: str) -> None:
    _, folder = tiny_pair
    copy = tmp_path / "broken"
    shutil.copytree(folder, copy)
    if broken == "missing":
        (copy / "model.safetensors").unlink()
    else:
        (copy / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError, match="cannot load") as info:
        load_backbone(copy)
    assert str(copy) in str(info.value)


def test_missing_processor_files(tiny_pair, tmp_path: Path) -> None:
    _, folder = tiny_pair
    copy = tmp_path / "noproc"
    copy.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(folder / name, copy / name)
    with pytest.raises(ModelLoadError, match=str(copy).replace("\\", "\\\\")):
        load_backbone(copy)


def test_unknown_name_suggests_demo() -> None:
    with pytest.raises(ModelLoadError) as info:
        load_backbone("tiny-lava")
    msg = str(info.value)
    assert 'did you mean "tiny-llava"' in msg and "local model folder" in msg and "org/name" in msg


@pytest.mark.parametrize("name", ["./no/such/folder", "/definitely/not/here", "nonsense"])
def test_nonexistent_path_or_name(name: str) -> None:
    with pytest.raises(ModelLoadError, match="tiny-llava") as info:
        load_backbone(name)
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("device", ["tpu:9", "banana", "meta"])
def test_bad_device(device: str) -> None:
    with pytest.raises(ModelLoadError, match="device"):
        load_backbone("tiny-llava", device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda() -> None:
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        load_backbone("tiny-llava", device="cuda")
