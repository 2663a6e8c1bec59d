"""Qwen3_5Adapter on the tiny-qwen3.5-random demo: merged tokens against the processor's placeholders, the merger as
projector, the reduced rows where the hybrid (Gated DeltaNet + full attention) decoder consumes them, mrope positions
of kept rows, eager decoding (the static loop refuses the decoder) and batched answers."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from care_core.backbones import ImageTokens, Qwen3VLMergerProjector, load_backbone
from care_core.backbones.chat_adapter import collate_left_padded
from care_core.backbones.probes import VISION_PROBES
from care_core.backbones.qwen3_5.adapter import Qwen3_5Adapter
from care_core.backbones.static_generation import unsupported_reason
from care_core.errors import MethodError
from care_core.scoring import responses_fd, responses_jvp, unit_directions

from ._helpers import forward_with_image_rows, noise_image, reference_ids

QUESTION = "What is in the image?"
DEMO = "tiny-qwen3.5-random"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def qwen35(demo_home: Path) -> Qwen3_5Adapter:
    adapter = load_backbone(DEMO, home=demo_home)
    assert isinstance(adapter, Qwen3_5Adapter)
    return adapter


@pytest.fixture(scope="module")
def image() -> Any:
    return noise_image(500, 800, seed=5)


@pytest.fixture(scope="module")
def tokens(qwen35: Qwen3_5Adapter, image: Any) -> ImageTokens:
    return qwen35.encode_image(image)


@pytest.fixture(scope="module")
def standard(qwen35: Qwen3_5Adapter, image: Any) -> dict[str, Any]:
    inputs = qwen35.processor(text=qwen35.prompt(QUESTION), images=image, return_tensors="pt")
    out, image_rows = forward_with_image_rows(qwen35, inputs)
    return {"inputs": inputs, "logits": out.logits[0], "image_rows": image_rows}


def seen_inputs(module: torch.nn.Module, run: Any) -> dict[str, Any]:
    """The keyword arguments ``module`` receives during ``run()`` (its first call)."""
    seen: dict[str, Any] = {}

    def grab(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not seen:
            seen.update(kwargs)

    hook = module.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        run()
    finally:
        hook.remove()
    return seen


def test_the_demo_decoder_mixes_gated_deltanet_and_full_attention(qwen35: Qwen3_5Adapter) -> None:
    layers: Any = qwen35._language_model.layers
    assert [hasattr(layer, "linear_attn") for layer in layers] == [True, True, True, False]
    assert not hasattr(qwen35.model.config.vision_config, "deepstack_visual_indexes")


# ---------------------------------------------------------------------------------------- tokens
@pytest.mark.parametrize(("hw", "expected"), [((336, 336), 100), ((500, 800), 400), ((1024, 768), 768)])
def test_token_counts_match_the_processors_placeholders(
    qwen35: Qwen3_5Adapter, hw: tuple[int, int], expected: int
) -> None:
    height, width = hw
    image = noise_image(height, width)
    tokens = qwen35.encode_image(image)
    inputs = qwen35.processor(text=qwen35.prompt("q"), images=image, return_tensors="pt")
    placeholders = int((inputs["input_ids"] == qwen35.image_token_id).sum())
    t, gh, gw = inputs["image_grid_thw"][0].tolist()
    # counts by hand: sides rounded to multiples of 32 px (336 -> 320, 500 -> 512, 800 -> 800), one token per 32x32
    assert t == 1 and tokens.num_tokens == placeholders == (gh // 2) * (gw // 2) == expected
    assert tokens.grid == (gh // 2, gw // 2)
    assert tokens.features.shape == (placeholders, 4 * qwen35.model.config.vision_config.hidden_size)
    assert "deepstack" not in tokens.model_inputs


def test_projector_is_the_towers_merger(qwen35: Qwen3_5Adapter, tokens: ImageTokens, standard: Any) -> None:
    projector = qwen35.projector
    assert isinstance(projector, Qwen3VLMergerProjector) and projector.norm_first_mlp() is not None
    visual = qwen35.model.model.visual
    with torch.no_grad():
        out = visual(tokens.model_inputs["pixel_values"], grid_thw=tokens.model_inputs["image_grid_thw"])
        projected = projector(tokens.features)
    assert torch.equal(projected, out.pooler_output)
    assert torch.allclose(projected, standard["image_rows"], atol=1e-6)  # what the language model receives


def test_jvp_through_the_merger_agrees_with_fd_in_float64(qwen35: Qwen3_5Adapter, tokens: ImageTokens) -> None:
    features = tokens.features[:40].double()
    projector = copy.deepcopy(qwen35.projector).double()
    directions = unit_directions(6, features.shape[1], seed=0, dtype=torch.float64)
    jvp = responses_jvp(features, projector, directions)
    fd = responses_fd(features, projector, directions, 1e-5)
    assert float(((jvp - fd).abs() / fd.abs()).max()) < 1e-7


# ---------------------------------------------------------------------------------- language model
def test_all_tokens_logits_equal_the_models_own_forward(
    qwen35: Qwen3_5Adapter, tokens: ImageTokens, standard: Any
) -> None:
    with torch.no_grad():
        projected = qwen35.projector(tokens.features)
    logits = qwen35.language_model_logits(QUESTION, tokens, projected)
    assert logits.shape == standard["logits"].shape
    assert torch.allclose(logits, standard["logits"], atol=1e-5, rtol=0)
    full = qwen35.full_positions(QUESTION, tokens)
    assert torch.equal(full["input_ids"], standard["inputs"]["input_ids"])


def test_k_rows_are_k_rows_where_the_decoder_consumes_them(qwen35: Qwen3_5Adapter, tokens: ImageTokens) -> None:
    _, cols = tokens.grid  # type: ignore[misc]
    kept = torch.tensor([cols + 3, 0, 5 * cols + 7, -1, tokens.num_tokens - 1])  # any order; -1: a merged row
    k, n = kept.numel(), tokens.num_tokens
    with torch.no_grad():
        projected = qwen35.projector(tokens.features[kept.clamp(min=0)])
    layers: Any = qwen35._language_model.layers

    def run() -> None:
        qwen35.language_model_logits(QUESTION, tokens, projected, kept)

    decoder = seen_inputs(qwen35._language_model, run)
    linear = seen_inputs(layers[0].linear_attn, run)  # the first Gated DeltaNet layer's input rows
    full_attention = seen_inputs(layers[3].self_attn, run)
    full = qwen35.full_positions(QUESTION, tokens)
    length = full["input_ids"].shape[1]
    start = int((full["input_ids"][0] == qwen35.image_token_id).nonzero()[0])
    assert linear["hidden_states"].shape[1] == full_attention["hidden_states"].shape[1] == length - n + k
    assert torch.equal(decoder["inputs_embeds"][0, start : start + k], projected)  # rows in the order given
    pos = decoder["position_ids"]  # (4, 1, L_K): text row, then t, h, w
    token = torch.where(kept < 0, torch.full_like(kept, n - 1), kept)
    assert torch.equal(pos[1:, 0, start : start + k], full["positions"][:, 0, start + token])
    assert torch.equal(pos[1:, 0, start + k :], full["positions"][:, 0, start + n :])


def test_full_k_answer_equals_the_models_own_generate(
    qwen35: Qwen3_5Adapter, tokens: ImageTokens, standard: Any
) -> None:
    with torch.no_grad():
        projected = qwen35.projector(tokens.features)
    answer = qwen35.generate(QUESTION, tokens, projected, max_new_tokens=4)
    assert answer.decoding == "eager"
    assert list(answer.token_ids) == reference_ids(qwen35, dict(standard["inputs"]), 4)[: len(answer.token_ids)]


def test_the_static_loop_refuses_the_hybrid_decoder(qwen35: Qwen3_5Adapter) -> None:
    reason = unsupported_reason(qwen35.model)
    assert reason is not None and "qwen3_5_text decoder" in reason


# ------------------------------------------------------------------------------------------ batches
def _three_samples(qwen35: Qwen3_5Adapter) -> tuple[list[str], list[ImageTokens], list[Any], list[Any]]:
    images = [noise_image(336, 336, seed=1), noise_image(500, 800, seed=2), noise_image(300, 900, seed=3)]
    tokens = qwen35.encode_images(images)
    kept: list[torch.Tensor | None] = [torch.tensor([3, 1, -1, 5]), None, torch.arange(0, tokens[2].num_tokens, 3)]
    with torch.no_grad():
        rows = [qwen35.projector(tokens[0].features[[3, 1, 0, 5]]), qwen35.projector(tokens[1].features),
                qwen35.projector(tokens[2].features[kept[2]])]  # fmt: skip
    return ["What is it?", "Describe the picture in detail.", "Colour?"], tokens, rows, kept


def test_left_padded_prompts_give_each_prompts_own_last_logits(qwen35: Qwen3_5Adapter) -> None:
    """The recurrent layers see padding before each shorter prompt: its last logits are still its own."""
    samples = [qwen35._lm_inputs(*args) for args in zip(*_three_samples(qwen35), strict=True)]
    assert len({int(s["input_ids"].shape[1]) for s in samples}) == 3  # three lengths: two rows are padded
    batch = collate_left_padded(samples, qwen35._pad_token_id)
    with torch.no_grad():
        batched = qwen35.model(**batch).logits[:, -1]
        for i, sample in enumerate(samples):
            alone = qwen35.model(**sample).logits[0, -1]
            assert torch.allclose(batched[i], alone, atol=1e-4, rtol=0)


def test_generate_batch_equals_each_sample_alone(qwen35: Qwen3_5Adapter) -> None:
    questions, tokens, rows, kept = _three_samples(qwen35)
    batch = qwen35.generate_batch(questions, tokens, rows, kept, 5)
    for i, got in enumerate(batch):
        alone = qwen35.generate(questions[i], tokens[i], rows[i], 5, kept[i])
        assert got.token_ids == alone.token_ids and got.text == alone.text


# ------------------------------------------------------------------------------------------ probes, CLI
def test_probes_refuse_in_one_line(qwen35: Qwen3_5Adapter, tokens: ImageTokens) -> None:
    for name in sorted(VISION_PROBES):
        with pytest.raises(MethodError, match=rf"{DEMO}: Qwen3.5 has no CLS token; {name} is not"):
            qwen35.probe_inputs(tokens, [name])
    with pytest.raises(MethodError, match=r"Gated DeltaNet linear attention") as info:
        qwen35.check_probes(["language_model"], "fastv")
    assert "\n" not in str(info.value)


def test_methods_list_qwen3_5_only_where_its_adapter_offers_their_probes() -> None:
    from care_core.methods import method_class, method_names

    offers = Qwen3_5Adapter.capabilities.fget(None)  # type: ignore[attr-defined]
    for name in method_names():
        assert method_class(name).serves("qwen3.5") == (method_class(name).needs <= offers), name
    assert not method_class("fastv").serves("qwen3.5") and not method_class("sparsevlm").serves("qwen3.5")


def test_care_methods_says_what_qwen3_5_lacks_for_fastv(care: Any) -> None:
    result = care("methods", "fastv", "--json")
    assert result.code == 0, result.err
    (row,) = json.loads(result.out)["methods"]
    assert "qwen3.5" not in row["backbones"] and "qwen2.5-vl" in row["backbones"]
    assert "softmax attention" in row["not_served"]["qwen3.5"]


def test_care_reduce_runs_the_demo(care: Any, qwen35: Qwen3_5Adapter) -> None:
    picture = EXAMPLES / "astronaut.jpg"
    result = care("reduce", picture, "--model", DEMO, "--method", "care", "--keep", "16", "--json",
                  "--device", "cpu")  # fmt: skip
    assert result.code == 0, result.err
    report = json.loads(result.out)
    image = Image.open(picture).convert("RGB")
    inputs = qwen35.processor(text=qwen35.prompt("q"), images=image, return_tensors="pt")
    n = int((inputs["input_ids"] == qwen35.image_token_id).sum())
    assert report["backbone"]["family"] == "qwen3.5"
    assert (report["N"], report["K"], len(report["token_index"])) == (n, 16, 16)
