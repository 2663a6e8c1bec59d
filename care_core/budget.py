"""The token budget (docs/design/care.md §Budget): K from a retention ratio or given directly, defined here only.

``K = max(1, floor(ratio · N))`` with the ratio read as the decimal the user wrote: ``0.29`` is 29/100 exactly,
so 0.29 of 100 tokens is 29 (binary floating point gives 28.999…, whose floor would be 28). Every command,
method, the FLOP report and the integrations resolve budgets through this module.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Literal

from care_core.errors import BudgetError

Ratio = float | Fraction | Decimal


def exact_ratio(ratio: object) -> Fraction:
    """The ratio as an exact fraction of the decimal it was written as; BudgetError unless it is in (0, 1]."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float, Fraction, Decimal)):
        raise BudgetError(f"must be a number in (0, 1], got {ratio!r}", parameter="ratio")
    if isinstance(ratio, float) and not math.isfinite(ratio):
        raise BudgetError(f"must be in (0, 1], got {ratio}", parameter="ratio")
    # repr(float) is the shortest decimal that reads back as the same float: what the user typed
    exact = Fraction(repr(float(ratio))) if isinstance(ratio, float) else Fraction(ratio)
    if not 0 < exact <= 1:
        raise BudgetError(f"must be in (0, 1], got {ratio}", parameter="ratio")
    return exact


def check_keep(keep: object, num_tokens: int | None = None) -> int:
    """K given directly: an integer >= 1 (and <= N once N is known); BudgetError otherwise."""
    bounds = "at least 1" if num_tokens is None else f"between 1 and N = {num_tokens}"
    if isinstance(keep, bool) or not isinstance(keep, numbers.Integral):
        raise BudgetError(f"must be an integer {bounds}, got {keep!r}", parameter="keep")
    value = int(keep)
    if value < 1 or (num_tokens is not None and value > num_tokens):
        raise BudgetError(f"must be {bounds}, got {keep!r}", parameter="keep")
    return value


def keep_from_ratio(ratio: object, num_tokens: int) -> int:
    """K = max(1, floor(ratio · N)), exact in decimal arithmetic."""
    return max(1, math.floor(exact_ratio(ratio) * num_tokens))


def resolve_budget(num_tokens: int, ratio: Ratio | None = None, keep: int | None = None) -> int:
    """K from exactly one of ``ratio`` (fraction kept) and ``keep`` (tokens kept), for N = ``num_tokens``."""
    if num_tokens < 1:
        raise BudgetError(f"there are no visual tokens to reduce (N = {num_tokens})")
    if (ratio is None) == (keep is None):
        raise BudgetError("give exactly one of {ratio} (fraction kept) and {keep} (number of tokens kept)")
    if ratio is not None:
        return keep_from_ratio(ratio, num_tokens)
    return check_keep(keep, num_tokens)


@dataclass(frozen=True)
class Budget:
    """A token budget: a retention ratio (K = max(1, floor(ratio N)), exact) or an absolute K."""

    kind: Literal["ratio", "keep"]
    value: float

    @classmethod
    def ratio(cls, value: Ratio) -> Budget:
        exact_ratio(value)
        return cls("ratio", float(value))

    @classmethod
    def keep(cls, value: int) -> Budget:
        return cls("keep", check_keep(value))

    @property
    def label(self) -> str:
        return f"ratio {self.value:g}" if self.kind == "ratio" else f"K={int(self.value)}"

    def resolve(self, num_tokens: int) -> int:
        """K for an image of N = ``num_tokens`` visual tokens."""
        if self.kind == "ratio":
            return resolve_budget(num_tokens, ratio=self.value)
        return resolve_budget(num_tokens, keep=int(self.value))

    def resolve_at_most(self, num_tokens: int) -> int:
        """:meth:`resolve`, except that a K above N keeps all N tokens instead of being an error (for estimates made
        on a reference image, not on the user's)."""
        if self.kind == "keep" and int(self.value) > num_tokens:
            return num_tokens
        return self.resolve(num_tokens)


def budgets_from(ratios: Iterable[Ratio] = (), keeps: Iterable[int] = ()) -> list[Budget]:
    """Budgets in the order given (ratios, then keeps), duplicates dropped; at least one."""
    budgets = [Budget.ratio(r) for r in ratios] + [Budget.keep(k) for k in keeps]
    if not budgets:
        raise BudgetError("give at least one budget: a {ratio} or a {keep}")
    return list(dict.fromkeys(budgets))
