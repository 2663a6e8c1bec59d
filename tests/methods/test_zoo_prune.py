"""ZOO-Prune: SADS weights and greedy steps by hand, golden files."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from care_core.methods import MethodInputs, build_method
from care_core.methods.zoo_prune import sads_select, sads_weights
from care_core.scoring import Scorer
from tests.reference import care_reference as reference

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


def _independent(inputs: MethodInputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pre-projector V, SADS weights, post-projector embeddings) in float64 numpy, from the reference module of
    tests/reference (no care_core code): sensitivity = mean over the 64 default directions (seed 42) of the raw
    Eq. 1 response with ZOO-Prune's h = 0.01, then min-max."""
    layers = inputs.projector
    W1, b1, W2, b2 = (t.detach().double().numpy() for t in (layers[0].weight, layers[0].bias, layers[2].weight,
                                                             layers[2].bias))  # fmt: skip
    V = inputs.features.double().numpy()
    U = reference.default_directions(64, V.shape[1], 42)
    sensitivity = reference.responses_fd(V, W1, b1, W2, b2, U, 0.01).mean(axis=0)
    weights = (sensitivity - sensitivity.min()) / (sensitivity.max() - sensitivity.min() + 1e-8)
    return V, weights, reference.mlp(V, W1, b1, W2, b2)


def _float64(inputs: MethodInputs) -> MethodInputs:
    projector = copy.deepcopy(inputs.projector).double()
    return MethodInputs(inputs.features.double(), projector, inputs.positions.double(), grid=inputs.grid)


@pytest.mark.parametrize(("n", "keep", "seed"), [(100, 12, 2), (64, 30, 5)])
def test_registered_method_equals_an_independent_float64_computation(n: int, keep: int, seed: int) -> None:
    """The whole method against an independent recomputation: diversity 1 - cos on the post-projector embeddings
    M(v), greedy argmax w_i min_S D with ties to the lowest index (float64 in, float64 maths)."""
    inputs = _float64(make_inputs(n=n, d_v=16, seed=seed))
    _, weights, embeddings = _independent(inputs)
    order, margin = reference.greedy_anchors(embeddings, weights, keep, 1e-12)
    assert margin > 1e-6, "near-tie in the greedy: pick another seed"

    result = build_method("zoo-prune")(inputs, keep)
    assert result.info["selection_order"].tolist() == order
    assert result.token_index.tolist() == sorted(order)
    np.testing.assert_allclose(result.scores.numpy(), weights, rtol=0, atol=1e-9)
    assert torch.equal(result.tokens, inputs.features[sorted(order)])


@pytest.mark.parametrize("second_layer", [None, "dense", "triangular"])
@pytest.mark.parametrize(("n", "keep", "seed"), [(100, 12, 2), (81, 10, 1)])
def test_float32_selection_equals_the_literal_float64_one(
    n: int, keep: int, seed: int, second_layer: str | None
) -> None:
    """In float32 (the default compute precision), through the fd engine's shared first layer and, with a
    triangular scorer, W2's factor: the selection the literal float64 Eq. 1 responses give, and weights within a
    quarter of the greedy's smallest margin of theirs (so the agreement is no luck)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)  # d_out >= d_h, so that W2 has a square triangular factor
        projector = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.GELU(), torch.nn.Linear(24, 32))
    inputs = dataclasses.replace(make_inputs(n=n, d_v=16, seed=seed), projector=projector)  # float32
    if second_layer is not None:
        inputs.scorer = Scorer(projector, second_layer=second_layer)
        assert (inputs.scorer.factor(torch.float32, "cpu") is None) == (second_layer == "dense")
    _, weights, embeddings = _independent(_float64(inputs))
    order, margin = reference.greedy_anchors(embeddings, weights, keep, 1e-12)

    result = build_method("zoo-prune")(inputs, keep)
    assert result.info["selection_order"].tolist() == order
    assert np.abs(result.scores.double().numpy() - weights).max() < margin / 4


def test_pre_projector_diversity_would_be_seen() -> None:
    """Guard for the test above: on its first input, diversity on the pre-projector features gives another order,
    so a method that measured diversity before the projector would fail it."""
    V, weights, embeddings = _independent(_float64(make_inputs(n=100, d_v=16, seed=2)))
    post, _ = reference.greedy_anchors(embeddings, weights, 12, 1e-12)
    pre, _ = reference.greedy_anchors(V, weights, 12, 1e-12)
    assert post != pre


@pytest.mark.parametrize("name", GOLDEN_FILES["zooprune"])
def test_golden(name: str) -> None:
    assert_golden_passes(name)
