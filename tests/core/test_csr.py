"""care_core.csr_score: hand-worked cases, invariants, and agreement with the reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from care_core import csr_score
from care_core.csr import csr_from_reference, csr_reference, csr_tensor_from_reference
from tests.reference.care_reference import reference_csr


def T(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def test_reduced_equal_full_is_one():
    rng = np.random.default_rng(0)
    full = rng.normal(size=(40, 16))
    q = rng.normal(size=(5, 16))
    assert csr_score(T(full), T(full), T(q)) == pytest.approx(1.0, abs=1e-12)
    assert 100 * csr_score(T(full), T(full), T(q)) == pytest.approx(100.0, abs=1e-10)


def test_orthogonal_reduced_is_zero():
    rng = np.random.default_rng(1)
    full = np.zeros((10, 6))
    full[:, :3] = rng.normal(size=(10, 3))
    reduced = np.zeros((4, 6))
    reduced[:, 3:] = rng.normal(size=(4, 3))
    q = rng.normal(size=(3, 6))
    assert csr_score(T(full), T(reduced), T(q)) == pytest.approx(0.0, abs=1e-12)


def test_hand_worked_positive_relevance():
    # full:     v1 = (1, 0), v2 = (0, 2) -> (0, 1), v3 = (3, 4) -> (0.6, 0.8)
    # question: t  = (2, 0) -> (1, 0)
    # r = [max(1,0), max(0,0), max(0.6,0)] = [1, 0, 0.6];  sum r = 1.6
    # w = [1/1.6, 0, 0.6/1.6] = [0.625, 0, 0.375]
    # reduced:  s  = (0, 5) -> (0, 1)
    # c = [max(0,0), max(1,0), max(0.8,0)] = [0, 1, 0.8]
    # CSR = 0.625*0 + 0*1 + 0.375*0.8 = 0.3
    full = T([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]])
    reduced = T([[0.0, 5.0]])
    q = T([[2.0, 0.0]])
    assert csr_score(full, reduced, q) == pytest.approx(0.3, abs=1e-12)
    assert reference_csr(full.numpy(), reduced.numpy(), q.numpy()) == pytest.approx(0.3, abs=1e-12)
    _tensor_csr_is(full, reduced, q, 0.3)


def _tensor_csr_is(full: torch.Tensor, reduced: torch.Tensor, q: torch.Tensor, expected: float) -> None:
    """The tensor form, in float64 and float32: a 0-dim tensor of the reference's dtype with the hand-worked value,
    and exactly the float of the float form."""
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        full, reduced, q = full.to(dtype), reduced.to(dtype), q.to(dtype)
        reference = csr_reference(full, q)
        got = csr_tensor_from_reference(reference, reduced)
        assert got.ndim == 0 and got.dtype == dtype
        assert got.item() == pytest.approx(expected, abs=tolerance)
        assert float(got) == csr_from_reference(reference, reduced) == csr_score(full, reduced, q)


def test_hand_worked_two_reduced_two_question():
    # full: (1,0), (0,1), (0.6,0.8) as above; question t1 = (1,0), t2 = (0,-1)
    # r1 = max(1, 0) = 1; r2 = max(0, [-1]_+ = 0) = 0; r3 = max(0.6, [-0.8]_+) = 0.6
    # w = [0.625, 0, 0.375]
    # reduced: s1 = (0,1), s2 = (1,1)/sqrt2
    # c1 = max(0, 1/sqrt2) = 0.70710678; c2 = max(1, 1/sqrt2) = 1
    # c3 = max(0.8, 1.4/sqrt2 = 0.98994949) = 0.98994949
    # CSR = 0.625*0.70710678 + 0.375*0.98994949 = 0.44194174 + 0.37123106 = 0.81317280
    full = T([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    reduced = T([[0.0, 1.0], [1.0, 1.0]])
    q = T([[1.0, 0.0], [0.0, -1.0]])
    expected = 0.625 / math.sqrt(2) + 0.375 * 1.4 / math.sqrt(2)
    assert expected == pytest.approx(0.8131728, abs=1e-7)
    assert csr_score(full, reduced, q) == pytest.approx(expected, abs=1e-12)
    _tensor_csr_is(full, reduced, q, expected)


def test_no_positive_relevance_uses_uniform_weights():
    # full: v1 = (1,0), v2 = (0,1), v3 = (1,1)/sqrt2; question t = (-1,-1)
    # every v_i . t <= 0  ->  r = [0, 0, 0]  ->  w = [1/3, 1/3, 1/3]
    # reduced: s = (1, 0): c = [1, 0, 1/sqrt2]
    # CSR = (1 + 0 + 0.70710678) / 3 = 0.56903559
    full = T([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    reduced = T([[1.0, 0.0]])
    q = T([[-1.0, -1.0]])
    expected = (1.0 + 0.0 + 1.0 / math.sqrt(2)) / 3.0
    assert expected == pytest.approx(0.56903559, abs=1e-8)
    assert csr_score(full, reduced, q) == pytest.approx(expected, abs=1e-12)
    _tensor_csr_is(full, reduced, q, expected)
    assert csr_reference(full, q).uniform
    assert reference_csr(full.numpy(), reduced.numpy(), q.numpy()) == pytest.approx(expected, abs=1e-12)


def test_invariant_to_order_of_reduced_tokens():
    rng = np.random.default_rng(2)
    full = rng.normal(size=(50, 12))
    reduced = rng.normal(size=(9, 12))
    q = rng.normal(size=(4, 12))
    a = csr_score(T(full), T(reduced), T(q))
    for s in range(3):
        perm = np.random.default_rng(s).permutation(9)
        assert csr_score(T(full), T(reduced[perm]), T(q)) == pytest.approx(a, abs=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_matches_reference_random(seed):
    rng = np.random.default_rng(100 + seed)
    N = int(rng.integers(1, 120))
    K = int(rng.integers(1, N + 1))
    d = int(rng.integers(2, 48))
    Tq = int(rng.integers(1, 10))
    full = rng.normal(size=(N, d)) + rng.normal(size=d)  # shared offset: mostly positive cosines
    reduced = full[rng.choice(N, size=K, replace=False)] + 0.3 * rng.normal(size=(K, d))
    q = rng.normal(size=(Tq, d))
    if seed % 4 == 3:  # include zero rows in every input
        full[0] = 0.0
        reduced[0] = 0.0
        q[0] = 0.0
    got = csr_score(T(full), T(reduced), T(q))
    ref = reference_csr(full, reduced, q)
    assert isinstance(got, float)
    assert 0.0 <= got <= 1.0
    assert got == pytest.approx(ref, abs=1e-9)


def test_float32_inputs():
    rng = np.random.default_rng(3)
    full = rng.normal(size=(30, 8))
    reduced = full[:7]
    q = rng.normal(size=(3, 8))
    got = csr_score(T(full).float(), T(reduced).float(), T(q).float())
    assert got == pytest.approx(reference_csr(full, reduced, q), abs=1e-5)
