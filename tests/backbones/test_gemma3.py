"""Gemma3Adapter on the tiny-gemma3-random demo: 256 pooled SigLIP tokens, the RMSNorm + linear projector per token,
the model's own logits with all tokens, K placeholders in one bidirectional image block, eager decoding and what
the family refuses (pan-and-scan, CLS probes)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import care_core
from care_core import CaReConfig, care_reduce
from care_core.backbones import ImageTokens, load_backbone
from care_core.backbones.gemma3.adapter import Gemma3Adapter
from care_core.backbones.static_generation import unsupported_reason
from care_core.errors import MethodError, ModelLoadError
from care_core.scoring import _as_mlp, responses_fd, responses_jvp, unit_directions

from ._helpers import forward_with_image_rows, noise_image, reference_ids

QUESTION = "What is in the image?"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def gemma(demo_home: Path) -> Gemma3Adapter:
    adapter = load_backbone("tiny-gemma3-random", home=demo_home)
    assert isinstance(adapter, Gemma3Adapter)
    return adapter


@pytest.fixture(scope="module")
def image() -> Any:
    return noise_image(300, 500, seed=3)


@pytest.fixture(scope="module")
def tokens(gemma: Gemma3Adapter, image: Any) -> ImageTokens:
    return gemma.encode_image(image)


def processor_inputs(gemma: Gemma3Adapter, image: Any, question: str = QUESTION) -> Any:
    """The model's own processor on the adapter's prompt for it (its image written as ``<start_of_image>``, which
    the processor expands): test_all_tokens_give_the_models_own_logits holds it to the adapter's own ids."""
    return gemma.processor(text=gemma.processor_prompt(question), images=image, return_tensors="pt")


# ---------------------------------------------------------------------------------------- tokens
@pytest.mark.parametrize("hw", [(300, 500), (896, 896), (1000, 120), (64, 64)])
def test_token_count_is_the_processors_placeholder_count(gemma: Gemma3Adapter, hw: tuple[int, int]) -> None:
    image = noise_image(*hw)
    inputs = processor_inputs(gemma, image, "q")
    placeholders = int((inputs["input_ids"] == gemma.image_token_id).sum())
    assert placeholders == 256  # mm_tokens_per_image, pan-and-scan off: any size or aspect ratio
    tokens = gemma.encode_image(image)
    assert tokens.num_tokens == placeholders and tokens.grid == (16, 16)


def test_features_are_the_4x4_means_of_siglips_last_hidden_state(gemma: Gemma3Adapter, tokens: ImageTokens) -> None:
    inner = gemma.model.model
    with torch.no_grad():
        hidden = inner.vision_tower(pixel_values=tokens.model_inputs["pixel_values"]).last_hidden_state[0]
    blocks = hidden.reshape(16, 4, 16, 4, -1).double().mean(dim=(1, 3))  # (64 x 64 patches) -> 16 x 16 cells
    torch.testing.assert_close(tokens.features.double(), blocks.reshape(256, -1), rtol=1e-6, atol=1e-6)


def test_projector_is_rmsnorm_with_one_plus_w_then_the_linear_map(gemma: Gemma3Adapter, tokens: ImageTokens) -> None:
    mm = gemma.model.model.multi_modal_projector
    x = tokens.features.double()
    eps = float(mm.mm_soft_emb_norm.eps)
    normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + mm.mm_soft_emb_norm.weight.double())
    expected = normed @ mm.mm_input_projection_weight.double()
    with torch.no_grad():
        projected = gemma.projector(tokens.features)
    torch.testing.assert_close(projected.double(), expected, rtol=1e-5, atol=1e-5)
    assert float(projected.abs().max()) > 0  # the demo's projector weight is drawn, not transformers' zeros


def test_projected_rows_are_the_models_own_bit_for_bit(gemma: Gemma3Adapter, tokens: ImageTokens) -> None:
    """The per-token projector writes the norm out (to keep float64 wide); in float32 and bfloat16 its rows are the
    model's own projector's, bit for bit."""
    mm = gemma.model.model.multi_modal_projector
    with torch.no_grad():
        own = gemma.model.model.get_image_features(pixel_values=tokens.model_inputs["pixel_values"]).pooler_output
        assert torch.equal(gemma.projector(tokens.features), own.reshape(tokens.num_tokens, -1))
        half, projector = copy.deepcopy(mm).to(torch.bfloat16), copy.deepcopy(gemma.projector).to(torch.bfloat16)
        rows = tokens.features.to(torch.bfloat16)
        expected = torch.matmul(half.mm_soft_emb_norm(rows), half.mm_input_projection_weight).type_as(rows)
        assert torch.equal(projector(rows), expected)


def test_jvp_through_the_rmsnorm_projector_agrees_with_fd_in_float64(gemma: Gemma3Adapter, tokens: ImageTokens) -> None:
    """Eq. 1's central difference at h = 1e-5 in float64 against the exact J u (the norm-then-linear fast path,
    held to the generic torch.func.jvp path in tests/core/test_scoring_norm_linear.py); a norm rounding to float32
    would miss by ~1e-2."""
    projector = copy.deepcopy(gemma.projector).double()
    assert _as_mlp(projector) is None
    features = tokens.features[::13].double()
    directions = unit_directions(8, features.shape[1], seed=0, dtype=torch.float64)
    jvp = responses_jvp(features, projector, directions)
    fd = responses_fd(features, projector, directions, 1e-5)
    assert jvp.shape == fd.shape == (8, features.shape[0])
    assert float(((jvp - fd).abs() / fd.abs()).max()) < 1e-7
    for engine in ("fd", "jvp"):  # and CaRe runs end to end on the pooled tokens with either engine
        red = care_reduce(tokens.features.double(), projector, tokens.positions, keep=20,
                          config=CaReConfig(m=8, engine=engine))  # fmt: skip
        assert red.indices.numel() == 20 and red.tokens.shape == (20, tokens.features.shape[1])


def test_boxes_tile_the_squashed_image(gemma: Gemma3Adapter, tokens: ImageTokens) -> None:
    boxes = tokens.boxes.double()
    assert torch.allclose(boxes[0], torch.tensor([0.0, 0.0, 500 / 16, 300 / 16], dtype=torch.float64))
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    assert torch.isclose(areas.sum(), torch.tensor(300.0 * 500.0, dtype=torch.float64))


# ------------------------------------------------------------------------------------ language model
def test_all_tokens_give_the_models_own_logits(gemma: Gemma3Adapter, image: Any, tokens: ImageTokens) -> None:
    inputs = processor_inputs(gemma, image)
    with torch.no_grad():
        expected = gemma.model(**inputs).logits[0]
        projected = gemma.projector(tokens.features)
    ours = gemma._lm_inputs(QUESTION, tokens, projected, None)
    assert torch.equal(ours["input_ids"], inputs["input_ids"])  # boi + 256 placeholders + eoi, as the processor
    assert torch.equal(ours["token_type_ids"], inputs["token_type_ids"])
    logits = gemma.language_model_logits(QUESTION, tokens, projected)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_reduced_rows_are_exactly_k_rows_in_one_block(gemma: Gemma3Adapter, tokens: ImageTokens) -> None:
    kept = torch.arange(0, tokens.num_tokens, 9)
    with torch.no_grad():
        projected = gemma.projector(tokens.features[kept])
    inputs = gemma._lm_inputs(QUESTION, tokens, projected, kept)
    ids, types = inputs["input_ids"][0], inputs["token_type_ids"][0]
    tid = gemma.tokenizer.convert_tokens_to_ids
    start = int((ids == tid("<start_of_image>")).nonzero())
    end = int((ids == tid("<end_of_image>")).nonzero())
    assert end - start - 1 == kept.numel() and bool((ids[start + 1 : end] == gemma.image_token_id).all())
    assert torch.equal(types.nonzero().flatten(), torch.arange(start + 1, end))  # type 1 on exactly those K
    _, rows = forward_with_image_rows(gemma, inputs)
    assert torch.equal(rows, projected)  # exactly the K rows, in the order given, where the decoder takes them
    assert gemma.visual_tokens_fed(tokens, kept.numel(), kept) == kept.numel()


def _first_image_logits(gemma: Gemma3Adapter, inputs: dict[str, Any], rows: torch.Tensor) -> torch.Tensor:
    first = int((inputs["input_ids"][0] == gemma.image_token_id).nonzero()[0])
    fed = {**inputs, "mm_encoder_outputs": gemma._encoder_outputs(rows, None, None)}  # type: ignore[arg-type]
    with torch.no_grad():
        return gemma.model(**fed).logits[0, first]  # type: ignore[no-any-return]


def test_the_k_rows_attend_to_each_other_both_ways(gemma: Gemma3Adapter, tokens: ImageTokens) -> None:
    """Changing the LAST of the K rows changes the output at the FIRST: only a bidirectional block allows that (a
    causal mask hides later rows); without token_type_ids the model's mask is causal and the first row is blind."""
    kept = torch.arange(0, tokens.num_tokens, 9)
    with torch.no_grad():
        projected = gemma.projector(tokens.features[kept])
    inputs = gemma._lm_inputs(QUESTION, tokens, projected, kept)
    changed = projected.clone()
    changed[-1] = changed[-1] * -3.0 + 1.0
    before, after = _first_image_logits(gemma, inputs, projected), _first_image_logits(gemma, inputs, changed)
    assert not torch.allclose(before, after, atol=1e-6)
    causal = {key: value for key, value in inputs.items() if key != "token_type_ids"}
    torch.testing.assert_close(_first_image_logits(gemma, causal, projected),
                               _first_image_logits(gemma, causal, changed), rtol=0, atol=0)  # fmt: skip


def test_generate_with_all_and_reduced_tokens_is_model_generate(
    gemma: Gemma3Adapter, image: Any, tokens: ImageTokens
) -> None:
    with torch.no_grad():
        full = gemma.projector(tokens.features)
    answer = gemma.generate(QUESTION, tokens, full, max_new_tokens=4)
    assert list(answer.token_ids) == reference_ids(gemma, processor_inputs(gemma, image), 4)  # the pixel path's
    kept = torch.arange(0, tokens.num_tokens, 11)
    reduced = gemma.generate(QUESTION, tokens, full[kept], max_new_tokens=4, kept=kept)
    assert list(reduced.token_ids) == reference_ids(gemma, gemma._lm_inputs(QUESTION, tokens, full[kept], kept), 4)
    assert reduced.decoding == "eager" and reduced.eager_reason


def test_the_static_loop_refuses_gemma3(gemma: Gemma3Adapter) -> None:
    assert "gemma3_text" in str(unsupported_reason(gemma.model))  # the decoder is not one the static loop drives
    assert gemma.graph_generation_reason() is not None


def test_batched_answers_equal_single_ones(gemma: Gemma3Adapter, tokens: ImageTokens) -> None:
    with torch.no_grad():
        full = gemma.projector(tokens.features)
    kept = [torch.arange(0, 256, 7), torch.arange(0, 256, 3)]
    questions = [QUESTION, "Which colour?"]
    batch = gemma.generate_batch(questions, [tokens, tokens], [full[k] for k in kept], kept, max_new_tokens=3)
    single = [
        gemma.generate(q, tokens, full[k], max_new_tokens=3, kept=k) for q, k in zip(questions, kept, strict=True)
    ]
    assert [b.token_ids for b in batch] == [s.token_ids for s in single]


# ------------------------------------------------------------------------------------------ drop-in
def processor_batch(gemma: Gemma3Adapter, images: list[Any], questions: list[str]) -> Any:
    """The processor's left-padded batch (with its full-length ``token_type_ids``) of one image per prompt."""
    texts = [gemma.processor_prompt(q) for q in questions]
    nested = [[image] for image in images]  # Gemma 3's processor takes a list of images per prompt
    return gemma.processor(text=texts, images=nested, return_tensors="pt", padding=True, padding_side="left")


def test_the_dropin_generates_the_adapters_reduced_answers(gemma: Gemma3Adapter) -> None:
    """Inside the block, transformers' generate on the processor's batch gives each sample the new tokens of the
    adapter's own reduced path (its K rows in one bidirectional block) for the kept tokens the method chose."""
    images, questions = [noise_image(300, 500, seed=3), noise_image(200, 120, seed=4)], [QUESTION, "Which colour?"]
    inputs = processor_batch(gemma, images, questions)
    assert inputs["token_type_ids"].shape == inputs["input_ids"].shape and bool((inputs["attention_mask"] == 0).any())
    options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": gemma._pad_token_id}
    with care_core.reduce_visual_tokens(gemma.model, processor=gemma.processor, keep=40) as reduction:
        out = gemma.model.generate(**inputs, **options)
        with torch.no_grad():
            reduced = reduction.reduced_inputs(inputs)
            last_logits = gemma.model(**reduced).logits[:, -1]
    types, ids = reduced["token_type_ids"], reduced["input_ids"]
    assert torch.equal(types, (ids == gemma.image_token_id).long())  # 1 on exactly the K placeholders of each row
    assert torch.equal(types.sum(1), torch.tensor([40, 40]))
    length = inputs["input_ids"].shape[1]
    assert torch.equal(out[:, :length], inputs["input_ids"])
    for b, (image, question, result) in enumerate(zip(images, questions, reduction.results, strict=True)):
        tokens = gemma.encode_image(image)
        kept = result.token_index
        assert kept.numel() == 40
        with torch.no_grad():  # the method's K tokens: a signal token is its calibrated row, not its raw feature
            projected = gemma.projector(result.tokens.to(gemma.dtype))
        own = gemma.language_model_logits(question, tokens, projected, kept)[-1]
        torch.testing.assert_close(last_logits[b], own, rtol=1e-4, atol=1e-4)  # the prompt's mask, not just its ids
        answer = gemma.generate(question, tokens, projected, max_new_tokens=4, kept=kept)
        assert tuple(out[b, length : length + len(answer.token_ids)].tolist()) == answer.token_ids


def test_the_dropin_keeping_every_token_equals_plain_generate(gemma: Gemma3Adapter) -> None:
    images, questions = [noise_image(300, 500, seed=3), noise_image(200, 120, seed=4)], [QUESTION, "Which colour?"]
    inputs = processor_batch(gemma, images, questions)
    options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": gemma._pad_token_id}
    with torch.no_grad():
        plain = gemma.model.generate(**inputs, **options)
        with care_core.reduce_visual_tokens(gemma.model, processor=gemma.processor, ratio=1.0):
            reduced = gemma.model.generate(**inputs, **options)
    assert torch.equal(reduced, plain)


# ------------------------------------------------------------------------------------------ refusals
def test_pan_and_scan_is_refused_at_load(gemma: Gemma3Adapter) -> None:
    processor = copy.deepcopy(gemma.processor)
    processor.image_processor.do_pan_and_scan = True
    with pytest.raises(ModelLoadError, match="pan-and-scan"):
        Gemma3Adapter(gemma.model, processor, name="pas")


def test_cls_probes_refuse_in_one_line(gemma: Gemma3Adapter) -> None:
    with pytest.raises(MethodError, match="no CLS token"):
        gemma.check_probes(["cls_attention"], method="visionzip")


# ------------------------------------------------------------------------------------------ CLI
def test_care_reduce_runs_on_the_demo(care: Any) -> None:
    result = care("reduce", EXAMPLES / "astronaut.jpg", "--model", "tiny-gemma3-random", "--method", "care",
                  "--keep", "28", "--json", "--device", "cpu")  # fmt: skip
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["backbone"]["family"] == "gemma3"
    assert (report["N"], report["K"], len(report["token_index"])) == (256, 28, 28)
