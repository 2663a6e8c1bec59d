"""N for an image size, cross-checked with transformers' own processor and model arithmetic."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image
from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from care_core.architecture import IMAGE_LAYOUTS
from care_core.flops.specs import KNOWN_BACKBONES
from care_core.flops.tokens import TOKEN_COUNTERS, ImageSizeError, parse_image_size, squarest_grid, visual_tokens

NEXT, QWEN, LLAVA = KNOWN_BACKBONES["llava-next-7b"], KNOWN_BACKBONES["qwen2.5-vl-7b"], KNOWN_BACKBONES["llava-1.5-7b"]
INTERNVL = KNOWN_BACKBONES["internvl3-8b"]
ONEVISION = KNOWN_BACKBONES["llava-onevision-7b"]


@pytest.mark.parametrize(("size", "n"), [((672, 672), 2880), ((500, 800), 2016), ((900, 300), 2304)])
def test_llava_next_counts(size: tuple[int, int], n: int) -> None:
    assert visual_tokens(NEXT, *size).tokens == n


@pytest.mark.parametrize(("size", "n"), [((672, 672), 576), ((500, 800), 522), ((900, 300), 352)])
def test_qwen_counts(size: tuple[int, int], n: int) -> None:
    assert visual_tokens(QWEN, *size).tokens == n


def test_llava15_is_always_576() -> None:
    assert {visual_tokens(LLAVA, h, w).tokens for h, w in [(10, 10), (336, 336), (500, 800), (2000, 90)]} == {576}


def test_one_fixed_view_counts_its_feature_tokens_whatever_the_tower_kind() -> None:
    """A SigLIP tower on one 384 px view (no pinpoints): (384 / 14)² = 27² = 729 tokens for any image."""
    one_view = replace(ONEVISION, grid_pinpoints=(), max_crops=0)
    assert one_view.image_layout == "one_view"
    assert {visual_tokens(one_view, h, w).tokens for h, w in [(10, 10), (384, 384), (500, 800)]} == {729}


def test_every_image_layout_has_a_token_counter() -> None:
    assert set(TOKEN_COUNTERS) == set(IMAGE_LAYOUTS)


def _processor() -> LlavaNextProcessor:
    processor = object.__new__(LlavaNextProcessor)  # only the counting attributes, no tokenizer needed
    processor.image_processor = SimpleNamespace(image_grid_pinpoints=[list(p) for p in NEXT.grid_pinpoints])
    processor.patch_size, processor.num_additional_image_tokens = 14, 0
    return processor


def _sizes(count: int) -> list[tuple[int, int]]:
    rng = random.Random(0)
    fixed = [(672, 672), (500, 800), (900, 300), (1165, 582), (1235, 617), (1, 1), (336, 336), (4000, 20)]
    return fixed + [(rng.randint(8, 3000), rng.randint(8, 3000)) for _ in range(count)]


def test_llava_next_matches_transformers_processor_and_model() -> None:
    processor, pinpoints = _processor(), [list(p) for p in NEXT.grid_pinpoints]
    for height, width in _sizes(600):
        ours = visual_tokens(NEXT, height, width)
        rows, cols = ours.grid
        # the processor's count includes one newline token per high-res row; our N does not
        # (docs/design/backbones.md §LLaVA-NeXT)
        assert processor._get_number_of_features(height, width, 336, 336) == ours.tokens + rows, (height, width)
        tiles_h, tiles_w = get_anyres_image_grid_shape((height, width), pinpoints, 336)
        unpadded = unpad_image(torch.empty(1, tiles_h * 24, tiles_w * 24), (height, width))
        assert tuple(unpadded.shape[1:]) == (rows, cols), (height, width)
        assert ours.crops == 1 + tiles_h * tiles_w


def test_llava_onevision_matches_transformers_processor() -> None:
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    processor = object.__new__(LlavaOnevisionProcessor)  # only the counting attributes, no tokenizer needed
    processor.image_processor = SimpleNamespace(image_grid_pinpoints=[list(p) for p in ONEVISION.grid_pinpoints])
    processor.num_image_tokens, processor.vision_aspect_ratio = 729, "anyres_max_9"
    pooled_sizes = 0
    for height, width in _sizes(600):
        ours = visual_tokens(ONEVISION, height, width)
        rows, cols = ours.grid
        pooled_rows, pooled_cols = ours.detail["pooled_grid"]
        pooled_sizes += (pooled_rows, pooled_cols) != (rows, cols)
        # N: base + the unpooled grid; the processor counts the model's own rows (pooled grid + a newline per row)
        assert processor._get_number_of_features(height, width, 384, 384) == ours.detail["model_visual_rows"]
        assert ours.detail["model_visual_rows"] == 729 + pooled_rows * (pooled_cols + 1)
        assert ours.tokens == 729 + rows * cols, (height, width)
    assert pooled_sizes > 50  # many of the sizes are pooled


def test_llava_onevision_counts() -> None:  # the table of docs/design/backbones.md §LLaVA-OneVision
    counts = {(384, 384): (1458, 1485), (768, 768): (3645, 3699), (500, 800): (4779, 4829),
              (2000, 1000): (729 + 162 * 81, 7341)}  # fmt: skip
    for size, (n, model_rows) in counts.items():
        ours = visual_tokens(ONEVISION, *size)
        assert (ours.tokens, ours.detail["model_visual_rows"]) == (n, model_rows), size


def test_float_rounding_follows_transformers() -> None:
    # exact rational arithmetic would pick 1008×336 here; the processor (float) picks 672×336
    assert visual_tokens(NEXT, 1165, 582).detail["best_resolution"] == [672, 336]


def test_qwen_matches_transformers_smart_resize() -> None:
    for height, width in _sizes(600):
        if max(height, width) / min(height, width) > 200:
            with pytest.raises(ImageSizeError):
                visual_tokens(QWEN, height, width)
            continue
        new_h, new_w = hf_smart_resize(height, width, 28, QWEN.min_pixels, QWEN.max_pixels)
        assert visual_tokens(QWEN, height, width).tokens == (new_h // 28) * (new_w // 28), (height, width)


def test_qwen_pixel_limits() -> None:
    assert visual_tokens(QWEN, 10, 10).tokens == 4  # min_pixels 3136 = 56×56 -> 2×2 merged tokens
    assert visual_tokens(QWEN, 20000, 20000).tokens <= QWEN.max_pixels // 28**2
    with pytest.raises(ImageSizeError):
        visual_tokens(QWEN, 10, 5000)  # aspect ratio above 200


@pytest.mark.parametrize("text", ["672x672", "672×672", " 500 X 800 ", "500,800"])
def test_parse_image_size(text: str) -> None:
    assert parse_image_size(text) in {(672, 672), (500, 800)}


@pytest.mark.parametrize("text", ["672", "axb", "0x10", "10x-3", "1.5x2"])
def test_parse_image_size_rejects(text: str) -> None:
    with pytest.raises(ImageSizeError):
        parse_image_size(text)


def test_squarest_grid() -> None:
    assert squarest_grid(1110) == (30, 37) and squarest_grid(576) == (24, 24) and squarest_grid(7) == (1, 7)


# (height, width) -> N by hand: (cols, rows) closest to W/H among 1..12 tiles, + a thumbnail when > 1 tile, 256 each
@pytest.mark.parametrize(("size", "n"), [((448, 448), 256), ((336, 336), 256), ((448, 896), 768),
                                         ((500, 2000), 1280), ((500, 800), 1792), ((672, 672), 1280)])  # fmt: skip
def test_internvl_counts(size: tuple[int, int], n: int) -> None:
    assert visual_tokens(INTERNVL, *size).tokens == n


def test_internvl_matches_transformers_tile_rule() -> None:
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    processor = GotOcr2ImageProcessorPil(size={"height": 448, "width": 448})
    for height, width in _sizes(400):
        tiles = processor.get_number_of_image_patches(height, width, {"crop_to_patches": True})
        assert visual_tokens(INTERNVL, height, width).tokens == 256 * tiles, (height, width)
