"""The typed readers of a model's parts: each returns the attribute itself in its one type, and a model holding
something else at that name is a TypeError naming the attribute, not a failure somewhere later."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from care_core.backbones.module_attrs import (
    float_attr,
    input_embeddings,
    instance_forwards,
    int_attr,
    optional_tensor_attr,
    submodule,
    tensor_attr,
    typed_attr,
)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 2)
        self.register_buffer("scale", torch.ones(2))
        self.num_heads = 4
        self.eps = 1e-6


def test_readers_return_the_attribute_itself() -> None:
    block = _Block()
    assert submodule(block, "proj") is block.proj
    assert tensor_attr(block.proj, "weight") is block.proj.weight
    assert tensor_attr(block, "scale") is block.scale  # a buffer reads like a parameter
    assert typed_attr(block, "proj", nn.Linear) is block.proj
    assert int_attr(block, "num_heads") == 4 and float_attr(block, "eps") == 1e-6


def test_a_missing_or_none_bias_reads_as_none() -> None:
    with_bias, without_bias = nn.Linear(3, 2), nn.Linear(3, 2, bias=False)
    assert optional_tensor_attr(with_bias, "bias") is with_bias.bias
    assert without_bias.bias is None and optional_tensor_attr(without_bias, "bias") is None
    assert optional_tensor_attr(nn.GELU(), "bias") is None  # no such attribute at all


def test_a_part_of_another_type_is_a_type_error_naming_it() -> None:
    block = _Block()
    with pytest.raises(TypeError, match=r"^_Block\.scale is a Tensor, not a Module$"):
        submodule(block, "scale")
    with pytest.raises(TypeError, match=r"^_Block\.proj is a Linear, not a Tensor$"):
        tensor_attr(block, "proj")
    with pytest.raises(TypeError, match=r"^_Block\.proj is a Linear, not a Sequential$"):
        typed_attr(block, "proj", nn.Sequential)
    with pytest.raises(TypeError, match=r"^_Block\.proj is a Linear, not a Tensor$"):
        optional_tensor_attr(block, "proj")
    with pytest.raises(AttributeError):
        submodule(block, "missing")


def test_the_input_embeddings_are_the_ones_the_model_names(demos: dict[str, Any]) -> None:
    for name, adapter in demos.items():
        assert input_embeddings(adapter.model) is adapter.model.get_input_embeddings(), name


def test_a_model_of_another_layout_is_asked_for_its_input_embeddings() -> None:
    class _Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Embedding(5, 3)

        def get_input_embeddings(self) -> nn.Module:
            return self.table

    model = _Other()
    assert input_embeddings(model) is model.table


def test_instance_forwards_hold_for_the_block_and_leave_a_set_forward_alone() -> None:
    first, second, owned = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    vars(owned)["forward"] = lambda x: x  # set by its owner: stays as it is
    x = torch.ones(1, 2)
    with instance_forwards([(first, lambda x: x * 0), (second, torch.neg), (owned, torch.neg)]) as count:
        assert count == 2 and torch.equal(first(x), x * 0) and torch.equal(second(x), -x)
        assert torch.equal(owned(x), x)
        with instance_forwards([(first, torch.neg)]) as inner:  # an enclosing block's forward is kept
            assert inner == 0 and torch.equal(first(x), x * 0)
    assert "forward" not in vars(first) and "forward" not in vars(second) and "forward" in vars(owned)
    with pytest.raises(RuntimeError, match="inside"), instance_forwards([(first, torch.neg)]):
        raise RuntimeError("inside")
    assert "forward" not in vars(first)
