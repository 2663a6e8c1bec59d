"""Helpers the fast-path scoring tests share: force the fast path, hide a projector from the recognisers, compare."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from care_core import scoring


def fast_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the generic path fail, so that a result shows the fast path ran."""

    def refuse(*args: object) -> torch.Tensor:
        raise AssertionError("the generic torch.func.jvp path ran")

    monkeypatch.setattr(scoring, "_jvp_generic", refuse)


def generic(projector: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The projector as a plain function: no recogniser reads it, so the jvp engine takes torch.func.jvp."""
    return lambda v: projector(v)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest absolute difference relative to the largest reference value."""
    return float((got - want).abs().max() / want.abs().max())
