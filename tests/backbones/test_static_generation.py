"""Greedy decoding over a static KV cache (the CUDA-graph path of ``generate``): same tokens as
``model.generate`` (1-D rope, and Qwen's multimodal rope and DeepStack rows), run eagerly here on CPU and
captured/replayed on CUDA where one is present; the shape a call runs in (its own, or a captured one at most
``REUSE_ROWS_RATIO`` times its rows)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from care_core.backbones import load_backbone
from care_core.backbones.probes import attention_implementation
from care_core.backbones.static_generation import (
    BUCKET,
    StaticGreedy,
    StaticPrompt,
    eos_ids,
    reused_shape,
    unsupported_reason,
)
from care_core.errors import GenerationError

from ._helpers import noise_image, reference_ids, static_prompt_from_inputs

QUESTION = "What is in the image?"
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _feeds(adapter: Any, tokens: Any) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """All tokens, and two reductions whose prompts are not multiples of the bucket (padding is exercised)."""
    n = tokens.num_tokens
    g = torch.Generator().manual_seed(0)
    feeds: list[tuple[torch.Tensor, torch.Tensor | None]] = [(adapter.projector(tokens.features), None)]
    for k in (7, 30):
        kept = torch.randperm(n, generator=g)[:k].sort().values
        feeds.append((adapter.projector(tokens.features[kept.to(tokens.features.device)]), kept))
    return feeds


@pytest.fixture(scope="module")
def image() -> Any:
    return noise_image(300, 400, seed=4)


@pytest.mark.parametrize("name", ["demo", "next_demo", "internvl_demo"])
def test_static_loop_gives_model_generate_tokens(request: pytest.FixtureRequest, image: Any, name: str) -> None:
    adapter = request.getfixturevalue(name)
    assert unsupported_reason(adapter.model) is None
    tokens = adapter.encode_image(image)
    greedy = StaticGreedy(adapter.model, graphs=False)
    lengths = []
    with torch.no_grad():
        for projected, kept in _feeds(adapter, tokens):
            inputs = adapter._lm_inputs(QUESTION, tokens, projected, kept)
            lengths.append(int(inputs["input_ids"].shape[1]))
            ids = greedy.generate(adapter._prompt_embeddings(inputs), 12)
            assert ids == reference_ids(adapter, inputs, 12)
    assert any(length % BUCKET for length in lengths)  # a padded prefill was among them
    assert greedy.kv is not None and greedy.kv.capacity >= max(lengths) + 11
    assert greedy.captures == 0  # CPU: nothing captured


def _qwen_feeds(adapter: Any, tokens: Any) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """All tokens, a kept subset in raster order, a shuffled one, and one with a row tied to no token (-1)."""
    n = tokens.num_tokens
    g = torch.Generator().manual_seed(1)
    subset = torch.randperm(n, generator=g)[:30]
    kepts = [subset.sort().values, subset, torch.tensor([*subset[:11].tolist(), -1])]
    with torch.no_grad():
        rows = [adapter.projector(tokens.features[kept.clamp(min=0).to(tokens.features.device)]) for kept in kepts]
        return [(adapter.projector(tokens.features), None), *zip(rows, kepts, strict=True)]


@pytest.mark.parametrize("name", ["qwen_demo", "qwen3_demo"])
def test_static_loop_gives_model_generate_tokens_with_multimodal_rope(
    request: pytest.FixtureRequest, image: Any, name: str
) -> None:
    adapter = request.getfixturevalue(name)
    tokens = adapter.encode_image(image)
    greedy = StaticGreedy(adapter.model, graphs=False)
    with torch.no_grad():
        inputs = [adapter._lm_inputs(QUESTION, tokens, p, k) for p, k in _qwen_feeds(adapter, tokens)]
        assert all(adapter._graph_reason(x, 12) == adapter.graph_generation_reason() for x in inputs)  # no extras
        prompts = [static_prompt_from_inputs(adapter, x) for x in inputs]
        references = [reference_ids(adapter, x, 12) for x in inputs]
        assert [greedy.generate(p, 12) for p in prompts] == references
        # a batch of prompts of different lengths: per sample what batch 1 gives
        assert len({int(p.embeds.shape[0]) for p in prompts}) == 3  # the raster and shuffled subsets: one length
        assert greedy.generate_batch(prompts[::-1], 12)[::-1] == references
        # the comparison sees the positions (and Qwen3-VL's DeepStack rows): without them the answer changes
        assert greedy.generate(StaticPrompt(prompts[0].embeds, None, prompts[0].deepstack), 12) != references[0]
        if prompts[0].deepstack is not None:
            assert greedy.generate(StaticPrompt(prompts[0].embeds, prompts[0].positions), 12) != references[0]
    assert greedy.captures == 0


def test_qwen3_prompts_carry_positions_and_deepstack_rows_into_the_loop(qwen3_demo: Any, image: Any) -> None:
    tokens = qwen3_demo.encode_image(image)
    kept = torch.tensor([5, 0, -1])
    with torch.no_grad():
        inputs = qwen3_demo._lm_inputs(QUESTION, tokens, qwen3_demo.projector(tokens.features[[5, 0, 0]]), kept)
    prompt = static_prompt_from_inputs(qwen3_demo, inputs)
    ids = inputs["input_ids"][0]
    visual = ids == qwen3_demo.image_token_id
    assert int(visual.sum()) == 3
    assert prompt.positions is not None and torch.equal(prompt.positions, inputs["position_ids"][1:, 0])  # t, h, w
    assert torch.equal(inputs["position_ids"][0, 0], torch.arange(ids.numel()))  # the text row: the cache index
    levels = inputs["mm_encoder_outputs"]["image"].deepstack_features
    assert prompt.deepstack is not None and prompt.deepstack.shape == (2, ids.numel(), prompt.embeds.shape[1])
    for level, rows in enumerate(levels):
        assert torch.equal(prompt.deepstack[level, visual], rows[0])  # the K rows at the placeholders, in order
        assert not prompt.deepstack[level, visual.nonzero()[-1]].any()  # the -1 row: nothing added
        assert not prompt.deepstack[level, ~visual].any()  # text rows: nothing added
    assert "carries pixel_values" in (qwen3_demo._graph_reason({**inputs, "pixel_values": None}, 8) or "")


def _bits(value: torch.Tensor | None) -> torch.Tensor | None:
    """``value``'s bits (a float tensor viewed as integers of its width): equal bits, not merely equal values."""
    if value is None or not value.is_floating_point():
        return value
    return value.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[value.element_size()])


def _kepts(n: int) -> list[torch.Tensor | None]:
    """All tokens in order, a subset in raster order, the same shuffled, and one with a row tied to no token."""
    subset = torch.randperm(n, generator=torch.Generator().manual_seed(2))[:13]
    return [None, subset.sort().values, subset, torch.tensor([*subset[:6].tolist(), -1, *subset[6:9].tolist()])]


def _written(prompt: StaticPrompt) -> torch.Tensor:
    """The (L, d) embeddings ``prompt`` writes into the loop's static inputs."""
    out = prompt.embeds.new_full((prompt.length, prompt.embeds.shape[-1]), float("nan"))
    prompt.write(out)
    return out


def test_a_prompts_rows_are_written_with_the_inserted_ones_at_their_place() -> None:
    text = torch.arange(12.0).view(6, 2)
    rows = -torch.arange(1.0, 7.0).view(3, 2)
    for at in (0, 2, 6):
        prompt = StaticPrompt(text, inserted=rows, at=at)
        want = [text[i].tolist() for i in range(at)] + rows.tolist() + [text[i].tolist() for i in range(at, 6)]
        assert prompt.length == 9 and _written(prompt).tolist() == want
    with pytest.raises(ValueError, match="inserted rows"):
        StaticGreedy.__new__(StaticGreedy)._checked(StaticPrompt(text, inserted=rows, at=7))


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-llava-next", "tiny-llava-onevision", "tiny-internvl3",
                                  "tiny-qwen2.5-vl", "tiny-qwen3-vl"])  # fmt: skip
def test_the_loop_prompt_from_the_parts_is_the_one_from_the_model_inputs_bit_for_bit(
    demo_home: Path, image: Any, name: str
) -> None:
    adapter: Any = load_backbone(name, home=demo_home)
    tokens = adapter.encode_image(image)
    with torch.no_grad():
        for kept in _kepts(tokens.num_tokens):
            rows = tokens.features if kept is None else tokens.features[kept.clamp(min=0)]
            projected = adapter.projector(rows)  # all tokens: LLaVA-NeXT and OneVision add their newline rows
            direct = adapter._loop_prompt(adapter._prompt_parts(QUESTION, tokens, projected, kept))
            via = static_prompt_from_inputs(adapter, adapter._lm_inputs(QUESTION, tokens, projected, kept))
            assert direct.length == via.length
            for field in ("embeds", "positions", "deepstack"):
                got, want = getattr(direct, field), getattr(via, field)
                if field == "embeds":  # the text rows with the visual rows inserted, as the loop writes them
                    got, want = _written(direct), _written(via)
                assert (got is None) == (want is None), field
                if want is not None:
                    assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want)), field


@pytest.mark.parametrize("name", ["tiny-llava", "tiny-llava-next", "tiny-llava-onevision", "tiny-internvl3",
                                  "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3.5-random",
                                  "tiny-gemma3-random"])  # fmt: skip
def test_the_graph_decision_from_the_parts_is_the_one_from_the_model_inputs(
    demo_home: Path, image: Any, name: str
) -> None:
    adapter: Any = load_backbone(name, home=demo_home)
    tokens = adapter.encode_image(image)
    kept = torch.arange(0, tokens.num_tokens, 5)
    with torch.no_grad():
        parts = adapter._prompt_parts(QUESTION, tokens, adapter.projector(tokens.features[kept]), kept)
    inputs = adapter._model_inputs(parts)
    assert set(inputs) - set(parts.carried()) <= adapter.static_inputs  # what the parts leave out, the loop takes
    assert adapter._graph_reason(parts.carried(), 8) == adapter._graph_reason(inputs, 8)
    assert torch.equal(parts.input_ids, inputs["input_ids"])


def test_fed_deepstack_gives_each_row_its_tokens_rows_alone_and_in_a_batch(qwen3_demo: Any) -> None:
    levels, n, width = 2, 6, 3
    deepstack = torch.arange(levels * n * width, dtype=torch.float32).view(levels, n, width) + 1
    kept = torch.tensor([4, 0, -1, 5])
    want = torch.stack([torch.stack([deepstack[lv, t] if t >= 0 else torch.zeros(width) for t in kept.tolist()])
                        for lv in range(levels)])  # fmt: skip
    got = qwen3_demo.fed_deepstack(deepstack, kept, 4)
    assert torch.equal(got, want)
    batch = qwen3_demo.fed_deepstack(torch.stack([deepstack, deepstack.flip(1)], dim=1), torch.stack([kept, kept]), 4)
    assert torch.equal(batch[:, 0], want)
    assert torch.equal(batch[:, 1], qwen3_demo.fed_deepstack(deepstack.flip(1), kept, 4))
    assert torch.equal(qwen3_demo.fed_deepstack(deepstack, None, 2), deepstack[:, :2])


def test_a_qwen3_image_without_deepstack_rows_is_refused_before_decoding(
    qwen3_demo: Any, image: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = qwen3_demo.encode_image(image)
    bare = dataclasses.replace(tokens, model_inputs={k: v for k, v in tokens.model_inputs.items() if k != "deepstack"})
    monkeypatch.setattr(type(qwen3_demo), "_batch_graph_reason", lambda self, parts, new: None)  # as on a GPU
    monkeypatch.setattr(type(qwen3_demo), "_static_greedy", lambda self: StaticGreedy(self.model, graphs=False))
    with torch.no_grad(), pytest.raises(ValueError, match="no deepstack rows for every token"):
        qwen3_demo.generate(QUESTION, bare, qwen3_demo.projector(tokens.features[:4]), max_new_tokens=2)
    assert qwen3_demo._graph_failure is None  # a bad input, not a failed capture: graphs stay on


def test_the_loop_refuses_extras_its_decoder_does_not_take(demo: Any, qwen_demo: Any, image: Any) -> None:
    tokens = qwen_demo.encode_image(image)
    with torch.no_grad():
        inputs = qwen_demo._lm_inputs(QUESTION, tokens, qwen_demo.projector(tokens.features[:4]), None)
    prompt = static_prompt_from_inputs(qwen_demo, inputs)
    assert prompt.positions is not None and prompt.deepstack is None  # Qwen2.5-VL has no DeepStack
    length, width = prompt.embeds.shape
    qwen = StaticGreedy(qwen_demo.model, graphs=False)
    with pytest.raises(ValueError, match="deepstack"):
        qwen.generate(replace(prompt, deepstack=torch.zeros(2, length, width)), 2)
    with pytest.raises(ValueError, match=r"positions \(3, 7\) for 8 rows"):
        qwen.generate(replace(prompt, embeds=prompt.embeds[:8], positions=prompt.positions[:, :7]), 2)
    llama = StaticGreedy(demo.model, graphs=False)
    embeds = torch.zeros(8, demo.model.config.text_config.hidden_size)
    with pytest.raises(ValueError, match="1-D"):
        llama.generate(StaticPrompt(embeds, torch.zeros(3, 8, dtype=torch.long)), 2)


def test_stops_at_the_end_token_as_generate_does(demo: Any, image: Any) -> None:
    tokens = demo.encode_image(image)
    inputs = demo._lm_inputs(QUESTION, tokens, demo.projector(tokens.features[:20]), torch.arange(20))
    reference = reference_ids(demo, inputs, 40)
    assert reference[-1] in eos_ids(demo.model) and len(reference) < 40  # the trained demo ends its answers
    with torch.no_grad():
        ids = StaticGreedy(demo.model, graphs=False).generate(demo._prompt_embeddings(inputs), 40)
    assert ids == reference


def test_a_model_set_to_eager_attention_gets_its_own_tokens(tiny_pair: Any, image: Any) -> None:
    adapter, _ = tiny_pair  # model.generate then runs transformers' eager attention; the loop its own causal one
    tokens = adapter.encode_image(image)
    with attention_implementation(adapter.model, {"text_config": "eager"}), torch.no_grad():
        assert adapter.model.config.text_config._attn_implementation == "eager"
        greedy = StaticGreedy(adapter.model, graphs=False)
        for projected, kept in _feeds(adapter, tokens):
            inputs = adapter._lm_inputs(QUESTION, tokens, projected, kept)
            assert greedy.generate(adapter._prompt_embeddings(inputs), 8) == reference_ids(adapter, inputs, 8)


def test_one_cache_serves_growing_prompts(demo: Any, image: Any) -> None:
    tokens = demo.encode_image(image)
    greedy = StaticGreedy(demo.model, graphs=False)
    with torch.no_grad():
        for k in (5, 576, 9):  # short, then long (the cache grows), then short again in the grown cache
            kept = torch.arange(k)
            inputs = demo._lm_inputs(QUESTION, tokens, demo.projector(tokens.features[:k]), kept)
            assert greedy.generate(demo._prompt_embeddings(inputs), 6) == reference_ids(demo, inputs, 6)
    assert greedy.kv is not None and greedy.kv.capacity >= 576
    spans = {span for _, span in greedy.decodes}  # the short prompt's steps attended over its own span only
    assert min(spans) < greedy.kv.capacity


def test_a_call_replays_a_captured_shape_only_within_a_quarter_more_rows() -> None:
    captured = [(16, 96), (8, 112), (64, 96), (64, 624), (64, 176), (16, 272)]  # (batch bucket, rows) with a graph
    assert reused_shape(16, 96, captured) == (16, 96)  # its own shape, captured, is never traded for a larger one
    assert reused_shape(4, 112, captured) == (4, 112)  # (8, 112): 896 rows > 1.25 x 448: a bucket of its own
    assert reused_shape(1, 80, captured) == (1, 80)  # 896 rows for 80
    assert reused_shape(16, 240, captured) == (16, 272)  # 4,352 rows <= 1.25 x 3,840 = 4,800
    assert reused_shape(16, 208, captured) == (16, 208)  # 4,352 > 1.25 x 3,328 = 4,160
    assert reused_shape(64, 144, captured) == (64, 176)  # 11,264 <= 1.25 x 9,216 = 11,520
    assert reused_shape(64, 128, captured) == (64, 128)  # 11,264 > 1.25 x 8,192 = 10,240
    assert reused_shape(32, 176, captured) == (32, 176)  # (64, 176) is twice its rows
    assert reused_shape(1, 64, [(1, 80)]) == (1, 80)  # exactly 1.25 x its rows: replayed
    assert reused_shape(8, 160, [(8, 192), (8, 176)]) == (8, 176)  # both within 1,600 rows: the fewer
    assert reused_shape(1, 208, [(1, 2912)]) == (1, 208)  # issue #47: a reduced prompt after the all-token one


def test_a_data_sets_last_short_batch_captures_its_own_bucket() -> None:
    # care eval on LLaVA-1.5 at K = 64, batch 64 (H100, 2026-11-27): the warm-up's prompts pad to 112 rows, the
    # task's to 176 (162-166 rows: 64 kept tokens and the byte tokenizer's question), the last batch holds 4
    captured = [(64, 112), (64, 176)]
    assert reused_shape(4, 176, captured) == (4, 176)  # 64 x 176 = 16 x its 4 x 176 rows: captures its own
    assert reused_shape(4, 160, captured) == (4, 160)
    assert reused_shape(64, 160, captured) == (64, 176)  # a full batch of shorter prompts: 1.1 x its rows
    assert reused_shape(64, 192, captured) == (64, 192)  # longer prompts than any captured: a graph of their own


def test_a_reduced_prompt_after_a_longer_one_runs_in_its_own_shape(demo: Any, image: Any) -> None:
    tokens = demo.encode_image(image)
    n = tokens.num_tokens

    def inputs(k: int) -> dict[str, Any]:
        return demo._lm_inputs(QUESTION, tokens, demo.projector(tokens.features[:k]), torch.arange(k))

    def padded(k: int) -> int:
        return BUCKET * -(-int(inputs(k)["input_ids"].shape[1]) // BUCKET)

    greedy = StaticGreedy(demo.model, graphs=False)  # the eager loop picks shapes as the graph loop does
    longest = padded(n)
    near = next(k for k in range(n, 0, -1) if padded(k) < longest)  # one bucket shorter: within 1.25x
    far = next(k for k in range(near, 0, -1) if 1.25 * padded(k) < longest)
    with torch.no_grad():
        assert greedy.generate(demo._prompt_embeddings(inputs(n)), 6) == reference_ids(demo, inputs(n), 6)
        assert greedy.last_shape == (1, longest)
        for k, shape in ((20, (1, padded(20))), (far, (1, padded(far))), (near, (1, longest))):
            assert greedy.generate(demo._prompt_embeddings(inputs(k)), 6) == reference_ids(demo, inputs(k), 6)
            assert greedy.last_shape == shape, k


def test_prompts_taking_turns_in_one_shape_each_answer_from_their_own_last_row(demo: Any, image: Any) -> None:
    tokens = demo.encode_image(image)

    def inputs(k: int) -> dict[str, Any]:
        return demo._lm_inputs(QUESTION, tokens, demo.projector(tokens.features[:k]), torch.arange(k))

    length = {k: int(inputs(k)["input_ids"].shape[1]) for k in range(16, 33)}
    short = next(k for k in length if length[k] % BUCKET == 1)  # one row into a bucket, then one a few rows longer
    turns = (short, short + 5, short, short + 5)
    greedy = StaticGreedy(demo.model, graphs=False)
    with torch.no_grad():
        for k in turns:
            assert greedy.generate(demo._prompt_embeddings(inputs(k)), 4) == reference_ids(demo, inputs(k), 4), k
            entry = greedy.prefills[greedy.last_shape]
            assert greedy.last_shape == (1, BUCKET * -(-length[short] // BUCKET))  # one shape for all four
            assert entry.last.tolist() == [length[k] - 1], k  # each prompt's own last row, read back from the buffer


def test_rows_past_each_prompt_hold_zeros_whatever_the_earlier_fills_wrote(demo: Any) -> None:
    greedy = StaticGreedy(demo.model, graphs=False)
    d = greedy.hidden_size
    greedy._ensure_capacity(2, 32)
    entry = greedy._bucket(2, 32)
    # longer prompts, then shorter ones, then the same lengths again (where the zeros are not written anew)
    for lengths in ((30, 20), (5, 9), (5, 9), (12,), (12,)):
        prompts = [StaticPrompt(torch.full((n, d), float(i + 1))) for i, n in enumerate(lengths)]
        greedy._fill(entry, prompts, lengths)
        for i in range(2):
            n = lengths[i] if i < len(lengths) else 0
            assert torch.all(entry.embeds[i, :n] == i + 1) and torch.all(entry.embeds[i, n:] == 0), (lengths, i)
        assert entry.last.tolist() == [n - 1 for n in lengths] + [0] * (2 - len(lengths)), lengths


def test_the_loops_text_rows_follow_the_embedding_table(demo: Any) -> None:
    adapter = copy.copy(demo)  # its own memos, the demo's model copied below
    adapter.model = copy.deepcopy(demo.model)
    adapter._device_text = {}
    ids, at = adapter._prompt_ids(QUESTION)
    text_ids = torch.cat([ids[:at], ids[at + 1 :]])
    table = adapter.model.get_input_embeddings().weight
    for edit in (None, lambda: table.mul_(2.0), lambda: adapter.model.to(torch.float64)):
        if edit is not None:
            with torch.no_grad():
                edit()
        text = adapter._text_rows(QUESTION)
        weight = adapter.model.get_input_embeddings().weight
        assert text.dtype == weight.dtype and torch.equal(text, weight[text_ids])


def test_a_short_batch_runs_in_its_own_bucket(demo: Any, image: Any) -> None:
    tokens = demo.encode_image(image)
    with torch.no_grad():
        prompts = [demo._lm_inputs(QUESTION, tokens, demo.projector(tokens.features[:k]), torch.arange(k))
                   for k in (9, 10, 11, 12, 13, 14, 15, 30)]  # fmt: skip
        embeds = [demo._prompt_embeddings(x) for x in prompts]
    lengths = [int(x["input_ids"].shape[1]) for x in prompts]
    assert lengths[-1] - lengths[0] == 21 and lengths[-1] % BUCKET > 5  # the last pads one bucket further
    eight = BUCKET * -(-lengths[-1] // BUCKET)
    own = BUCKET * -(-lengths[4] // BUCKET)  # the first 3 and the first 5 pad to this
    assert own == eight - BUCKET and eight <= 1.25 * own
    greedy = StaticGreedy(demo.model, graphs=False)
    with torch.no_grad():
        greedy.generate_batch(embeds, 4)
        assert greedy.last_shape == (8, eight)
        assert greedy.generate_batch(embeds[:3], 4) == [reference_ids(demo, x, 4) for x in prompts[:3]]
        assert greedy.last_shape == (4, own)  # not bucket 8: twice its rows
        assert greedy.generate_batch(embeds[:5], 4) == [reference_ids(demo, x, 4) for x in prompts[:5]]
        assert greedy.last_shape == (8, eight)  # its own bucket, padded one bucket further: 1.25x its rows


def test_replaced_weights_make_the_loop_stale(demo: Any) -> None:
    import copy

    model = copy.deepcopy(demo.model)
    greedy = StaticGreedy(model, graphs=False)
    assert not greedy.stale
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)  # in place: same storage, the graphs would read the new values
    assert not greedy.stale
    model.to(torch.float64)  # new tensors: graphs captured on the old ones would read stale memory
    assert greedy.stale


def test_where_the_loop_would_not_be_the_models_computation(
    demo: Any, qwen_demo: Any, qwen3_demo: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert unsupported_reason(qwen_demo.model) is None and unsupported_reason(qwen3_demo.model) is None
    monkeypatch.setattr(qwen3_demo.model.config.text_config, "model_type", "qwen3_vl_moe_text")
    assert "qwen3_vl_moe_text" in (unsupported_reason(qwen3_demo.model) or "")
    monkeypatch.setattr(
        qwen3_demo.model.config.vision_config, "deepstack_visual_indexes", list(range(9)), raising=False
    )
    monkeypatch.setattr(qwen3_demo.model.config.text_config, "model_type", "qwen3_vl_text")
    assert "9 DeepStack levels for 4 decoder layers" in (unsupported_reason(qwen3_demo.model) or "")
    assert "CUDA" in (demo.graph_generation_reason() or "")  # the demo runs on CPU here
    generation = demo.model.generation_config
    monkeypatch.setattr(generation, "repetition_penalty", 1.3)
    assert "repetition_penalty" in (unsupported_reason(demo.model) or "")
    monkeypatch.setattr(generation, "repetition_penalty", 1.0)
    assert unsupported_reason(demo.model) is None
    text = demo.model.config.text_config
    monkeypatch.setattr(text, "sliding_window", 64, raising=False)
    assert unsupported_reason(demo.model, length=64) is None
    assert "sliding window" in (unsupported_reason(demo.model, length=65) or "")
    with pytest.raises(ValueError, match="CUDA"):
        StaticGreedy(demo.model, graphs=True)


def test_generate_options_on_cpu(demo: Any, image: Any) -> None:
    tokens = demo.encode_image(image)
    projected, kept = demo.projector(tokens.features[:24]), torch.arange(24)
    auto = demo.generate(QUESTION, tokens, projected, max_new_tokens=6, kept=kept)
    assert auto.decoding == "eager" and "CUDA graphs need a CUDA device" in (auto.eager_reason or "")
    with torch.no_grad():
        reference = reference_ids(demo, demo._lm_inputs(QUESTION, tokens, projected, kept), 6)
    assert list(auto.token_ids) == reference  # model.generate's new tokens, and their text
    assert auto.text == demo.tokenizer.decode(reference, skip_special_tokens=True).strip()
    off = demo.generate(QUESTION, tokens, projected, max_new_tokens=6, kept=kept, cuda_graph=False)
    assert off == dataclasses.replace(auto, eager_reason="turned off (cuda_graph=False)")
    none = demo.generate(QUESTION, tokens, projected, max_new_tokens=0, kept=kept)
    assert (none.text, none.token_ids) == ("", ())
    with pytest.raises(GenerationError, match="CUDA graphs need a CUDA device") as info:
        demo.generate(QUESTION, tokens, projected, max_new_tokens=6, kept=kept, cuda_graph=True)
    assert len(str(info.value).splitlines()) == 1


# ---------------------------------------------------------------------------------------------- CUDA
CUDA_DEMOS = ("tiny-llava", "tiny-llava-next", "tiny-qwen2.5-vl", "tiny-qwen3-vl")


@pytest.fixture(scope="module")
def cuda_demos(demo_home: Path) -> dict[str, Any]:
    return {name: load_backbone(name, home=demo_home, device="cuda", dtype="float32") for name in CUDA_DEMOS}


@cuda_only
@pytest.mark.parametrize("name", CUDA_DEMOS)
def test_cuda_graphs_give_model_generate_answers(cuda_demos: dict[str, Any], image: Any, name: str) -> None:
    adapter = cuda_demos[name]
    assert adapter.graph_generation_reason() is None
    tokens = adapter.encode_image(image)
    feeds = _qwen_feeds(adapter, tokens) if name.startswith("tiny-qwen") else _feeds(adapter, tokens)
    with torch.no_grad():
        for projected, kept in feeds:
            eager = adapter.generate(QUESTION, tokens, projected, max_new_tokens=10, kept=kept, cuda_graph=False)
            assert eager.decoding == "eager"
            for _ in range(2):  # the first call captures, the second replays
                graph = adapter.generate(QUESTION, tokens, projected, max_new_tokens=10, kept=kept)
                assert graph.decoding == "cuda-graph" and graph.eager_reason is None
                assert (graph.text, graph.token_ids) == (eager.text, eager.token_ids)
            inputs = adapter._lm_inputs(QUESTION, tokens, projected, kept)
            reference = reference_ids(adapter, inputs, 10)
            assert adapter._static_greedy().generate(static_prompt_from_inputs(adapter, inputs), 10) == reference
            assert list(eager.token_ids) == reference  # no graphs: the loop step by step, still model.generate's


@cuda_only
@pytest.mark.parametrize("name", ["tiny-llava", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_cuda_graphs_are_captured_once_per_padded_length(cuda_demos: dict[str, Any], image: Any, name: str) -> None:
    adapter = cuda_demos[name]
    tokens = adapter.encode_image(image)
    greedy = StaticGreedy(adapter.model, graphs=True)
    with torch.no_grad():

        def inputs(k: int) -> dict[str, Any]:
            return adapter._lm_inputs(QUESTION, tokens, adapter.projector(tokens.features[:k]), torch.arange(k))

        def ids(k: int) -> list[int]:
            return greedy.generate(static_prompt_from_inputs(adapter, inputs(k)), 8)

        first = ids(32)
        captured = greedy.captures
        assert captured >= 1 and first == reference_ids(adapter, inputs(32), 8)
        assert ids(32) == first and greedy.captures == captured  # replayed

        def padded(k: int) -> int:
            return -(-int(inputs(k)["input_ids"].shape[1]) // BUCKET)

        same_bucket = [k for k in range(20, 60) if k != 32 and padded(k) == padded(32)]
        assert same_bucket
        assert ids(same_bucket[0]) == reference_ids(adapter, inputs(same_bucket[0]), 8)
        assert greedy.captures == captured  # a prompt in the same padded length reuses the graph


@cuda_only
def test_a_failed_capture_falls_back_to_generate(cuda_demos: dict[str, Any], image: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    import copy

    from care_core.backbones import LlavaAdapter

    base = cuda_demos["tiny-llava"]
    adapter = LlavaAdapter(copy.deepcopy(base.model), base.processor, name="copy")
    tokens = adapter.encode_image(image)
    projected, kept = adapter.projector(tokens.features[:16]), torch.arange(16)
    eager = adapter.generate(QUESTION, tokens, projected, max_new_tokens=6, kept=kept, cuda_graph=False)

    def broken(*args: Any, **kwargs: Any) -> list[int]:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(StaticGreedy, "generate_batch", broken)
    with pytest.raises(GenerationError, match="capturing the decoder failed"):
        adapter.generate(QUESTION, tokens, projected, max_new_tokens=6, kept=kept, cuda_graph=True)
    fallback = adapter.generate(QUESTION, tokens, projected, max_new_tokens=6, kept=kept)
    assert fallback.decoding == "eager" and (fallback.text, fallback.token_ids) == (eager.text, eager.token_ids)
    assert "capturing the decoder failed" in (fallback.eager_reason or "")
    assert "capturing the decoder failed" in (adapter.graph_generation_reason() or "")


def test_the_walk_over_the_decoder_layers_runs_once_per_model(demo: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from care_core.backbones import chat_adapter

    walked: list[Any] = []
    real = chat_adapter.unsupported_reason
    monkeypatch.setattr(chat_adapter, "unsupported_reason",
                        lambda model, length=None: walked.append(model) or real(model))  # fmt: skip
    monkeypatch.setattr(type(demo), "device", property(lambda self: torch.device("cuda")))  # as on a GPU
    monkeypatch.setattr(demo, "_static_form", None)
    assert [demo.graph_generation_reason(length) for length in (40, 80, 120)] == [None] * 3
    assert walked == [demo.model]  # one walk for three calls
    monkeypatch.setattr(demo, "model", copy.deepcopy(demo.model))
    monkeypatch.setattr(demo.model.config.text_config, "sliding_window", 64, raising=False)
    monkeypatch.setattr(demo.model.config.text_config, "use_sliding_window", True, raising=False)
    assert demo.graph_generation_reason(40) is None  # another model: walked again; the window is the call's
    assert "exceed the decoder's sliding window of 64" in (demo.graph_generation_reason(80) or "")
    assert len(walked) == 2


@pytest.mark.parametrize("name", ["demo", "qwen3_demo"])
def test_graphs_turned_off_where_they_would_apply_run_the_loop_step_by_step(
    request: pytest.FixtureRequest, image: Any, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = request.getfixturevalue(name)
    tokens = adapter.encode_image(image)
    kept = torch.arange(0, tokens.num_tokens, 3)
    projected = adapter.projector(tokens.features[kept])
    reference = reference_ids(adapter, adapter._lm_inputs(QUESTION, tokens, projected, kept), 8)
    stepped: list[bool] = []
    real = StaticGreedy.generate_batch

    def spy(self: StaticGreedy, prompts: Any, max_new_tokens: int, *, replay: bool = True, **hooks: Any) -> Any:
        stepped.append(replay)
        return real(self, prompts, max_new_tokens, replay=replay, **hooks)

    monkeypatch.setattr(type(adapter), "_batch_graph_reason", lambda self, inputs, new: None)  # as on a GPU
    monkeypatch.setattr(type(adapter), "_static_greedy", lambda self: StaticGreedy(self.model, graphs=False))
    monkeypatch.setattr(StaticGreedy, "generate_batch", spy)
    with torch.no_grad():
        off = adapter.generate(QUESTION, tokens, projected, max_new_tokens=8, kept=kept, cuda_graph=False)
    assert stepped == [False]  # the static loop, told not to replay
    assert off.decoding == "eager" and off.eager_reason == "turned off (cuda_graph=False)"
    assert list(off.token_ids) == reference  # model.generate's tokens


def test_the_work_after_the_prefill_runs_once_between_its_launch_and_the_first_token(
    demo: Any, image: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from care_core.backbones import static_generation

    tokens = demo.encode_image(image)
    with torch.no_grad():
        prompts = [demo._lm_inputs(QUESTION, tokens, demo.projector(tokens.features[:k]), torch.arange(k))
                   for k in (9, 12, 15)]  # fmt: skip
        embeds = [demo._prompt_embeddings(x) for x in prompts]
    events: list[str] = []
    for name in ("_prefill_step", "_decode_loop"):
        real = getattr(StaticGreedy, name)
        spy = lambda self, *a, real=real, name=name: events.append(name) or real(self, *a)  # noqa: E731
        monkeypatch.setattr(StaticGreedy, name, spy)
    monkeypatch.setattr(static_generation, "BATCH_BUCKETS", (1, 2))  # three prompts: a chunk of two, then one
    with torch.no_grad():
        greedy = StaticGreedy(demo.model, graphs=False)
        ids = greedy.generate_batch(embeds, 3, after_prefill=lambda: events.append("hook"))
    assert ids == [reference_ids(demo, x, 3) for x in prompts]
    assert events == ["_prefill_step", "hook", "_decode_loop", "_prefill_step", "_decode_loop"]


def test_generate_queues_the_kept_check_behind_the_prefill_and_reads_it_after(
    demo: Any, image: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from care_core.backbones.base import KeptRangeCheck

    tokens = demo.encode_image(image)
    kept = torch.arange(0, tokens.num_tokens, 3)
    projected = demo.projector(tokens.features[kept])
    events: list[str] = []
    queue, problem = KeptRangeCheck.queue, KeptRangeCheck.problem
    monkeypatch.setattr(KeptRangeCheck, "queue", lambda self: events.append("queue") or queue(self))
    monkeypatch.setattr(KeptRangeCheck, "problem", lambda self: events.append("read") or problem(self))
    real = StaticGreedy._prefill_step
    spy = lambda self, entry: events.append("prefill") or real(self, entry)  # noqa: E731
    monkeypatch.setattr(StaticGreedy, "_prefill_step", spy)
    monkeypatch.setattr(type(demo), "_batch_graph_reason", lambda self, inputs, new: None)  # as on a GPU
    monkeypatch.setattr(type(demo), "_static_greedy", lambda self: StaticGreedy(self.model, graphs=False))
    with torch.no_grad():
        demo.generate(QUESTION, tokens, projected, max_new_tokens=2, kept=kept, cuda_graph=False)
    assert events[:4] == ["prefill", "queue", "read", "queue"]  # the read's own queue call finds it queued
