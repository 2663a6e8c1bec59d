"""What all three demo backbones share: loading (demo, hub key layouts, uncached repo ids), the reduced-token
API with ``kept``, capabilities, and every registered method running (or refusing cleanly) on each."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from care_core import CaReConfig
from care_core.backbones import DEMO_BACKBONES, ImageTokens, ensure_demo, families, load_backbone
from care_core.backbones.demo import (
    MARKER,
    RANDOM_DEMO_NOTE,
    TRAINED_DEMO_NOTE,
    WEIGHTS_DIR,
    file_sha256,
    read_manifest,
)
from care_core.backbones.full_size_parts import QWEN2_SPLIT_PATTERN
from care_core.backbones.probes import VISION_PROBES
from care_core.backbones.tiny_parts import TRAINED_SIZES, build_byte_tokenizer
from care_core.errors import CareError, MethodError, ModelLoadError
from care_core.methods import MethodInputs
from care_core.methods.registry import build_method, method_names
from care_core.vocabulary import PROBES

from ._helpers import hub_key, noise_image, same_weights

NAMES = ["tiny-llava", "tiny-llava-next", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-internvl3"]
FAMILIES = {"tiny-llava": "llava-1.5", "tiny-llava-next": "llava-next", "tiny-qwen2.5-vl": "qwen2.5-vl",
            "tiny-qwen3-vl": "qwen3-vl", "tiny-internvl3": "internvl3"}  # fmt: skip
QUESTION = "What is in the image?"


def test_every_demo_is_registered_once_and_named_in_the_model_help() -> None:
    from care_cli.options import Model
    from care_core.backbones.families import DEFAULT_DEMO, backbone_family

    demos = [
        "tiny-llava",
        "tiny-llava-random",
        "tiny-llava-next",
        "tiny-llava-next-random",
        "tiny-qwen2.5-vl",
        "tiny-qwen2.5-vl-random",
        "tiny-qwen3-vl",
        "tiny-qwen3-vl-random",
        "tiny-qwen3.5",
        "tiny-qwen3.5-random",
        "tiny-internvl3",
        "tiny-internvl3-random",
        "tiny-llava-onevision",
        "tiny-llava-onevision-random",
        "tiny-gemma3",
        "tiny-gemma3-random",
    ]
    assert list(DEMO_BACKBONES) == demos and DEFAULT_DEMO == "tiny-llava"
    family_of = {**FAMILIES, "tiny-llava-onevision": "llava-onevision", "tiny-qwen3.5": "qwen3.5",
                 "tiny-gemma3": "gemma3"}  # fmt: skip
    family_of.update({f"{name}-random": family for name, family in family_of.items()})
    for name in demos:
        assert DEMO_BACKBONES[name].family == family_of[name]
        assert DEMO_BACKBONES[name] in backbone_family(family_of[name]).demos
    help_text = Model.__metadata__[0].help
    listed = help_text[help_text.index("(") + 1 : help_text.index(")")]  # "A demo name (a, b, ...)"
    assert all(DEMO_BACKBONES[name].shipped for name in demos)  # every trained demo ships its weights
    assert set(listed.replace(",", " ").split()) >= set(demos)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.fixture(scope="module")
def encoded(demos: dict[str, Any]) -> dict[str, ImageTokens]:
    image = noise_image(336, 336, seed=9)  # N: 576 / 1152 / 144 / 256
    return {name: adapter.encode_image(image) for name, adapter in demos.items()}


def assert_same_outputs(a: Any, b: Any) -> None:
    image = noise_image(400, 300, seed=11)
    ta, tb = a.encode_image(image), b.encode_image(image)
    assert torch.equal(ta.features, tb.features)
    assert torch.equal(ta.boxes, tb.boxes) and torch.equal(ta.positions, tb.positions)
    with torch.no_grad():
        assert torch.equal(a.projector(ta.features), b.projector(tb.features))
        pa = a.projector(ta.features[:5])
        assert torch.equal(a.language_model_logits("q", ta, pa), b.language_model_logits("q", tb, pa))
    assert torch.equal(a.question_embeddings("what colour?"), b.question_embeddings("what colour?"))


# ---------------------------------------------------------------------------------------------- demos
@pytest.mark.parametrize("name", NAMES)
def test_demo_loads_from_its_folder(demos: dict[str, Any], demo_home: Path, name: str) -> None:
    adapter = demos[name]
    folder = demo_home / "demo" / DEMO_BACKBONES[name].folder_name
    assert adapter.name == name and adapter.is_demo and adapter.family == FAMILIES[name]
    assert DEMO_BACKBONES[name].family == FAMILIES[name]
    marker = json.loads((folder / MARKER).read_text())
    expected = "trained on synthetic shapes" if DEMO_BACKBONES[name].trained else "random weights"
    assert marker["name"] == name and marker["weights"] == expected
    assert adapter.demo_note == DEMO_BACKBONES[name].note and adapter.notices == []
    assert Path(adapter.model.name_or_path) == folder
    assert not adapter.model.training and not any(p.requires_grad for p in adapter.model.parameters())
    assert adapter.model.config.text_config.num_hidden_layers >= 4  # room for in-LLM methods (layer 2)
    assert adapter.capabilities <= frozenset(PROBES)


@pytest.mark.parametrize(
    "name",
    [
        "tiny-llava-next-random",
        "tiny-qwen2.5-vl-random",
        "tiny-qwen3-vl-random",
        "tiny-internvl3-random",
        "tiny-llava-onevision-random",
    ],
)
def test_demo_build_is_deterministic_and_keeps_global_rng(demo_home: Path, name: str) -> None:
    torch.manual_seed(1234)
    state = torch.random.get_rng_state()
    spec = DEMO_BACKBONES[name]
    model, _ = spec.build(spec.seed)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert same_weights(model, load_backbone(name, home=demo_home).model)  # random weights: the seed's


@pytest.mark.parametrize("name", ["tiny-llava-next", "tiny-qwen2.5-vl", "tiny-internvl3"])
def test_new_demos_print_nothing(demo_home: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    adapter = load_backbone(name, home=demo_home)
    tokens = adapter.encode_image(noise_image(200, 260))
    with torch.no_grad():
        adapter.generate("hi", tokens, adapter.projector(tokens.features[:8]), max_new_tokens=2)
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


# ----------------------------------------------------------------------------------- reduced-token API
@pytest.mark.parametrize("name", NAMES)
def test_generate_and_logits_with_kept(demos: dict[str, Any], encoded: dict[str, ImageTokens], name: str) -> None:
    adapter, tokens = demos[name], encoded[name]
    n = tokens.num_tokens
    kept = torch.tensor([n - 1, 0, -1, n // 2, 3])
    with torch.no_grad():
        projected = adapter.projector(tokens.features[kept.clamp(min=0)])
    answer = adapter.generate(QUESTION, tokens, projected, max_new_tokens=3, kept=kept).text
    assert isinstance(answer, str)
    logits = adapter.language_model_logits(QUESTION, tokens, projected, kept=kept)
    full = adapter.language_model_logits(QUESTION, tokens, adapter.projector(tokens.features))
    fed = adapter.visual_tokens_fed(tokens, n)
    assert logits.shape[0] == full.shape[0] - fed + 5
    assert adapter.visual_tokens_fed(tokens, 5, kept) == 5
    with pytest.raises(ValueError, match="kept"):
        adapter.language_model_logits(QUESTION, tokens, projected, kept=kept[:3])
    with pytest.raises(ValueError, match="kept"):
        adapter.generate(QUESTION, tokens, projected, kept=kept.float())


@pytest.mark.parametrize("name", NAMES)
def test_every_method_runs_or_refuses_cleanly(
    demos: dict[str, Any], encoded: dict[str, ImageTokens], name: str
) -> None:
    """Every registered method on every backbone: K output rows that the language model accepts, or a
    one-line MethodError (a probe the backbone lacks, or a method that needs a single grid)."""
    adapter, tokens = demos[name], encoded[name]
    n = tokens.num_tokens
    keep = n - n // 8  # few merge steps for the iterative methods: this checks that they run, not what they keep
    question = adapter.question_embeddings(QUESTION)
    outcomes: dict[str, str] = {}
    for method_name in method_names():
        fields = getattr(build_method(method_name), "__dataclass_fields__", {})
        options: dict[str, Any] = (
            {"m": 8} if "m" in fields else {"config": CaReConfig(m=8)} if "config" in fields else {}
        )
        method = build_method(method_name, **options)  # m = 8 directions: fast, same code paths
        needs = sorted(method.needs - {"question"})
        try:
            adapter.check_probes(needs, method_name)
            probes = adapter.probe_inputs(tokens, needs, question=QUESTION) if needs else {}
            probes["question"] = question
            inputs = MethodInputs(
                tokens.features, adapter.projector, tokens.positions, grid=tokens.grid, probes=probes, seed=0
            )
            result = method(inputs, keep)
        except MethodError as exc:
            assert "\n" not in str(exc)
            outcomes[method_name] = "refused"
            continue
        with torch.no_grad():
            projected = adapter.projector(result.tokens.to(adapter.dtype))
        # what the language model would be fed (the forward itself is covered by the kept tests above)
        fed = adapter._lm_inputs(QUESTION, tokens, projected, result.token_index)
        placeholders = int((fed["input_ids"] == adapter.image_token_id).sum())
        assert placeholders == adapter.visual_tokens_fed(tokens, projected.shape[0], result.token_index)
        outcomes[method_name] = "ran"
    refused = {m for m, o in outcomes.items() if o == "refused"}
    if name == "tiny-llava":
        assert not refused
    elif name == "tiny-llava-next":
        assert refused <= {"pool"}  # pool needs one raster grid; NeXT has two views
    else:  # Qwen2.5-VL, InternVL3: no CLS probes, so exactly the methods that need a vision-tower probe refuse
        assert refused == {m for m in outcomes if build_method(m).needs & VISION_PROBES}
    assert {"care", "random", "fastv"} <= {m for m, o in outcomes.items() if o == "ran"}


# ------------------------------------------------------------------------------------------- loading
def _copy_with_keys(source: Path, target: Path, rename: Any) -> dict[str, torch.Tensor]:
    shutil.copytree(source, target)
    (target / MARKER).unlink()  # a hub checkpoint carries no care demo marker
    state = load_file(str(source / "model.safetensors"))
    renamed = {rename(k): v for k, v in state.items()}
    save_file(renamed, str(target / "model.safetensors"), metadata={"format": "pt"})
    return renamed


def next_hub_key(key: str) -> str:
    """LLaVA-NeXT: the llava-hf 4.x names (language_model.model.*, vision_tower.vision_model.*, image_newline)."""
    if key.startswith("model.image_newline"):
        return key[len("model.") :]
    return hub_key(key)


def test_llava_next_hub_key_layout_loads(next_demo: Any, demo_home: Path, tmp_path: Path, no_network: None) -> None:
    folder = demo_home / "demo" / DEMO_BACKBONES["tiny-llava-next"].folder_name
    renamed = _copy_with_keys(folder, tmp_path / "hub", next_hub_key)
    for prefix in (
        "language_model.model.",
        "language_model.lm_head.",
        "vision_tower.vision_model.",
        "multi_modal_projector.",
        "image_newline",
    ):
        assert any(k.startswith(prefix) for k in renamed), prefix
    adapter = load_backbone(tmp_path / "hub")
    assert type(adapter) is type(next_demo) and not adapter.is_demo and adapter.demo_note is None
    assert same_weights(adapter.model, next_demo.model)
    assert_same_outputs(adapter, next_demo)


def test_qwen_hub_key_and_file_layout_loads(qwen_demo: Any, demo_home: Path, tmp_path: Path, no_network: None) -> None:
    """Qwen2.5-VL hub keys (model.* = language model, visual.*, lm_head.*) and hub processor files
    (preprocessor_config.json, chat_template.json, a video config we ignore) load without torchvision."""
    folder = demo_home / "demo" / DEMO_BACKBONES["tiny-qwen2.5-vl"].folder_name
    hub = tmp_path / "hub"
    renamed = _copy_with_keys(folder, hub, lambda k: k)
    assert any(k.startswith("model.layers.") for k in renamed) and any(k.startswith("visual.") for k in renamed)
    assert any(k.startswith("lm_head.") for k in renamed)
    config = json.loads((hub / "processor_config.json").read_text())
    (hub / "processor_config.json").unlink()
    image_config = {**config["image_processor"], "processor_class": "Qwen2_5_VLProcessor"}
    (hub / "preprocessor_config.json").write_text(json.dumps(image_config))
    (hub / "video_preprocessor_config.json").write_text(
        json.dumps({"video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2_5_VLProcessor"})
    )
    template = (hub / "chat_template.jinja").read_text()
    (hub / "chat_template.jinja").unlink()
    (hub / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    adapter = load_backbone(hub)
    assert type(adapter) is type(qwen_demo)
    assert adapter.prompt("q") == qwen_demo.prompt("q")
    assert same_weights(adapter.model, qwen_demo.model)
    assert_same_outputs(adapter, qwen_demo)


@pytest.mark.parametrize("name", ["tiny-llava-next", "tiny-qwen2.5-vl"])
def test_module_path_key_layout_loads(
    demos: dict[str, Any], demo_home: Path, tmp_path: Path, name: str, no_network: None
) -> None:
    """The 5.x module paths (model.language_model.*, model.vision_tower.* / model.visual.*) load too."""
    adapter = demos[name]
    folder = tmp_path / "modules"
    shutil.copytree(demo_home / "demo" / DEMO_BACKBONES[name].folder_name, folder)
    (folder / MARKER).unlink()
    state = {k: v.clone().contiguous() for k, v in adapter.model.state_dict().items()}
    assert any(k.startswith("model.language_model.") for k in state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_backbone(folder)
    assert same_weights(loaded.model, adapter.model)


@pytest.mark.parametrize("repo_id", ["llava-hf/llava-v1.6-mistral-7b-hf", "Qwen/Qwen2.5-VL-7B-Instruct"])
def test_uncached_repo_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_network: None, repo_id: str) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ModelLoadError) as info:
        load_backbone(repo_id)
    msg = str(info.value)
    assert "local Hugging Face cache" in msg and str(tmp_path / "empty-hub") in msg
    assert f"hf download {repo_id}" in msg and "--model PATH" in msg
    assert isinstance(info.value, CareError)


# ------------------------------------------------------------------------- shipped weights and demo notes
TRAINED_DEMOS = [name for name, spec in DEMO_BACKBONES.items() if spec.weights]


@pytest.fixture(scope="module")
def weights_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``demo_weights`` folder as ``train_demo --install-from`` leaves it for every trained demo: the shipped files
    where the package has them, else the demo's trained skeleton with seed-0 weights in float16, as train_demo saves
    them (placeholders, made here)."""
    folder = tmp_path_factory.mktemp("demo_weights")
    manifest = read_manifest()
    for name in TRAINED_DEMOS:
        spec = DEMO_BACKBONES[name]
        assert spec.weights is not None
        if spec.weights in manifest:
            shutil.copyfile(WEIGHTS_DIR / spec.weights, folder / spec.weights)
            continue
        model, _ = spec.build_trained(0)
        model.half().save_pretrained(str(folder / name))
        shutil.move(folder / name / "model.safetensors", folder / spec.weights)
        manifest[spec.weights] = {"sha256": file_sha256(folder / spec.weights),
                                  "bytes": (folder / spec.weights).stat().st_size, "backbone": name}  # fmt: skip
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


@pytest.fixture
def installed(weights_folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The package's weights folder pointed at :func:`weights_folder`."""
    monkeypatch.setattr(families, "WEIGHTS_DIR", weights_folder)
    return weights_folder


@pytest.mark.parametrize("name", TRAINED_DEMOS)
def test_trained_demo_weights_match_the_manifest(installed: Path, tmp_path: Path, name: str) -> None:
    spec = DEMO_BACKBONES[name]
    assert spec.weights is not None and spec.trained
    entry = read_manifest()[spec.weights]
    folder = ensure_demo(name, tmp_path)
    assert folder.name == spec.folder_name
    assert file_sha256(installed / spec.weights) == entry["sha256"]
    assert file_sha256(folder / "model.safetensors") == entry["sha256"]
    assert json.loads((folder / MARKER).read_text())["sha256"] == entry["sha256"]
    assert (installed / spec.weights).stat().st_size < 8 * 2**20  # a few MB
    adapter = load_backbone(name, home=tmp_path)
    assert adapter.model.config.text_config.hidden_size == TRAINED_SIZES.text_hidden  # the trained skeleton
    assert adapter.demo_note == TRAINED_DEMO_NOTE and adapter.demo_note.startswith("demo backbone: tiny model trained")


def test_shipped_tiny_llava_has_the_llava_geometry(demo: Any) -> None:
    assert demo.model.config.vision_config.image_size == 336 and demo.num_image_tokens == 576
    assert demo.demo_note == TRAINED_DEMO_NOTE


@pytest.mark.parametrize("name", [n for n in TRAINED_DEMOS if DEMO_BACKBONES[n].trained_builder])
def test_a_demo_is_refused_until_its_weights_are_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weights_folder: Path, name: str
) -> None:
    spec = DEMO_BACKBONES[name]
    monkeypatch.setattr(families, "WEIGHTS_DIR", tmp_path / "nothing installed")
    assert not spec.trained and spec.note == RANDOM_DEMO_NOTE and spec.folder_name == f"{name}-v{spec.version}"
    model, _ = spec.build(0)
    assert model.config.text_config.hidden_size == 64  # the random demo's sizes
    # not offered and refused on load (one line naming the file and the random demo to use), nothing built
    assert not spec.shipped and name not in families.shipped_demos() and f"{name}-random" in families.shipped_demos()
    with pytest.raises(ModelLoadError) as refused:
        load_backbone(name, home=tmp_path / "home")
    message = str(refused.value)
    assert "\n" not in message and spec.weights in message and "not shipped" in message and f"{name}-random" in message
    assert not (tmp_path / "home" / "demo").exists()
    monkeypatch.setattr(families, "WEIGHTS_DIR", weights_folder)
    assert spec.trained and spec.note == TRAINED_DEMO_NOTE and spec.folder_name == f"{name}-v{spec.version}-trained"
    assert spec.shipped and name in families.shipped_demos()
    random = DEMO_BACKBONES[f"{name}-random"]
    assert not random.trained and random.family == spec.family


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _edit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # same size, one byte of a weight changed
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", TRAINED_DEMOS)
@pytest.mark.parametrize(("damage", "word"), [(_truncate, "truncated"), (_edit, "corrupt"), (Path.unlink, "missing")])
def test_damaged_cached_weights_are_restored_with_a_notice(
    installed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: Any, word: str, name: str
) -> None:
    spec = DEMO_BACKBONES[name]
    home = tmp_path / "home"
    weights = ensure_demo(name, home) / "model.safetensors"
    damage(weights)
    adapter = load_backbone(name, home=home)
    assert len(adapter.notices) == 1
    notice = adapter.notices[0]
    assert "\n" not in notice and word in notice and "restored from the copy shipped with care" in notice
    assert file_sha256(weights) == read_manifest()[spec.weights]["sha256"]
    assert not [p.name for p in (home / "demo").iterdir() if p.name.startswith(".")]  # no temp leftovers
    assert capsys.readouterr() == ("", "")  # the core prints nothing: the CLI shows the notice
    again = load_backbone(name, home=home)
    assert again.notices == []


def test_damaged_random_demo_is_rebuilt_with_a_notice(tmp_path: Path) -> None:
    folder = ensure_demo("tiny-llava-random", tmp_path)
    _truncate(folder / "model.safetensors")
    adapter = load_backbone("tiny-llava-random", home=tmp_path)
    assert len(adapter.notices) == 1 and "truncated" in adapter.notices[0] and "seed 0" in adapter.notices[0]
    assert adapter.demo_note == RANDOM_DEMO_NOTE
    assert adapter.model.config.text_config.hidden_size == 64  # the random builder's sizes


def test_demo_folder_keeps_its_note(demo_home: Path, tmp_path: Path, tiny_pair: Any) -> None:
    folder = demo_home / "demo" / DEMO_BACKBONES["tiny-llava"].folder_name
    adapter = load_backbone(folder)
    assert adapter.is_demo and adapter.demo_note == TRAINED_DEMO_NOTE and adapter.name == str(folder)
    _, plain = tiny_pair  # a folder without a marker: a real model as far as care knows
    assert load_backbone(plain).demo_note is None
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    _truncate(copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"truncated.*model=tiny-llava\) to restore it") as caught:
        load_backbone(copy)
    assert "(--model=tiny-llava)" in caught.value.render({"model": "--model"}.get)  # the CLI's spelling
    old = tmp_path / "old"  # a marker from before notes and hashes: random weights
    shutil.copytree(ensure_demo("tiny-llava-next-random", demo_home), old)
    marker = json.loads((old / MARKER).read_text())
    (old / MARKER).write_text(json.dumps({k: marker[k] for k in ("name", "version", "weights")}))
    assert load_backbone(old).demo_note == RANDOM_DEMO_NOTE


# ------------------------------------------------------------------ what the trained demo answers (CPU, float32)
# Measured (2026-11-26, CPU float32, torch 2.13, the shipped weights): on these 60 held-out questions all tokens
# answer 53, random at K=64 44; on the first 25 every method at K=64 answers at most 21 (all tokens: 23). On 500
# held-out questions (benchmarks/results/2026-11-26-gpu-h200-bench_demo_accuracy.json): all tokens 86.6%, methods
# at K=64 55.4-79.6%. The margins below are about three binomial standard deviations.
HELDOUT_SAMPLE = 60
METHOD_SAMPLE = 25


@pytest.fixture(scope="module")
def heldout(demo: Any) -> list[tuple[Any, ImageTokens]]:
    from PIL import Image

    from care_core.synthetic import iter_questions

    root = Path(__file__).resolve().parents[2] / "examples"
    photos = [Image.open(root / name).convert("RGB") for name in ("astronaut.jpg", "chelsea.jpg", "coffee.jpg")]
    return [(qa, demo.encode_image(scene.image)) for scene, qa in iter_questions(1, HELDOUT_SAMPLE, photos=photos)]


def _first_words(
    adapter: Any, sample: list[tuple[Any, ImageTokens]], methods: list[str], keep: int = 64
) -> tuple[list[str], dict[str, list[str]]]:
    """The first word of every answer (all tokens, and each method at K = ``keep``), on the library's batched path:
    one :meth:`~care_core.pipeline.ReductionPipeline.run_batch` over the sample, whose answers are per image those of
    ``care reduce --generate`` on it alone (tests/core/test_pipeline_batch.py)."""
    from care_core.budget import Budget
    from care_core.pipeline import ReductionPipeline
    from care_core.synthetic import first_word

    pipe = ReductionPipeline(adapter, methods, CaReConfig(seed=0))
    results = pipe.run_batch([tokens for _, tokens in sample], [qa.question for qa, _ in sample], [Budget.keep(keep)],
                             generate=True, max_new_tokens=10, timed=False)  # fmt: skip
    full = [first_word(r.full_answer.text) for r in results]
    return full, {name: [first_word(r.run(name).answer.text) for r in results] for name in pipe.methods}


def _hits(words: list[str], sample: list[tuple[Any, ImageTokens]]) -> int:
    return sum(word == qa.answer for word, (qa, _) in zip(words, sample, strict=True))


def test_trained_demo_answers_held_out_questions(demo: Any, heldout: list[tuple[Any, ImageTokens]]) -> None:
    full, reduced = _first_words(demo, heldout, ["random"])
    assert _hits(full, heldout) >= 45  # measured 53 / 60; a random-weight model answers ~0 (it never learned the words)
    assert _hits(full, heldout) - _hits(reduced["random"], heldout) >= 3  # random at 11% of the tokens: measured 44


def test_no_method_at_k64_beats_all_tokens(demo: Any, heldout: list[tuple[Any, ImageTokens]]) -> None:
    sample = heldout[:METHOD_SAMPLE]
    full, reduced = _first_words(demo, sample, method_names())
    assert set(reduced) == set(method_names())  # tiny-llava serves every method
    for name, words in reduced.items():
        assert _hits(words, sample) <= _hits(full, sample) + 2, name  # noise margin: 2 of 25


@pytest.mark.parametrize("name", TRAINED_DEMOS)
def test_a_cached_demo_from_another_release_is_replaced_by_the_shipped_weights(
    installed: Path, tmp_path: Path, name: str
) -> None:
    spec = DEMO_BACKBONES[name]
    home = tmp_path / "home"
    folder = ensure_demo(name, home)
    weights = folder / "model.safetensors"
    _edit(weights)  # an older release's weights: intact in themselves, their marker records their own hash
    marker = json.loads((folder / MARKER).read_text())
    older = file_sha256(weights)
    (folder / MARKER).write_text(json.dumps({**marker, "sha256": older}))
    adapter = load_backbone(name, home=home)
    assert len(adapter.notices) == 1
    notice = adapter.notices[0]
    assert "\n" not in notice and older[:12] in notice and "replaced by the copy shipped with care" in notice
    shipped = read_manifest()[spec.weights]["sha256"]
    assert file_sha256(weights) == shipped and json.loads((folder / MARKER).read_text())["sha256"] == shipped
    assert load_backbone(name, home=home).notices == []


def test_the_byte_tokenizer_encodes_given_pieces_as_one_token_where_a_word_is_made_of_them() -> None:
    text = "Is there? ASSISTANT: three"
    plain = build_byte_tokenizer(["<image>"])
    assert len(plain(text)["input_ids"]) == 1 + len(text.encode())  # <s>, then one token per byte
    pieced = build_byte_tokenizer(["<image>"], pieces=(" there", "SS", "IST", "ANT", " A"))
    ids = pieced(text)["input_ids"]
    # by hand: " ASSISTANT" is " A" SS IST ANT; " three" shares only " th" with " there" (Ġ is the byte-level space)
    assert pieced.convert_ids_to_tokens(ids) == ["<s>", "I", "s", "Ġthere", "?", "ĠA", "SS", "IST", "ANT", ":",
                                                 "Ġth", "r", "e", "e"]  # fmt: skip
    assert pieced.decode(ids, skip_special_tokens=True) == text
    assert pieced.unk_token_id not in ids
    with pytest.raises(ValueError, match="not one word"):
        build_byte_tokenizer([], pieces=("two words",))


def test_the_byte_tokenizer_cuts_words_with_a_given_regex_so_a_piece_may_span_punctuation_and_a_line_break() -> None:
    text = "Is it?\nAnswer"
    with pytest.raises(ValueError, match="not one word"):  # GPT-2's regex: "?" and "\n" are two words
        build_byte_tokenizer([], pieces=("?\n",))
    qwen = build_byte_tokenizer([], add_bos=False, pieces=("?\n", "Answer"), split_pattern=QWEN2_SPLIT_PATTERN)
    ids = qwen(text)["input_ids"]
    # by hand, as the Qwen2 tokenizer cuts it: "Is" " it" "?\n" "Answer" (Ċ is the byte-level line break)
    assert qwen.convert_ids_to_tokens(ids) == ["I", "s", "Ġ", "i", "t", "?Ċ", "Answer"]
    assert qwen.decode(ids) == text
    plain = build_byte_tokenizer([], add_bos=False)
    assert (
        build_byte_tokenizer([], add_bos=False, split_pattern=QWEN2_SPLIT_PATTERN)(text)["input_ids"]
        == plain(text)["input_ids"]
    )  # no pieces: the same byte ids whatever the regex
