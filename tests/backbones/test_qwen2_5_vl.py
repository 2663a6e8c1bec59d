"""Qwen2_5_VLAdapter on the tiny-qwen2.5-vl demo: merged tokens, the merger as projector, geometry, mrope
positions of kept tokens, mm_token_type_ids, the torchvision-free processor and the probes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from care_core import CaReConfig, care_reduce
from care_core.backbones import ImageTokens, Qwen2_5_VLAdapter, QwenMergerProjector, load_backbone
from care_core.backbones.probes import VISION_PROBES, LanguageModelRun
from care_core.errors import MethodError
from care_core.scoring import responses_fd, responses_jvp, unit_directions
from care_core.vocabulary import PROBES

from ._helpers import Unchanged, forward_with_image_rows, noise_image, position_image

QUESTION = "What is in the image?"
SIZES = [(672, 672), (500, 800), (900, 300)]


@pytest.fixture(scope="module")
def image() -> Any:
    return noise_image(500, 800, seed=5)


@pytest.fixture(scope="module")
def tokens(qwen_demo: Qwen2_5_VLAdapter, image: Any) -> ImageTokens:
    return qwen_demo.encode_image(image)


@pytest.fixture(scope="module")
def standard(qwen_demo: Qwen2_5_VLAdapter, image: Any) -> dict[str, Any]:
    inputs = qwen_demo.processor(text=qwen_demo.prompt(QUESTION), images=image, return_tensors="pt")
    out, image_rows = forward_with_image_rows(qwen_demo, inputs)
    return {"inputs": inputs, "logits": out.logits[0], "image_rows": image_rows}


# ---------------------------------------------------------------------------------------- tokens
@pytest.mark.parametrize("hw", SIZES)
def test_token_counts_match_processor(qwen_demo: Qwen2_5_VLAdapter, hw: tuple[int, int]) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    height, width = hw
    image = noise_image(height, width)
    tokens = qwen_demo.encode_image(image)
    inputs = qwen_demo.processor(text=qwen_demo.prompt("q"), images=image, return_tensors="pt")
    placeholders = int((inputs["input_ids"] == qwen_demo.image_token_id).sum())
    t, gh, gw = inputs["image_grid_thw"][0].tolist()
    assert t == 1 and tokens.num_tokens == placeholders == (gh // 2) * (gw // 2)
    assert tokens.grid == (gh // 2, gw // 2)
    assert smart_resize(height, width, factor=28, min_pixels=3136, max_pixels=12845056) == (gh * 14, gw * 14)
    d_v = qwen_demo.model.config.vision_config.hidden_size
    assert tokens.features.shape == (placeholders, 4 * d_v)
    assert tokens.views is None and tokens.seen_box == (0.0, 0.0, float(width), float(height))
    assert qwen_demo.visual_tokens_fed(tokens, placeholders) == placeholders


def test_features_and_merger_projector(qwen_demo: Qwen2_5_VLAdapter, tokens: ImageTokens, standard: Any) -> None:
    projector = qwen_demo.projector
    assert isinstance(projector, QwenMergerProjector) and projector is qwen_demo.projector
    with torch.no_grad():
        projected = projector(tokens.features)
        merger = qwen_demo.model.model.visual.merger
        d_v = qwen_demo.model.config.vision_config.hidden_size
        assert torch.equal(projected, merger(tokens.features.reshape(-1, d_v)))  # the merger, bit for bit
    assert torch.allclose(projected, standard["image_rows"], atol=1e-6)  # what the LM receives
    # the window permutation is undone: the tower's raw (window-ordered) states, regrouped, give the same tokens
    from transformers.vision_utils import get_vision_window_index

    vc = qwen_demo.model.config.vision_config
    thw = tokens.model_inputs["image_grid_thw"]
    with torch.no_grad():
        raw = qwen_demo.model.model.visual(tokens.model_inputs["pixel_values"], grid_thw=thw).last_hidden_state
    window, _ = get_vision_window_index(thw, spatial_merge_size=2, window_size=vc.window_size, patch_size=14)
    assert not torch.equal(window, torch.arange(window.numel()))  # the permutation is not trivial here
    assert torch.equal(raw.view(-1, 4, d_v)[window.argsort()].reshape(tokens.num_tokens, -1), tokens.features)
    with pytest.raises(ValueError, match="expected rows of"):
        projector(tokens.features[:, :d_v])


def test_jvp_through_merger_agrees_with_fd_in_float64(qwen_demo: Qwen2_5_VLAdapter, tokens: ImageTokens) -> None:
    features = tokens.features[:60].double()
    projector = copy.deepcopy(qwen_demo.projector).double()
    directions = unit_directions(8, features.shape[1], seed=0, dtype=torch.float64)
    jvp = responses_jvp(features, projector, directions)
    fd = responses_fd(features, projector, directions, 5e-4)
    assert jvp.shape == fd.shape == (8, 60)
    assert float(((jvp - fd).abs() / fd.abs()).max()) < 1e-4
    red = care_reduce(tokens.features, qwen_demo.projector, tokens.positions, keep=20, config=CaReConfig(m=8))
    assert red.indices.numel() == 20 and red.tokens.shape == (20, tokens.features.shape[1])


# -------------------------------------------------------------------------------------- geometry
@pytest.mark.parametrize("hw", SIZES)
def test_boxes_point_at_the_pixels_the_tokens_saw(qwen_demo: Qwen2_5_VLAdapter, hw: tuple[int, int]) -> None:
    height, width = hw
    tokens = qwen_demo.encode_image(position_image(height, width))
    ip = qwen_demo.processor.image_processor
    # pixel_values rows: one 14x14 patch each, (channel, frame, y, x) flattened, 2x2 groups of 4 consecutive rows
    pv = tokens.model_inputs["pixel_values"].double().view(-1, 3, 2, 14, 14)[:, :, 0]
    mean = torch.tensor(ip.image_mean, dtype=torch.float64)[None, :, None, None]
    std = torch.tensor(ip.image_std, dtype=torch.float64)[None, :, None, None]
    rgb = ((pv * std + mean) / float(ip.rescale_factor)).mean(dim=(-1, -2))  # (4N, 3)
    rgb = rgb.view(tokens.num_tokens, 4, 3).mean(1)
    x_seen, y_seen = rgb[:, 0] / 255 * width, rgb[:, 1] / 255 * height
    boxes = tokens.boxes.double()
    cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
    half_x, half_y = (boxes[:, 2] - boxes[:, 0]) / 2, (boxes[:, 3] - boxes[:, 1]) / 2
    assert bool(((cx - x_seen).abs() <= half_x).all()), float((cx - x_seen).abs().max())
    assert bool(((cy - y_seen).abs() <= half_y).all()), float((cy - y_seen).abs().max())
    assert bool(((cx - x_seen).abs() <= 0.3 * half_x).all() and ((cy - y_seen).abs() <= 0.3 * half_y).all())
    assert torch.allclose(tokens.positions.double()[:, 0], cy / height, atol=1e-6)
    assert torch.allclose(tokens.positions.double()[:, 1], cx / width, atol=1e-6)
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    assert float(areas.sum()) == pytest.approx(height * width, rel=1e-9)


# ---------------------------------------------------------------------------------- language model
def test_full_k_logits_equal_standard_path(qwen_demo: Qwen2_5_VLAdapter, tokens: ImageTokens, standard: Any) -> None:
    with torch.no_grad():
        projected = qwen_demo.projector(tokens.features)
    logits = qwen_demo.language_model_logits(QUESTION, tokens, projected)
    assert logits.shape == standard["logits"].shape
    assert torch.allclose(logits, standard["logits"], atol=1e-5, rtol=0)
    # the same ids and mm_token_type_ids as the processor's
    full = qwen_demo.full_positions(QUESTION, tokens)
    assert torch.equal(full["input_ids"], standard["inputs"]["input_ids"])
    assert torch.equal(full["mm_token_type_ids"], standard["inputs"]["mm_token_type_ids"].long())


@pytest.mark.parametrize("name", ["qwen_demo", "qwen3_demo"])
def test_full_prompt_positions_are_the_models_rope_index_kept_per_question_and_grid(
    request: pytest.FixtureRequest, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = request.getfixturevalue(name)
    images = [noise_image(300, 400, seed=1), noise_image(500, 260, seed=2)]
    tokens = [adapter.encode_image(image) for image in images]
    assert tokens[0].grid != tokens[1].grid
    want = {}
    for question in (QUESTION, "Describe the colours."):
        for image, t in zip(images, tokens, strict=True):
            inputs = adapter.processor(text=adapter.prompt(question), images=image, return_tensors="pt")
            positions, _ = adapter.model.model.get_rope_index(
                inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
            )  # the model's own, on the processor's prompt
            got, start = adapter.rope_positions(question, t)
            assert torch.equal(got, positions[:, 0]) and got.device.type == "cpu"
            assert int(inputs["input_ids"][0, start - 1]) != adapter.image_token_id
            assert bool((inputs["input_ids"][0, start : start + t.num_tokens] == adapter.image_token_id).all())
            want[question, t.grid] = got

    def walked(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("get_rope_index ran again for a prompt it has seen")

    monkeypatch.setattr(adapter.model.model, "get_rope_index", walked)
    for (question, grid), positions in want.items():
        t = tokens[0] if tokens[0].grid == grid else tokens[1]
        assert adapter.rope_positions(question, t)[0] is positions  # kept, not worked out again
        with torch.no_grad():
            inputs = adapter._lm_inputs(question, t, adapter.projector(t.features[:5]), torch.arange(5))
        assert int(inputs["position_ids"].shape[-1]) == positions.shape[1] - t.num_tokens + 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="device syncs need a CUDA device")
@pytest.mark.parametrize("name", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_prompt_assembly_never_waits_for_the_device(demo_home: Path, name: str) -> None:
    adapter = load_backbone(name, home=demo_home, device="cuda", dtype="float32")
    tokens = adapter.encode_image(noise_image(300, 400, seed=1))
    with torch.no_grad():
        rows = adapter.projector(tokens.features[:3])
    kept = torch.tensor([3, 0, -1])
    adapter._lm_inputs(QUESTION, tokens, rows, kept)  # the first call works the positions out (on the host)
    torch.cuda.set_sync_debug_mode("error")  # any wait for the device raises
    try:
        inputs = adapter._lm_inputs(QUESTION, tokens, rows, kept)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (
        inputs["position_ids"].device.type == "cuda"
        and inputs["position_ids"].shape[-1] == inputs["input_ids"].shape[1]
    )


def test_mm_token_type_ids_matter(qwen_demo: Qwen2_5_VLAdapter, tokens: ImageTokens, standard: Any) -> None:
    """Without mm_token_type_ids the model silently uses 1-D positions; our path must not."""
    inputs = {k: v for k, v in standard["inputs"].items() if k != "mm_token_type_ids"}
    qwen_demo.model.model.rope_deltas = None
    with torch.no_grad():
        without = qwen_demo.model(**inputs).logits[0]
    assert not torch.allclose(without, standard["logits"], atol=1e-4)  # the silent gotcha is real
    with torch.no_grad():
        ours = qwen_demo.language_model_logits(QUESTION, tokens, qwen_demo.projector(tokens.features))
    assert not torch.allclose(ours, without, atol=1e-4)
    # our positions are the model's mrope ids: image tokens differ from plain 1-D positions
    positions = qwen_demo._lm_inputs(QUESTION, tokens, qwen_demo.projector(tokens.features), None)["position_ids"]
    assert positions.shape[0] == 4 and not torch.equal(positions[1], positions[0])


def test_kept_tokens_keep_their_mrope_positions(qwen_demo: Qwen2_5_VLAdapter, tokens: ImageTokens) -> None:
    _, cols = tokens.grid  # type: ignore[misc]
    kept = torch.tensor([cols + 3, 0, 5 * cols + 7, -1, tokens.num_tokens - 1])  # any order, -1 = summary row
    with torch.no_grad():
        projected = qwen_demo.projector(tokens.features[kept.clamp(min=0)])
    full = qwen_demo.full_positions(QUESTION, tokens)
    seen: dict[str, torch.Tensor] = {}
    language_model = qwen_demo.model.model.language_model
    handle = language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.update(position_ids=kw["position_ids"], embeds=kw["inputs_embeds"]), with_kwargs=True
    )
    try:
        logits = qwen_demo.language_model_logits(QUESTION, tokens, projected, kept=kept)
    finally:
        handle.remove()
    pos = seen["position_ids"]  # (4, 1, L_K): text row, then t, h, w
    ids = full["input_ids"][0]
    start = int((ids == qwen_demo.image_token_id).nonzero()[0])
    n, k = tokens.num_tokens, kept.numel()
    assert pos.shape == (4, 1, ids.numel() - n + k) and logits.shape[0] == pos.shape[-1]
    image = pos[1:, 0, start : start + k]
    offset = int(full["positions"][1, 0, start])  # the image's rope offset s: (t, h, w) = (s, s + row, s + col)
    token = kept.clamp(min=0)  # -1 takes the last image token's position
    token[kept < 0] = n - 1
    assert torch.equal(image[0], torch.full((k,), offset))
    assert torch.equal(image[1], offset + token // cols)  # original row
    assert torch.equal(image[2], offset + token % cols)  # original column
    assert torch.equal(image, full["positions"][:, 0, start + token])
    # text before and after the image keeps its original positions
    assert torch.equal(pos[1:, 0, :start], full["positions"][:, 0, :start])
    assert torch.equal(pos[1:, 0, start + k :], full["positions"][:, 0, start + n :])
    assert torch.equal(pos[0, 0], torch.arange(pos.shape[-1]))
    assert torch.equal(seen["embeds"][0, start : start + k], projected)  # rows in the order given


def test_generate_with_reduced_tokens(qwen_demo: Qwen2_5_VLAdapter, tokens: ImageTokens, standard: Any) -> None:
    kept = torch.arange(0, tokens.num_tokens, 7)
    with torch.no_grad():
        projected = qwen_demo.projector(tokens.features[kept])
    answer = qwen_demo.generate(QUESTION, tokens, projected, max_new_tokens=4, kept=kept).text
    assert isinstance(answer, str)
    assert answer == qwen_demo.generate(QUESTION, tokens, projected, max_new_tokens=4, kept=kept).text
    # K = N: the same greedy tokens as the standard path
    with torch.no_grad():
        full = qwen_demo.generate(QUESTION, tokens, qwen_demo.projector(tokens.features), max_new_tokens=4).text
        out = qwen_demo.model.generate(**standard["inputs"], max_new_tokens=4, do_sample=False)
    new = out[0, standard["inputs"]["input_ids"].shape[1] :]
    assert full == qwen_demo.tokenizer.decode(new, skip_special_tokens=True).strip()


# ------------------------------------------------------------------------------------------ probes
def test_no_cls_probes_refuse(qwen_demo: Qwen2_5_VLAdapter, tokens: ImageTokens) -> None:
    assert qwen_demo.capabilities == frozenset({"question", "language_model"})
    for name in sorted(VISION_PROBES):
        with pytest.raises(MethodError, match=rf"tiny-qwen2\.5-vl: Qwen2\.5-VL has no CLS token; {name} is not"):
            qwen_demo.probe_inputs(tokens, [name])
    with pytest.raises(MethodError, match=r"method 'visionzip' cannot run on tiny-qwen2\.5-vl") as info:
        qwen_demo.check_probes(["keys", "cls_attention", "hidden_with_cls"], "visionzip")
    assert "\n" not in str(info.value) and "no CLS token" in str(info.value)
    qwen_demo.check_probes(["question", "language_model"], "fastv")  # offered: no error


def test_language_model_probe(qwen_demo: Qwen2_5_VLAdapter, tokens: ImageTokens) -> None:
    with Unchanged(qwen_demo.model):
        out = qwen_demo.probe_inputs(tokens, ["language_model", "question"], QUESTION)
    lm = out["language_model"]
    assert isinstance(lm, LanguageModelRun) and set(out) == {"language_model", "question"}
    start, end = lm.image_span
    assert end - start == tokens.num_tokens
    with Unchanged(qwen_demo.model):
        attentions = lm.attentions(1)
    # the eager reference with the same (mrope) inputs
    eager = copy.deepcopy(qwen_demo.model)
    eager.set_attn_implementation("eager")
    inputs = qwen_demo._lm_inputs(QUESTION, tokens, qwen_demo.projector(tokens.features), None, probe=True)
    with torch.no_grad():
        ref = eager(**inputs, output_attentions=True).attentions
    heads = qwen_demo.model.config.text_config.num_attention_heads
    for got, want in zip(attentions, ref[:2], strict=True):
        assert got.shape == (heads, lm.input_ids.numel(), lm.input_ids.numel())
        assert torch.allclose(got, want[0], atol=1e-6)
    with torch.no_grad():
        assert torch.allclose(lm.input_embeddings()[start:end], qwen_demo.projector(tokens.features))
    assert set(PROBES) - qwen_demo.capabilities == set(VISION_PROBES)
