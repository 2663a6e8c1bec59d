"""The statistics behind the accuracy tables, against values computed by hand (arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest

from care_core.errors import CareError
from care_core.statistics import (
    average_ranks,
    mcnemar_exact,
    normal_cdf,
    normal_quantile,
    spearman,
    two_sided_z,
    wilson_interval,
)


def test_normal_quantile_matches_the_tabulated_values() -> None:
    # Standard normal tables: Phi(1.959964) = 0.975, Phi(0) = 0.5, Phi(-2.326348) = 0.01, Phi(1.644854) = 0.95.
    assert normal_quantile(0.975) == pytest.approx(1.959964, abs=1e-6)
    assert normal_quantile(0.5) == pytest.approx(0.0, abs=1e-12)
    assert normal_quantile(0.01) == pytest.approx(-2.326348, abs=1e-6)
    assert two_sided_z(0.90) == pytest.approx(1.644854, abs=1e-6)


def test_normal_quantile_inverts_the_cdf_and_is_symmetric() -> None:
    for p in (1e-12, 0.001, 0.2, 0.5, 0.8, 0.999):
        assert normal_cdf(normal_quantile(p)) == pytest.approx(p, rel=1e-9)
    for p in (0.001, 0.2, 0.5):  # 1 - p is exact enough in floats
        assert normal_quantile(1 - p) == pytest.approx(-normal_quantile(p), abs=1e-9)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5])
def test_normal_quantile_refuses_probabilities_outside_0_1(bad: float) -> None:
    with pytest.raises(CareError, match="probability must be strictly between 0 and 1"):
        normal_quantile(bad)


def test_wilson_interval_for_86_of_100() -> None:
    # z = 1.959964, z^2 = 3.841459, z^2/n = 0.03841459, 1 + z^2/n = 1.03841459
    # centre = (0.86 + z^2/2n) / 1.03841459 = (0.86 + 0.01920729) / 1.03841459 = 0.87920729 / 1.03841459 = 0.846682
    # half = z / 1.03841459 * sqrt(0.86 * 0.14 / 100 + z^2 / (4 * 100^2))
    #      = z / 1.03841459 * sqrt(0.001204 + 0.0000960365) = 1.959964 * 0.0360560 / 1.03841459 = 0.068054
    # low = 0.846682 - 0.068054 = 0.778628; high = 0.846682 + 0.068054 = 0.914736
    interval = wilson_interval(86, 100)
    assert interval.estimate == 0.86
    assert interval.low == pytest.approx(0.778628, abs=2e-6)
    assert interval.high == pytest.approx(0.914736, abs=2e-6)


def test_wilson_interval_for_none_of_10_starts_at_0() -> None:
    # p = 0: centre = (z^2/2n) / (1 + z^2/n) and half = z/(1 + z^2/n) * sqrt(z^2/4n^2) = (z^2/2n) / (1 + z^2/n),
    # so low = 0 and high = (z^2/n) / (1 + z^2/n) = 0.3841459 / 1.3841459 = 0.277534
    interval = wilson_interval(0, 10)
    assert interval.low == 0.0
    assert interval.high == pytest.approx(0.277534, abs=2e-6)


def test_wilson_interval_holds_its_estimate_and_widens_with_confidence() -> None:
    for successes, trials in ((0, 1), (1, 1), (3, 7), (250, 500), (499, 500)):
        narrow, wide = wilson_interval(successes, trials, 0.8), wilson_interval(successes, trials, 0.99)
        assert 0.0 <= wide.low <= narrow.low <= narrow.estimate <= narrow.high <= wide.high <= 1.0
        mirrored = wilson_interval(trials - successes, trials)  # counting failures mirrors the interval
        assert mirrored.low == pytest.approx(1 - wilson_interval(successes, trials).high, abs=1e-12)


@pytest.mark.parametrize(
    ("successes", "trials", "confidence", "message"),
    [(1, 0, 0.95, "trials must be at least 1"), (11, 10, 0.95, "successes must be between 0 and trials"),
     (-1, 10, 0.95, "successes must be between"), (5, 10, 1.0, "confidence must be strictly between")],
)  # fmt: skip
def test_wilson_interval_refuses_impossible_input(successes: int, trials: int, confidence: float, message: str) -> None:
    with pytest.raises(CareError, match=message):
        wilson_interval(successes, trials, confidence)


def test_mcnemar_one_against_six_discordant() -> None:
    # A right and B wrong on 1 question, the reverse on 6, both right on 2 and both wrong on 1 (10 questions):
    # n = 7 discordant, P(X <= 1) = (C(7,0) + C(7,1)) / 2^7 = (1 + 7) / 128, p = 2 * 8 / 128 = 0.125
    a = [1, 0, 0, 0, 0, 0, 0, 1, 1, 0]
    b = [0, 1, 1, 1, 1, 1, 1, 1, 1, 0]
    test = mcnemar_exact(a, b)
    assert (test.only_a, test.only_b, test.questions) == (1, 6, 10)
    assert test.p_value == 0.125


def test_mcnemar_all_discordant_one_way() -> None:
    # b = 0, c = 5: p = 2 * C(5,0) / 2^5 = 2 / 32 = 0.0625 (five one-way wins are not enough at 0.05)
    test = mcnemar_exact([False] * 5, [True] * 5)
    assert test.p_value == 0.0625


def test_mcnemar_caps_the_p_value_at_1() -> None:
    # b = c = 3: P(X <= 3) = (1 + 6 + 15 + 20) / 64 = 42/64, and 2 * 42/64 = 84/64 > 1, so p = 1
    test = mcnemar_exact([1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1])
    assert (test.only_a, test.only_b, test.p_value) == (3, 3, 1.0)


def test_mcnemar_without_discordant_questions_is_1() -> None:
    assert mcnemar_exact([1, 0, 1], [1, 0, 1]).p_value == 1.0
    assert mcnemar_exact([], []).p_value == 1.0


def test_mcnemar_is_symmetric_in_its_two_methods() -> None:
    a = [1, 1, 0, 1, 0, 1, 1, 1, 0, 1, 1, 1]
    b = [0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0]
    forward, backward = mcnemar_exact(a, b), mcnemar_exact(b, a)
    assert (forward.only_a, forward.only_b) == (backward.only_b, backward.only_a)
    assert forward.p_value == backward.p_value


def test_mcnemar_refuses_unequal_lengths_and_non_binary_answers() -> None:
    with pytest.raises(CareError, match=r"b_correct has 2 answers but a_correct has 3"):
        mcnemar_exact([1, 0, 1], [1, 0])
    with pytest.raises(CareError, match=r"a_correct must hold 0/1"):
        mcnemar_exact([1, 2], [1, 0])


def test_average_ranks_share_ties() -> None:
    # sorted: 1 (rank 1), 2 and 2 (ranks 2 and 3 -> 2.5 each), 3 (4), 5 (5)
    assert average_ranks([3, 2, 5, 2, 1]) == [4.0, 2.5, 5.0, 2.5, 1.0]


def test_spearman_with_ties_by_hand() -> None:
    # x = [1, 2, 2, 3, 4] -> ranks [1, 2.5, 2.5, 4, 5]; y = [1, 3, 2, 5, 4] -> ranks [1, 3, 2, 5, 4]; both mean 3
    # deviations dx = [-2, -0.5, -0.5, 1, 2], dy = [-2, 0, -1, 2, 1]
    # sum dx*dy = 4 + 0 + 0.5 + 2 + 2 = 8.5; sum dx^2 = 9.5; sum dy^2 = 10
    # rho = 8.5 / sqrt(9.5 * 10) = 8.5 / 9.746794 = 0.872082
    # interval: atanh(0.872082) = ln(1.872082 / 0.127918) / 2 = ln(14.63497) / 2 = 1.341707
    # se = sqrt(1.06 / (5 - 3)) = 0.728011; z * se = 1.959964 * 0.728011 = 1.426875
    # low = tanh(1.341707 - 1.426875) = tanh(-0.085168) = -0.084963; high = tanh(2.768582) = 0.992156
    result = spearman([1, 2, 2, 3, 4], [1, 3, 2, 5, 4])
    assert result.n == 5 and result.reason is None
    assert result.rho == pytest.approx(0.872082, abs=1e-6)
    assert result.low == pytest.approx(-0.084963, abs=1e-5)
    assert result.high == pytest.approx(0.992156, abs=1e-6)


def test_spearman_depends_on_order_only() -> None:
    x = [0.3, 1.2, 0.9, 4.0, 2.2, 2.2, 7.5]
    y = [10.0, 12.0, 9.0, 15.0, 14.0, 11.0, 13.0]
    base = spearman(x, y)
    assert spearman([math.exp(v) for v in x], [v**3 for v in y]).rho == pytest.approx(base.rho, abs=1e-12)
    assert spearman(y, x).rho == pytest.approx(base.rho, abs=1e-12)
    assert spearman(x, [-v for v in y]).rho == pytest.approx(-base.rho, abs=1e-12)
    assert base.low < base.rho < base.high


def test_spearman_perfect_order_gives_a_degenerate_interval() -> None:
    result = spearman([1, 2, 3, 4, 5], [2, 4, 8, 16, 32])
    assert (result.rho, result.low, result.high) == (1.0, 1.0, 1.0)


def test_spearman_undefined_cases_say_why() -> None:
    short = spearman([1, 2, 3], [3, 2, 1])
    assert math.isnan(short.rho) and math.isnan(short.low) and short.reason == "needs at least 4 pairs, got 3"
    flat = spearman([1, 2, 3, 4], [5, 5, 5, 5])
    assert math.isnan(flat.rho) and flat.reason == "y is constant"
    with pytest.raises(CareError, match="y has 2 values but x has 3"):
        spearman([1, 2, 3], [1, 2])
