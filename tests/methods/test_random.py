"""Random baseline: seeded, uniform, ascending, unique."""

from __future__ import annotations

import torch

from care_core.methods import build_method
from care_core.methods.random_select import random_select

from .conftest import make_inputs


def test_sorted_unique_and_seeded() -> None:
    kept = random_select(100, 30, seed=5)
    assert kept.numel() == 30 and torch.equal(kept, kept.unique())
    assert torch.equal(kept, random_select(100, 30, seed=5))
    assert not torch.equal(kept, random_select(100, 30, seed=6))
    expected = torch.randperm(100, generator=torch.Generator().manual_seed(5))[:30].sort().values
    assert torch.equal(kept, expected)


def test_method_uses_inputs_seed_unless_overridden() -> None:
    inputs = make_inputs(seed=3)
    result = build_method("random")(inputs, 20)
    assert torch.equal(result.token_index, random_select(inputs.num_tokens, 20, 3))
    assert torch.equal(result.tokens, inputs.features[result.token_index])
    override = build_method("random", seed=11)(inputs, 20)
    assert torch.equal(override.token_index, random_select(inputs.num_tokens, 20, 11))
    assert override.info["seed"] == 11


def test_roughly_uniform() -> None:
    counts = torch.zeros(20)
    for seed in range(2000):
        counts[random_select(20, 5, seed)] += 1
    # each token is kept with probability 1/4: 500 expected, sd ~19
    assert counts.min() > 400 and counts.max() < 600
    assert random_select(20, 20, 0).tolist() == list(range(20))
