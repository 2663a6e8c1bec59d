"""ZOO-Prune: SADS weights and greedy steps by hand, golden files."""

from __future__ import annotations

import pytest
import torch

from care_core.methods import create_method
from care_core.methods.zoo_prune import sads_select, sads_weights

from .conftest import GOLDEN_FILES, assert_golden_passes, make_inputs


def test_weights_min_max_and_constant_branch() -> None:
    w = sads_weights(torch.tensor([1.0, 2.0, 3.0]))
    assert w.tolist() == pytest.approx([0.0, 0.5, 1.0], abs=1e-7)
    assert sads_weights(torch.full((4,), 2.5)).tolist() == [1.0, 1.0, 1.0, 1.0]


def test_sads_steps_by_hand() -> None:
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [1.0, 0.1]])
    importance = torch.tensor([1.0, 3.0, 2.0, 5.0])  # w = [0, 0.5, 0.25, 1]
    # step 0: argmax w -> 3; step 1: w * (1 - cos to token 3): token 0: 0, token 1: 0.5 * (1 - 0.1/1.005) = 0.450,
    # token 2: 0.25 * (1 + 1/1.005) = 0.499 -> 2
    order = sads_select(x, importance, 3)
    assert order[:2].tolist() == [3, 2]
    # step 3: token 1: 0.5 * min(0.9005, 1) = 0.450; token 0: 0 -> 1
    assert order.tolist() == [3, 2, 1]


def test_constant_importance_starts_at_index_zero() -> None:
    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
    assert sads_select(x, torch.ones(10), 3)[0].item() == 0


def test_registered_method_selects_with_sads_on_post_projector_tokens() -> None:
    inputs = make_inputs(seed=2)
    method = create_method("zoo-prune")
    weights, embeddings = method.scores(inputs)
    result = method(inputs, 12)
    assert torch.equal(result.info["selection_order"], sads_select(embeddings, weights, 12))


@pytest.mark.parametrize("name", GOLDEN_FILES["zooprune"])
def test_golden(name: str) -> None:
    assert_golden_passes(name)
