"""Every registered method over a batch: per image, what the method gives that image alone
(docs/design/batches.md §Batches).

The oracle is the method called on each image by itself. Images differ in N and K; they share one projector, as a
pipeline's do, so CaRe's variants and ZOO-Prune take their joint path (one Eq. 1 pass, one padded Eq. 3 loop).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
import torch

from care_core import CaReConfig
from care_core.errors import CareError, MethodError
from care_core.methods import MethodInputs, MethodResult, build_method, method_names
from care_core.methods.care_family import prca_key
from care_core.methods.divprune import divprune_select, divprune_select_batch
from care_core.scoring import Scorer

from .conftest import make_inputs

SIZES = {1: (56,), 3: (42, 132, 90), 8: (42, 132, 56, 90, 49, 110, 64, 72)}  # each N a rows x cols grid
KEEPS = (5, 40, 17, 9, 30, 3, 22, 12)
CONFIG = CaReConfig(m=8, h=1e-3, seed=3, engine="fd")
PRCA_ANCHORED = ("care", "prca-only", "prca+simple-calib")
ZOO_ANCHORED = ("zoo-prune", "simple-calib", "confidence-calib")  # all read ZOO-Prune's sensitivity
TOLERANCE = {torch.float64: {"rtol": 0, "atol": 1e-9}, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}
BIT_FOR_BIT = frozenset({"sparsevlm", "ficoco-v"})  # bit-identical on the CPU: docs/design/batches.md §Batches
EXACT = {"rtol": 0, "atol": 0}


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


@functools.cache
def _images(sizes: tuple[int, ...], dtype: torch.dtype) -> tuple[MethodInputs, ...]:
    """One image per N (seeded by its place), every probe, in `dtype`, all sharing image 0's projector."""
    made = [make_inputs(n, d_v=12, seed=11 * i + n) for i, n in enumerate(sizes)]
    projector = made[0].projector.to(dtype).requires_grad_(False)
    return tuple(
        dataclasses.replace(
            one,
            features=one.features.to(dtype),
            positions=one.positions.to(dtype),
            projector=projector,
            probes={name: _cast(value, dtype) for name, value in one.probes.items()},
        )
        for one in made
    )


def images(sizes: tuple[int, ...], dtype: torch.dtype = torch.float64, **changes: Any) -> list[MethodInputs]:
    """Fresh copies of the cached images (each with its own memo or stage timer where `changes` give them)."""
    return [dataclasses.replace(one, **changes) for one in _images(sizes, dtype)]


def assert_same_value(got: Any, want: Any, tol: dict[str, float], what: str) -> None:
    """Integer tensors and everything not a tensor equal; float tensors within `tol`; containers item by item."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, what
        if want.is_floating_point():
            torch.testing.assert_close(got, want, **tol, msg=what)
        else:
            assert torch.equal(got, want), what
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), what
        for key in want:
            assert_same_value(got[key], want[key], tol, f"{what}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), what
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_value(a, b, tol, f"{what}[{i}]")
    else:
        assert got == want, what


def assert_same_result(got: MethodResult, want: MethodResult, tol: dict[str, float], what: str) -> None:
    assert torch.equal(got.indices, want.indices), f"{what}: indices"
    for name in ("token_index", "assignment", "signals", "tokens", "scores", "info"):
        assert_same_value(getattr(got, name), getattr(want, name), tol, f"{what}: {name}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("name", method_names())
def test_batch_gives_each_image_what_it_gets_alone(name, batch, dtype):
    method = build_method(name, CONFIG)
    inputs, keeps = images(SIZES[batch], dtype), list(KEEPS[:batch])
    got = method.batch(inputs, keeps)
    assert len(got) == batch
    for i, (result, one, keep) in enumerate(zip(got, inputs, keeps, strict=True)):
        tol = EXACT if name in BIT_FOR_BIT else TOLERANCE[dtype]
        assert_same_result(result, method(one, keep), tol, f"{name} image {i}")


def test_batches_hold_distinct_sizes_and_budgets():
    """The parametrised batches mean something: N and K differ, and every K is a valid budget."""
    sizes, keeps = SIZES[8], KEEPS
    assert len(set(sizes)) == len(sizes) and len(set(keeps)) == len(keeps)
    assert all(1 <= k < n for n, k in zip(sizes, keeps, strict=True))
    assert all(one.grid is not None for one in images(sizes))  # pool needs a grid


@pytest.mark.parametrize("name", method_names())
def test_budget_errors_name_the_image(name):
    method = build_method(name, CONFIG)
    inputs = images(SIZES[3])
    with pytest.raises(MethodError, match=re.escape(f"{name}: image 1: the budget K must be between 1 and N = 132")):
        method.batch(inputs, [5, 0, 5])
    with pytest.raises(MethodError, match=re.escape(f"{name}: image 2: the budget K must be between 1 and N = 90")):
        method.batch(inputs, [5, 5, 91])
    with pytest.raises(MethodError, match="3 images but 2 budgets"):
        method.batch(inputs, [5, 5])


# ------------------------------------------------------------------------------ CaRe's joint path


class CountingScorer(Scorer):
    """A scorer that records the number of tokens of each Eq. 1 pass."""

    def __init__(self, projector: Any) -> None:
        super().__init__(projector)
        self.passes: list[int] = []

    def responses(self, features: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.passes.append(int(features.shape[0]))
        return super().responses(features, *args, **kwargs)


def scored_images(sizes: tuple[int, ...], **changes: Any) -> tuple[list[MethodInputs], CountingScorer]:
    """Images with their own memo and one counting scorer for their shared projector."""
    inputs = images(sizes, **changes)
    scorer = CountingScorer(inputs[0].projector)
    return [dataclasses.replace(one, memo={}, scorer=scorer) for one in inputs], scorer


@pytest.mark.parametrize("name", PRCA_ANCHORED)
def test_one_scoring_pass_for_the_batch_and_its_psi_bar_is_reused_later(name):
    inputs, scorer = scored_images(SIZES[3])
    key = prca_key(CONFIG)
    got = build_method(name, CONFIG).batch(inputs, [4, 9, 2])
    assert scorer.passes == [sum(SIZES[3])], "one Eq. 1 pass over all images' tokens"
    for one, result in zip(inputs, got, strict=True):
        assert result.scores is one.memo[key], "the batch stores each image's psi_bar in its memo"
    for other in PRCA_ANCHORED:  # any budget, any PRCA-anchored method, one image at a time
        for one in inputs:
            assert build_method(other, CONFIG)(one, 3).scores is one.memo[key]
    assert scorer.passes == [sum(SIZES[3])], "nothing scored again"


@pytest.mark.parametrize("name", PRCA_ANCHORED)
def test_memoised_psi_bar_is_not_recomputed(name):
    inputs, scorer = scored_images(SIZES[3])
    key = prca_key(CONFIG)
    given = torch.linspace(1, 0, SIZES[3][1], dtype=torch.float64) ** 2  # hand-made: token 0 scores highest
    inputs[1].memo[key] = given
    got = build_method(name, CONFIG).batch(inputs, [4, 9, 2])
    assert scorer.passes == [SIZES[3][0] + SIZES[3][2]], "image 1's tokens are not scored"
    assert got[1].scores is given and got[1].info["selection_order"][0] == 0
    for one in inputs:
        one.memo[key] = given[: one.num_tokens] if one is not inputs[1] else given
    build_method(name, CONFIG).batch(inputs, [4, 9, 2])
    assert len(scorer.passes) == 1, "every psi_bar memoised: no pass at all"


@pytest.mark.parametrize(("name", "stages"), [("care", ["scoring", "anchors", "calibration"]),
                                              ("prca-only", ["scoring", "anchors"]),
                                              ("confidence-calib", ["scoring", "anchors", "calibration"]),
                                              ("zoo-prune", ["scoring", "anchors"])])  # fmt: skip
def test_each_stage_is_timed_once_for_the_batch(name, stages):
    seen: list[str] = []

    @contextmanager
    def timer(stage: str):
        seen.append(stage)
        yield

    build_method(name, CONFIG).batch(images(SIZES[8], stage_timer=timer), list(KEEPS))
    assert seen == stages


def test_images_that_cannot_share_a_pass_go_one_at_a_time():
    """Mixed dtypes, projectors or stage timers: each image as it goes alone (and its own scoring pass)."""
    method = build_method("care", CONFIG)
    wide, narrow = images(SIZES[3]), images(SIZES[3], torch.float32)
    other = make_inputs(40, d_v=12, seed=99).projector.double()
    timers = [lambda _stage: nullcontext() for _ in range(3)]  # three timers, not one
    batches = [
        [wide[0], narrow[1], wide[2]],
        [wide[0], dataclasses.replace(wide[1], projector=other), wide[2]],
        [dataclasses.replace(one, stage_timer=t) for one, t in zip(wide, timers, strict=True)],
    ]
    for batch in batches:
        got = method.batch(batch, [4, 9, 2])
        for i, (result, one) in enumerate(zip(got, batch, strict=True)):
            want = method(one, [4, 9, 2][i])
            assert_same_result(result, want, TOLERANCE[one.features.dtype], f"image {i}")
    bad = [wide[0], dataclasses.replace(wide[1], features=wide[1].features.clone().fill_(float("nan"))), wide[2]]
    with pytest.raises(CareError, match="NaN"):
        method.batch(bad, [4, 9, 2])


# ------------------------------------------------------------------------------ ZOO-Prune's shared sensitivity


class CountingProjector:
    """The images' projector, counting its calls (a plain callable: the methods use it as it is)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.calls = module, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.module(x)


def counted_images(sizes: tuple[int, ...]) -> tuple[list[MethodInputs], CountingProjector]:
    """Float64 images, each with its own memo, sharing one counting projector."""
    inputs = images(sizes)
    projector = CountingProjector(inputs[0].projector)
    return [dataclasses.replace(one, projector=projector, memo={}) for one in inputs], projector


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("first", ZOO_ANCHORED)
def test_zoo_sensitivity_is_computed_once_per_image_set_for_every_zoo_anchored_method(first, batch):
    """Whichever ZOO-anchored method runs first scores every image in one joint pass and memoises it; the others
    call the projector no more, and every image gets what each method gives it alone (no memo, own projector)."""
    inputs, projector = counted_images(SIZES[batch])
    keeps = list(KEEPS[:batch])
    alone = images(SIZES[batch])
    order = [first, *(name for name in ZOO_ANCHORED if name != first)]
    for position, name in enumerate(order):
        method = build_method(name, CONFIG)
        got = method.batch(inputs, keeps)
        if position == 0:
            scored = projector.calls
        for i, (result, one, keep) in enumerate(zip(got, alone, keeps, strict=True)):
            assert_same_result(result, method(one, keep), TOLERANCE[torch.float64], f"{name} image {i}")
    assert projector.calls == scored, "the later methods read the memo"
    single, counter = counted_images(SIZES[1])
    build_method(first, CONFIG).batch(single, [KEEPS[0]])
    # one joint sensitivity pass: as many projector calls as for one image, plus one embedding call per image
    assert scored == counter.calls + batch - 1


def test_zoo_memo_is_not_shared_with_other_hyperparameters():
    """Another h, m or seed computes its own sensitivity (the projector is called again) and gives each image
    what that method gives it alone; the first method's memo entry is left as it was."""
    inputs, projector = counted_images(SIZES[3])
    keeps = [4, 9, 2]
    base = build_method("zoo-prune", CONFIG).batch(inputs, keeps)
    kept = [dict(one.memo) for one in inputs]
    for change in ({"h": 2e-3}, {"m": 9}, {"seed": 4}):
        config = dataclasses.replace(CONFIG, **change)
        for name in ZOO_ANCHORED:
            before = projector.calls
            got = build_method(name, config).batch(inputs, keeps)
            assert (projector.calls > before) == (name == "zoo-prune"), f"{change}: {name} scores once per change"
            for i, (result, one, keep) in enumerate(zip(got, images(SIZES[3]), keeps, strict=True)):
                assert_same_result(result, build_method(name, config)(one, keep), TOLERANCE[torch.float64],
                                   f"{change} {name} image {i}")  # fmt: skip
        for old, new in zip(base, got, strict=True):
            assert not torch.equal(old.scores, new.scores), f"{change}: other weights"
    for one, before in zip(inputs, kept, strict=True):
        assert all(one.memo[key] is value for key, value in before.items())
        assert sum(key[0] == "zoo-prune" for key in one.memo) == 1 + 3, "one sensitivity per setting"
        assert len(one.memo) == 2 * (1 + 3), "and one SADS order per setting, shared by the three methods"


# ------------------------------------------------------------------------------ DivPrune's joint greedy loop


@pytest.mark.parametrize("mask_selected", [False, True])
def test_divprune_batch_steps_by_hand(mask_selected):
    """The hand-checked images of test_divprune in one batch, with a single token: each its own steps."""
    spread = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [-1.0, 0.0]])  # -> 3, 0, 2
    twins = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])  # -> 0, 2, then 0 again or 1
    single = torch.tensor([[0.5, 0.5]])
    got = divprune_select_batch([spread, twins, single], [3, 3, 1], mask_selected=mask_selected)
    assert [o.tolist() for o in got] == [[3, 0, 2], [0, 2, 1 if mask_selected else 0], [0]]


@pytest.mark.parametrize("mask_selected", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_divprune_batch_equals_each_image_with_duplicates_and_zeros(mask_selected, dtype):
    """Exhaustion (K = N on duplicated tokens), zero rows, K = 1, N = 1: the single-image order, image by image."""
    cases = ((30, True, False), (1, False, False), (45, False, True), (20, True, True))  # N, duplicates, zeros
    made = [make_inputs(n, d_v=6, seed=n, duplicates=dup, zeros=zero) for n, dup, zero in cases]
    embeddings = [one.features.to(dtype) for one in made]
    keeps = [30, 1, 1, 20]
    got = divprune_select_batch(embeddings, keeps, mask_selected=mask_selected)
    for order, x, k in zip(got, embeddings, keeps, strict=True):
        assert torch.equal(order, divprune_select(x, k, mask_selected=mask_selected))
    assert mask_selected == (got[0].unique().numel() == 30), "the duplicates do exhaust the greedy"


def test_divprune_batch_raises_where_the_released_rule_reselects():
    inputs = [make_inputs(20, d_v=6, seed=1, duplicates=True), make_inputs(30, d_v=6, seed=2)]
    with pytest.raises(MethodError, match="re-selected"):
        build_method("divprune", mask_selected=False).batch(inputs, [20, 5])
