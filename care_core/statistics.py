"""Small-sample statistics for accuracy tables: Wilson intervals, McNemar's exact test, Spearman's rho.

Pure functions on plain numbers (no numpy, no scipy): what a results table needs so that a reader can tell a
real difference from noise. The choices are recorded in ``docs/design/measures.md`` §Statistics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from .errors import CareError

FIELLER_VARIANCE = 1.06  # var(atanh(rho_s)) ~ 1.06 / (n - 3): Fieller, Hartley & Pearson (1957)


@dataclass(frozen=True)
class Interval:
    """A proportion with its confidence interval (all three in [0, 1])."""

    estimate: float
    low: float
    high: float
    confidence: float


@dataclass(frozen=True)
class PairedTest:
    """McNemar's exact test of two methods answered on the same questions.

    ``only_a``: questions A got right and B wrong; ``only_b``: the reverse (the discordant pairs, b and c in
    McNemar's notation); ``p_value``: two-sided exact binomial p-value of ``only_a`` vs ``only_b``.
    """

    only_a: int
    only_b: int
    questions: int
    p_value: float


@dataclass(frozen=True)
class Correlation:
    """Spearman's rho over ``n`` pairs with its confidence interval; NaN everywhere and ``reason`` set when
    rho is undefined (fewer than 4 pairs, or a constant input)."""

    rho: float
    low: float
    high: float
    n: int
    confidence: float
    reason: str | None = None


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise CareError(f"must be strictly between 0 and 1, got {confidence}", parameter="confidence")


def normal_cdf(x: float) -> float:
    """P(Z <= x) for a standard normal Z (``erfc`` keeps the lower tail accurate)."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def normal_quantile(probability: float) -> float:
    """The x with P(Z <= x) = ``probability``, by bisection on :func:`normal_cdf` to float resolution.

    Bisection is slow next to a rational approximation (e.g. Acklam's) but needs no constants to get right;
    a table computes a handful of quantiles.
    """
    if not 0.0 < probability < 1.0:
        raise CareError(f"must be strictly between 0 and 1, got {probability}", parameter="probability")
    low, high = -40.0, 40.0  # normal_cdf(-40) underflows to 0 and normal_cdf(40) is 1: the root lies inside
    while True:
        middle = (low + high) / 2
        if middle in (low, high):  # no float left between them
            return middle
        if normal_cdf(middle) < probability:
            low = middle
        else:
            high = middle


def two_sided_z(confidence: float) -> float:
    """The z with P(-z <= Z <= z) = ``confidence`` (1.959964 for 0.95)."""
    _check_confidence(confidence)
    return normal_quantile(1.0 - (1.0 - confidence) / 2)


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> Interval:
    """Wilson's score interval for ``successes`` out of ``trials`` (Wilson 1927).

    With p = successes / trials and z = :func:`two_sided_z`: centre (p + z²/2n) / (1 + z²/n), half-width
    z / (1 + z²/n) · sqrt(p(1 - p)/n + z²/4n²). Unlike p ± z·sqrt(p(1 - p)/n) it stays inside [0, 1] and keeps
    its coverage near 0 and 1.
    """
    if trials < 1:
        raise CareError(f"must be at least 1, got {trials}", parameter="trials")
    if not 0 <= successes <= trials:
        raise CareError(f"must be between 0 and {{trials}} ({trials}), got {successes}", parameter="successes")
    z = two_sided_z(confidence)
    n, p = float(trials), successes / trials
    shrink = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / shrink
    half = z / shrink * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return Interval(estimate=p, low=max(0.0, centre - half), high=min(1.0, centre + half), confidence=confidence)


def _as_outcomes(values: Sequence[bool | int], parameter: str) -> list[bool]:
    for i, value in enumerate(values):
        if value not in (0, 1):  # True/False compare equal to 1/0
            raise CareError(f"must hold 0/1 (or booleans) per question, got {value!r} at {i}", parameter=parameter)
    return [bool(v) for v in values]


def mcnemar_exact(a_correct: Sequence[bool | int], b_correct: Sequence[bool | int]) -> PairedTest:
    """McNemar's exact test: did A and B answer the same questions equally well?

    ``a_correct[i]``, ``b_correct[i]``: whether A and B got question i right. Only the discordant questions
    count: under the null hypothesis each of the n = only_a + only_b goes either way with probability 1/2, so
    p = min(1, 2 · P(X <= min(only_a, only_b))) with X ~ Binomial(n, 1/2); p = 1 when n = 0. Exact rational
    arithmetic, so the p-value has no rounding error before the final float.
    """
    a = _as_outcomes(a_correct, "a_correct")
    b = _as_outcomes(b_correct, "b_correct")
    if len(a) != len(b):
        raise CareError(f"has {len(b)} answers but {{a_correct}} has {len(a)}", parameter="b_correct")
    only_a = sum(1 for x, y in zip(a, b, strict=True) if x and not y)
    only_b = sum(1 for x, y in zip(a, b, strict=True) if y and not x)
    n = only_a + only_b
    tail = Fraction(sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1)), 2**n)
    return PairedTest(only_a=only_a, only_b=only_b, questions=len(a), p_value=float(min(Fraction(1), 2 * tail)))


def average_ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values``; tied values share the mean of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def _pearson(x: Sequence[float], y: Sequence[float]) -> float:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    r = cov / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))
    return math.copysign(1.0, r) if abs(r) > 1.0 - 1e-12 else r  # identical orders: exactly +-1, not 1 - 2e-16


def spearman(x: Sequence[float], y: Sequence[float], confidence: float = 0.95) -> Correlation:
    """Spearman's rho (Pearson's r of the average ranks) with a Fisher-z interval.

    Interval: tanh(atanh(rho) ± z · sqrt(1.06 / (n - 3))), the variance of Fieller, Hartley & Pearson (1957,
    Biometrika 44) for Spearman's rho; defined for n >= 4. A perfect |rho| = 1 gives the degenerate interval
    [rho, rho] (atanh has no finite value there). Fewer than 4 pairs or a constant input: NaN with ``reason``.
    """
    if len(x) != len(y):
        raise CareError(f"has {len(y)} values but {{x}} has {len(x)}", parameter="y")
    z = two_sided_z(confidence)
    n = len(x)
    nan = math.nan
    if n < 4:
        return Correlation(nan, nan, nan, n, confidence, reason=f"needs at least 4 pairs, got {n}")
    rx, ry = average_ranks(x), average_ranks(y)
    if len(set(rx)) == 1 or len(set(ry)) == 1:
        which = "x" if len(set(rx)) == 1 else "y"
        return Correlation(nan, nan, nan, n, confidence, reason=f"{which} is constant")
    rho = _pearson(rx, ry)
    if abs(rho) == 1.0:
        return Correlation(rho, rho, rho, n, confidence)
    centre, half = math.atanh(rho), z * math.sqrt(FIELLER_VARIANCE / (n - 3))
    return Correlation(rho, math.tanh(centre - half), math.tanh(centre + half), n, confidence)
