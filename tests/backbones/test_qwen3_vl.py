"""Qwen3VLAdapter on the tiny-qwen3-vl demo: merged tokens against the processor's placeholders, the main merger as
projector, every deepstack level reduced with the main rows, mrope positions of kept rows, batched encoding and
batched answers, the float64 responses through the merger."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from care_core import CaReConfig, care_reduce
from care_core.backbones import ImageTokens, Qwen3VLAdapter, Qwen3VLMergerProjector
from care_core.backbones.chat_adapter import collate_left_padded
from care_core.backbones.probes import VISION_PROBES
from care_core.errors import MethodError
from care_core.scoring import responses_fd, responses_jvp, unit_directions

from ._helpers import forward_with_image_rows, noise_image, reference_ids

QUESTION = "What is in the image?"


@pytest.fixture(scope="module")
def image() -> Any:
    return noise_image(500, 800, seed=5)


@pytest.fixture(scope="module")
def tokens(qwen3_demo: Qwen3VLAdapter, image: Any) -> ImageTokens:
    return qwen3_demo.encode_image(image)


@pytest.fixture(scope="module")
def standard(qwen3_demo: Qwen3VLAdapter, image: Any) -> dict[str, Any]:
    inputs = qwen3_demo.processor(text=qwen3_demo.prompt(QUESTION), images=image, return_tensors="pt")
    out, image_rows = forward_with_image_rows(qwen3_demo, inputs)
    return {"inputs": inputs, "logits": out.logits[0], "image_rows": image_rows}


def tower_deepstack(adapter: Qwen3VLAdapter, tokens: ImageTokens) -> list[torch.Tensor]:
    """Each deepstack level (N, d_t) recomputed from the tower's own block outputs and deepstack mergers."""
    visual = adapter.model.model.visual
    taps = list(adapter.model.config.vision_config.deepstack_visual_indexes)
    seen: dict[int, torch.Tensor] = {}
    hooks = [visual.blocks[i].register_forward_hook(lambda m, a, out, i=i: seen.update({i: out})) for i in taps]
    try:
        with torch.no_grad():
            visual(tokens.model_inputs["pixel_values"], grid_thw=tokens.model_inputs["image_grid_thw"])
            return [merger(seen[i]) for i, merger in zip(taps, visual.deepstack_merger_list, strict=True)]
    finally:
        for hook in hooks:
            hook.remove()


def text_model_inputs(adapter: Qwen3VLAdapter, run: Any) -> dict[str, Any]:
    """The keyword arguments the text model (decoder) receives during ``run()``."""
    seen: dict[str, Any] = {}
    hook = adapter._language_model.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    try:
        run()
    finally:
        hook.remove()
    return seen


# ---------------------------------------------------------------------------------------- tokens
@pytest.mark.parametrize(("hw", "expected"), [((336, 336), 100), ((500, 800), 400), ((1024, 768), 768),
                                              ((200, 900), None)])  # fmt: skip
def test_token_counts_match_the_processors_placeholders(
    qwen3_demo: Qwen3VLAdapter, hw: tuple[int, int], expected: int | None
) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    height, width = hw
    image = noise_image(height, width)
    tokens = qwen3_demo.encode_image(image)
    inputs = qwen3_demo.processor(text=qwen3_demo.prompt("q"), images=image, return_tensors="pt")
    placeholders = int((inputs["input_ids"] == qwen3_demo.image_token_id).sum())
    t, gh, gw = inputs["image_grid_thw"][0].tolist()
    assert t == 1 and tokens.num_tokens == placeholders == (gh // 2) * (gw // 2)
    if expected is not None:  # counts worked out by hand for the 32 px resize factor
        assert placeholders == expected
    assert smart_resize(height, width, factor=32, min_pixels=65536, max_pixels=16777216) == (gh * 16, gw * 16)
    assert tokens.grid == (gh // 2, gw // 2)
    d_v, d_t = qwen3_demo.model.config.vision_config.hidden_size, qwen3_demo.model.config.text_config.hidden_size
    assert tokens.features.shape == (placeholders, 4 * d_v)
    assert tokens.model_inputs["deepstack"].shape == (2, placeholders, d_t)
    assert tokens.seen_box == (0.0, 0.0, float(width), float(height))
    boxes = tokens.boxes.double()
    assert float(((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])).sum()) == pytest.approx(height * width)


def test_features_projector_and_deepstack_are_the_towers(
    qwen3_demo: Qwen3VLAdapter, tokens: ImageTokens, standard: Any
) -> None:
    projector = qwen3_demo.projector
    assert isinstance(projector, Qwen3VLMergerProjector) and projector.unit == 4
    visual = qwen3_demo.model.model.visual
    with torch.no_grad():
        out = visual(tokens.model_inputs["pixel_values"], grid_thw=tokens.model_inputs["image_grid_thw"])
        projected = projector(tokens.features)
    assert torch.equal(projected, out.pooler_output)  # the main merger, bit for bit
    assert torch.allclose(projected, standard["image_rows"], atol=1e-6)  # what the language model receives
    for level, want in zip(tokens.model_inputs["deepstack"], tower_deepstack(qwen3_demo, tokens), strict=True):
        assert torch.allclose(level, want, atol=1e-6)
    with pytest.raises(ValueError, match="expected rows of"):
        projector(tokens.features[:, :32])


def test_jvp_through_the_merger_agrees_with_fd_in_float64(qwen3_demo: Qwen3VLAdapter, tokens: ImageTokens) -> None:
    features = tokens.features[:60].double()
    projector = copy.deepcopy(qwen3_demo.projector).double()
    directions = unit_directions(8, features.shape[1], seed=0, dtype=torch.float64)
    jvp = responses_jvp(features, projector, directions)
    fd = responses_fd(features, projector, directions, 1e-5)
    assert jvp.shape == fd.shape == (8, 60)
    assert float(((jvp - fd).abs() / fd.abs()).max()) < 1e-7
    # and CaRe runs end to end on the merged tokens with either engine
    for engine in ("fd", "jvp"):
        red = care_reduce(tokens.features.double(), projector, tokens.positions, keep=20,
                          config=CaReConfig(m=8, engine=engine))  # fmt: skip
        assert red.indices.numel() == 20 and red.tokens.shape == (20, tokens.features.shape[1])


# ---------------------------------------------------------------------------------- language model
def test_all_tokens_logits_equal_the_models_own_forward(
    qwen3_demo: Qwen3VLAdapter, tokens: ImageTokens, standard: Any
) -> None:
    with torch.no_grad():
        projected = qwen3_demo.projector(tokens.features)
    logits = qwen3_demo.language_model_logits(QUESTION, tokens, projected)
    assert logits.shape == standard["logits"].shape
    assert torch.allclose(logits, standard["logits"], atol=1e-5, rtol=0)
    full = qwen3_demo.full_positions(QUESTION, tokens)
    assert torch.equal(full["input_ids"], standard["inputs"]["input_ids"])
    assert torch.equal(full["mm_token_type_ids"], standard["inputs"]["mm_token_type_ids"].long())
    # without the deepstack rows the answer changes: they are really fed
    inputs = qwen3_demo._lm_inputs(QUESTION, tokens, projected, None)
    image = inputs["mm_encoder_outputs"]["image"]
    image.deepstack_features = [[torch.zeros_like(level[0])] for level in image.deepstack_features]
    with torch.no_grad():
        assert not torch.allclose(qwen3_demo.model(**inputs).logits[0], standard["logits"], atol=1e-4)


def test_k_rows_feed_k_placeholders_and_k_rows_at_every_deepstack_level(
    qwen3_demo: Qwen3VLAdapter, tokens: ImageTokens
) -> None:
    _, cols = tokens.grid  # type: ignore[misc]
    kept = torch.tensor([cols + 3, 0, 5 * cols + 7, -1, tokens.num_tokens - 1])  # any order; -1: a merged row
    k, n = kept.numel(), tokens.num_tokens
    with torch.no_grad():
        projected = qwen3_demo.projector(tokens.features[kept.clamp(min=0)])
    seen = text_model_inputs(qwen3_demo, lambda: qwen3_demo.language_model_logits(QUESTION, tokens, projected, kept))
    full = qwen3_demo.full_positions(QUESTION, tokens)
    start = int((full["input_ids"][0] == qwen3_demo.image_token_id).nonzero()[0])
    mask = seen["visual_pos_masks"][0]
    assert int(mask.sum()) == k and torch.equal(mask.nonzero().flatten(), torch.arange(start, start + k))
    assert mask.numel() == full["input_ids"].shape[1] - n + k
    assert torch.equal(seen["inputs_embeds"][0, start : start + k], projected)  # rows in the order given
    want = tower_deepstack(qwen3_demo, tokens)
    levels = seen["deepstack_visual_embeds"]
    assert len(levels) == len(want) == 2
    for got, ref in zip(levels, want, strict=True):
        assert got.shape == (k, ref.shape[1])
        real = kept >= 0
        assert torch.allclose(got[real], ref[kept[real]], atol=1e-6)  # each row: its own token's deepstack row
        assert torch.equal(got[~real], torch.zeros_like(got[~real]))  # a row tied to no token: nothing added
    # mrope: each kept row has its token's (t, h, w); the text after the image keeps its positions
    pos = seen["position_ids"]
    token = torch.where(kept < 0, torch.full_like(kept, n - 1), kept)
    assert torch.equal(pos[1:, 0, start : start + k], full["positions"][:, 0, start + token])
    assert torch.equal(pos[1:, 0, start + k :], full["positions"][:, 0, start + n :])


def test_full_k_answer_equals_the_models_own_generate(
    qwen3_demo: Qwen3VLAdapter, tokens: ImageTokens, standard: Any
) -> None:
    with torch.no_grad():
        projected = qwen3_demo.projector(tokens.features)
    answer = qwen3_demo.generate(QUESTION, tokens, projected, max_new_tokens=4)
    assert list(answer.token_ids) == reference_ids(qwen3_demo, dict(standard["inputs"]), 4)[: len(answer.token_ids)]


# ------------------------------------------------------------------------------------------ batches
def test_batched_encoding_equals_each_image_alone(qwen3_demo: Qwen3VLAdapter) -> None:
    images = [noise_image(336, 336, seed=1), noise_image(500, 800, seed=2), noise_image(300, 900, seed=3)]
    batch = qwen3_demo.encode_images(images)
    for image, got in zip(images, batch, strict=True):
        alone = qwen3_demo.encode_image(image)
        assert got.grid == alone.grid and got.num_tokens == alone.num_tokens
        assert torch.allclose(got.features, alone.features, atol=1e-5)
        assert torch.allclose(got.model_inputs["deepstack"], alone.model_inputs["deepstack"], atol=1e-5)
        assert torch.equal(got.boxes, alone.boxes) and torch.equal(got.positions, alone.positions)
        assert torch.equal(got.model_inputs["pixel_values"], alone.model_inputs["pixel_values"])


def test_generate_batch_equals_each_sample_alone(qwen3_demo: Qwen3VLAdapter) -> None:
    images = [noise_image(336, 336, seed=1), noise_image(500, 800, seed=2), noise_image(300, 900, seed=3)]
    tokens = qwen3_demo.encode_images(images)
    kept: list[torch.Tensor | None] = [torch.tensor([3, 1, -1, 5]), None, torch.arange(0, tokens[2].num_tokens, 3)]
    with torch.no_grad():
        rows = [qwen3_demo.projector(tokens[0].features[[3, 1, 0, 5]]), qwen3_demo.projector(tokens[1].features),
                qwen3_demo.projector(tokens[2].features[kept[2]])]  # fmt: skip
    questions = ["What is it?", "Describe the picture in detail.", "Colour?"]
    batch = qwen3_demo.generate_batch(questions, tokens, rows, kept, 5)
    for i, got in enumerate(batch):
        alone = qwen3_demo.generate(questions[i], tokens[i], rows[i], 5, kept[i])
        assert got.token_ids == alone.token_ids and got.text == alone.text
    # the collated batch joins every deepstack level sample after sample
    samples = [qwen3_demo._lm_inputs(q, t, r, k) for q, t, r, k in zip(questions, tokens, rows, kept, strict=True)]
    joined = collate_left_padded(samples, qwen3_demo._pad_token_id)["mm_encoder_outputs"]["image"]
    assert [r.shape[0] for r in joined.pooler_output] == [4, tokens[1].num_tokens, kept[2].numel()]  # type: ignore[union-attr]
    for level in range(2):
        parts = [s["mm_encoder_outputs"]["image"].deepstack_features[level][0] for s in samples]
        assert len(joined.deepstack_features[level]) == 3
        assert all(torch.equal(a, b) for a, b in zip(joined.deepstack_features[level], parts, strict=True))


# ------------------------------------------------------------------------------------------ probes
def test_cls_probes_refuse_in_one_line(qwen3_demo: Qwen3VLAdapter, tokens: ImageTokens) -> None:
    assert qwen3_demo.capabilities == frozenset({"question", "language_model"})
    for name in sorted(VISION_PROBES):
        with pytest.raises(MethodError, match=rf"tiny-qwen3-vl: Qwen3-VL has no CLS token; {name} is not"):
            qwen3_demo.probe_inputs(tokens, [name])
    with pytest.raises(MethodError, match=r"method 'visionzip' cannot run on tiny-qwen3-vl") as info:
        qwen3_demo.check_probes(["keys", "cls_attention"], "visionzip")
    assert "\n" not in str(info.value)


def test_in_llm_methods_run_on_the_language_model_probe(qwen3_demo: Qwen3VLAdapter) -> None:
    """FastV and SparseVLM read the language model's attention over the prompt's input embeddings (the deepstack
    rows are added inside the decoder, not to those embeddings); CaRe runs beside them."""
    from care_core.budget import Budget
    from care_core.pipeline import ReductionPipeline

    image = noise_image(336, 336, seed=4)
    tokens = qwen3_demo.encode_image(image)
    run = qwen3_demo.language_model_probe(tokens, QUESTION)
    start, end = run.image_span
    with torch.no_grad():
        assert end - start == tokens.num_tokens
        assert torch.equal(run.input_embeddings()[start:end], qwen3_demo.projector(tokens.features))
    result = ReductionPipeline(qwen3_demo, ["fastv", "sparsevlm", "care"])(image, QUESTION, [Budget.keep(16)])
    assert [r.method for r in result.runs] == ["fastv", "sparsevlm", "care"]
    assert all(r.projected.shape[0] == r.result.num_tokens for r in result.runs)
    assert result.runs[2].result.num_tokens == 16
