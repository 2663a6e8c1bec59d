"""FiCoCo-V: score and window helpers, a hand-checkable step in both row orders, explicit map state, the method,
and the golden file."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from care_core.methods import MethodInputs, MethodResult, build_method, ficoco
from care_core.methods.ficoco import FiCoCoV, ficoco_step, fresh_score_map, redundancy_scores, window_minima

from .conftest import GOLDEN_FILES, assert_golden_passes, make_inputs

# CLS + 3 patches: token 3 is the most redundant (low CLS logit, high mean patch logit); its softmax row peaks on
# token 1 (one target: the 0.998-quantile of [0, 10, 0, 0] is 9.94, one entry above it).
LOGITS = torch.tensor([[0.0, 1, 1, -5], [0, 0, 0, 0], [0, 0, 0, 0], [0, 10, 0, 0]])
HIDDEN = torch.tensor([[1.0, 0], [0, 1], [2, 2], [4, 0]])


def test_redundancy_scores() -> None:
    c = torch.tensor([1.0, 1, -5]) / 27**0.5
    p = torch.tensor([0.0, 0, 1])
    assert torch.allclose(redundancy_scores(LOGITS), 0.35 * c - 0.65 * p)


def test_window_minima() -> None:
    values = torch.tensor([[5.0, 1, 7, 7], [2, 3, 7, 7], [0, 9, 4, 4], [9, 9, 4, 4]]).flatten()
    # windows (0,0): min 1 at (0,1); (0,1): all 7 -> first (0,2); (1,0): 0 at (2,0); (1,1): first 4 at (2,2)
    assert window_minima(values, (4, 4)).tolist() == [1, 2, 8, 10]
    assert window_minima(torch.arange(5.0), (1, 5)).numel() == 0
    assert window_minima(torch.arange(5.0), None).numel() == 0


def test_hand_step_released_order() -> None:
    state = fresh_score_map(3)  # not a square: no window penalty
    step = ficoco_step(HIDDEN, LOGITS, 1, score_map=state)
    assert step.merge.tolist() == [3]
    assert step.order.tolist() == [3, 1, 2, 0]  # ascending score, tie 1 = 2 broken by position, CLS last
    assert step.targets.tolist() == [[1]]
    # released addressing: target token 1 < T - r, so its weight lands on output row 1, which holds token 2
    assert step.rows.tolist() == [1, 2, 0]
    assert torch.allclose(step.hidden, torch.stack([HIDDEN[1], (HIDDEN[2] + HIDDEN[3]) / 2, HIDDEN[0]]))
    assert step.size.tolist() == [1.0, 2.0, 1.0]
    assert torch.equal(state, fresh_score_map(3))  # the input state is not mutated
    assert torch.allclose(step.score_map, redundancy_scores(LOGITS))  # every live slot written


def test_hand_step_paper_order() -> None:
    step = ficoco_step(HIDDEN, LOGITS, 1, row_order="paper", local_penalty="paper")
    assert step.rows.tolist() == [0, 1, 2]
    assert torch.allclose(step.hidden, torch.stack([HIDDEN[0], (HIDDEN[1] + HIDDEN[3]) / 2, HIDDEN[2]]))
    assert step.score_map is None


def test_released_map_retires_window_minima() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(17, 17, generator=g)
    step = ficoco_step(torch.randn(17, 3, generator=g), logits, 4, score_map=fresh_score_map(16))
    retired = torch.isinf(step.score_map).nonzero().flatten()
    assert retired.numel() == 4  # one slot per 2x2 window of the 4x4 map
    raw = redundancy_scores(logits)
    expected = torch.where(raw[retired] > 0, raw[retired] / 2, raw[retired] * 2)
    assert torch.allclose(step.scores[retired], expected)


def test_method_official_schedule() -> None:
    inputs = make_inputs(n=576, d_v=8, seed=1)
    result = FiCoCoV()(inputs, 114)
    # LLaVA-1.5 with the official setting: 11 steps of 42, 577 -> 115 tokens, 114 after dropping row 0
    assert result.info["steps"] == tuple(577 - 42 * i for i in range(12))
    assert result.num_tokens == 114
    kept = result.token_index[result.token_index >= 0]
    assert kept.unique().numel() == kept.numel()


@pytest.mark.parametrize("row_order", ["released", "paper"])
@pytest.mark.parametrize("penalty", ["released", "paper"])
def test_method_modes(row_order: str, penalty: str) -> None:
    inputs = make_inputs(seed=2, zeros=True)
    method = build_method("ficoco-v", row_order=row_order, local_penalty=penalty)
    result = method(inputs, 10)
    assert result.num_tokens == 10 and torch.isfinite(result.tokens).all()
    assert (result.assignment >= -1).all() and (result.assignment < 10).all()
    if row_order == "paper":  # CLS stays in row 0 and is dropped: patches in ascending order
        assert torch.equal(result.token_index, result.token_index.sort().values)
        assert (result.token_index >= 0).all()
    again = method(inputs, 10)
    assert torch.equal(again.tokens, result.tokens)  # no state leaks between images


@pytest.mark.parametrize("name", GOLDEN_FILES["ficoco_v"])
def test_golden(name: str) -> None:
    assert_golden_passes(name)


# ------------------------------------------------------------------------------ many images in one loop

# Images of one N and keep step together (a group may be one image). Batch 8 has groups of 4, 2, 1 and 1.
BATCH_SIZES = {1: (144,), 3: (144, 90, 144), 8: (144, 144, 90, 144, 144, 90, 56, 144)}
BATCH_KEEPS = {1: (20,), 3: (20, 30, 20), 8: (20, 20, 30, 20, 50, 30, 5, 20)}


def _batch_inputs(sizes: tuple[int, ...], dtype: torch.dtype) -> list[MethodInputs]:
    made = [make_inputs(n, d_v=8, seed=i) for i, n in enumerate(sizes)]
    return [
        dataclasses.replace(
            one,
            features=one.features.to(dtype),
            probes={name: one.probes[name].to(dtype) for name in ("hidden_with_cls", "attention_logits")},
        )
        for one in made
    ]


def _assert_same(got: MethodResult, want: MethodResult, what: str) -> None:
    """Bit for bit (on the CPU, in float64 and float32): every tensor of the result and of its info."""
    for name in ("tokens", "token_index", "assignment", "scores"):
        assert torch.equal(getattr(got, name), getattr(want, name)), f"{what}: {name}"
    assert got.info["steps"] == want.info["steps"], what
    assert got.info["dropped_row_token"] == want.info["dropped_row_token"], what
    if want.info["score_map"] is None:
        assert got.info["score_map"] is None, what
    else:
        assert torch.equal(got.info["score_map"], want.info["score_map"]), f"{what}: score_map"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_batch_gives_each_image_what_it_gets_alone(batch: int, dtype: torch.dtype) -> None:
    method = build_method("ficoco-v", r=9)
    inputs, keeps = _batch_inputs(BATCH_SIZES[batch], dtype), list(BATCH_KEEPS[batch])
    for i, (got, one, keep) in enumerate(zip(method.batch(inputs, keeps), inputs, keeps, strict=True)):
        _assert_same(got, method(one, keep), f"image {i}")


@pytest.mark.parametrize("row_order", ["released", "paper"])
@pytest.mark.parametrize("penalty", ["released", "paper"])
def test_batch_modes_give_each_image_what_it_gets_alone(row_order: str, penalty: str) -> None:
    method = build_method("ficoco-v", r=9, row_order=row_order, local_penalty=penalty)
    inputs, keeps = _batch_inputs(BATCH_SIZES[8], torch.float64), list(BATCH_KEEPS[8])
    for i, (got, one, keep) in enumerate(zip(method.batch(inputs, keeps), inputs, keeps, strict=True)):
        _assert_same(got, method(one, keep), f"image {i}")


@pytest.mark.parametrize(
    ("row_order", "token_index", "assignment"),
    [("released", [6, -1, 3], [-1, -1, -1, 2, -1, -1, 0]), ("paper", [4, 5, 6], [-1, -1, -1, -1, 0, 1, 2])],
)
def test_batch_ties_merge_the_lowest_rows_first(row_order: str, token_index: list[int], assignment: list[int]) -> None:
    """Constant logits: every score ties, so each step merges the lowest rows (stable sort), and no logit exceeds
    the 0.998-quantile (k = 0: merged tokens have no target and are dropped), while the random image in the same
    group has k >= 1. 7 patches (no grid, no window penalty), keep 3: steps of 3 and 1. By hand: step 1 merges
    tokens 1-3; step 2 merges row 1, which holds token 5 (released: rows in score order, CLS last) or token 4
    (paper: token order). Released then drops row 0 (token 4) and ends with tokens 7, CLS, 4."""
    flat = make_inputs(7, d_v=4, seed=1)
    flat = dataclasses.replace(flat, probes={**flat.probes, "attention_logits": torch.zeros(8, 8)})
    method = build_method("ficoco-v", row_order=row_order, local_penalty="paper")
    got, other, again = method.batch([flat, make_inputs(7, d_v=4, seed=2), flat], [3, 3, 3])
    assert got.info["steps"] == (8, 5, 4)
    assert got.token_index.tolist() == token_index and got.assignment.tolist() == assignment
    rows = torch.tensor(token_index) + 1  # merged tokens carry no weight: the kept rows are unchanged
    torch.testing.assert_close(got.tokens, flat.probes["hidden_with_cls"][rows], rtol=0, atol=0)
    assert torch.equal(again.tokens, got.tokens)
    _assert_same(other, method(make_inputs(7, d_v=4, seed=2), 3), "the random image")


# ------------------------------------------------------------------------------ budgets of one image share steps

# N = 324 (an 18 x 18 grid), r = 42, by hand: K = 16 steps 325 -> 283 -> 241 -> 199 -> 157 -> 115 -> 73 -> 37 -> 19
# -> 17 (9 steps); K = 40 shares the first 6 (to 73), then 73 -> 41; K = 100 shares the first 5 (to 115), then
# 115 -> 101. Alone: 9 + 7 + 6 = 22 steps; sharing: 9 + 1 + 1 = 11.
PLANNED = (16, 40, 100)
ORDERS = {"ascending": PLANNED, "descending": PLANNED[::-1]}
MODES = {"released": ("released", "released"), "paper": ("paper", "paper")}


def _spoil(result: MethodResult) -> None:
    """Overwrite every tensor a caller gets (a memo that handed one out would then give wrong results)."""
    for value in (result.tokens, result.scores, result.info["score_map"]):
        if value is not None:
            value.fill_(float("nan"))
    result.token_index.fill_(-7)
    result.assignment.fill_(-7)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ORDERS)
def test_budgets_sharing_a_memo_get_what_each_gets_alone(order: str, mode: str, dtype: torch.dtype) -> None:
    """Every budget, in either order and asked twice (the second time from the latest state the memo holds), and
    K = 60 (not planned; it shares the first 6 steps), gives what a call without memo gives, bit for bit; results
    overwritten by the caller leave the memo intact."""
    row_order, penalty = MODES[mode]
    method = build_method("ficoco-v", row_order=row_order, local_penalty=penalty)
    alone = _batch_inputs((324,), dtype)[0]
    shared = dataclasses.replace(alone, memo={}, planned_keeps=PLANNED)
    for keep in (*ORDERS[order], 60, *ORDERS[order]):
        got = method(shared, keep)
        _assert_same(got, method(alone, keep), f"K = {keep}")
        _spoil(got)


@pytest.mark.parametrize("order", ORDERS)
def test_budgets_sharing_a_memo_take_their_common_steps_once(order: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three planned budgets take the smallest one's 9 steps and one own step each for the other two (the T of
    every step by hand, above); the memo keeps only the two states they resume from (after 5 and 6 steps)."""
    seen: list[int] = []
    real = ficoco.ficoco_step

    def counting(hidden: torch.Tensor, *args: object, **kwargs: object) -> ficoco.FiCoCoStep:
        seen.append(hidden.shape[0])
        return real(hidden, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ficoco, "ficoco_step", counting)
    inputs = dataclasses.replace(_batch_inputs((324,), torch.float64)[0], memo={}, planned_keeps=PLANNED)
    for keep in ORDERS[order]:
        FiCoCoV()(inputs, keep)
    chain_16 = [325, 283, 241, 199, 157, 115, 73, 37, 19]
    expected = [*chain_16, 73, 115] if order == "ascending" else [*chain_16[:6], 115, 73, *chain_16[6:]]
    assert seen == expected
    assert sorted(state.hidden.shape[0] for entry in inputs.memo.values() for state in entry.values()) == [73, 115]
    seen.clear()
    FiCoCoV()(_batch_inputs((324,), torch.float64)[0], 40)  # without a memo: every step of its own
    assert seen == [*chain_16[:6], 73]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("order", ORDERS)
def test_batches_sharing_memos_give_each_image_what_it_gets_alone(order: str, dtype: torch.dtype) -> None:
    """Three images (two of N = 324 step together, N = 306 alone), every budget in either order: what each image
    gets alone without memo. Image 2 first runs one budget alone, so its memo holds a state where image 0's does
    not: the two then step apart (another start), and still get their own results."""
    method = build_method("ficoco-v")
    alone = _batch_inputs((324, 306, 324), dtype)
    shared = [dataclasses.replace(one, memo={}, planned_keeps=PLANNED) for one in alone]
    _spoil(method(shared[2], ORDERS[order][0]))
    for keep in ORDERS[order]:
        got = method.batch(shared, [keep] * 3)
        for i, (result, one) in enumerate(zip(got, alone, strict=True)):
            _assert_same(result, method(one, keep), f"K = {keep}, image {i}")
            _spoil(result)


def test_batches_sharing_memos_take_their_common_steps_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of three images (two groups) at three planned budgets takes the Filter steps of the smallest budget
    alone and at most one more per larger budget and group; without memos, far more."""
    seen: list[int] = []
    real = ficoco._batch_filter

    def counting(chain: ficoco._BatchChain, *args: object) -> ficoco._Filtered:
        seen.append(chain.logits.shape[1])
        return real(chain, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ficoco, "_batch_filter", counting)
    method = build_method("ficoco-v")

    def steps(inputs: list[MethodInputs], keeps: tuple[int, ...]) -> int:
        seen.clear()
        for keep in keeps:
            method.batch(inputs, [keep] * len(inputs))
        return len(seen)

    alone = _batch_inputs((324, 306, 324), torch.float64)
    smallest = steps(alone, (16,))
    shared = [dataclasses.replace(one, memo={}, planned_keeps=PLANNED) for one in alone]
    assert steps(shared, PLANNED[::-1]) <= smallest + 2 * 2
    assert steps(alone, PLANNED) >= smallest + 2 * 5  # K = 40 and 100 each take 5 steps or more per group
