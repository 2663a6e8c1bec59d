"""Registry-driven contract tests: every registered method gets them, with no per-method code."""

from __future__ import annotations

import pytest
import torch

from care_core.errors import MethodError
from care_core.methods import MethodResult, build_method, canonical_name, method_class, method_names
from care_core.vocabulary import PROBES

from .conftest import make_inputs

METHODS = method_names()
BUDGETS = [1, 16, 50]


def _check_result(name: str, result: MethodResult, n: int, keep: int) -> None:
    method = build_method(name)
    assert result.tokens.ndim == 2 and result.tokens.shape[0] == method.output_count(n, keep)
    assert result.token_index.shape == (result.tokens.shape[0],)
    assert result.token_index.dtype == torch.long
    assert torch.all(result.token_index >= -1) and torch.all(result.token_index < n)
    indices = result.indices
    assert torch.equal(indices, indices.sort().values) and indices.unique().numel() == indices.numel()
    assert torch.isfinite(result.tokens).all(), f"{name} returned non-finite tokens"
    if result.scores is not None:
        assert result.scores.shape == (n,)
    if result.assignment is not None:
        assert result.assignment.shape == (n,)
        assert torch.all(result.assignment >= -1) and torch.all(result.assignment < result.tokens.shape[0])


def test_registry_lists_the_paper_methods_ablations_and_baselines() -> None:
    expected = {
        "care", "zoo-prune", "prca-only", "simple-calib", "confidence-calib", "prca+simple-calib",
        "divprune", "visionzip", "prumerge+", "tome", "fastv", "sparsevlm", "ficoco-v", "random", "pool",
    }  # fmt: skip
    assert expected <= set(METHODS)
    assert canonical_name("sense-diversity") == "zoo-prune"


@pytest.mark.parametrize("name", METHODS)
def test_metadata(name: str) -> None:
    cls = method_class(name)
    assert cls.category in ("selection", "merging", "calibration")
    assert cls.paper and cls.__doc__
    assert set(cls.needs) <= set(PROBES)


@pytest.mark.parametrize("keep", BUDGETS)
@pytest.mark.parametrize("name", METHODS)
def test_contract_on_random_inputs(name: str, keep: int) -> None:
    inputs = make_inputs(seed=keep)
    result = build_method(name)(inputs, keep)
    _check_result(name, result, inputs.num_tokens, keep)


@pytest.mark.parametrize("name", METHODS)
def test_same_seed_same_output(name: str) -> None:
    first = build_method(name)(make_inputs(seed=3), 20)
    second = build_method(name)(make_inputs(seed=3), 20)
    assert torch.equal(first.token_index, second.token_index)
    assert torch.equal(first.tokens, second.tokens)


@pytest.mark.parametrize("case", ["duplicates", "zeros"])
@pytest.mark.parametrize("name", METHODS)
def test_no_nan_with_degenerate_tokens(name: str, case: str) -> None:
    inputs = make_inputs(seed=5, **{case: True})
    result = build_method(name)(inputs, 24)
    _check_result(name, result, inputs.num_tokens, 24)


@pytest.mark.parametrize("name", METHODS)
def test_missing_probe_is_a_clear_error(name: str) -> None:
    cls = method_class(name)
    if not cls.needs:
        pytest.skip("needs nothing beyond features")
    inputs = make_inputs()
    inputs.probes = {}
    with pytest.raises(MethodError, match="needs"):
        build_method(name)(inputs, 10)


def test_unknown_method_suggests_close_names() -> None:
    with pytest.raises(MethodError, match=r"did you mean.*visionzip"):
        canonical_name("visonzip")
