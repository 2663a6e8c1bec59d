"""Random selection baseline: ``keep`` visual tokens drawn uniformly without replacement, in ascending order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from care_core._lazy import torch
from care_core.methods.base import Category, Method, MethodInputs, MethodResult, selection_result
from care_core.methods.registry import register


def random_select(num_tokens: int, keep: int, seed: int) -> torch.Tensor:
    """(keep,) ascending indices: the first `keep` of ``randperm(num_tokens)`` from a CPU generator seeded `seed`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_tokens, generator=g)[:keep].sort().values


@register
@dataclass(frozen=True)
class RandomSelect(Method):
    """Uniform random token selection, the standard lower baseline of the token-reduction literature.

    The draw comes from a ``torch.Generator`` seeded with ``seed`` if given, else with ``inputs.seed``, so the same
    seed gives the same tokens on every device.
    """

    name: ClassVar[str] = "random"
    category: ClassVar[Category] = "selection"
    paper: ClassVar[str] = "uniform random selection baseline (no paper; used as a control in e.g. FastV, DivPrune)"
    rank: ClassVar[int] = 14
    cost_model: ClassVar[str | None] = "random"
    hyperparameters: ClassVar[frozenset[str]] = frozenset({"seed"})

    seed: int | None = None  # overrides inputs.seed

    def reduce(self, inputs: MethodInputs, keep: int) -> MethodResult:
        n = inputs.num_tokens
        seed = inputs.seed if self.seed is None else self.seed
        kept = random_select(n, keep, seed).to(inputs.features.device)
        return selection_result(inputs.features, kept, None, seed=seed)
