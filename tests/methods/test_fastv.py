"""FastV: last-token, head-mean attention of layer K-1 over the image span; top tokens ascending."""

from __future__ import annotations

import pytest
import torch

from care_core.errors import MethodError
from care_core.methods import MethodInputs, build_method
from care_core.methods.fastv import fastv_scores, top_tokens

from .test_sparsevlm import ScriptedLM


def _inputs(last_rows: dict[int, list[float]], n: int = 5, prefix: int = 2, text: int = 2) -> MethodInputs:
    length = prefix + n + text
    layers = [torch.full((2, length, length), 1.0 / length) for _ in range(3)]
    for layer, row in last_rows.items():
        layers[layer][0, -1, prefix : prefix + n] = torch.tensor(row)
        layers[layer][1, -1, prefix : prefix + n] = 0.0
    lm = ScriptedLM(layers, torch.zeros(length, 4), (prefix, prefix + n), (prefix + n, length))
    features = torch.arange(n * 3, dtype=torch.float32).view(n, 3)
    return MethodInputs(features, lambda v: v, torch.zeros(n, 2), probes={"language_model": lm})


def test_scores_are_head_mean_last_row_on_the_image_span() -> None:
    attention = torch.zeros(2, 6, 6)
    attention[0, -1, 1:4] = torch.tensor([0.2, 0.6, 0.2])
    attention[1, -1, 1:4] = torch.tensor([0.4, 0.0, 0.0])
    attention[0, -2, 1:4] = 9.0  # not the last token: ignored
    assert fastv_scores(attention, (1, 4)).tolist() == pytest.approx([0.3, 0.3, 0.1])


def test_top_tokens_ascending_ties_to_lowest_index() -> None:
    assert top_tokens(torch.tensor([0.1, 0.5, 0.5, 0.9, 0.5]), 3).tolist() == [1, 2, 3]


def test_default_uses_layer_1_and_keeps_top_in_order() -> None:
    inputs = _inputs({1: [0.1, 0.4, 0.0, 0.3, 0.2], 0: [0.9, 0.0, 0.0, 0.0, 0.9]})
    result = build_method("fastv")(inputs, 2)  # K = 2: layer index 1
    assert inputs.probes["language_model"].calls == [1]
    assert result.token_index.tolist() == [1, 3]
    assert torch.equal(result.tokens, inputs.features[[1, 3]])
    assert result.scores.tolist() == pytest.approx([0.05, 0.2, 0.0, 0.15, 0.1])
    assert result.assignment.tolist() == [-1, 0, -1, 1, -1]
    assert build_method("fastv", agg_layer=1)(inputs, 2).token_index.tolist() == [0, 4]


def test_invalid_layer_and_span_are_errors() -> None:
    inputs = _inputs({1: [0.1, 0.4, 0.0, 0.3, 0.2]})
    with pytest.raises(MethodError, match="agg_layer"):
        build_method("fastv", agg_layer=0)(inputs, 2)
    with pytest.raises(MethodError, match="no layer"):
        build_method("fastv", agg_layer=9)(inputs, 2)
    inputs.probes["language_model"].image = (2, 6)
    with pytest.raises(MethodError, match="image span"):
        build_method("fastv")(inputs, 2)
