"""Greedy decoding over a static KV cache (the CUDA-graph path of ``generate``): same tokens as
``model.generate``, run eagerly here on CPU and captured/replayed on CUDA where one is present."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from care_core.backbones import load_backbone
from care_core.backbones.probes import attention_implementation
from care_core.backbones.static_generation import BUCKET, StaticGreedy, eos_ids, reused_shape, unsupported_reason
from care_core.errors import GenerationError

from ._helpers import noise_image, reference_ids

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


def test_stops_at_the_end_token_as_generate_does(demo: Any, image: Any) -> None:
    tokens = demo.encode_image(image)
    inputs = demo._lm_inputs(QUESTION, tokens, demo.projector(tokens.features[:20]), torch.arange(20))
    reference = reference_ids(demo, inputs, 40)
    assert reference[-1] in eos_ids(demo.model) and len(reference) < 40  # the trained demo ends its answers
    with torch.no_grad():
        ids = StaticGreedy(demo.model, graphs=False).generate(demo._prompt_embeddings(inputs), 40)
    assert ids == reference


def test_eager_attention_takes_the_causal_mask(tiny_pair: Any, image: Any) -> None:
    adapter, _ = tiny_pair
    tokens = adapter.encode_image(image)
    with attention_implementation(adapter.model, {"text_config": "eager"}), torch.no_grad():
        assert adapter.model.config.text_config._attn_implementation == "eager"
        greedy = StaticGreedy(adapter.model, graphs=False)
        assert greedy.eager_attention
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


def test_a_short_batch_reuses_a_captured_shape_where_its_extra_rows_are_few() -> None:
    captured = [(16, 96), (8, 112), (64, 96), (64, 624), (64, 176), (16, 272)]  # (batch bucket, rows) with a graph
    assert reused_shape(4, 112, captured) == (8, 112)  # 4 dummy samples of 112 rows: the fewest rows that hold it
    assert reused_shape(4, 96, captured) == (8, 112)  # 8 x 112 = 896 rows < 16 x 96 = 1,536
    assert reused_shape(1, 80, captured) == (8, 112)  # longer padding: 896 - 80 = 816 extra rows
    assert reused_shape(16, 96, captured) == (16, 96)  # its own shape, captured, is never traded for a larger one
    assert reused_shape(16, 112, captured) == (16, 272)  # 16 x (272 - 112) = 2,560 extra rows, fewer than 64 x 176
    assert reused_shape(4, 624, captured) == (4, 624)  # 60 x 624 = 37,440 dummy rows: its own
    assert reused_shape(32, 176, captured) == (64, 176)  # 32 x 176 = 5,632 dummy rows
    assert reused_shape(32, 272, captured) == (32, 272)  # no captured shape holds 32 samples of 272 rows
    assert reused_shape(4, 256, [(64, 272)]) == (4, 256)  # 64 x 272 - 4 x 256 = 16,384 > 12,288: its own


def test_llava_15s_last_batch_replays_the_graphs_of_its_full_batches() -> None:
    # care eval on LLaVA-1.5 at K = 64, batch 64 (H100, 2026-11-27): the warm-up's prompts pad to 112 rows, the
    # task's to 176 (162-166 rows: 64 kept tokens and the byte tokenizer's question); the last 4 captured their
    # own graphs under the earlier rule, which looked only at the same padded length and 8,192 dummy rows
    captured = [(64, 112), (64, 176)]
    assert reused_shape(4, 176, captured) == (64, 176)  # 60 x 176 = 10,560 dummy rows
    assert reused_shape(4, 160, captured) == (64, 176)  # 64 x 176 - 4 x 160 = 10,624 extra rows
    assert reused_shape(64, 192, captured) == (64, 192)  # longer prompts than any captured: a graph of their own


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
    demo: Any, qwen_demo: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "qwen2_5_vl_text" in (unsupported_reason(qwen_demo.model) or "")
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
@pytest.fixture(scope="module")
def cuda_demos(demo_home: Path) -> dict[str, Any]:
    return {name: load_backbone(name, home=demo_home, device="cuda", dtype="float32")
            for name in ("tiny-llava", "tiny-llava-next")}  # fmt: skip


@cuda_only
@pytest.mark.parametrize("name", ["tiny-llava", "tiny-llava-next"])
def test_cuda_graphs_give_model_generate_answers(cuda_demos: dict[str, Any], image: Any, name: str) -> None:
    adapter = cuda_demos[name]
    assert adapter.graph_generation_reason() is None
    tokens = adapter.encode_image(image)
    with torch.no_grad():
        for projected, kept in _feeds(adapter, tokens):
            eager = adapter.generate(QUESTION, tokens, projected, max_new_tokens=10, kept=kept, cuda_graph=False)
            assert eager.decoding == "eager"
            for _ in range(2):  # the first call captures, the second replays
                graph = adapter.generate(QUESTION, tokens, projected, max_new_tokens=10, kept=kept)
                assert graph.decoding == "cuda-graph" and graph.eager_reason is None
                assert (graph.text, graph.token_ids) == (eager.text, eager.token_ids)
            inputs = adapter._lm_inputs(QUESTION, tokens, projected, kept)
            ids = adapter._static_greedy().generate(adapter._prompt_embeddings(inputs), 10)
            assert ids == reference_ids(adapter, inputs, 10)


@cuda_only
def test_cuda_graphs_are_captured_once_per_padded_length(cuda_demos: dict[str, Any], image: Any) -> None:
    adapter = cuda_demos["tiny-llava"]
    tokens = adapter.encode_image(image)
    greedy = StaticGreedy(adapter.model, graphs=True)
    with torch.no_grad():

        def ids(k: int) -> list[int]:
            inputs = adapter._lm_inputs(QUESTION, tokens, adapter.projector(tokens.features[:k]), torch.arange(k))
            return greedy.generate(adapter._prompt_embeddings(inputs), 8)

        first = ids(32)
        captured = greedy.captures
        assert captured >= 1
        assert ids(32) == first and greedy.captures == captured  # replayed

        def padded(k: int) -> int:
            inputs = adapter._lm_inputs(QUESTION, tokens, adapter.projector(tokens.features[:k]), torch.arange(k))
            return -(-int(inputs["input_ids"].shape[1]) // BUCKET)

        same_bucket = [k for k in range(20, 60) if k != 32 and padded(k) == padded(32)]
        assert same_bucket
        ids(same_bucket[0])
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
