"""The one budget rule (docs/design/care.md §Budget): K = max(1, floor(ratio · N)) in exact decimal arithmetic."""

from __future__ import annotations

from fractions import Fraction

import pytest

from care_core.budget import Budget, budgets_from, check_keep, keep_from_ratio, resolve_budget
from care_core.errors import BudgetError

# (ratio as typed, N, K by hand): 0.29 · 100 is 28.999… in binary floating point, 29 in the decimal typed
HAND_COMPUTED = [(0.29, 100, 29), (0.11, 576, 63), (0.056, 2880, 161), (0.1112, 576, 64), (0.111, 576, 63),
                 (1.0, 7, 7), (0.001, 10, 1), (0.5, 3, 1), (0.7, 10, 7), (0.57, 100, 57)]  # fmt: skip


@pytest.mark.parametrize(("ratio", "n", "k"), HAND_COMPUTED)
def test_ratio_budgets_follow_the_decimal_the_user_typed(ratio: float, n: int, k: int) -> None:
    assert keep_from_ratio(ratio, n) == k
    assert resolve_budget(n, ratio=ratio) == k
    assert Budget.ratio(ratio).resolve(n) == k


def test_exact_inputs_are_taken_as_they_are() -> None:
    assert keep_from_ratio(Fraction(1, 3), 9) == 3
    assert keep_from_ratio(1, 5) == 5


@pytest.mark.parametrize("ratio", [0, -0.1, 1.0001, float("nan"), float("inf"), True, "0.5", None])
def test_a_ratio_outside_zero_one_names_the_ratio(ratio: object) -> None:
    with pytest.raises(BudgetError) as info:
        keep_from_ratio(ratio, 10)
    assert info.value.parameter == "ratio" and str(info.value).startswith("ratio ")


@pytest.mark.parametrize("keep", [0, 11, -3, 2.0, True, "4"])
def test_a_keep_outside_one_to_n_names_keep_and_n(keep: object) -> None:
    with pytest.raises(BudgetError) as info:
        check_keep(keep, 10)
    assert info.value.parameter == "keep" and "N = 10" in str(info.value)


def test_exactly_one_of_ratio_and_keep() -> None:
    with pytest.raises(BudgetError) as info:
        resolve_budget(10, ratio=0.5, keep=3)
    assert info.value.parameters == ["ratio", "keep"]
    with pytest.raises(BudgetError):
        resolve_budget(10)
    with pytest.raises(BudgetError, match="no visual tokens"):
        resolve_budget(0, keep=1)


def test_budgets_keep_their_order_without_duplicates() -> None:
    assert budgets_from([0.11, 0.11], [128, 64, 128]) == [Budget.ratio(0.11), Budget.keep(128), Budget.keep(64)]
    with pytest.raises(BudgetError):
        budgets_from([], [])


def test_resolving_at_most_n_keeps_all_tokens_where_k_exceeds_n() -> None:
    assert Budget.keep(160).resolve_at_most(2880) == 160
    assert Budget.keep(3000).resolve_at_most(2880) == 2880  # resolve() refuses it: K > N
    assert Budget.ratio(0.11).resolve_at_most(576) == 63  # as resolve(): floor(0.11 · 576)
    with pytest.raises(BudgetError):
        Budget.keep(3000).resolve(2880)
