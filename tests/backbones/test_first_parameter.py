"""The adapters' device and dtype (care_core/backbones/base.py): the first parameter is the one torch's
``parameters()`` lists first, whatever holes (None parameters or children) and parameter-less modules come before it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from care_core.backbones.base import first_parameter


def _holey() -> nn.Module:
    """No parameter of its own (one registered as None), a None child, a parameter-less child, then nested Linears."""
    root = nn.Module()
    root.register_parameter("absent", None)
    root.register_module("nothing", None)
    root.act = nn.GELU()
    root.inner = nn.Sequential(nn.ReLU(), nn.Sequential(nn.Identity(), nn.Linear(3, 2, dtype=torch.float64)))
    root.later = nn.Linear(2, 2)
    return root


def test_the_first_parameter_is_the_one_parameters_lists_first(demo: Any) -> None:
    for module in (_holey(), nn.Linear(4, 4), demo.model, demo.projector):
        assert first_parameter(module) is next(module.parameters())
    assert first_parameter(_holey()).dtype == torch.float64  # the nested Linear's weight, before `later`
    assert demo.device == next(demo.model.parameters()).device and demo.dtype == next(demo.model.parameters()).dtype


def test_a_module_without_parameters_has_no_first_one() -> None:
    with pytest.raises(StopIteration):
        first_parameter(nn.Sequential(nn.ReLU(), nn.Identity()))
