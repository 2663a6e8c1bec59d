"""Batched greedy answers: per sample exactly the token ids it gets alone, whatever its batch mates and their
order (eager: one left-padded ``model.generate``; static loop: right-padded per-sample positions, batch buckets)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from care_core.backbones import Qwen2_5_VLAdapter, Qwen3VLAdapter, load_backbone, static_generation
from care_core.backbones.chat_adapter import collate_left_padded
from care_core.backbones.probes import attention_implementation
from care_core.backbones.static_generation import StaticGreedy, eos_ids
from care_core.errors import GenerationError

from ._helpers import noise_image, reference_ids

QUESTIONS = ("What is in the image?", "Describe the colours.", "Is there a cat?")
NEW_TOKENS = 8
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

Samples = tuple[list[str], list[Any], list[torch.Tensor], list[torch.Tensor | None]]


@pytest.fixture(scope="module")
def images() -> list[Any]:
    return [noise_image(300, 400, seed=1), noise_image(180, 260, seed=2), noise_image(420, 240, seed=3)]


def _samples(adapter: Any, images: list[Any]) -> Samples:
    """Three images of different sizes and three questions: the first 7 rows, all N rows, and 12 rows (on
    the Qwen families the last one tied to no token, kept -1)."""
    tokens = [adapter.encode_image(image) for image in images]
    with torch.no_grad():
        full = [adapter.projector(t.features) for t in tokens]
    last = -1 if isinstance(adapter, (Qwen2_5_VLAdapter, Qwen3VLAdapter)) else 11
    kept: list[torch.Tensor | None] = [torch.arange(7), None, torch.tensor([*range(11), last])]
    return list(QUESTIONS), tokens, [full[0][:7], full[1], full[2][:12]], kept


@pytest.fixture(scope="module")
def samples(demos: dict[str, Any], images: list[Any]) -> dict[str, Samples]:
    return {name: _samples(adapter, images) for name, adapter in demos.items()}


def _alone(adapter: Any, samples: Samples, **options: Any) -> list[Any]:
    return [adapter.generate(q, t, p, NEW_TOKENS, k, **options) for q, t, p, k in zip(*samples, strict=True)]


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-llava-next", "tiny-qwen2.5-vl"])
def test_each_sample_gets_its_own_answer(demos: dict[str, Any], samples: dict[str, Samples], name: str) -> None:
    adapter, batch_samples = demos[name], samples[name]
    prompts = [adapter._lm_inputs(q, t, p, k) for q, t, p, k in zip(*batch_samples, strict=True)]
    assert len({int(x["input_ids"].shape[1]) for x in prompts}) == 3  # every sample is padded to another length
    batch = adapter.generate_batch(*batch_samples, max_new_tokens=NEW_TOKENS)
    assert [list(g.token_ids) for g in batch] == [reference_ids(adapter, x, NEW_TOKENS) for x in prompts]
    assert batch == _alone(adapter, batch_samples)  # text, ids, decoding and reason as generate gives alone
    assert all(g.decoding == "eager" and g.eager_reason for g in batch)  # CPU: no graphs
    reversed_samples = tuple(column[::-1] for column in batch_samples)
    assert adapter.generate_batch(*reversed_samples, max_new_tokens=NEW_TOKENS)[::-1] == batch


def test_answers_ending_early_lose_the_padding_after_their_end(demo: Any, samples: dict[str, Samples]) -> None:
    batch = demo.generate_batch(*samples["tiny-llava"], max_new_tokens=NEW_TOKENS)
    lengths = [len(g.token_ids) for g in batch]
    ends = eos_ids(demo.model)
    assert min(lengths) < NEW_TOKENS and len(set(lengths)) > 1  # the trained demo ends some answers early
    for g in batch:
        assert all(t not in ends for t in g.token_ids[:-1])  # nothing after an end token
        assert len(g.token_ids) == NEW_TOKENS or g.token_ids[-1] in ends


def test_static_batch_gives_every_sample_its_batch_one_tokens(
    demo: Any, samples: dict[str, Samples], monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [demo._lm_inputs(q, t, p, k) for q, t, p, k in zip(*samples["tiny-llava"], strict=True)]
    unforced = [reference_ids(demo, x, NEW_TOKENS) for x in prompts]
    forced = unforced[1][3]  # the middle sample's fourth token becomes an end token: it stops after 4 tokens
    ends = sorted(eos_ids(demo.model) | {forced})
    monkeypatch.setattr(demo.model.generation_config, "eos_token_id", ends)
    references = [reference_ids(demo, x, NEW_TOKENS) for x in prompts]
    assert len(references[1]) == 4 and len({len(r) for r in references}) == 3  # three different stopping steps
    greedy = StaticGreedy(demo.model, graphs=False)
    with torch.no_grad():
        embeds = [demo._prompt_embeddings(x) for x in prompts]
        batch = greedy.generate_batch(embeds, NEW_TOKENS)
        assert batch == references
        assert greedy.kv is not None and greedy.kv.batch == 4  # three samples and one dummy
        assert [greedy.generate(e, NEW_TOKENS) for e in embeds] == references
        assert greedy.generate_batch(embeds[::-1], NEW_TOKENS)[::-1] == references
        assert greedy.generate_batch(embeds, 0) == [[], [], []] and greedy.generate_batch([], 5) == []
    assert greedy.captures == 0


def test_static_batch_of_a_model_set_to_eager_attention_masks_each_sample(tiny_pair: Any, images: list[Any]) -> None:
    adapter, _ = tiny_pair
    batch_samples = _samples(adapter, images)
    prompts = [adapter._lm_inputs(q, t, p, k) for q, t, p, k in zip(*batch_samples, strict=True)]
    with attention_implementation(adapter.model, {"text_config": "eager"}), torch.no_grad():
        greedy = StaticGreedy(adapter.model, graphs=False)
        ids = greedy.generate_batch([adapter._prompt_embeddings(x) for x in prompts], 6)
        assert ids == [reference_ids(adapter, x, 6) for x in prompts]


def test_batches_beyond_the_largest_bucket_go_in_chunks(
    demo: Any, samples: dict[str, Samples], monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [demo._lm_inputs(q, t, p, k) for q, t, p, k in zip(*samples["tiny-llava"], strict=True)]
    monkeypatch.setattr(static_generation, "BATCH_BUCKETS", (1, 2))
    greedy = StaticGreedy(demo.model, graphs=False)
    with torch.no_grad():
        ids = greedy.generate_batch([demo._prompt_embeddings(x) for x in prompts], 6)
    assert ids == [reference_ids(demo, x, 6) for x in prompts]
    assert greedy.kv is not None and greedy.kv.batch == 2


def test_collate_left_pads_each_sequence_and_lists_rows_in_sample_order() -> None:
    rows = [torch.full((2, 3), 1.0), torch.full((1, 3), 2.0)]
    samples = [
        {"input_ids": torch.tensor([[5, 9, 9, 6]]), "attention_mask": torch.ones(1, 4, dtype=torch.long),
         "position_ids": torch.arange(12).view(3, 1, 4),
         "mm_encoder_outputs": {"image": BaseModelOutputWithPooling(pooler_output=[rows[0]])}},
        {"input_ids": torch.tensor([[7, 9]]), "attention_mask": torch.ones(1, 2, dtype=torch.long),
         "position_ids": torch.tensor([[[1, 2]], [[3, 4]], [[5, 6]]]),
         "mm_encoder_outputs": {"image": BaseModelOutputWithPooling(pooler_output=[rows[1]])}},
    ]  # fmt: skip
    batch = collate_left_padded(samples, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 9, 9, 6], [0, 0, 7, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
    assert batch["position_ids"].tolist() == [
        [[0, 1, 2, 3], [0, 0, 1, 2]],
        [[4, 5, 6, 7], [0, 0, 3, 4]],
        [[8, 9, 10, 11], [0, 0, 5, 6]],
    ]
    pooled = batch["mm_encoder_outputs"]["image"].pooler_output
    assert len(pooled) == 2 and pooled[0] is rows[0] and pooled[1] is rows[1]


def test_generate_batch_options(demo: Any, samples: dict[str, Samples]) -> None:
    questions, tokens, projected, kept = samples["tiny-llava"]
    auto = demo.generate_batch(questions, tokens, projected, kept, max_new_tokens=NEW_TOKENS)
    off = demo.generate_batch(questions, tokens, projected, kept, max_new_tokens=NEW_TOKENS, cuda_graph=False)
    assert off == [dataclasses.replace(g, eager_reason="turned off (cuda_graph=False)") for g in auto]
    with pytest.raises(GenerationError, match="CUDA graphs need a CUDA device") as info:
        demo.generate_batch(questions, tokens, projected, kept, max_new_tokens=NEW_TOKENS, cuda_graph=True)
    assert len(str(info.value).splitlines()) == 1
    none = demo.generate_batch(questions, tokens, projected, kept, max_new_tokens=0)
    assert [(g.text, g.token_ids) for g in none] == [("", ())] * 3
    assert demo.generate_batch([], [], [], [], max_new_tokens=4) == []
    with pytest.raises(ValueError, match="one question, image, rows and kept per sample"):
        demo.generate_batch(questions[:2], tokens, projected, kept)


def test_out_of_memory_in_the_static_decoder_reaches_the_caller_and_keeps_graphs_on(
    demo: Any, samples: dict[str, Samples], monkeypatch: pytest.MonkeyPatch
) -> None:
    class OutOfMemory:  # a static decoder whose batch does not fit
        def generate_batch(self, embeds: Any, max_new_tokens: int, **options: Any) -> Any:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 768.00 MiB")

    monkeypatch.setattr(type(demo), "_batch_graph_reason", lambda self, inputs, new: None)  # as on a GPU
    monkeypatch.setattr(type(demo), "_static_greedy", lambda self: OutOfMemory())
    with pytest.raises(torch.cuda.OutOfMemoryError):  # care_core.batch_sizes splits the batch on it
        demo.generate_batch(*samples["tiny-llava"], max_new_tokens=NEW_TOKENS)
    assert demo._graph_failure is None  # graphs were not turned off for the rest of the run


# ---------------------------------------------------------------------------------------------- CUDA
@cuda_only
@pytest.mark.parametrize(
    "name", ["tiny-llava", "tiny-llava-next", "tiny-internvl3", "tiny-qwen2.5-vl", "tiny-qwen3-vl"]
)
def test_cuda_graph_batches_give_each_sample_its_eager_answer(demo_home: Path, images: list[Any], name: str) -> None:
    adapter = load_backbone(name, home=demo_home, device="cuda", dtype="float32")
    batch_samples = _samples(adapter, images)
    eager = _alone(adapter, batch_samples, cuda_graph=False)
    greedy = adapter._static_greedy()
    first = adapter.generate_batch(*batch_samples, max_new_tokens=NEW_TOKENS)  # captures
    captured = greedy.captures
    second = adapter.generate_batch(*batch_samples, max_new_tokens=NEW_TOKENS)  # replays
    assert captured >= 2 and adapter._static_greedy() is greedy and greedy.captures == captured
    for batch in (first, second):
        assert all(g.decoding == "cuda-graph" and g.eager_reason is None for g in batch)
        assert [(g.text, g.token_ids) for g in batch] == [(g.text, g.token_ids) for g in eager]
    eager_batch = adapter.generate_batch(*batch_samples, max_new_tokens=NEW_TOKENS, cuda_graph=False)
    assert [g.token_ids for g in eager_batch] == [g.token_ids for g in eager]


@cuda_only
def test_a_short_batch_captures_its_own_bucket(demo_home: Path, images: list[Any]) -> None:
    adapter = load_backbone("tiny-llava", home=demo_home, device="cuda", dtype="float32")
    three = _samples(adapter, images)
    eight: Samples = tuple([*part, *part, *part[:2]] for part in three)  # type: ignore[assignment]
    adapter.generate_batch(*eight, max_new_tokens=NEW_TOKENS)  # bucket 8, captured at the longest prompt's rows
    greedy = adapter._static_greedy()
    captured = greedy.captures
    short = adapter.generate_batch(*three, max_new_tokens=NEW_TOKENS)  # bucket 4: bucket 8 is twice its rows
    assert greedy.captures > captured and greedy.last_shape is not None and greedy.last_shape[0] == 4
    assert {b for b, _ in greedy.prefills} == {4, 8}
    assert [g.token_ids for g in short] == [g.token_ids for g in _alone(adapter, three, cuda_graph=False)]


@cuda_only
def test_shorter_prompts_replay_a_captured_shape_within_a_quarter_more_rows(demo_home: Path, images: list[Any]) -> None:
    adapter = load_backbone("tiny-llava", home=demo_home, device="cuda", dtype="float32")
    tokens = adapter.encode_image(images[0])

    def samples(ks: tuple[int, ...]) -> Samples:
        with torch.no_grad():
            rows = [adapter.projector(tokens.features[:k]) for k in ks]
        return [QUESTIONS[0]] * len(ks), [tokens] * len(ks), rows, [torch.arange(k) for k in ks]

    def padded(k: int) -> int:
        width = adapter.model.config.text_config.hidden_size
        inputs = adapter._lm_inputs(QUESTIONS[0], tokens, torch.zeros(k, width), None)
        return static_generation.BUCKET * -(-int(inputs["input_ids"].shape[1]) // static_generation.BUCKET)

    longest = padded(400)
    near = next(k for k in range(400, 0, -1) if padded(k) < longest)  # one bucket shorter: within 1.25x
    adapter.generate_batch(*samples((400, 300)), max_new_tokens=NEW_TOKENS)  # bucket 2 at the longest padding
    greedy = adapter._static_greedy()
    captured, shapes = greedy.captures, set(greedy.prefills)
    short = samples((near, 300))
    answers = adapter.generate_batch(*short, max_new_tokens=NEW_TOKENS)
    assert greedy.last_shape == (2, longest) and set(greedy.prefills) == shapes  # the prefill replayed
    assert greedy.captures == captured  # and so did the decode (the same span)
    assert [g.token_ids for g in answers] == [g.token_ids for g in _alone(adapter, short, cuda_graph=False)]
