"""Hand-worked checks of the reference itself (no care_core involved)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.reference import care_reference as ref


def test_gelu_exact_values():
    # GELU(1) = 0.5 * (1 + erf(1/sqrt2)) = Phi(1) = 0.8413447460685429
    assert ref.gelu(np.array([1.0]))[0] == pytest.approx(0.8413447460685429, abs=1e-15)
    assert ref.gelu(np.array([0.0]))[0] == 0.0
    z = np.linspace(-3, 3, 13)
    num = (ref.gelu(z + 1e-6) - ref.gelu(z - 1e-6)) / 2e-6
    np.testing.assert_allclose(ref.gelu_prime(z), num, atol=1e-8)


def test_cos_convention_zero_vector():
    assert ref.cos(np.zeros(3), np.array([1.0, 2.0, 3.0]), 1e-8) == 0.0
    assert ref.cos(np.array([1.0, 0.0]), np.array([2.0, 0.0]), 1e-8) == pytest.approx(1.0)


def test_robust_scores_hand():
    # one direction, C = [1, 2, 3, 10]: median = 2.5, |C - 2.5| = [1.5, .5, .5, 7.5], MAD = 1.0
    # Z = [-1.5, -0.5, 0.5, 7.5]; sigma = 0 (one direction); psi = Z
    # psi_bar = (Z + 1.5) / (9 + eps) = [0, 1/9, 2/9, 1]
    _, psi, pb = ref.robust_scores(np.array([[1.0, 2.0, 3.0, 10.0]]), 0.5, 1e-8)
    np.testing.assert_allclose(psi, [-1.5, -0.5, 0.5, 7.5], atol=1e-7)
    np.testing.assert_allclose(pb, [0, 1 / 9, 2 / 9, 1], atol=1e-8)
    # two directions: token stats mu = mean, sigma = population std
    C = np.array([[0.0, 1.0, 2.0], [0.0, 3.0, 2.0]])
    # dir 1: med 1, MAD 1, Z = [-1, 0, 1]; dir 2: med 2, MAD 1, Z = [-2, 1, 0]
    # mu = [-1.5, .5, .5]; sigma = [.5, .5, .5]; psi = mu - .5 sigma = [-1.75, .25, .25]
    _, psi, pb = ref.robust_scores(C, 0.5, 1e-8)
    np.testing.assert_allclose(psi, [-1.75, 0.25, 0.25], atol=1e-7)
    np.testing.assert_allclose(pb, [0, 1, 1], atol=1e-8)


def test_greedy_hand():
    # psi_bar = [1, .5, .9]; V = (1,0), (0,1), (1,.1)
    # step 1: argmax psi_bar = 0
    # step 2: token 1: .5 * (1 - 0) = .5; token 2: .9 * (1 - 1/sqrt(1.01)) = .00447 -> 1
    V = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1]])
    order, _ = ref.greedy_anchors(V, np.array([1.0, 0.5, 0.9]), 3, 1e-8)
    assert order == [0, 1, 2]
    # ties go to the lowest index
    order, _ = ref.greedy_anchors(np.eye(3), np.array([1.0, 1.0, 1.0]), 2, 1e-8)
    assert order == [0, 1]


def test_calibrate_hand_k1():
    # N = 2, K = 1, anchor 0 = (1,0), residual 1 = (1,1), same position.
    # A = cos + eta * exp(0) = 1/sqrt2 + .45 = 1.15710678; k_f = min(1, 2) = 1 -> c_ent = 1
    # c = c_sim = sigmoid((1.15710678 - .4) / .1) = sigmoid(7.5710678) = 0.99948506 >= .9
    # w = (psi_bar_1 + eps) c ; q = 1 ; g = w (1,1) / (w + eps)
    # v' = (1,0) + .15 g ; v_hat = 1 / (||v'|| + eps) v'
    cfg = dict(ref.DEFAULTS)
    V = np.array([[1.0, 0.0], [1.0, 1.0]])
    P = np.array([[0.5, 0.5], [0.5, 0.5]])
    psi_bar = np.array([1.0, 0.25])
    tokens, signals, diag = ref.calibrate(V, P, [0], psi_bar, cfg)
    assert signals == [1]
    assert diag["c"][1] == pytest.approx(1 / (1 + math.exp(-7.5710678118654755)), abs=1e-12)
    w = (0.25 + 1e-8) * diag["c"][1]
    g = w * np.array([1.0, 1.0]) / (w + 1e-8)
    vp = np.array([1.0, 0.0]) + 0.15 * g
    np.testing.assert_allclose(tokens[0], vp / (np.linalg.norm(vp) + 1e-8), atol=1e-14)
    np.testing.assert_allclose(tokens[0], [0.99160, 0.12934], atol=1e-5)


def test_calibrate_entropy_gate():
    # K = 2 anchors equidistant from the residual: pi = (1/2, 1/2), c_ent = 1 - log2/log2 = 0,
    # c = c_sim / 2 < .9 -> rejected.
    cfg = dict(ref.DEFAULTS)
    V = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    P = np.array([[0.0, 0.5], [1.0, 0.5], [0.5, 0.5]])
    tokens, signals, diag = ref.calibrate(V, P, [0, 1], np.array([1.0, 1.0, 0.5]), cfg)
    assert signals == []
    assert diag["c"][2] < 0.5 + 1e-12
    # R non-empty, R+ empty: g = 0, Eq. 9 applied literally: v_hat = ||v|| / (||v|| + eps) v
    np.testing.assert_allclose(tokens, V[:2] / (1 + 1e-8), atol=1e-15)


def test_budget_reference():
    assert ref.budget(576, ratio=0.11) == 63
    assert ref.budget(10, ratio=0.01) == 1
    for bad in (
        {"ratio": 0},
        {"ratio": 2},
        {"ratio": float("nan")},
        {},
        {"ratio": 0.5, "keep": 1},
        {"keep": 11},
    ):
        with pytest.raises(ValueError):
            ref.budget(10, **bad)
