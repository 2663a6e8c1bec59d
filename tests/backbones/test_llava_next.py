"""LlavaNextAdapter on the tiny-llava-next demo: packed tokens, geometry, the reduced LM path and the probes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from care_core.backbones import ImageTokens, LlavaNextAdapter
from care_core.backbones.probes import VISION_PROBES, LanguageModelRun
from care_core.vocabulary import PROBES

from ._helpers import Unchanged, forward_with_image_rows, noise_image, position_image

QUESTION = "What is in the image?"
COUNTS = {(672, 672): (2880, 48), (500, 800): (2016, 30), (900, 300): (2304, 72)}  # N, newline rows


@pytest.fixture(scope="module")
def image() -> Any:
    return noise_image(500, 800, seed=5)


@pytest.fixture(scope="module")
def tokens(next_demo: LlavaNextAdapter, image: Any) -> ImageTokens:
    return next_demo.encode_image(image)


@pytest.fixture(scope="module")
def standard(next_demo: LlavaNextAdapter, image: Any) -> dict[str, Any]:
    """The processor path: inputs, logits and what the projector saw (one forward)."""
    inputs = next_demo.processor(text=next_demo.prompt(QUESTION), images=image, return_tensors="pt")
    seen: dict[str, torch.Tensor] = {}
    hook = next_demo.projector.register_forward_hook(lambda m, a, o: seen.update(inp=a[0]))
    try:
        out, image_rows = forward_with_image_rows(next_demo, inputs)
    finally:
        hook.remove()
    return {"inputs": inputs, "logits": out.logits[0], "projector_input": seen["inp"], "image_rows": image_rows}


# ---------------------------------------------------------------------------------------- tokens
@pytest.mark.parametrize("hw", list(COUNTS))
def test_token_counts_match_processor(next_demo: LlavaNextAdapter, hw: tuple[int, int]) -> None:
    height, width = hw
    n, newlines = COUNTS[hw]
    image = noise_image(height, width)
    tokens = next_demo.encode_image(image)
    assert tokens.num_tokens == n
    ids = next_demo.processor(text=next_demo.prompt("q"), images=image, return_tensors="pt")["input_ids"]
    placeholders = int((ids == next_demo.image_token_id).sum())
    assert placeholders == n + newlines  # the processor counts the newline rows, N does not
    rows, cols = tokens.model_inputs["hires_grid"]
    assert rows == newlines and 576 + rows * cols == n
    assert next_demo.visual_tokens_fed(tokens, n) == placeholders
    assert next_demo.visual_tokens_fed(tokens, n, torch.arange(n)) == placeholders
    assert next_demo.visual_tokens_fed(tokens, 100, torch.arange(100)) == 100
    assert tokens.features.shape == (n, next_demo.model.config.vision_config.hidden_size)
    assert tokens.grid is None and tokens.seen_box == (0.0, 0.0, float(width), float(height))
    assert tokens.views is not None and tokens.views.dtype == torch.long
    assert torch.equal(tokens.views, (torch.arange(n) >= 576).long())  # base view first, then high-res
    assert torch.equal(tokens.model_inputs["crop_index"][:576], torch.zeros(576, dtype=torch.long))
    assert torch.equal(tokens.model_inputs["patch_index"][:576], torch.arange(576))
    assert tokens.positions.shape == (n, 2) and tokens.boxes.shape == (n, 4)
    assert bool(((tokens.positions >= 0) & (tokens.positions <= 1)).all())


def test_features_are_the_packed_projector_input(
    next_demo: LlavaNextAdapter, tokens: ImageTokens, standard: dict[str, Any]
) -> None:
    per_crop = standard["projector_input"]  # (crops, 576, d_v): what the model projects, before packing
    crop, patch = tokens.model_inputs["crop_index"], tokens.model_inputs["patch_index"]
    assert torch.equal(per_crop[crop, patch], tokens.features)
    # packing the model's own way (pack_image_features with image_newline=None) gives the same order
    packed, _ = next_demo.model.model.pack_image_features(
        [per_crop], standard["inputs"]["image_sizes"], "default", image_newline=None
    )
    assert torch.equal(packed[0], tokens.features)
    # projecting our tokens and re-inserting the newline rows is the model's image embedding sequence
    with torch.no_grad():
        rebuilt = next_demo._with_newlines(tokens, next_demo.projector(tokens.features))
    assert torch.allclose(rebuilt, standard["image_rows"], atol=1e-6)


# -------------------------------------------------------------------------------------- geometry
@pytest.mark.parametrize("hw", list(COUNTS))
def test_boxes_point_at_the_pixels_the_tokens_saw(next_demo: LlavaNextAdapter, hw: tuple[int, int]) -> None:
    """Colour encodes position; every token's box centre is within half a patch of its pixels' mean position."""
    height, width = hw
    tokens = next_demo.encode_image(position_image(height, width))
    ip = next_demo.processor.image_processor
    pv = tokens.model_inputs["pixel_values"][0].double()  # (crops, 3, 336, 336)
    mean = torch.tensor(ip.image_mean, dtype=torch.float64)[:, None, None]
    std = torch.tensor(ip.image_std, dtype=torch.float64)[:, None, None]
    rgb = (pv * std + mean) / float(ip.rescale_factor)
    valid = (rgb[:, 2] > 64).double()  # B = 128 in the image, 0 in the zero padding of the canvas

    def pool(x: torch.Tensor) -> torch.Tensor:  # (crops, 336, 336) -> (crops, 24, 24) sums per patch
        return x.unfold(1, 14, 14).unfold(2, 14, 14).sum(dim=(-1, -2))

    count, sum_x, sum_y = pool(valid), pool(rgb[:, 0] * valid), pool(rgb[:, 1] * valid)
    crop, patch = tokens.model_inputs["crop_index"], tokens.model_inputs["patch_index"]
    r, c = patch // 24, patch % 24
    pixels = count[crop, r, c]
    assert bool((pixels > 0).all())  # unpad leaves no token that sees only padding
    x_seen = sum_x[crop, r, c] / pixels / 255 * width
    y_seen = sum_y[crop, r, c] / pixels / 255 * height
    boxes = tokens.boxes.double()
    cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
    half_x, half_y = (boxes[:, 2] - boxes[:, 0]) / 2, (boxes[:, 3] - boxes[:, 1]) / 2
    for view in (0, 1):  # base view and high-resolution tokens
        sel = tokens.views == view
        assert bool(((cx - x_seen).abs() <= half_x)[sel].all()), float((cx - x_seen).abs()[sel].max())
        assert bool(((cy - y_seen).abs() <= half_y)[sel].all()), float((cy - y_seen).abs()[sel].max())
    # far tighter in practice: 8-bit colour steps and bicubic ringing only
    assert bool(((cx - x_seen).abs() <= 0.3 * half_x).all() and ((cy - y_seen).abs() <= 0.3 * half_y).all())
    # positions are the box centres in the whole image's frame
    assert torch.allclose(tokens.positions.double()[:, 0], cy / height, atol=1e-6)
    assert torch.allclose(tokens.positions.double()[:, 1], cx / width, atol=1e-6)
    # each view tiles the whole image: base 24x24 squashed, high-res grid clipped to the image
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    assert float(areas[tokens.views == 0].sum()) == pytest.approx(height * width, rel=1e-6)
    assert float(areas[tokens.views == 1].sum()) == pytest.approx(height * width, rel=1e-6)


def test_images_of_one_size_share_geometry_but_never_its_tensors(next_demo: LlavaNextAdapter) -> None:
    """The geometry a size gives is worked out once per adapter: a second image of that size gets equal boxes,
    positions and indices, and changing one image's tensors in place changes no other image's."""
    first = next_demo.encode_image(noise_image(500, 800, seed=11))
    first.boxes.add_(1000.0)
    first.model_inputs["crop_index"].zero_()
    second = next_demo.encode_image(noise_image(500, 800, seed=12))
    fresh = LlavaNextAdapter(next_demo.model, next_demo.processor, name="fresh").encode_image(noise_image(500, 800))
    assert torch.equal(second.boxes, fresh.boxes) and torch.equal(second.positions, fresh.positions)
    assert torch.equal(second.model_inputs["crop_index"], fresh.model_inputs["crop_index"])
    assert int(second.model_inputs["crop_index"].max()) > 0  # the in-place zeroing of the first did not reach it


# ---------------------------------------------------------------------------------- language model
def test_full_k_logits_equal_standard_path(
    next_demo: LlavaNextAdapter, tokens: ImageTokens, standard: dict[str, Any]
) -> None:
    with torch.no_grad():
        projected = next_demo.projector(tokens.features)
    ref = standard["logits"]
    logits = next_demo.language_model_logits(QUESTION, tokens, projected)
    assert logits.shape == ref.shape
    assert torch.allclose(logits, ref, atol=1e-5, rtol=0)
    same = next_demo.language_model_logits(QUESTION, tokens, projected, kept=torch.arange(tokens.num_tokens))
    assert torch.equal(same, logits)


def test_reduced_rows_fed_in_given_order_without_newlines(next_demo: LlavaNextAdapter, tokens: ImageTokens) -> None:
    n = tokens.num_tokens
    kept = torch.tensor([700, 3, 1500, -1, 42])  # any order, with a row tied to no token
    with torch.no_grad():
        projected = next_demo.projector(tokens.features[kept.clamp(min=0)])
    seen: dict[str, torch.Tensor] = {}
    language_model = next_demo.model.model.language_model
    handle = language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.update(embeds=kw["inputs_embeds"]), with_kwargs=True
    )
    try:
        logits = next_demo.language_model_logits(QUESTION, tokens, projected, kept=kept)
    finally:
        handle.remove()
    ids = next_demo._encode_prompt(QUESTION, 5)["input_ids"][0]
    assert logits.shape[0] == ids.numel()
    image_rows = seen["embeds"][0][ids == next_demo.image_token_id]
    assert torch.equal(image_rows, projected)
    # all N tokens in another order: no newline rows either
    perm = torch.arange(n).flip(0)
    with torch.no_grad():
        full = next_demo.projector(tokens.features[perm])
    assert next_demo.language_model_logits(QUESTION, tokens, full, kept=perm).shape[0] == ids.numel() - 5 + n
    with pytest.raises(ValueError, match="kept"):
        next_demo.language_model_logits(QUESTION, tokens, projected, kept=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="outside"):
        next_demo.language_model_logits(QUESTION, tokens, projected, kept=torch.tensor([0, 1, 2, 3, n]))


def test_generate_with_reduced_tokens(next_demo: LlavaNextAdapter, tokens: ImageTokens) -> None:
    kept = torch.arange(0, tokens.num_tokens, 16)
    with torch.no_grad():
        projected = next_demo.projector(tokens.features[kept])
    answer = next_demo.generate(QUESTION, tokens, projected, max_new_tokens=3, kept=kept).text
    assert isinstance(answer, str)
    assert answer == next_demo.generate(QUESTION, tokens, projected, max_new_tokens=3, kept=kept).text
    assert next_demo.generate(QUESTION, tokens, projected, max_new_tokens=0, kept=kept).text == ""


# ------------------------------------------------------------------------------------------ probes
@pytest.fixture(scope="module")
def probes(next_demo: LlavaNextAdapter, tokens: ImageTokens) -> dict[str, Any]:
    with Unchanged(next_demo.model):
        return next_demo.probe_inputs(tokens, list(PROBES), QUESTION)


@pytest.fixture(scope="module")
def eager_crops(next_demo: LlavaNextAdapter, tokens: ImageTokens) -> dict[str, Any]:
    """Per-crop eager attentions and hidden states of a copy of the demo, plus per-head q/k of the feature block."""
    model = copy.deepcopy(next_demo.model)
    model.set_attn_implementation("eager")
    crops = tokens.model_inputs["pixel_values"][0]
    tower = model.model.vision_tower
    with torch.no_grad():
        out = tower(crops, output_attentions=True, output_hidden_states=True)
        block = model.config.vision_config.num_hidden_layers + model.config.vision_feature_layer
        layer = tower.encoder.layers[block]
        attn = layer.self_attn
        x = layer.layer_norm1(out.hidden_states[block])  # (crops, 577, d)
        shape = (*x.shape[:2], attn.num_heads, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)  # (crops, H, 577, d_head)
        k = attn.k_proj(x).view(shape).transpose(1, 2)
        last = tower.encoder.layers[-1]
        y = last.layer_norm1(out.hidden_states[-2])
        last_q, last_k = last.self_attn.q_proj(y), last.self_attn.k_proj(y)
    return {
        "out": out,
        "block": block,
        "q": q,
        "k": k,
        "scale": attn.head_dim**-0.5,
        "last_q": last_q,
        "last_k": last_k,
    }


def packed_slots(tokens: ImageTokens) -> tuple[torch.Tensor, torch.Tensor]:
    """(crop, slot in [CLS, patches]) for the 1 + N probe rows, row 0 = the base view's CLS."""
    zero = torch.zeros(1, dtype=torch.long)
    return (
        torch.cat([zero, tokens.model_inputs["crop_index"]]),
        torch.cat([zero, tokens.model_inputs["patch_index"] + 1]),
    )


def test_probe_shapes(next_demo: LlavaNextAdapter, tokens: ImageTokens, probes: dict[str, Any]) -> None:
    vc = next_demo.model.config.vision_config
    t = 1 + tokens.num_tokens
    assert next_demo.capabilities == frozenset(PROBES)
    assert probes["cls_attention"].shape == (vc.num_attention_heads, t)
    assert probes["attention_logits"].shape == (t, t)
    assert probes["keys"].shape == (t, vc.hidden_size // vc.num_attention_heads)
    assert probes["hidden_with_cls"].shape == (t, vc.hidden_size)
    assert probes["last_layer_qk"].shape == (2, t, vc.hidden_size)
    assert isinstance(probes["language_model"], LanguageModelRun)
    for name in ("cls_attention", "attention_logits", "keys", "last_layer_qk"):
        assert probes[name].dtype == torch.float32


def test_cls_attention_is_per_crop_eager_in_packed_order(
    tokens: ImageTokens, probes: dict[str, Any], eager_crops: dict[str, Any]
) -> None:
    per_crop = eager_crops["out"].attentions[eager_crops["block"]][:, :, 0, :]  # (crops, H, 577): CLS rows
    crop, slot = packed_slots(tokens)
    expected = per_crop[crop, :, slot].T  # (H, 1 + N)
    # 1e-5: the trained demo's attention is sharp (rows up to 0.9), and two float32 attention kernels differ by a
    # few ulps of 1 on some CPUs (an AMD host of the device machine, 2026-11-26); a wrong slot is off by far more
    assert torch.allclose(probes["cls_attention"], expected, atol=1e-5, rtol=0)
    assert torch.allclose(probes["cls_attention"][:, 0], per_crop[0, :, 0], atol=1e-5)  # base CLS to itself
    # each crop's share of the row is that crop's softmax: sums to 1 per crop (minus unpadded-away patches)
    assert float(probes["cls_attention"][:, 1:577].sum(-1).add(probes["cls_attention"][:, 0]).min()) == (
        pytest.approx(1.0, abs=1e-5)
    )


def test_attention_logits_keys_hidden_last_qk(
    tokens: ImageTokens, probes: dict[str, Any], eager_crops: dict[str, Any]
) -> None:
    crop, slot = packed_slots(tokens)
    q, k, scale = eager_crops["q"], eager_crops["k"], eager_crops["scale"]
    # the eager per-head q k^T really is the model's attention
    per_head = q @ k.transpose(-1, -2) * scale  # (crops, H, 577, 577)
    assert torch.allclose(per_head.softmax(-1), eager_crops["out"].attentions[eager_crops["block"]], atol=1e-5)
    logits = probes["attention_logits"]
    gen = torch.Generator().manual_seed(0)
    i = torch.randint(1, logits.shape[0], (400,), generator=gen)
    j = torch.randint(1, logits.shape[0], (400,), generator=gen)
    # any two tokens: head-mean of q_i . k_j with each token's q / k from its own crop (same crop: the model's)
    expected = (q[crop[i], :, slot[i]] * k[crop[j], :, slot[j]]).sum(-1).mean(-1) * scale
    assert torch.allclose(logits[i, j], expected, atol=1e-5, rtol=1e-5)
    same = crop[i] == crop[j]
    assert bool(same.any()) and bool((~same).any())
    assert torch.allclose(
        logits[i[same], j[same]], per_head.mean(1)[crop[i[same]], slot[i[same]], slot[j[same]]], atol=1e-5
    )
    # row / column 0: each token's own crop's CLS
    assert torch.allclose(logits[0, j], per_head.mean(1)[crop[j], 0, slot[j]], atol=1e-5)
    assert torch.allclose(logits[i, 0], per_head.mean(1)[crop[i], slot[i], 0], atol=1e-5)
    assert torch.allclose(logits[0, 0], per_head.mean(1)[0, 0, 0], atol=1e-5)
    assert torch.allclose(probes["keys"], k.mean(1)[crop, slot], atol=1e-6)
    hidden = eager_crops["out"].hidden_states[-2]
    assert torch.allclose(probes["hidden_with_cls"], hidden[crop, slot], atol=1e-5)
    assert torch.equal(probes["hidden_with_cls"][1:], tokens.features)
    qk = torch.stack([eager_crops["last_q"][crop, slot], eager_crops["last_k"][crop, slot]])
    assert torch.allclose(probes["last_layer_qk"], qk, atol=1e-5)


def test_one_vision_pass_and_no_leftovers(next_demo: LlavaNextAdapter, tokens: ImageTokens, count_calls: Any) -> None:
    tower = next_demo.model.model.vision_tower
    embeds = count_calls(tower.embeddings)
    last_mlp = count_calls(tower.encoder.layers[-1].mlp)
    with Unchanged(next_demo.model):
        next_demo.probe_inputs(tokens, sorted(VISION_PROBES))
    assert len(embeds) == 1 and len(last_mlp) == 0  # all crops in one batch, stopped early


def test_language_model_probe_has_n_image_tokens(
    next_demo: LlavaNextAdapter, tokens: ImageTokens, probes: dict[str, Any]
) -> None:
    lm = probes["language_model"]
    start, end = lm.image_span
    assert end - start == tokens.num_tokens  # no newline rows in the probe's sequence
    with torch.no_grad():
        assert torch.allclose(lm.input_embeddings()[start:end], next_demo.projector(tokens.features))
    with Unchanged(next_demo.model):
        attentions = lm.attentions(1)
    length = lm.input_ids.numel()
    assert len(attentions) == 2 and attentions[0].shape == (4, length, length)
    assert torch.allclose(attentions[1].sum(-1), torch.ones(4, length), atol=1e-4)
