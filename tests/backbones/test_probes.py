"""LlavaAdapter.probe_inputs on the tiny-llava demo, checked against independent eager / manual computations."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from care_core.architecture import hidden_state_index, hidden_state_indices
from care_core.backbones import ImageTokens, LlavaAdapter
from care_core.backbones.probes import VISION_PROBES, LanguageModelRun
from care_core.errors import MethodError, QuestionError
from care_core.vocabulary import DEFAULT_QUESTION, PROBES

from ._helpers import Unchanged, attn_strings, noise_image

QUESTION = "What is in the image?"


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tokens(demo: LlavaAdapter) -> ImageTokens:
    return demo.encode_image(noise_image(300, 420, seed=7))


@pytest.fixture(scope="module")
def eager(demo: LlavaAdapter) -> torch.nn.Module:
    """A copy of the demo model with eager attention everywhere (returns attention weights)."""
    model = copy.deepcopy(demo.model)
    model.set_attn_implementation("eager")
    assert demo.model.config.vision_config._attn_implementation == "sdpa"
    return model


@pytest.fixture(scope="module")
def eager_vision(eager: torch.nn.Module, tokens: ImageTokens) -> Any:
    with torch.no_grad():
        return eager.model.vision_tower(
            tokens.model_inputs["pixel_values"], output_attentions=True, output_hidden_states=True
        )


@pytest.fixture(scope="module")
def probes(demo: LlavaAdapter, tokens: ImageTokens) -> dict[str, Any]:
    return demo.probe_inputs(tokens, list(PROBES), QUESTION)


def feature_block(demo: LlavaAdapter) -> int:
    """Index of the encoder block whose output is hidden_states[vision_feature_layer] (L_v - 2 here)."""
    num_layers = demo.model.config.vision_config.num_hidden_layers
    return num_layers + demo.model.config.vision_feature_layer


def layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.model.vision_tower.encoder.layers


# ------------------------------------------------------------------------------------- vision side
def test_shapes_dtypes_devices(demo: LlavaAdapter, probes: dict[str, Any]) -> None:
    vc, tc = demo.model.config.vision_config, demo.model.config.text_config
    heads, d_v, t = vc.num_attention_heads, vc.hidden_size, 1 + 576
    assert list(probes) == list(PROBES)
    assert probes["cls_attention"].shape == (heads, t)
    assert probes["attention_logits"].shape == (t, t)
    assert probes["keys"].shape == (t, d_v // heads)
    assert probes["hidden_with_cls"].shape == (t, d_v)
    assert probes["last_layer_qk"].shape == (2, t, d_v)
    assert probes["question"].shape[1] == tc.hidden_size
    assert isinstance(probes["language_model"], LanguageModelRun)
    for name in VISION_PROBES | {"question"}:
        assert probes[name].device == demo.device and not probes[name].requires_grad
    for name in ("cls_attention", "attention_logits", "keys", "last_layer_qk"):
        assert probes[name].dtype == torch.float32


def test_cls_attention_equals_eager(demo: LlavaAdapter, probes: dict[str, Any], eager_vision: Any) -> None:
    ref = eager_vision.attentions[demo.model.config.vision_feature_layer][0, :, 0, :]  # attentions[-2]
    assert torch.allclose(probes["cls_attention"], ref, atol=1e-5, rtol=0)
    assert torch.allclose(probes["cls_attention"].sum(-1), torch.ones(ref.shape[0]), atol=1e-5)
    # the feature block's attention, not a neighbour's
    other = eager_vision.attentions[-1][0, :, 0, :]
    assert not torch.allclose(probes["cls_attention"], other, atol=1e-3)


def manual_qk(model: torch.nn.Module, hidden: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head (H, T, d_head) q and k of encoder block `block` from its input hidden state (T, d)."""
    layer = layers(model)[block]
    attn = layer.self_attn
    x = layer.layer_norm1(hidden)
    q = attn.q_proj(x).view(x.shape[0], attn.num_heads, attn.head_dim).transpose(0, 1)
    k = attn.k_proj(x).view(x.shape[0], attn.num_heads, attn.head_dim).transpose(0, 1)
    return q, k


def test_attention_logits_are_head_mean_of_per_head_logits(
    demo: LlavaAdapter, eager: torch.nn.Module, probes: dict[str, Any], eager_vision: Any
) -> None:
    block = feature_block(demo)
    with torch.no_grad():
        q, k = manual_qk(eager, eager_vision.hidden_states[block][0], block)
    logits = q @ k.transpose(1, 2) * layers(eager)[block].self_attn.head_dim ** -0.5  # (H, T, T)
    # the per-head reference logits really are the eager attention's pre-softmax logits
    assert torch.allclose(logits.softmax(-1), eager_vision.attentions[block][0], atol=1e-5, rtol=0)
    assert torch.allclose(probes["attention_logits"], logits.mean(0), atol=1e-5, rtol=1e-5)
    # mean of logits, not logits of the mean attention
    assert not torch.allclose(probes["attention_logits"].softmax(-1), eager_vision.attentions[block][0].mean(0))


def test_keys_are_head_mean_of_layer_keys(demo: LlavaAdapter, probes: dict[str, Any], eager_vision: Any) -> None:
    block = feature_block(demo)
    layer = layers(demo.model)[block]
    with torch.no_grad():
        k = layer.self_attn.k_proj(layer.layer_norm1(eager_vision.hidden_states[block][0]))  # bias included
    heads = layer.self_attn.num_heads
    ref = k.view(k.shape[0], heads, -1).mean(dim=1)
    assert torch.allclose(probes["keys"], ref, atol=1e-6, rtol=1e-5)


def test_hidden_with_cls(demo: LlavaAdapter, tokens: ImageTokens, probes: dict[str, Any], eager_vision: Any) -> None:
    ref = eager_vision.hidden_states[demo.model.config.vision_feature_layer][0]
    assert torch.allclose(probes["hidden_with_cls"], ref, atol=1e-5)
    assert torch.equal(probes["hidden_with_cls"][1:], tokens.features)  # same computation as encode_image


def test_last_layer_qk(demo: LlavaAdapter, probes: dict[str, Any], eager_vision: Any) -> None:
    last = demo.model.config.vision_config.num_hidden_layers - 1
    layer = layers(demo.model)[last]
    with torch.no_grad():
        x = layer.layer_norm1(eager_vision.hidden_states[last][0])
        ref = torch.stack([layer.self_attn.q_proj(x), layer.self_attn.k_proj(x)])
    assert torch.allclose(probes["last_layer_qk"], ref, atol=1e-5)


def test_one_truncated_vision_pass(demo: LlavaAdapter, tokens: ImageTokens, count_calls: Any) -> None:
    tower = demo.model.model.vision_tower
    embeds = count_calls(tower.embeddings)
    last_mlp = count_calls(layers(demo.model)[-1].mlp)
    feature_mlp = count_calls(layers(demo.model)[feature_block(demo)].mlp)
    demo.probe_inputs(tokens, sorted(VISION_PROBES))
    assert len(embeds) == 1  # one tower pass for all five vision probes
    assert len(last_mlp) == 0  # stopped once the last block's q/k were captured
    assert len(feature_mlp) == 1
    demo.probe_inputs(tokens, ["cls_attention", "keys"])
    assert len(embeds) == 2 and len(feature_mlp) == 1  # stopped at the feature block's attention input


def test_only_requested_probes(demo: LlavaAdapter, tokens: ImageTokens, probes: dict[str, Any]) -> None:
    assert demo.probe_inputs(tokens, []) == {}
    out = demo.probe_inputs(tokens, ["keys", "cls_attention", "keys"])
    assert list(out) == ["keys", "cls_attention"]
    assert torch.equal(out["keys"], probes["keys"])
    # one query row here, all rows when attention_logits is requested too: equal up to float rounding
    assert torch.allclose(out["cls_attention"], probes["cls_attention"], atol=1e-7, rtol=1e-5)
    out = demo.probe_inputs(tokens, ("attention_logits",))
    assert torch.equal(out["attention_logits"], probes["attention_logits"])


def test_feature_layer_indexing(
    demo: LlavaAdapter, tokens: ImageTokens, probes: dict[str, Any], eager_vision: Any
) -> None:
    num_layers = demo.model.config.vision_config.num_hidden_layers
    assert hidden_state_index(-2, num_layers) == num_layers - 1 and hidden_state_index(0, num_layers) == 0
    with pytest.raises(ValueError):
        hidden_state_index(num_layers + 1, num_layers)
    assert hidden_state_indices(-2, 24) == [23] and hidden_state_indices([-1, 0, 3], 24) == [24, 0, 3]
    assert hidden_state_indices((2, -24), 24) == [2, 1] and hidden_state_indices([], 24) == []
    with pytest.raises(ValueError, match="out of range for a 24-layer tower"):
        hidden_state_indices([-2, 25], 24)
    names = ["cls_attention", "keys", "hidden_with_cls"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(demo.model.config, "vision_feature_layer", num_layers - 1)  # the same layer as -2
        same = demo.probe_inputs(tokens, names)
        mp.setattr(demo.model.config, "vision_feature_layer", [-2, -1])
        both = demo.probe_inputs(tokens, ["hidden_with_cls"])
        with pytest.raises(ValueError, match="single vision feature layer"):
            demo.probe_inputs(tokens, ["keys"])
        mp.setattr(demo.model.config, "vision_feature_layer", 0)
        embedded = demo.probe_inputs(tokens, ["hidden_with_cls"])
        with pytest.raises(ValueError, match="embedding output"):
            demo.probe_inputs(tokens, ["cls_attention"])
    for name in names:
        assert torch.allclose(same[name], probes[name], atol=1e-7, rtol=1e-5)
    hs = eager_vision.hidden_states
    assert torch.allclose(both["hidden_with_cls"], torch.cat([hs[-2][0], hs[-1][0]], dim=-1), atol=1e-5)
    assert torch.allclose(embedded["hidden_with_cls"], hs[0][0], atol=1e-6)


def test_question_probe(demo: LlavaAdapter, tokens: ImageTokens, probes: dict[str, Any]) -> None:
    assert torch.equal(probes["question"], demo.question_embeddings(QUESTION))
    with pytest.raises(QuestionError):
        demo.probe_inputs(tokens, ["question"])
    with pytest.raises(MethodError, match="unknown probe"):
        demo.probe_inputs(tokens, ["cls_attention", "no_such_probe"])


def test_bf16_model_probes_in_float32(demo: LlavaAdapter, tokens: ImageTokens, probes: dict[str, Any]) -> None:
    bf16 = LlavaAdapter(copy.deepcopy(demo.model).to(torch.bfloat16), demo.processor, name="bf16")
    out = bf16.probe_inputs(bf16.encode_image(noise_image(300, 420, seed=7)), list(PROBES), QUESTION)
    for name in ("cls_attention", "attention_logits", "keys", "last_layer_qk"):
        assert out[name].dtype == torch.float32
        assert torch.allclose(out[name], probes[name], atol=0.1, rtol=0.1)
    assert out["hidden_with_cls"].dtype == torch.bfloat16
    attn = out["language_model"].attentions(0)[0]
    assert attn.dtype == torch.float32
    assert torch.allclose(attn.sum(-1), torch.ones_like(attn.sum(-1)), atol=2e-2)
    assert attn_strings(bf16.model) == ("sdpa", "sdpa", "sdpa")


# ----------------------------------------------------------------------------- language-model side
def test_language_model_attentions_equal_eager(
    demo: LlavaAdapter, tokens: ImageTokens, probes: dict[str, Any], eager: torch.nn.Module
) -> None:
    lm = probes["language_model"]
    n_layers = demo.model.config.text_config.num_hidden_layers
    assert n_layers >= 2
    attentions = lm.attentions(n_layers - 1)
    with torch.no_grad():
        projected = demo.projector(tokens.features)
        enc = demo._lm_inputs(QUESTION, tokens, projected, None)
        ref = eager(**enc, output_attentions=True).attentions
    assert len(attentions) == n_layers and len(ref) == n_layers
    length = enc["input_ids"].shape[1]
    heads = demo.model.config.text_config.num_attention_heads
    for got, want in zip(attentions, ref, strict=True):
        assert got.shape == (heads, length, length) and got.dtype == torch.float32
        assert torch.allclose(got, want[0], atol=1e-6)
    assert not torch.allclose(attentions[0], attentions[1])
    # cached: fewer layers come from the same tensors
    again = lm.attentions(0)
    assert len(again) == 1 and again[0] is attentions[0]
    # list-slice semantics past the last layer (methods check len and raise their own error)
    past = lm.attentions(n_layers + 5)
    assert len(past) == n_layers and all(torch.equal(a, b) for a, b in zip(past, attentions, strict=True))
    with pytest.raises(ValueError):
        lm.attentions(-1)


def test_language_model_attentions_stop_early(demo: LlavaAdapter, tokens: ImageTokens, count_calls: Any) -> None:
    lm = demo.probe_inputs(tokens, ["language_model"], QUESTION)["language_model"]
    text_layers = demo.model.model.language_model.layers
    layer1, mlp0, head = count_calls(text_layers[1]), count_calls(text_layers[0].mlp), count_calls(demo.model.lm_head)
    first = lm.attentions(0)
    assert len(layer1) == 0 and len(mlp0) == 0 and len(head) == 0
    both = lm.attentions(1)  # needs one more layer: one new (truncated) run
    assert len(layer1) == 1 and len(head) == 0
    assert torch.allclose(both[0], first[0], atol=0)


def test_spans_and_input_embeddings(demo: LlavaAdapter, tokens: ImageTokens, probes: dict[str, Any]) -> None:
    lm = probes["language_model"]
    enc = demo._encode_prompt(QUESTION, tokens.num_tokens)
    ids = enc["input_ids"][0]
    start, end = lm.image_span
    assert end - start == tokens.num_tokens
    assert bool((ids[start:end] == demo.image_token_id).all())
    assert int((ids == demo.image_token_id).sum()) == tokens.num_tokens  # no image token outside the span
    assert lm.text_span == (end, ids.numel())
    text = demo.tokenizer.decode(ids[end:], skip_special_tokens=True)
    assert QUESTION in text
    # input_embeddings() is what the language model receives on the mm_encoder_outputs route
    seen: dict[str, torch.Tensor] = {}
    language_model = demo.model.model.language_model
    handle = language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.update(embeds=kw["inputs_embeds"]), with_kwargs=True
    )
    try:
        demo.language_model_logits(QUESTION, tokens, demo.projector(tokens.features))
    finally:
        handle.remove()
    embeds = lm.input_embeddings()
    assert embeds.shape == (ids.numel(), demo.model.config.text_config.hidden_size)
    assert torch.equal(embeds, seen["embeds"][0])
    assert lm.input_embeddings() is embeds  # cached
    with torch.no_grad():
        assert torch.allclose(embeds[start:end], demo.projector(tokens.features))


def test_language_model_default_question(demo: LlavaAdapter, tokens: ImageTokens) -> None:
    lm = demo.probe_inputs(tokens, ["language_model"])["language_model"]
    ids = demo._encode_prompt(DEFAULT_QUESTION, tokens.num_tokens)["input_ids"][0]
    assert torch.equal(lm.input_ids, ids)


# ------------------------------------------------------------------------------------------ cleanup
@pytest.mark.parametrize("names", [[n] for n in PROBES] + [list(PROBES)])
def test_probes_leave_no_hooks_or_settings(demo: LlavaAdapter, tokens: ImageTokens, names: list[str]) -> None:
    with Unchanged(demo.model):
        out = demo.probe_inputs(tokens, names, QUESTION)
    if "language_model" in names:
        with Unchanged(demo.model):
            out["language_model"].attentions(1)
        with Unchanged(demo.model):
            out["language_model"].input_embeddings()


def test_failing_vision_probe_cleans_up(demo: LlavaAdapter, tokens: ImageTokens, probes: dict[str, Any]) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    with Unchanged(demo.model), pytest.MonkeyPatch.context() as mp:
        mp.setattr(layers(demo.model)[0].mlp, "forward", boom)
        with pytest.raises(RuntimeError, match="boom"):
            demo.probe_inputs(tokens, sorted(VISION_PROBES))
    out = demo.probe_inputs(tokens, ["last_layer_qk"])  # still works afterwards
    assert torch.equal(out["last_layer_qk"], probes["last_layer_qk"])


def test_failing_language_model_probe_cleans_up(
    demo: LlavaAdapter, tokens: ImageTokens, probes: dict[str, Any]
) -> None:
    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("boom")

    lm = demo.probe_inputs(tokens, ["language_model"], QUESTION)["language_model"]
    seen_impl: list[str] = []
    with Unchanged(demo.model), pytest.MonkeyPatch.context() as mp:

        def boom_after_looking(*args: Any, **kwargs: Any) -> None:
            seen_impl.append(demo.model.config.text_config._attn_implementation)
            boom()

        mp.setattr(demo.model.model.language_model.layers[0].mlp, "forward", boom_after_looking)
        with pytest.raises(RuntimeError, match="boom"):
            lm.attentions(1)
    assert seen_impl == ["eager"]  # eager inside the probe, restored after the failure
    # nothing half-cached: a later call runs again and matches
    attentions = lm.attentions(1)
    for got, want in zip(attentions, probes["language_model"].attentions(1), strict=True):
        assert torch.allclose(got, want, atol=0)
