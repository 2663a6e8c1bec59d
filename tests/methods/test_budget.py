"""The budget contract, checked once in Method.__call__ for every registered method (registry-driven)."""

from __future__ import annotations

import pytest
import torch

from care_core.errors import MethodError
from care_core.methods import Method, build_method, method_class, method_names

from .conftest import make_inputs

METHODS = method_names()
N = 36  # a 6 x 6 grid


@pytest.fixture(scope="module")
def small_inputs():
    return make_inputs(n=N, seed=4)


@pytest.mark.parametrize("name", METHODS)
def test_call_is_the_base_template(name: str) -> None:
    """No method overrides __call__, so the budget check cannot be bypassed."""
    assert method_class(name).__call__ is Method.__call__
    assert method_class(name).reduce is not Method.reduce


@pytest.mark.parametrize("keep", [0, -1, N + 1, N + 5, True, False, 2.0, 3.5, "4", None])
@pytest.mark.parametrize("name", METHODS)
def test_bad_budget_is_a_one_line_method_error(name: str, keep: object, small_inputs) -> None:
    with pytest.raises(MethodError) as info:
        build_method(name)(small_inputs, keep)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{name}:"), message
    assert f"N = {N}" in message and repr(keep) in message


@pytest.mark.parametrize("keep", [1, N])
@pytest.mark.parametrize("name", METHODS)
def test_extreme_budgets_give_the_documented_count(name: str, keep: int, small_inputs) -> None:
    method = build_method(name)
    result = method(small_inputs, keep)
    assert result.num_tokens == method.output_count(N, keep) == keep
    assert result.token_index.shape == (keep,)
    assert torch.isfinite(result.tokens).all()
    kept = result.token_index[result.token_index >= 0]
    assert kept.unique().numel() == kept.numel()  # never a patch twice (the old N + 5 bug duplicated rows)
    if result.assignment is not None:
        assert result.assignment.shape == (N,) and int(result.assignment.max()) < keep


def test_numpy_integers_are_integers(small_inputs) -> None:
    import numpy as np

    assert build_method("random")(small_inputs, np.int64(5)).num_tokens == 5
    with pytest.raises(MethodError, match="integer"):
        build_method("random")(small_inputs, np.float64(5.0))


def test_keep_n_on_care_keeps_every_token_uncalibrated(small_inputs) -> None:
    result = build_method("care")(small_inputs, N)
    assert torch.equal(result.token_index, torch.arange(N))
    assert torch.equal(result.tokens, small_inputs.features)  # no residuals, nothing to calibrate
    assert result.signals is not None and result.signals.numel() == 0
