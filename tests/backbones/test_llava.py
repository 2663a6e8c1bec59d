"""LlavaAdapter on the tiny-llava demo: tokens, geometry, question embeddings, the reduced LM path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from care_core.backbones import ImageTokens, LlavaAdapter
from care_core.backbones.geometry import clip_boxes, crop_geometry, grid_crop_boxes, resized_size
from care_core.errors import QuestionError

from ._helpers import noise_image, position_image

SIZES = [(336, 336), (500, 800), (900, 300)]  # (height, width)
QUESTION = "What is in the image?"


# ---------------------------------------------------------------------------------------- tokens
def test_demo_tokens_shape_and_positions(demo: LlavaAdapter) -> None:
    tokens = demo.encode_image(noise_image(400, 500))
    d_v = demo.model.config.vision_config.hidden_size
    assert isinstance(tokens, ImageTokens)
    assert tokens.features.shape == (576, d_v)
    assert tokens.num_tokens == 576
    assert tokens.features.dtype == demo.dtype and tokens.features.device == demo.device
    assert tokens.grid == (24, 24)
    assert tokens.positions.shape == (576, 2) and tokens.boxes.shape == (576, 4)
    assert bool(((tokens.positions > 0) & (tokens.positions < 1)).all())
    # (row, col) order, raster: token 1 is row 0, col 1; token 24 is row 1, col 0
    assert torch.allclose(tokens.positions[0], torch.tensor([0.5 / 24, 0.5 / 24]))
    assert torch.allclose(tokens.positions[1], torch.tensor([0.5 / 24, 1.5 / 24]))
    assert torch.allclose(tokens.positions[24], torch.tensor([1.5 / 24, 0.5 / 24]))
    assert tokens.image_size == (400, 500)
    assert tokens.model_inputs["pixel_values"].shape == (1, 3, 336, 336)
    assert not tokens.features.requires_grad


def test_features_are_what_the_projector_sees(demo: LlavaAdapter) -> None:
    image = noise_image(336, 400, seed=3)
    tokens = demo.encode_image(image)
    seen = {}
    hook = demo.projector.register_forward_hook(lambda m, a, o: seen.update(inp=a[0], out=o))
    try:
        inputs = demo.processor(text=demo.prompt(QUESTION), images=image, return_tensors="pt")
        with torch.no_grad():
            demo.model(**inputs)
    finally:
        hook.remove()
    assert torch.equal(seen["inp"][0], tokens.features)
    with torch.no_grad():
        assert torch.allclose(demo.projector(tokens.features), seen["out"][0], atol=1e-6)


def test_encode_image_converts_mode_like_the_processor(demo: LlavaAdapter) -> None:
    rgba = noise_image(336, 300).convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(rgba.size))  # partly transparent
    for image in (rgba, noise_image(336, 336).convert("L"), noise_image(200, 336).convert("P")):
        tokens = demo.encode_image(image)
        ref = demo.processor.image_processor(images=image, return_tensors="pt")["pixel_values"]
        assert torch.equal(tokens.model_inputs["pixel_values"], ref)
    with pytest.raises(TypeError):
        demo.encode_image(np.zeros((10, 10, 3)))  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------- geometry
@pytest.mark.parametrize("hw", [(336, 336), (500, 800), (900, 300), (337, 1001), (1000, 999), (77, 50)])
def test_resize_arithmetic_matches_processor(demo: LlavaAdapter, hw: tuple[int, int]) -> None:
    ip = demo.processor.image_processor
    torchvision_backend = any(c.__name__ == "TorchvisionBackend" for c in type(ip).__mro__)
    arr = torch.zeros((3, *hw), dtype=torch.uint8) if torchvision_backend else np.zeros((3, *hw), np.uint8)
    resized = ip.resize(arr, size=ip.size, resample=ip.resample)
    assert resized_size(*hw, ip) == tuple(resized.shape[-2:])


def test_crop_larger_than_image_pads_and_clips() -> None:
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    ip = CLIPImageProcessorPil(do_resize=False, crop_size={"height": 336, "width": 336})
    height, width = 301, 320
    pv = ip(images=Image.new("RGB", (width, height), (255, 255, 255)), return_tensors="pt")["pixel_values"][0]
    white = pv[0] > 0  # normalised white > 0, zero padding < 0
    rows, cols = torch.nonzero(white.any(1)).flatten(), torch.nonzero(white.any(0)).flatten()
    geom = crop_geometry(height, width, ip, (336, 336))
    assert (geom.top, geom.left) == (-int(rows[0]), -int(cols[0]))
    assert int(rows[-1]) - int(rows[0]) + 1 == height and int(cols[-1]) - int(cols[0]) + 1 == width
    assert geom.seen_box() == (0.0, 0.0, float(width), float(height))
    boxes = clip_boxes(geom.crop_to_original(grid_crop_boxes(24, 24, 14)), height, width)
    assert float(boxes[:, 0::2].min()) == 0.0 and float(boxes[:, 0::2].max()) == width


@pytest.mark.parametrize("hw", SIZES)
def test_boxes_tile_the_seen_region(demo: LlavaAdapter, hw: tuple[int, int]) -> None:
    height, width = hw
    tokens = demo.encode_image(noise_image(height, width))
    boxes = tokens.boxes.double()
    x0, y0, x1, y1 = tokens.seen_box
    assert 0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height
    assert bool((boxes[:, 0] >= 0).all() and (boxes[:, 2] <= width + 1e-3).all())
    assert bool((boxes[:, 1] >= 0).all() and (boxes[:, 3] <= height + 1e-3).all())
    assert bool((boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all())
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    assert float(areas.sum()) == pytest.approx((x1 - x0) * (y1 - y0), rel=1e-5)
    # no gaps or overlaps: a 24x24 raster whose edges meet exactly
    grid = boxes.view(24, 24, 4)
    assert torch.allclose(grid[:, 1:, 0], grid[:, :-1, 2], atol=1e-3)  # left edge == previous right edge
    assert torch.allclose(grid[1:, :, 1], grid[:-1, :, 3], atol=1e-3)  # top edge == previous bottom edge
    assert torch.allclose(grid[:, :, 1], grid[:, :1, 1].expand(24, 24), atol=1e-3)  # rows share y-bounds
    assert torch.allclose(grid[:, :, 0], grid[:1, :, 0].expand(24, 24), atol=1e-3)  # columns share x-bounds
    assert float(grid[0, 0, 0]) == pytest.approx(x0, abs=1e-3)
    assert float(grid[0, 0, 1]) == pytest.approx(y0, abs=1e-3)
    assert float(grid[-1, -1, 2]) == pytest.approx(x1, abs=1e-3)
    assert float(grid[-1, -1, 3]) == pytest.approx(y1, abs=1e-3)
    # the seen region is the central square (up to the processor's floor rounding)
    side = min(height, width)
    assert (x1 - x0) == pytest.approx(side, rel=0.01) and (y1 - y0) == pytest.approx(side, rel=0.01)
    assert (x0 + x1) / 2 == pytest.approx(width / 2, abs=width / 336 + 1e-6)
    assert (y0 + y1) / 2 == pytest.approx(height / 2, abs=height / 336 + 1e-6)


@pytest.mark.parametrize("hw", SIZES)
def test_boxes_point_at_the_pixels_the_tokens_saw(demo: LlavaAdapter, hw: tuple[int, int]) -> None:
    height, width = hw
    tokens = demo.encode_image(position_image(height, width))
    ip = demo.processor.image_processor
    pv = tokens.model_inputs["pixel_values"][0].double()  # (3, 336, 336), normalised
    mean = torch.tensor(ip.image_mean, dtype=torch.float64)[:, None, None]
    std = torch.tensor(ip.image_std, dtype=torch.float64)[:, None, None]
    rgb = (pv * std + mean) / float(ip.rescale_factor)  # back to 0..255
    patch = 14
    means = rgb.unfold(1, patch, patch).unfold(2, patch, patch).mean(dim=(-1, -2))  # (3, 24, 24)
    x_seen = (means[0] / 255 * width).reshape(-1)
    y_seen = (means[1] / 255 * height).reshape(-1)
    boxes = tokens.boxes.double()
    cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
    half_x = (boxes[:, 2] - boxes[:, 0]) / 2
    half_y = (boxes[:, 3] - boxes[:, 1]) / 2
    assert bool(((cx - x_seen).abs() <= half_x).all()), float((cx - x_seen).abs().max())
    assert bool(((cy - y_seen).abs() <= half_y).all()), float((cy - y_seen).abs().max())
    # in practice far tighter (measured < 0.7 px): only bicubic ringing and 8-bit colour steps remain
    assert bool(((cx - x_seen).abs() <= 0.25 * half_x).all())
    assert bool(((cy - y_seen).abs() <= 0.25 * half_y).all())


# -------------------------------------------------------------------------------- question / prompt
def test_question_embeddings_are_embedding_rows(demo: LlavaAdapter) -> None:
    q = "How many cats? <image> ünïcode 日本"
    emb = demo.question_embeddings(q)
    tok = demo.tokenizer
    ids = tok(q, add_special_tokens=False)["input_ids"]
    special = set(tok.all_special_ids) | {demo.image_token_id}
    kept = [i for i in ids if i not in special]
    assert len(kept) < len(ids)  # the <image> token was dropped
    assert tok.unk_token_id not in ids  # the byte-level demo tokenizer never needs <unk>
    table = demo.model.get_input_embeddings().weight
    assert emb.shape == (len(kept), demo.model.config.text_config.hidden_size)
    assert torch.equal(emb, table[torch.tensor(kept)])


@pytest.mark.parametrize("question", ["", "   ", "\n\t", "<image>", "<s></s><pad>"])
def test_question_without_tokens_raises(demo: LlavaAdapter, question: str) -> None:
    with pytest.raises(QuestionError, match="has no tokens the language model can embed"):
        demo.question_embeddings(question)


def test_prompt_uses_chat_template_or_llava15_format(demo: LlavaAdapter, monkeypatch) -> None:
    assert demo.processor.chat_template
    assert demo.prompt("What?") == "USER: <image>\nWhat? ASSISTANT:"
    monkeypatch.setattr(demo.processor, "chat_template", None)
    monkeypatch.setattr(demo.tokenizer, "chat_template", None)
    assert demo.prompt("Why?") == "USER: <image>\nWhy? ASSISTANT:"
    assert demo.prompt("a <image> b").count("<image>") == 1


# ---------------------------------------------------------------------------------- language model
def test_full_k_logits_equal_standard_path(demo: LlavaAdapter) -> None:
    image = noise_image(500, 800, seed=5)
    tokens = demo.encode_image(image)
    with torch.no_grad():
        projected = demo.projector(tokens.features)
    logits = demo.language_model_logits(QUESTION, tokens, projected)
    inputs = demo.processor(text=demo.prompt(QUESTION), images=image, return_tensors="pt")
    assert int((inputs["input_ids"] == demo.image_token_id).sum()) == 576
    with torch.no_grad():
        ref = demo.model(**inputs).logits[0]
    assert logits.shape == ref.shape
    assert torch.allclose(logits, ref, atol=1e-5, rtol=0)


def test_reduced_k_logits_and_generate(demo: LlavaAdapter) -> None:
    image = noise_image(336, 336, seed=6)
    tokens = demo.encode_image(image)
    with torch.no_grad():
        projected = demo.projector(tokens.features[::9])  # K = 64
    full_len = demo.language_model_logits(QUESTION, tokens, demo.projector(tokens.features)).shape[0]
    logits = demo.language_model_logits(QUESTION, tokens, projected)
    assert logits.shape == (full_len - 576 + 64, demo.model.config.text_config.vocab_size)
    answer = demo.generate(QUESTION, tokens, projected, max_new_tokens=4).text
    assert isinstance(answer, str)
    assert answer == demo.generate(QUESTION, tokens, projected, max_new_tokens=4).text  # greedy
    with pytest.raises(ValueError):
        demo.language_model_logits(QUESTION, tokens, projected[:, :3])
