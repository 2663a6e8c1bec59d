"""Greedy selection orders kept in the images' memos (docs/design/batches.md §Batches): DivPrune's max-min greedy,
SADS of the ZOO-anchored methods and PRCA's Eq. 3. Step t of each greedy reads only the tokens chosen before it, so the
order for K is the first K of the order for any larger K: one computation per image at the largest K asked or planned
serves every budget (and every method with the same greedy inputs), and every result equals a fresh call without a memo.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch

import care_core.care
import care_core.care_batch
import care_core.methods.divprune
from care_core import CaReConfig
from care_core.methods import MethodInputs, MethodResult, build_method
from care_core.methods.base import memo_orders
from care_core.methods.divprune import DivPrune

from .conftest import make_inputs

SIZES = (50, 42, 63)
BUDGETS = ((5, 4, 6), (12, 10, 15), (30, 25, 37))  # K per image, like K = 160, 320, 640 of N = 2880, scaled down
CONFIG = CaReConfig(m=8, h=1e-3, seed=3, engine="fd")
ZOO_ANCHORED = ("zoo-prune", "simple-calib", "confidence-calib")
PRCA_ANCHORED = ("care", "prca-only", "prca+simple-calib")
METHODS = ("divprune", *ZOO_ANCHORED, *PRCA_ANCHORED)
DIRECTIONS = {"descending": BUDGETS[::-1], "ascending": BUDGETS}


@functools.cache
def _made(sizes: tuple[int, ...], dtype: torch.dtype) -> tuple[MethodInputs, ...]:
    """Seeded images of these N in `dtype`, sharing image 0's projector (so batches take their joint paths)."""
    made = [make_inputs(n, d_v=12, seed=7 * i + n) for i, n in enumerate(sizes)]
    projector = made[0].projector.to(dtype).requires_grad_(False)
    return tuple(dataclasses.replace(one, features=one.features.to(dtype), positions=one.positions.to(dtype),
                                     projector=projector, probes={}) for one in made)  # fmt: skip


def images(sizes: tuple[int, ...] = SIZES, dtype: torch.dtype = torch.float64, **changes: Any) -> list[MethodInputs]:
    """Fresh copies of the seeded images (no memo unless `changes` give one; a dict is copied per image)."""
    return [dataclasses.replace(one, **{k: dict(v) if isinstance(v, dict) else v for k, v in changes.items()})
            for one in _made(sizes, dtype)]  # fmt: skip


def assert_identical(got: MethodResult, want: MethodResult, what: str) -> None:
    """Every tensor of the two results bit for bit (indices, order, tokens, scores, signals, info)."""
    for name in ("tokens", "token_index", "scores", "assignment", "signals"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), f"{what}: {name}"
        assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), f"{what}: {name}"
    assert got.info.keys() == want.info.keys(), what
    for key, value in want.info.items():
        same = torch.equal(got.info[key], value) if isinstance(value, torch.Tensor) else got.info[key] == value
        assert same, f"{what}: info[{key!r}]"


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", METHODS)
def test_every_budget_through_one_memo_equals_a_fresh_call(name, dtype, direction):
    """Budgets in either order through one memo per image, with and without a hint, in a batch of three N and one
    image alone: each result bit-identical to the same call on images without a memo, computed afresh."""
    method = build_method(name, CONFIG)
    planned = tuple(zip(*BUDGETS, strict=True))  # per image, every K it will be asked
    batch = images(dtype=dtype, memo={})
    hinted = [dataclasses.replace(one, planned_keeps=p) for one, p in zip(images(dtype=dtype, memo={}), planned,
                                                                          strict=True)]  # fmt: skip
    alone = images(dtype=dtype, memo={})[1]
    alone_hinted = dataclasses.replace(images(dtype=dtype, memo={})[1], planned_keeps=planned[1])
    for keeps in DIRECTIONS[direction]:
        fresh = method.batch(images(dtype=dtype), list(keeps))
        for inputs in (batch, hinted):
            for i, (got, want) in enumerate(zip(method.batch(inputs, list(keeps)), fresh, strict=True)):
                assert_identical(got, want, f"{name} K={keeps[i]} image {i}")
        want = method(images(dtype=dtype)[1], keeps[1])
        for one in (alone, alone_hinted):
            assert_identical(method(one, keeps[1]), want, f"{name} K={keeps[1]} alone")


@pytest.fixture
def greedy_calls(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The lengths of every greedy computation (one list per call: its images' lengths): spies on DivPrune's two
    greedy loops and on Eq. 3's (one image, a padded batch, and care_reduce's own)."""
    calls: list[list[int]] = []

    def spy(module: Any, name: str, lengths_at: int) -> None:
        real = getattr(module, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            lengths = args[lengths_at]
            calls.append(list(lengths) if isinstance(lengths, (list, tuple)) else [int(lengths)])
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    spy(care_core.methods.divprune, "divprune_select", 1)
    spy(care_core.methods.divprune, "divprune_select_batch", 1)
    spy(care_core.care_batch, "diversity_greedy", 2)
    spy(care_core.care_batch, "batch_anchors", 2)
    spy(care_core.care, "diversity_greedy", 2)
    return calls


@pytest.mark.parametrize("sizes", [SIZES, SIZES[:1]], ids=["batch", "alone"])
@pytest.mark.parametrize("name", METHODS)
def test_the_greedy_runs_once_per_image_for_descending_budgets_or_with_a_hint(name, sizes, greedy_calls):
    method = build_method(name, CONFIG)
    budgets = [keeps[: len(sizes)] for keeps in BUDGETS]
    largest = list(budgets[-1])
    inputs = images(sizes, memo={})
    for keeps in budgets[::-1]:
        method.batch(inputs, list(keeps))
    assert greedy_calls == [largest], "descending: one computation, at the first (largest) budget"
    greedy_calls.clear()
    planned = list(zip(*budgets, strict=True))
    inputs = [dataclasses.replace(one, planned_keeps=p) for one, p in zip(images(sizes, memo={}), planned, strict=True)]
    for keeps in budgets:
        method.batch(inputs, list(keeps))
    assert greedy_calls == [largest], "ascending with the planned budgets: one computation, at the largest"
    greedy_calls.clear()
    inputs = images(sizes, memo={})
    for keeps in [*budgets, *budgets[::-1]]:
        method.batch(inputs, list(keeps))
    assert greedy_calls == [list(keeps) for keeps in budgets], "no hint: each longer budget computes, none after"
    greedy_calls.clear()
    for keeps in budgets:
        method.batch(images(sizes), list(keeps))
    assert greedy_calls == [list(keeps) for keeps in budgets], "no memo: every call computes its own K"


@pytest.mark.parametrize("family", [ZOO_ANCHORED, PRCA_ANCHORED], ids=["sads", "prca"])
def test_methods_with_the_same_greedy_inputs_share_one_order(family, greedy_calls):
    """The three ZOO-anchored methods share SADS's order, the three PRCA-anchored ones Eq. 3's; another kernel
    setting (the ablations'; zoo-prune itself always runs "auto") or eps is another order. Each result is what a
    fresh call gives."""
    inputs = images(memo={})
    for keeps in BUDGETS[::-1]:
        for name in family:
            build_method(name, CONFIG).batch(inputs, list(keeps))
    assert greedy_calls == [list(BUDGETS[-1])]
    greedy_calls.clear()
    other = dataclasses.replace(CONFIG, **({"kernel": "torch"} if family is ZOO_ANCHORED else {"eps": 1e-6}))
    got = {name: build_method(name, other).batch(inputs, list(BUDGETS[0])) for name in family}
    assert greedy_calls == [list(BUDGETS[0])], "the other setting computes its own order once"
    for name in family:
        want = build_method(name, other).batch(images(), list(BUDGETS[0]))
        for i, (result, fresh) in enumerate(zip(got[name], want, strict=True)):
            assert_identical(result, fresh, f"{name} image {i}")


def test_divprune_mask_rules_keep_their_own_orders(greedy_calls):
    """The released rule and the registered one are two memo entries; each budget's result is the fresh call's."""
    memo = images(memo={})
    got = {(mask, tuple(keeps)): DivPrune(mask_selected=mask).batch(memo, list(keeps))
           for mask in (True, False) for keeps in BUDGETS[::-1]}  # fmt: skip
    assert greedy_calls == [list(BUDGETS[-1])] * 2, "one order per mask rule"
    assert {key[0] for key in memo[0].memo} == {"divprune-order"} and len(memo[0].memo) == 2
    for (mask, keeps), results in got.items():
        for i, (result, want) in enumerate(zip(results, DivPrune(mask_selected=mask).batch(images(), list(keeps)),
                                               strict=True)):  # fmt: skip
            assert_identical(result, want, f"mask_selected={mask} K={keeps[i]} image {i}")


def test_memo_orders_keeps_the_longest_order_and_hands_out_prefixes():
    """A hand-made greedy (image i of N tokens picks N-1, N-2, ...): requests within the stored order read its
    prefix, a longer one recomputes, the hint is capped at N and unused without a memo, and each image lacking an
    order is computed in one call with the others."""
    calls: list[tuple[list[int], list[int]]] = []

    def compute(todo: list[int], lengths: list[int]) -> list[torch.Tensor]:
        calls.append((todo, lengths))
        return [torch.arange(sizes[i] - 1, sizes[i] - 1 - n, -1) for i, n in zip(todo, lengths, strict=True)]

    sizes = [6, 4, 5]
    made = [MethodInputs(torch.zeros(n, 2), lambda x: x, torch.zeros(n, 2)) for n in sizes]
    hinted = dataclasses.replace(made[0], memo={}, planned_keeps=(2, 9))  # 9 > N = 6: capped
    plain = dataclasses.replace(made[1], memo={})
    got = memo_orders([hinted, plain, made[2]], [3, 2, 2], ["key"] * 3, compute)
    assert [o.tolist() for o in got] == [[5, 4, 3], [3, 2], [4, 3]]
    assert calls == [([0, 1, 2], [6, 2, 2])]
    got[0][0] = 99  # the caller's own copy
    got = memo_orders([hinted, plain, made[2]], [6, 3, 1], ["key"] * 3, compute)
    assert [o.tolist() for o in got] == [[5, 4, 3, 2, 1, 0], [3, 2, 1], [4]]
    assert calls[1:] == [([1, 2], [3, 1])], "image 0 reads its memo; image 1 needs a longer order, image 2 has none"
    assert plain.memo is not None and plain.memo["key"].tolist() == [3, 2, 1], "the longer order replaced the shorter"
    got = memo_orders([hinted, plain], [1, 2], ["key", "other key"], compute)
    assert [o.tolist() for o in got] == [[5], [3, 2]] and calls[2:] == [([1], [2])], "another key, another order"
