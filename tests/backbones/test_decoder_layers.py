"""The lean decoder layer against transformers' own layer forward, per decoder the static loop drives."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, MistralConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer, MistralRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

from care_core.backbones.decoder_layers import (
    LeanLayers,
    attention_inputs,
    layer_forward,
    layer_reason,
    layer_shape,
    layer_tensors,
    mlp_block,
    rotation_tables,
    stacked_rows,
)
from care_core.backbones.static_generation import unsupported_reason

SMALL = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "vocab_size": 16,
         "num_hidden_layers": 1, "attn_implementation": "sdpa"}  # fmt: skip
BUILT = {  # (config, layer class, rotary class): GQA, biases and head sizes the families use
    "llama-gqa": (LlamaConfig(**SMALL, num_key_value_heads=2), LlamaDecoderLayer, LlamaRotaryEmbedding),
    "llama-biases": (LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True), LlamaDecoderLayer, LlamaRotaryEmbedding),
    "mistral": (
        MistralConfig(**SMALL, num_key_value_heads=1, head_dim=16),
        MistralDecoderLayer,
        MistralRotaryEmbedding,
    ),
    "qwen2": (Qwen2Config(**SMALL, num_key_value_heads=2), Qwen2DecoderLayer, Qwen2RotaryEmbedding),
}


def _built(name: str) -> tuple[Any, nn.Module, nn.Module]:
    config, layer_class, rotary_class = BUILT[name]
    torch.manual_seed(0)
    layer = layer_class(config, layer_idx=0)
    for p in layer.parameters():  # norms' weights away from 1, biases away from 0: every tensor matters
        nn.init.normal_(p, mean=float(p.ndim == 1 and "norm" in str(p.shape)), std=0.3)
    return config, layer.double().eval(), rotary_class(config).double()


def _demo_layer(adapter: Any) -> tuple[Any, nn.Module, nn.Module]:
    lm = adapter.model.model.language_model
    return lm.config, copy.deepcopy(lm.layers[0]).double().eval(), copy.deepcopy(lm.rotary_emb).double()


def _positions(config: Any, batch: int, rows: int) -> torch.Tensor:
    text = torch.arange(rows)[None].expand(batch, rows)
    if config.model_type in ("qwen2_5_vl_text", "qwen3_vl_text"):  # (t, h, w) rows that differ, as an image's do
        return torch.stack([text, text // 3, text % 5])
    return text


class _Float64Norm(nn.Module):
    """weight * x / sqrt(mean(x²) + eps) in the input's dtype: transformers' RMSNorms compute in float32 even on
    float64 input, which would hide every other difference below their rounding."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _norms_in_float64(layer: nn.Module) -> nn.Module:
    reference = copy.deepcopy(layer)
    for owner in (reference, reference.self_attn):
        for name, child in list(owner.named_children()):
            if name.endswith("norm") or name.endswith("layernorm"):
                setattr(owner, name, _Float64Norm(child))
    return reference


def _fresh(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return keys, values  # a prompt into an empty cache attends over its own keys and values


def _check_layer(config: Any, layer: nn.Module, rotary: nn.Module) -> None:
    """float64 against the layer with its norms in float64 (1e-12), float32 against the layer as it is (1e-5)."""
    assert layer_reason(layer) is None
    torch.manual_seed(1)
    for dtype, reference, tol in ((torch.float64, _norms_in_float64(layer), 1e-12),
                                  (torch.float32, copy.deepcopy(layer).float(), 1e-5)):  # fmt: skip
        hidden = torch.randn(2, 9, config.hidden_size, dtype=dtype)
        cos, sin = rotary.to(dtype)(hidden, position_ids=_positions(config, 2, 9))
        with torch.no_grad():
            out = reference(hidden, attention_mask=None, position_embeddings=(cos, sin))
            expected = out[0] if isinstance(out, tuple) else out
            pieces, shape = LeanLayers(hidden.device), layer_shape(config, layer)
            rotation = rotation_tables(cos, sin)
            lean = layer_forward(pieces, hidden, layer_tensors(layer.to(dtype)), rotation, shape, _fresh, None)
        torch.testing.assert_close(lean, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", sorted(BUILT))
def test_the_lean_layer_computes_transformers_layer(name: str) -> None:
    _check_layer(*_built(name))


@pytest.mark.parametrize("fixture", ["qwen_demo", "qwen3_demo", "internvl_demo"])
def test_the_lean_layer_computes_each_demo_decoder_layer(request: pytest.FixtureRequest, fixture: str) -> None:
    _check_layer(*_demo_layer(request.getfixturevalue(fixture)))  # Qwen2.5-VL, Qwen3-VL (q/k norms), Qwen2


def test_stacking_makes_the_layers_own_tensors_views_of_one_buffer_with_their_values() -> None:
    config, layer, rotary = _built("llama-biases")
    attention = layer.self_attn
    projections = [attention.q_proj, attention.k_proj, attention.v_proj]
    params = [m.weight for m in projections] + [m.bias for m in projections]
    before = [p.detach().clone() for p in params]
    hidden = torch.randn(1, 4, config.hidden_size, dtype=torch.float64)
    cos, sin = rotary(hidden, position_ids=_positions(config, 1, 4))
    with torch.no_grad():
        expected = layer(hidden, attention_mask=None, position_embeddings=(cos, sin))
        tensors = layer_tensors(layer)
        after = layer(hidden, attention_mask=None, position_embeddings=(cos, sin))
    # the same Parameter objects with the same values, now rows of the stacked tensors, in order
    assert [m.weight for m in projections] + [m.bias for m in projections] == params
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert torch.equal(tensors.qkv, torch.cat(before[:3])) and torch.equal(tensors.qkv_bias, torch.cat(before[3:]))
    assert [p.data_ptr() for p in params[:3]] == [tensors.qkv[row].data_ptr() for row in (0, 32, 64)]
    assert attention.q_proj.bias.data_ptr() == tensors.qkv_bias.data_ptr()
    assert torch.equal(layer.mlp.up_proj.weight, tensors.gate_up[48:])
    torch.testing.assert_close(after, expected, rtol=0, atol=0)  # the model's own forward reads the same values
    again = layer_tensors(layer)  # already stacked: views of the same memory, nothing copied
    assert again.qkv.data_ptr() == tensors.qkv.data_ptr() and again.gate_up.data_ptr() == tensors.gate_up.data_ptr()


def test_stacking_rows_that_are_not_back_to_back_copies_them_once() -> None:
    base = torch.arange(12.0).view(6, 2)
    parts = [nn.Parameter(base[4:].clone()), nn.Parameter(base[:4].clone())]  # two storages
    stacked = stacked_rows(parts)
    assert stacked.tolist() == [[8, 9], [10, 11], [0, 1], [2, 3], [4, 5], [6, 7]]
    assert parts[1].data_ptr() == stacked[2].data_ptr()
    assert stacked_rows(parts).data_ptr() == stacked.data_ptr()
    assert stacked_rows(list(reversed(parts))).data_ptr() != stacked.data_ptr()  # out of order: a new stacking


def test_a_bias_only_some_projections_have_is_stacked_with_zeros_for_the_others() -> None:
    _, layer, _ = _built("qwen2")  # q/k/v biases
    layer.self_attn.k_proj.bias = None
    bias = layer_tensors(layer).qkv_bias
    assert bias is not None and bias.shape == (32 + 16 + 16,)
    assert torch.equal(bias[:32], layer.self_attn.q_proj.bias) and not bias[32:48].any()
    assert torch.equal(bias[48:], layer.self_attn.v_proj.bias)


def test_the_lean_layer_masks_what_the_decode_mask_hides() -> None:
    config, layer, rotary = _built("llama-gqa")
    torch.manual_seed(2)
    hidden = torch.randn(1, 6, config.hidden_size, dtype=torch.float64)
    cos, sin = rotary(hidden, position_ids=_positions(config, 1, 6))
    mask = torch.zeros(1, 1, 6, 6, dtype=torch.float64).masked_fill_(torch.ones(6, 6).triu(1).bool(), -torch.inf)
    with torch.no_grad():
        args = (LeanLayers(hidden.device), hidden, layer_tensors(layer), rotation_tables(cos, sin),
                layer_shape(config, layer), lambda k, v: (k, v))  # fmt: skip
        torch.testing.assert_close(layer_forward(*args, mask), layer_forward(*args, None), rtol=1e-12, atol=1e-12)
        # a mask that hides the first key from every later row changes those rows only
        mask[..., 1:, 0] = -torch.inf
        changed = (layer_forward(*args, mask) - layer_forward(*args, None)).abs().amax(-1)[0]
    assert changed[0] == 0 and bool((changed[1:] > 0).all())


def test_layers_of_another_form_are_left_to_generate() -> None:
    _, layer, _ = _built("qwen2")
    layer.mlp.act_fn = nn.GELU()
    assert "not SiLU" in (layer_reason(layer) or "")
    _, layer, _ = _built("llama-gqa")
    layer.post_attention_layernorm = nn.LayerNorm(32)
    assert "normalises with LayerNorm" in (layer_reason(layer) or "")


def test_a_model_whose_layers_the_lean_layer_cannot_compute_gets_no_static_loop(demo: Any) -> None:
    model = copy.deepcopy(demo.model)
    model.model.language_model.layers[1].mlp.act_fn = nn.GELU()
    assert "not SiLU" in (unsupported_reason(model) or "")


def test_eager_steps_and_a_piece_that_cannot_be_compiled_run_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    config, layer, rotary = _built("llama-gqa")
    hidden = torch.randn(1, 5, config.hidden_size, dtype=torch.float64)
    cos, sin = rotary(hidden, position_ids=_positions(config, 1, 5))
    args = (hidden, layer_tensors(layer), rotation_tables(cos, sin), layer_shape(config, layer), _fresh, None)
    plain = LeanLayers(hidden.device)
    assert not plain.compiled  # the CPU: as written
    with torch.no_grad():
        expected = layer_forward(plain, *args)

    class CompileFailed(torch._dynamo.exc.TorchDynamoException):  # what dynamo raises when Inductor cannot build
        pass

    def broken(*_: Any) -> Any:
        raise CompileFailed("no C compiler found")

    pieces = LeanLayers(hidden.device)
    pieces.compiled, pieces._compiled = True, (broken, broken)  # as on CUDA
    with torch.no_grad(), pieces.scope(for_graphs=False):  # an eager step never calls the compiled pieces
        eager = layer_forward(pieces, *args)
    torch.testing.assert_close(eager, expected, rtol=0, atol=0)
    assert pieces.compiled and pieces.compile_failure is None
    with torch.no_grad(), pieces.scope(for_graphs=True):
        got = layer_forward(pieces, *args)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert not pieces.compiled and pieces.compile_failure == "CompileFailed: no C compiler found"


def test_a_second_models_widths_are_compiled_as_constants() -> None:
    """Two models of other widths through one process's compiled pieces (as on CUDA, with a backend that records what
    dynamo hands it): the second model's weights reach it with their own sizes, not symbolic ones, while the rows stay
    symbolic (:func:`~care_core.backbones.decoder_layers._varying`)."""
    weight_shapes: list[list[str]] = []  # per compiled graph: the shapes of its 2-D inputs (the weights), as written

    def recorder(graph: torch.fx.GraphModule, _: Any) -> Any:
        values = [node.meta.get("example_value") for node in graph.graph.nodes if node.op == "placeholder"]
        weight_shapes.append([str(tuple(v.shape)) for v in values if isinstance(v, torch.Tensor) and v.dim() == 2])
        return graph.forward

    compiled = (  # as LeanLayers compiles them on CUDA, with the recording backend
        torch.compile(attention_inputs, backend=recorder, dynamic=None, fullgraph=True),
        torch.compile(mlp_block, backend=recorder, dynamic=None, fullgraph=True),
    )
    pieces = LeanLayers(torch.device("cpu"))
    pieces.compiled, pieces._compiled = True, compiled
    for width, ff in ((32, 48), (40, 64)):
        config = Qwen2Config(**{**SMALL, "hidden_size": width, "intermediate_size": ff}, num_key_value_heads=2)
        layer, rotary = Qwen2DecoderLayer(config, layer_idx=0).eval(), Qwen2RotaryEmbedding(config)
        hidden = torch.randn(1, 5, width)
        rotation = rotation_tables(*rotary(hidden, position_ids=_positions(config, 1, 5)))
        with torch.no_grad(), pieces.scope(for_graphs=True):
            layer_forward(pieces, hidden, layer_tensors(layer), rotation, layer_shape(config, layer), _fresh, None)
    assert len(weight_shapes) == 4  # two pieces, each compiled once per model
    second = [shape for shapes in weight_shapes[2:] for shape in shapes]
    # the second model (4 heads of 40 / 4 = 10 dims, 2 kv heads): q/k/v stacked (40 + 2 * 2 * 10 = 80 rows wide 40),
    # o (40, 40), gate/up (2 * 64, 40), down (40, 64), each size a constant
    assert sorted(second) == ["(128, 40)", "(40, 40)", "(40, 64)", "(80, 40)"]  # not "(s27, 40)" ...


def test_quantised_or_subclassed_projections_are_refused_by_name() -> None:
    class PackedLinear(nn.Linear):  # a quantised map's class: its forward may not be F.linear of its weight
        pass

    _, layer, _ = _built("qwen2")
    layer.self_attn.k_proj = PackedLinear(32, 16)
    assert (
        layer_reason(layer)
        == "Qwen2DecoderLayer's self_attn.k_proj (PackedLinear): not nn.Linear with floating-point weights"
    )
    _, layer, _ = _built("llama-gqa")
    packed = torch.zeros_like(layer.mlp.up_proj.weight, dtype=torch.int8)
    layer.mlp.up_proj.weight = nn.Parameter(packed, requires_grad=False)
    layer.mlp.down_proj.weight = nn.Parameter(packed.T.contiguous(), requires_grad=False)
    assert layer_reason(layer) == (
        "LlamaDecoderLayer's mlp.up_proj (Linear) and 1 more: not nn.Linear with floating-point weights"
    )
