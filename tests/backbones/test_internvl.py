"""InternVLAdapter on the tiny-internvl3 demo: pixel-shuffled tokens of every tile and the thumbnail, the LayerNorm
projector, tile geometry, K placeholders in one <img> span, batches, and the CLS probes it does not offer."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from care_core import CaReConfig, care_reduce
from care_core.backbones import ImageTokens
from care_core.backbones.internvl3.adapter import InternVLAdapter
from care_core.backbones.probes import VISION_PROBES
from care_core.errors import MethodError
from care_core.methods.registry import method_class
from care_core.scoring import _as_mlp, responses_fd, responses_jvp, unit_directions

from ._helpers import forward_with_image_rows, noise_image, reference_ids

QUESTION = "What is in the image?"
#: (height, width) -> tiles the processor cuts (hand-counted from the tile rule: (cols, rows) with the aspect ratio
#: closest to W / H among 1..12 tiles, plus a thumbnail when there is more than one tile)
TILES = {(336, 336): 1, (448, 896): 3, (500, 800): 7, (900, 300): 4}


@pytest.fixture(scope="module")
def image() -> Any:
    return noise_image(448, 896, seed=5)  # 2 tiles side by side + the thumbnail: 768 tokens


@pytest.fixture(scope="module")
def tokens(internvl_demo: InternVLAdapter, image: Any) -> ImageTokens:
    return internvl_demo.encode_image(image)


@pytest.fixture(scope="module")
def standard(internvl_demo: InternVLAdapter, image: Any) -> dict[str, Any]:
    inputs = internvl_demo.processor(text=internvl_demo.prompt(QUESTION), images=image, return_tensors="pt")
    out, image_rows = forward_with_image_rows(internvl_demo, inputs)
    return {"inputs": inputs, "logits": out.logits[0], "image_rows": image_rows}


# ---------------------------------------------------------------------------------------- tokens
@pytest.mark.parametrize("hw", list(TILES))
def test_token_count_is_the_processors_placeholder_count(internvl_demo: InternVLAdapter, hw: tuple[int, int]) -> None:
    image = noise_image(*hw)
    tokens = internvl_demo.encode_image(image)
    inputs = internvl_demo.processor(text=internvl_demo.prompt("q"), images=image, return_tensors="pt")
    placeholders = int((inputs["input_ids"] == internvl_demo.image_token_id).sum())
    assert tokens.num_tokens == placeholders == 256 * TILES[hw]
    assert inputs["pixel_values"].shape[0] == TILES[hw]
    d_v = internvl_demo.model.config.vision_config.hidden_size
    assert tokens.features.shape == (placeholders, 4 * d_v)
    assert internvl_demo.visual_tokens_fed(tokens, placeholders) == placeholders
    if TILES[hw] == 1:  # one tile, no thumbnail: one 16x16 grid, one view
        assert tokens.views is None and tokens.grid == (16, 16)
    else:  # tiles then the thumbnail (the last 256 tokens)
        assert tokens.grid is None
        assert torch.equal(tokens.views[-256:], torch.zeros(256, dtype=torch.long))
        assert torch.equal(tokens.views[:-256], torch.ones(tokens.num_tokens - 256, dtype=torch.long))


def test_features_are_the_four_patches_of_each_shuffled_token(
    internvl_demo: InternVLAdapter, tokens: ImageTokens, standard: Any
) -> None:
    pixel_values = tokens.model_inputs["pixel_values"]
    with torch.no_grad():
        patches = internvl_demo.model.model.vision_tower(pixel_values=pixel_values).last_hidden_state[:, 1:]
    grid = patches.reshape(3, 32, 32, -1)  # 3 tiles of 32x32 patches, CLS dropped
    i, j = 5, 11  # token (5, 11) of the second tile: patches (10, 22), (10, 23), (11, 22), (11, 23)
    expected = torch.cat([grid[1, 10, 22], grid[1, 10, 23], grid[1, 11, 22], grid[1, 11, 23]])
    assert torch.equal(tokens.features[256 + 16 * i + j], expected)
    with torch.no_grad():
        projected = internvl_demo.projector(tokens.features)
        own = internvl_demo.model.model.get_image_features(pixel_values=pixel_values).pooler_output
    assert torch.equal(projected, own.reshape(-1, own.shape[-1]))  # the model's projected tokens, bit for bit
    assert torch.equal(projected, standard["image_rows"])  # what its language model receives


def test_jvp_through_the_layernorm_projector_agrees_with_fd_in_float64(
    internvl_demo: InternVLAdapter, tokens: ImageTokens
) -> None:
    projector = copy.deepcopy(internvl_demo.projector).double()
    assert _as_mlp(projector) is None  # not the Linear-GELU-Linear path: that would skip the LayerNorm
    features = tokens.features[::13].double()
    directions = unit_directions(8, features.shape[1], seed=0, dtype=torch.float64)
    jvp = responses_jvp(features, projector, directions)
    fd = responses_fd(features, projector, directions, 1e-5)
    assert jvp.shape == fd.shape == (8, features.shape[0])
    assert float(((jvp - fd).abs() / fd.abs()).max()) < 1e-7
    red = care_reduce(tokens.features, internvl_demo.projector, tokens.positions, keep=64, config=CaReConfig(m=8))
    assert red.indices.numel() == 64 and red.tokens.shape == (64, tokens.features.shape[1])


# -------------------------------------------------------------------------------------- geometry
def test_boxes_follow_the_tile_canvas_and_the_thumbnail(internvl_demo: InternVLAdapter) -> None:
    height, width = 500, 800  # 3 cols x 2 rows of tiles on a 1344 x 896 canvas, then the thumbnail
    tokens = internvl_demo.encode_image(noise_image(height, width))
    assert tokens.model_inputs["tile_grid"] == (2, 3)
    boxes = tokens.boxes.double()
    sx, sy = width / 1344, height / 896
    # token (0, 0) of tile 4 (row 1, col 1): canvas pixels x 448..476, y 448..476
    assert torch.allclose(boxes[4 * 256], torch.tensor([448 * sx, 448 * sy, 476 * sx, 476 * sy], dtype=boxes.dtype))
    # the thumbnail's last token: the bottom-right 28x28 of 448x448
    last = torch.tensor([420 * width / 448, 420 * height / 448, width, height], dtype=boxes.dtype)
    assert torch.allclose(boxes[-1], last)
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    assert torch.isclose(areas[:-256].sum(), torch.tensor(height * width, dtype=boxes.dtype))  # tiles tile the image
    assert torch.isclose(areas[-256:].sum(), torch.tensor(height * width, dtype=boxes.dtype))  # and so does the thumb
    centre = torch.stack([(boxes[:, 1] + boxes[:, 3]) / 2 / height, (boxes[:, 0] + boxes[:, 2]) / 2 / width], 1)
    assert torch.allclose(tokens.positions.double(), centre, atol=1e-6)


# ------------------------------------------------------------------------------------ language model
def test_all_tokens_give_the_models_own_logits(
    internvl_demo: InternVLAdapter, tokens: ImageTokens, standard: Any
) -> None:
    with torch.no_grad():
        projected = internvl_demo.projector(tokens.features)
    logits = internvl_demo.language_model_logits(QUESTION, tokens, projected)
    ids = internvl_demo._lm_inputs(QUESTION, tokens, projected, None)["input_ids"]
    assert torch.equal(ids, standard["inputs"]["input_ids"])  # <img> + N placeholders + </img>, as the processor
    torch.testing.assert_close(logits, standard["logits"], rtol=1e-5, atol=1e-5)


def test_reduced_rows_are_exactly_k_placeholders_in_one_image_span(
    internvl_demo: InternVLAdapter, tokens: ImageTokens
) -> None:
    kept = torch.arange(0, tokens.num_tokens, 9)
    with torch.no_grad():
        projected = internvl_demo.projector(tokens.features[kept])
    inputs = internvl_demo._lm_inputs(QUESTION, tokens, projected, kept)
    ids = inputs["input_ids"][0]
    tok = internvl_demo.tokenizer
    start, end = (ids == tok.convert_tokens_to_ids("<img>")).nonzero(), (ids == tok.convert_tokens_to_ids("</img>"))
    assert start.numel() == 1 and int(end.sum()) == 1
    span = ids[int(start) + 1 : int(end.nonzero())]
    assert span.numel() == kept.numel() and bool((span == internvl_demo.image_token_id).all())
    assert int((ids == internvl_demo.image_token_id).sum()) == kept.numel()
    _, rows = forward_with_image_rows(internvl_demo, inputs)
    assert torch.equal(rows, projected)  # exactly the K rows, in the order given
    assert internvl_demo.visual_tokens_fed(tokens, kept.numel(), kept) == kept.numel()


def test_generate_with_all_and_reduced_tokens(
    internvl_demo: InternVLAdapter, tokens: ImageTokens, standard: Any
) -> None:
    with torch.no_grad():
        full = internvl_demo.projector(tokens.features)
    answer = internvl_demo.generate(QUESTION, tokens, full, max_new_tokens=4)
    assert list(answer.token_ids) == reference_ids(internvl_demo, standard["inputs"], 4)  # the pixel path's tokens
    kept = torch.arange(0, tokens.num_tokens, 11)
    reduced = internvl_demo.generate(QUESTION, tokens, full[kept], max_new_tokens=4, kept=kept)
    prompt = internvl_demo._lm_inputs(QUESTION, tokens, full[kept], kept)
    assert list(reduced.token_ids) == reference_ids(internvl_demo, prompt, 4)


# ------------------------------------------------------------------------------------------ batches
def test_batched_encoding_and_answers_are_per_sample(internvl_demo: InternVLAdapter, count_calls: Any) -> None:
    images = [noise_image(300, 420, seed=1), noise_image(500, 260, seed=2), noise_image(336, 336, seed=3)]
    calls = count_calls(internvl_demo.model.model.vision_tower)
    batch = internvl_demo.encode_images(images)
    assert len(calls) == 1  # every tile of every image in one tower pass
    alone = [internvl_demo.encode_image(image) for image in images]
    for one, ref in zip(batch, alone, strict=True):
        torch.testing.assert_close(one.features, ref.features, rtol=1e-6, atol=1e-6)
        assert torch.equal(one.positions, ref.positions) and torch.equal(one.boxes, ref.boxes)
        assert torch.equal(one.model_inputs["pixel_values"], ref.model_inputs["pixel_values"])
    with torch.no_grad():
        full = [internvl_demo.projector(t.features) for t in alone]
    kept: list[torch.Tensor | None] = [torch.arange(7), None, torch.arange(12)]
    projected = [full[0][:7], full[1], full[2][:12]]
    questions = [QUESTION, "Describe the colours.", "Is there a cat?"]
    answers = internvl_demo.generate_batch(questions, alone, projected, kept, max_new_tokens=6)
    samples = zip(questions, alone, projected, kept, strict=True)
    assert answers == [internvl_demo.generate(q, t, p, 6, k) for q, t, p, k in samples]


def test_encoding_the_models_own_processor_output(internvl_demo: InternVLAdapter, image: Any, tokens: Any) -> None:
    inputs = internvl_demo.processor(text=internvl_demo.prompt("q"), images=image, return_tensors="pt")
    assert "num_patches" not in inputs  # InternVLProcessor drops it: one image is still unambiguous
    (one,) = internvl_demo.encode_processed(inputs, [(448, 896)])
    assert torch.equal(one.features, tokens.features) and torch.equal(one.boxes, tokens.boxes)
    two = {"pixel_values": torch.cat([inputs["pixel_values"]] * 2)}
    with pytest.raises(ValueError, match="num_patches"):
        internvl_demo.encode_processed(two, [(448, 896)] * 2)


def test_processor_pads_left(internvl_demo: InternVLAdapter) -> None:
    images = [noise_image(336, 336), noise_image(448, 896)]
    prompts = [internvl_demo.prompt("q"), internvl_demo.prompt("a much longer question")]
    inputs = internvl_demo.processor(text=prompts, images=images, return_tensors="pt", padding=True)
    assert bool(inputs["attention_mask"][:, -1].all()) and not bool(inputs["attention_mask"][0, 0])


# ------------------------------------------------------------------------------------------ probes
def test_cls_probes_and_methods_refuse_in_one_line(internvl_demo: InternVLAdapter, tokens: ImageTokens) -> None:
    assert internvl_demo.capabilities == frozenset({"question", "language_model"})
    for name in sorted(VISION_PROBES):
        with pytest.raises(MethodError, match=rf"tiny-internvl3: InternViT's CLS .* {name} is not"):
            internvl_demo.probe_inputs(tokens, [name])
    with pytest.raises(MethodError, match=r"method 'visionzip' cannot run on tiny-internvl3") as info:
        internvl_demo.check_probes(["keys", "cls_attention", "hidden_with_cls"], "visionzip")
    assert "\n" not in str(info.value)
    for method in ("visionzip", "prumerge", "pool"):
        assert not method_class(method).serves("internvl3") and method_class(method).why_not_served("internvl3")
    assert method_class("care").serves("internvl3") and method_class("fastv").serves("internvl3")


def test_the_drop_in_refuses_in_one_line(internvl_demo: InternVLAdapter) -> None:
    from care_core import reduce_visual_tokens
    from care_core.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"^the drop-in cannot serve internvl3: .*image sizes") as info:
        reduce_visual_tokens(internvl_demo.model, processor=internvl_demo.processor, method="care", keep=8)
    assert "\n" not in str(info.value)


def test_a_processor_with_another_tile_size_is_refused(internvl_demo: InternVLAdapter) -> None:
    from care_core.errors import ModelLoadError

    processor = copy.copy(internvl_demo.processor)
    processor.image_processor = copy.copy(processor.image_processor)
    processor.image_processor.size = {"height": 384, "width": 384}
    with pytest.raises(ModelLoadError, match="tile size"):
        InternVLAdapter(internvl_demo.model, processor, name="odd")
