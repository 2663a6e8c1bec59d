"""LlavaOnevisionAdapter on the tiny-llava-onevision demo: N before the model's pooling, the model's own sequence from
all N tokens (pooled or not), K reduced rows, geometry, CaRe's responses through the projector, batches, refusals."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from care_core.backbones import ImageTokens, LlavaOnevisionAdapter, load_backbone
from care_core.backbones.families import backbone_family, demo_backbones
from care_core.backbones.probes import LanguageModelRun
from care_core.errors import MethodError
from care_core.methods import method_class
from care_core.scoring import _as_mlp, responses_fd, responses_jvp, unit_directions

from ._helpers import forward_with_image_rows, noise_image, position_image, reference_ids

QUESTION = "What is in the image?"
# image (H, W) -> N, the unpadded grid and the grid the model's own sequence has after pooling (hand-computed:
# canvas by select_best_resolution, 27 patches per 384 px crop, unpad_image, pooling when sqrt(r*c / 9*27^2) > 1.1)
COUNTS = {
    (384, 384): (729 + 27 * 27, (27, 27), (27, 27)),  # canvas 384x384, 1 crop
    (500, 800): (729 + 50 * 81, (50, 81), (50, 81)),  # canvas 768x1152: 54x81, unpad drops 2 + 2 rows
    (300, 900): (729 + 27 * 81, (27, 81), (27, 81)),  # canvas 384x1152, 3 crops side by side
    (900, 1200): (729 + 81 * 108, (81, 108), (70, 93)),  # canvas 1152x1536, 12 crops: ratio 1.155 -> pooled
}
SMALL, POOLED = (500, 800), (900, 1200)


@pytest.fixture(scope="module")
def ov(demo_home: Path) -> LlavaOnevisionAdapter:
    adapter = load_backbone("tiny-llava-onevision", home=demo_home)
    assert isinstance(adapter, LlavaOnevisionAdapter)
    return adapter


@pytest.fixture(scope="module")
def images() -> dict[tuple[int, int], Any]:
    return {hw: noise_image(*hw, seed=i) for i, hw in enumerate(COUNTS)}


@pytest.fixture(scope="module")
def encoded(ov: LlavaOnevisionAdapter, images: dict[tuple[int, int], Any]) -> dict[tuple[int, int], ImageTokens]:
    return {hw: ov.encode_image(image) for hw, image in images.items()}


def standard(ov: LlavaOnevisionAdapter, image: Any) -> dict[str, Any]:
    """The model's own processor path: inputs, logits, its image rows and what its projector saw (one forward)."""
    inputs = ov.processor(text=ov.prompt(QUESTION), images=image, return_tensors="pt")
    seen: dict[str, torch.Tensor] = {}
    hook = ov.projector.register_forward_hook(lambda m, a, o: seen.update(inp=a[0]))
    try:
        out, image_rows = forward_with_image_rows(ov, inputs)
    finally:
        hook.remove()
    return {"inputs": inputs, "logits": out.logits[0], "projector_input": seen["inp"], "image_rows": image_rows}


@pytest.fixture(scope="module")
def standards(ov: LlavaOnevisionAdapter, images: dict[tuple[int, int], Any]) -> dict[tuple[int, int], Any]:
    return {hw: standard(ov, images[hw]) for hw in (SMALL, POOLED)}


# ---------------------------------------------------------------------------------------- tokens
@pytest.mark.parametrize("hw", list(COUNTS))
def test_token_counts_match_the_models_own_processor(
    ov: LlavaOnevisionAdapter, encoded: dict[tuple[int, int], ImageTokens], hw: tuple[int, int]
) -> None:
    n, grid, pooled = COUNTS[hw]
    tokens = encoded[hw]
    assert tokens.num_tokens == n
    assert tokens.model_inputs["hires_grid"] == grid and tokens.model_inputs["pooled_grid"] == pooled
    ids = ov.processor(text=ov.prompt("q"), images=noise_image(*hw), return_tensors="pt")["input_ids"]
    placeholders = int((ids == ov.image_token_id).sum())
    assert placeholders == 729 + pooled[0] * (pooled[1] + 1)  # base + (pooled) grid + one newline per row
    if grid == pooled:
        assert placeholders == n + grid[0]  # the processor counts the newline rows, N does not
    assert ov.visual_tokens_fed(tokens, n) == ov.visual_tokens_fed(tokens, n, torch.arange(n)) == placeholders
    assert ov.visual_tokens_fed(tokens, 100, torch.arange(100)) == 100
    assert tokens.features.shape == (n, ov.model.config.vision_config.hidden_size)
    assert tokens.grid is None and tokens.seen_box == (0.0, 0.0, float(hw[1]), float(hw[0]))
    assert tokens.views is not None and torch.equal(tokens.views, (torch.arange(n) >= 729).long())
    assert torch.equal(tokens.model_inputs["patch_index"][:729], torch.arange(729))  # base view first, all 729


@pytest.mark.parametrize("hw", [SMALL, POOLED])
def test_features_are_the_projector_input_in_packed_order(
    ov: LlavaOnevisionAdapter, encoded: dict[tuple[int, int], ImageTokens], standards: dict[Any, Any], hw: Any
) -> None:
    tokens, ref = encoded[hw], standards[hw]
    per_crop = ref["projector_input"]  # (crops, 729, d_v): SigLIP's last hidden state, strategy "full"
    assert per_crop.shape[1] == 729  # no CLS row to drop
    crop, patch = tokens.model_inputs["crop_index"], tokens.model_inputs["patch_index"]
    assert torch.equal(per_crop[crop, patch], tokens.features)
    with torch.no_grad():  # SigLIP's hidden_states[-1] is before post_layernorm
        out = ov._vision_tower(pixel_values=tokens.model_inputs["pixel_values"][0], output_hidden_states=True)
    assert torch.equal(out.hidden_states[-1], per_crop)
    assert not torch.allclose(out.last_hidden_state, per_crop)


# -------------------------------------------------------------------------------------- language model
@pytest.mark.parametrize("hw", [SMALL, POOLED])
def test_all_tokens_give_the_models_own_logits(
    ov: LlavaOnevisionAdapter, encoded: dict[tuple[int, int], ImageTokens], standards: dict[Any, Any], hw: Any
) -> None:
    """All N rows in packed order rebuild the model's sequence (pooling where it pools, newline rows): float32, CPU."""
    tokens, ref = encoded[hw], standards[hw]
    with torch.no_grad():
        projected = ov.projector(tokens.features)
        rebuilt = ov._with_newlines(tokens, projected)
    assert rebuilt.shape == ref["image_rows"].shape
    assert torch.allclose(rebuilt, ref["image_rows"], atol=1e-6, rtol=0)
    logits = ov.language_model_logits(QUESTION, tokens, projected)
    assert logits.shape == ref["logits"].shape
    assert torch.allclose(logits, ref["logits"], atol=1e-5, rtol=0)
    assert torch.equal(ov.language_model_logits(QUESTION, tokens, projected, kept=torch.arange(tokens.num_tokens)),
                       logits)  # fmt: skip


def test_reduced_rows_are_exactly_the_k_rows_given(
    ov: LlavaOnevisionAdapter, encoded: dict[tuple[int, int], ImageTokens]
) -> None:
    tokens = encoded[POOLED]  # beyond the pooling ratio: reduced rows are never pooled
    n = tokens.num_tokens
    kept = torch.tensor([5000, 3, 9000, -1, 42, 728, 729])  # any order, with a row tied to no token
    with torch.no_grad():
        projected = ov.projector(tokens.features[kept.clamp(min=0)])
    seen: dict[str, torch.Tensor] = {}
    handle = ov._language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.update(embeds=kw["inputs_embeds"]), with_kwargs=True
    )
    try:
        logits = ov.language_model_logits(QUESTION, tokens, projected, kept=kept)
    finally:
        handle.remove()
    ids = ov._encode_prompt(QUESTION, 7)["input_ids"][0]
    assert int((ids == ov.image_token_id).sum()) == 7 and logits.shape[0] == ids.numel()
    assert torch.equal(seen["embeds"][0][ids == ov.image_token_id], projected)  # the K rows, in the order given
    assert ov.visual_tokens_fed(tokens, 7, kept) == 7
    assert ov.visual_tokens_fed(tokens, n, torch.arange(n).flip(0)) == n
    small = encoded[(384, 384)]  # all N in another order: N rows, no newline rows
    perm = torch.arange(small.num_tokens).flip(0)
    with torch.no_grad():
        full = ov.projector(small.features[perm])
    assert ov.language_model_logits(QUESTION, small, full, kept=perm).shape[0] == ids.numel() - 7 + small.num_tokens


def test_jvp_through_the_projector_agrees_with_fd_in_float64(
    ov: LlavaOnevisionAdapter, encoded: dict[tuple[int, int], ImageTokens]
) -> None:
    features = encoded[SMALL].features[::80].double()  # base and high-resolution tokens
    projector = copy.deepcopy(ov.projector).double()
    assert _as_mlp(projector) is not None  # the jvp engine's Linear -> GELU -> Linear path
    directions = unit_directions(8, features.shape[1], seed=0, dtype=torch.float64)
    jvp = responses_jvp(features, projector, directions)
    fd = responses_fd(features, projector, directions, 1e-4)
    assert jvp.shape == fd.shape == (8, features.shape[0])
    assert float(((jvp - fd).abs() / fd.abs()).max()) < 1e-6


# -------------------------------------------------------------------------------------- geometry
def test_boxes_point_at_the_pixels_the_tokens_saw(ov: LlavaOnevisionAdapter) -> None:
    """Colour encodes position; every token's box centre lies within half a patch of its pixels' mean position."""
    height, width = SMALL
    tokens = ov.encode_image(position_image(height, width))
    ip = ov.processor.image_processor
    pv = tokens.model_inputs["pixel_values"][0].double()  # (crops, 3, 384, 384)
    mean = torch.tensor(ip.image_mean, dtype=torch.float64)[:, None, None]
    std = torch.tensor(ip.image_std, dtype=torch.float64)[:, None, None]
    rgb = (pv * std + mean) / float(ip.rescale_factor)
    valid = (rgb[:, 2] > 64).double()  # B = 128 in the image, 0 in the canvas's zero padding

    def pool(x: torch.Tensor) -> torch.Tensor:  # (crops, 384, 384) -> (crops, 27, 27) sums per patch (6 px unused)
        return x[:, :378, :378].unfold(1, 14, 14).unfold(2, 14, 14).sum(dim=(-1, -2))

    count, sum_x, sum_y = pool(valid), pool(rgb[:, 0] * valid), pool(rgb[:, 1] * valid)
    crop, patch = tokens.model_inputs["crop_index"], tokens.model_inputs["patch_index"]
    r, c = patch // 27, patch % 27
    pixels = count[crop, r, c]
    assert bool((pixels > 0).all())  # unpad leaves no token that sees only padding
    x_seen, y_seen = sum_x[crop, r, c] / pixels / 255 * width, sum_y[crop, r, c] / pixels / 255 * height
    boxes = tokens.boxes.double()
    cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
    half_x, half_y = (boxes[:, 2] - boxes[:, 0]) / 2, (boxes[:, 3] - boxes[:, 1]) / 2
    assert bool(((cx - x_seen).abs() <= 0.3 * half_x).all() and ((cy - y_seen).abs() <= 0.3 * half_y).all())
    assert torch.allclose(tokens.positions.double()[:, 0], cy / height, atol=1e-6)
    assert torch.allclose(tokens.positions.double()[:, 1], cx / width, atol=1e-6)
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    base_patch = (14 * width / 384) * (14 * height / 384)  # the base view: 27 * 14 = 378 of its 384 px squashed
    assert float(areas[tokens.views == 0].sum()) == pytest.approx(729 * base_patch, rel=1e-6)
    assert float(areas[tokens.views == 1].sum()) <= height * width * (1 + 1e-6)


# -------------------------------------------------------------------------------------- batches
SIZES = [(300, 420), (500, 260), (384, 384)]


@pytest.fixture(scope="module")
def batch_images() -> list[Any]:
    return [noise_image(h, w, seed=10 + i) for i, (h, w) in enumerate(SIZES)]


def test_batched_encoding_equals_each_image_alone(
    ov: LlavaOnevisionAdapter, batch_images: list[Any], count_calls: Any
) -> None:
    calls = count_calls(ov._vision_tower)
    batch = ov.encode_images(batch_images)
    assert len(calls) == 1  # every crop of every image in one tower pass
    for one, image in zip(batch, batch_images, strict=True):
        ref = ov.encode_image(image)
        assert one.num_tokens == ref.num_tokens
        torch.testing.assert_close(one.features, ref.features, rtol=1e-6, atol=1e-6)
        assert torch.equal(one.positions, ref.positions) and torch.equal(one.boxes, ref.boxes)
        for key, value in ref.model_inputs.items():
            got = one.model_inputs[key]
            assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, key
    ours = ov.preprocess(batch_images)
    theirs = ov.processor.image_processor(images=batch_images, return_tensors="pt")
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key


def test_generate_batch_gives_each_sample_its_own_answer(ov: LlavaOnevisionAdapter, batch_images: list[Any]) -> None:
    tokens = ov.encode_images(batch_images)
    with torch.no_grad():
        full = [ov.projector(t.features) for t in tokens]
    questions = ["What is in the image?", "Describe the colours.", "Is there a cat?"]
    rows, kept = [full[0][:7], full[1], full[2][:12]], [torch.arange(7), None, torch.arange(12)]
    prompts = [ov._lm_inputs(q, t, p, k) for q, t, p, k in zip(questions, tokens, rows, kept, strict=True)]
    batch = ov.generate_batch(questions, tokens, rows, kept, max_new_tokens=6)
    assert [list(g.token_ids) for g in batch] == [reference_ids(ov, x, 6) for x in prompts]
    assert batch == [ov.generate(q, t, p, 6, k) for q, t, p, k in zip(questions, tokens, rows, kept, strict=True)]


# -------------------------------------------------------------------------------------- family
def test_family_record_and_refusals(ov: LlavaOnevisionAdapter, encoded: dict[tuple[int, int], ImageTokens]) -> None:
    family = backbone_family("llava_onevision")
    assert family.name == ov.family == "llava-onevision" and family.lmms_eval_model == "care_llava"
    assert not family.has_cls_token and not family.single_grid and family.crops
    assert demo_backbones()["tiny-llava-onevision"].family == "llava-onevision"
    for name in ("visionzip", "prumerge+", "prumerge", "ficoco-v", "pool"):
        assert not method_class(name).serves("llava-onevision"), name
    assert method_class("care").serves("llava-onevision") and method_class("divprune").serves("llava-onevision")
    assert ov.capabilities == frozenset({"question", "language_model"})
    with pytest.raises(MethodError, match=r"cannot run on tiny-llava-onevision.*no CLS token"):
        ov.check_probes(["cls_attention"], method="visionzip")
    probes = ov.probe_inputs(encoded[(384, 384)], ["question", "language_model"], QUESTION)
    lm = probes["language_model"]
    assert isinstance(lm, LanguageModelRun) and probes["question"].shape[1] == ov.model.config.text_config.hidden_size
    start, end = lm.image_span
    assert end - start == encoded[(384, 384)].num_tokens  # the probe's sequence: N rows, no newline rows


def test_static_loop_drives_the_qwen2_decoder(
    ov: LlavaOnevisionAdapter, encoded: dict[tuple[int, int], ImageTokens]
) -> None:
    """What CUDA graphs replay on a GPU, run eagerly here: the static-cache loop over OneVision's Qwen2 decoder (GQA,
    qkv biases) gives model.generate's ids, for K rows and for all N (the model's own sequence, newlines included)."""
    from care_core.backbones.static_generation import StaticGreedy, unsupported_reason

    assert unsupported_reason(ov.model) is None
    tokens = encoded[(384, 384)]
    greedy = StaticGreedy(ov.model, graphs=False)
    with torch.no_grad():
        for kept in (torch.arange(0, tokens.num_tokens, 9), None):
            rows = ov.projector(tokens.features if kept is None else tokens.features[kept])
            inputs = ov._lm_inputs(QUESTION, tokens, rows, kept)
            assert greedy.generate(ov._prompt_embeddings(inputs), 6) == reference_ids(ov, inputs, 6)
