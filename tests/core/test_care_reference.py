"""care_core.care_reduce against the independent numpy reference (tests/reference).

Only the public API is used: CaReConfig, care_reduce and the fields of its result.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn

from care_core import CaReConfig, care_reduce
from care_core.errors import CareError
from tests.core._problems import (
    make_problem,
    random_directions,
    recipe_directions,
    to_np,
)
from tests.reference.care_reference import budget, reference_care

TOL = 1e-9


def cfg_of(**kw) -> CaReConfig:
    return dataclasses.replace(CaReConfig(), **kw)


def run_core(prob, K, cfg, U=None, dtype=torch.float64, projector=None):
    dirs = None if U is None else torch.as_tensor(U, dtype=torch.float64).to(dtype)
    return care_reduce(
        prob.features(dtype),
        projector if projector is not None else prob.projector(dtype),
        prob.positions(dtype),
        keep=K,
        config=cfg,
        directions=dirs,
    )


def run_ref(prob, K, U=None, **cfg):
    return reference_care(prob.V, *prob.weights(), prob.P, K, U, cfg)


def check_structure(red, N, K):
    idx, order = to_np(red.indices), to_np(red.anchor_order)
    assert red.indices.dtype == torch.long and red.anchor_order.dtype == torch.long
    assert red.signals.dtype == torch.long
    assert idx.shape == (K,) and order.shape == (K,)
    assert red.tokens.shape[0] == K
    assert red.psi_bar.shape == (N,)
    assert np.all(np.diff(idx) > 0), "indices must be strictly ascending"
    assert sorted(order.tolist()) == idx.tolist(), "anchor_order must be a permutation of indices"
    assert idx.min() >= 0 and idx.max() < N
    sig = to_np(red.signals)
    assert np.all(np.diff(sig) > 0), "signals must be strictly ascending"
    assert not set(sig.tolist()) & set(idx.tolist()), "a signal cannot be an anchor"
    assert torch.isfinite(red.tokens).all(), "tokens contain NaN/inf"
    assert torch.isfinite(red.psi_bar).all(), "psi_bar contains NaN/inf"
    pb = to_np(red.psi_bar)
    assert pb.min() >= -1e-12 and pb.max() <= 1 + 1e-12


def assert_matches_reference(red, ref, scale, tol=TOL):
    np.testing.assert_array_equal(to_np(red.anchor_order), ref["anchor_order"], err_msg="selection order")
    np.testing.assert_array_equal(to_np(red.indices), ref["indices"], err_msg="indices")
    np.testing.assert_array_equal(to_np(red.signals), ref["signals"], err_msg="signals (R+)")
    np.testing.assert_allclose(to_np(red.psi_bar), ref["psi_bar"], rtol=0, atol=tol, err_msg="psi_bar")
    np.testing.assert_allclose(to_np(red.tokens), ref["tokens"], rtol=tol, atol=tol * max(1.0, scale), err_msg="tokens")


# (N, K, d_v, clustered, m, seed)
EXACT_CASES = [
    (1, 1, 4, False, 64, 0),
    (2, 1, 4, False, 64, 1),
    (2, 2, 8, True, 64, 2),
    (3, 1, 4, True, 64, 3),
    (3, 2, 6, False, 64, 4),
    (3, 3, 5, True, 64, 5),
    (17, 1, 8, True, 64, 6),
    (17, 5, 8, True, 64, 7),
    (17, 9, 12, True, 64, 8),
    (17, 16, 16, False, 64, 9),
    (17, 17, 8, False, 64, 10),
    (100, 1, 32, False, 16, 11),
    (100, 11, 32, True, 64, 12),
    (100, 23, 24, False, 64, 13),
    (100, 50, 16, True, 16, 14),
    (100, 99, 64, False, 16, 15),
    (100, 100, 8, True, 16, 16),
    (600, 1, 16, False, 16, 17),
    (600, 66, 32, True, 16, 18),
    (600, 300, 4, True, 16, 19),
    (600, 300, 64, False, 16, 20),
    (600, 599, 8, True, 16, 21),
    (600, 600, 4, True, 16, 22),
]


@pytest.mark.parametrize(("N", "K", "d_v", "clustered", "m", "seed"), EXACT_CASES)
def test_fd_float64_equals_reference(N, K, d_v, clustered, m, seed):
    prob = make_problem(seed, N, d_v, clustered)
    U = random_directions(seed, m, d_v)
    ref = run_ref(prob, K, U, m=m, engine="fd")
    # The inputs must not be near-ties, otherwise "identical anchors / signals" is ill-posed.
    assert ref["margin"] > 1e-10, "test input is a near-tie in the greedy; pick another seed"
    assert ref["gate_margin"] > 1e-10, "test input is a near-tie at the gate; pick another seed"

    red = run_core(prob, K, cfg_of(engine="fd", m=m), U)
    check_structure(red, N, K)
    assert red.tokens.dtype == torch.float64
    assert_matches_reference(red, ref, scale=float(np.abs(prob.V).max()))


def test_exact_cases_exercise_calibration():
    """Guard that the case list really exercises the gate: several cases must have both
    accepted and rejected residual tokens in the reference."""
    with_signals = with_rejects = 0
    for N, K, d_v, clustered, m, seed in EXACT_CASES:
        if N > 100 or K == N:
            continue
        prob = make_problem(seed, N, d_v, clustered)
        ref = run_ref(prob, K, random_directions(seed, m, d_v), m=m, engine="fd")
        n_sig = len(ref["signals"])
        with_signals += n_sig > 0
        with_rejects += n_sig < N - K
    assert with_signals >= 3 and with_rejects >= 3


def test_fd_default_config_m64_clustered_large():
    """Default m = 64 and default directions (seed 42) on a 576-token clustered input."""
    prob = make_problem(123, 576, 16, True)
    cfg = cfg_of(engine="fd")
    assert cfg.m == 64 and cfg.seed == 42
    red = care_reduce(prob.features(), prob.projector(), prob.positions(), ratio=0.11, config=cfg)
    ref = run_ref(prob, 63, None, engine="fd")
    assert ref["margin"] > 1e-10 and ref["gate_margin"] > 1e-10
    check_structure(red, 576, 63)
    assert len(ref["signals"]) > 0
    assert_matches_reference(red, ref, scale=float(np.abs(prob.V).max()))


# ----------------------------------------------------------------------------- jvp vs fd
def _separated_problem(N, K, d_v, clustered, m, min_margin, start_seed):
    """First seed (deterministic) whose reference greedy/gate margins exceed min_margin."""
    for seed in range(start_seed, start_seed + 50):
        prob = make_problem(seed, N, d_v, clustered)
        U = random_directions(seed, m, d_v)
        ref = run_ref(prob, K, U, m=m, engine="fd")
        if ref["margin"] > min_margin and ref["gate_margin"] > min_margin:
            return prob, U, ref
    raise AssertionError("no well-separated input found")


@pytest.mark.parametrize(
    ("N", "K", "d_v", "clustered", "m", "seed"),
    [(40, 8, 16, True, 64, 100), (64, 16, 16, False, 64, 200), (150, 30, 32, True, 32, 300)],
)
def test_jvp_agrees_with_fd(N, K, d_v, clustered, m, seed):
    # fd and jvp differ by O(h^2) ~ 1e-8 on psi_bar; a 1e-5 margin is "well separated".
    prob, U, ref_fd = _separated_problem(N, K, d_v, clustered, m, 1e-5, seed)
    red_fd = run_core(prob, K, cfg_of(engine="fd", m=m), U)
    red_jvp = run_core(prob, K, cfg_of(engine="jvp", m=m), U)
    check_structure(red_jvp, N, K)
    np.testing.assert_allclose(to_np(red_jvp.psi_bar), to_np(red_fd.psi_bar), rtol=0, atol=1e-4)
    np.testing.assert_allclose(to_np(red_jvp.psi_bar), ref_fd["psi_bar"], rtol=0, atol=1e-4)
    ref_jvp = run_ref(prob, K, U, m=m, engine="jvp")
    np.testing.assert_allclose(to_np(red_jvp.psi_bar), ref_jvp["psi_bar"], rtol=0, atol=1e-4)
    np.testing.assert_array_equal(to_np(red_jvp.anchor_order), to_np(red_fd.anchor_order))
    np.testing.assert_array_equal(to_np(red_jvp.signals), to_np(red_fd.signals))
    np.testing.assert_allclose(to_np(red_jvp.tokens), to_np(red_fd.tokens), rtol=1e-4, atol=1e-4)


def test_reference_jvp_matches_reference_fd():
    """Self-check of the reference: its two engines agree (h^2 error only)."""
    prob = make_problem(5, 50, 12, True)
    U = random_directions(5, 32, 12)
    a = run_ref(prob, 10, U, m=32, engine="fd")
    b = run_ref(prob, 10, U, m=32, engine="jvp")
    np.testing.assert_allclose(a["C"], b["C"], rtol=1e-6)
    np.testing.assert_allclose(a["psi_bar"], b["psi_bar"], atol=1e-5)


# ----------------------------------------------------------------------------- degenerate inputs
ENGINES = ["fd", "jvp"]


@pytest.mark.parametrize("engine", ENGINES)
def test_keep_all_returns_tokens_unchanged(engine):
    prob = make_problem(31, 20, 8, True)
    red = run_core(prob, 20, cfg_of(engine=engine, m=16))
    check_structure(red, 20, 20)
    np.testing.assert_array_equal(to_np(red.indices), np.arange(20))
    assert red.signals.numel() == 0
    assert torch.equal(red.tokens, prob.features()), "K = N must not calibrate anything"


@pytest.mark.parametrize("engine", ENGINES)
def test_keep_one(engine):
    prob = make_problem(32, 30, 8, True)
    red = run_core(prob, 1, cfg_of(engine=engine, m=16))
    check_structure(red, 30, 1)
    # K = 1: the single anchor is argmax psi_bar.
    assert int(red.indices[0]) == int(torch.argmax(red.psi_bar))


@pytest.mark.parametrize("engine", ENGINES)
def test_single_token(engine):
    prob = make_problem(33, 1, 6, False)
    red = run_core(prob, 1, cfg_of(engine=engine, m=8))
    check_structure(red, 1, 1)
    assert int(red.indices[0]) == 0 and int(red.anchor_order[0]) == 0
    assert torch.equal(red.tokens, prob.features())
    assert red.signals.numel() == 0
    # MAD = 0 and max = min: psi_bar = 0 / (0 + eps) = 0.
    assert float(red.psi_bar[0]) == 0.0


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("K", [1, 3, 5, 8, 20])
def test_duplicate_tokens(engine, K):
    base = make_problem(34, 5, 8, False)
    prob = dataclasses.replace(base, V=np.repeat(base.V, 4, axis=0), P=np.random.default_rng(0).uniform(size=(20, 2)))
    red = run_core(prob, K, cfg_of(engine=engine, m=16))
    check_structure(red, 20, K)
    V = prob.features()
    np.testing.assert_allclose(to_np(red.tokens.norm(dim=1)), to_np(V[red.indices].norm(dim=1)), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("K", [1, 4, 10, 12])
def test_zero_norm_tokens(engine, K):
    prob = make_problem(35, 12, 8, True)
    V = prob.V.copy()
    V[[0, 5, 6]] = 0.0
    prob = dataclasses.replace(prob, V=V)
    red = run_core(prob, K, cfg_of(engine=engine, m=16))
    check_structure(red, 12, K)
    Vt = prob.features()
    np.testing.assert_allclose(to_np(red.tokens.norm(dim=1)), to_np(Vt[red.indices].norm(dim=1)), rtol=1e-6, atol=1e-12)
    for k, i in enumerate(to_np(red.indices)):
        if i in (0, 5, 6):
            assert float(red.tokens[k].abs().max()) == 0.0, "a zero anchor must stay zero"


def test_zero_norm_tokens_fd_equals_reference():
    """A zero token has cos 0 with everything (D = 1): still well defined, and equal to the
    reference. (One zero token only: two of them tie exactly in psi_bar.)"""
    prob = make_problem(36, 15, 8, True)
    V = prob.V.copy()
    V[2] = 0.0
    prob = dataclasses.replace(prob, V=V)
    U = random_directions(36, 16, 8)
    ref = run_ref(prob, 6, U, m=16, engine="fd")
    assert ref["margin"] > 1e-10 and ref["gate_margin"] > 1e-10
    red = run_core(prob, 6, cfg_of(engine="fd", m=16), U)
    check_structure(red, 15, 6)
    assert_matches_reference(red, ref, scale=float(np.abs(V).max()))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("K", [1, 5, 16])
def test_constant_responses_linear_projector(engine, K):
    """A linear projector has the same response for every token in each direction
    (MAD = 0 up to rounding): results must still be defined and NaN-free."""
    prob = make_problem(37, 16, 8, True)
    torch.manual_seed(0)
    lin = nn.Linear(8, 12).double()
    red = run_core(prob, K, cfg_of(engine=engine, m=16), projector=lin)
    check_structure(red, 16, K)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("K", [1, 4, 10])
def test_all_identical_tokens(engine, K):
    prob = make_problem(38, 10, 8, False)
    prob = dataclasses.replace(prob, V=np.repeat(prob.V[:1], 10, axis=0))
    red = run_core(prob, K, cfg_of(engine=engine, m=16))
    check_structure(red, 10, K)
    np.testing.assert_allclose(to_np(red.tokens.norm(dim=1)), np.linalg.norm(prob.V[0]), rtol=1e-6)


@pytest.mark.parametrize("engine", ENGINES)
def test_all_zero_tokens(engine):
    prob = make_problem(39, 10, 8, False)
    prob = dataclasses.replace(prob, V=np.zeros((10, 8)))
    red = run_core(prob, 3, cfg_of(engine=engine, m=16))
    check_structure(red, 10, 3)
    assert float(red.tokens.abs().max()) == 0.0


# ----------------------------------------------------------------------------- invariants
def test_calibrated_norms_equal_anchor_norms():
    prob = make_problem(40, 120, 16, True)
    red = run_core(prob, 20, cfg_of(engine="fd", m=32), random_directions(40, 32, 16))
    check_structure(red, 120, 20)
    assert red.signals.numel() > 0, "input should produce calibration signals"
    V = prob.features()
    anchors = V[red.indices]
    assert not torch.allclose(red.tokens, anchors), "calibration should move the anchors"
    np.testing.assert_allclose(to_np(red.tokens.norm(dim=1)), to_np(anchors.norm(dim=1)), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("engine", ENGINES)
def test_same_seed_is_deterministic(engine):
    prob = make_problem(41, 80, 16, True)
    cfg = cfg_of(engine=engine, m=32, seed=7)
    a = run_core(prob, 12, cfg)
    b = run_core(prob, 12, cfg)
    for f in ("indices", "anchor_order", "signals", "tokens", "psi_bar"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize("engine", ENGINES)
def test_different_seed_changes_directions(engine):
    prob = make_problem(42, 80, 16, False)
    a = run_core(prob, 12, cfg_of(engine=engine, m=16, seed=1))
    b = run_core(prob, 12, cfg_of(engine=engine, m=16, seed=2))
    assert not torch.allclose(a.psi_bar, b.psi_bar, atol=1e-6)


@pytest.mark.parametrize(("m", "seed"), [(64, 42), (16, 3)])
def test_default_directions_follow_recipe(m, seed):
    prob = make_problem(43, 60, 12, True)
    cfg = cfg_of(engine="fd", m=m, seed=seed)
    implicit = run_core(prob, 10, cfg, None)
    explicit = run_core(prob, 10, cfg, recipe_directions(m, 12, seed))
    assert torch.equal(implicit.anchor_order, explicit.anchor_order)
    assert torch.equal(implicit.signals, explicit.signals)
    torch.testing.assert_close(implicit.psi_bar, explicit.psi_bar, rtol=0, atol=1e-12)
    torch.testing.assert_close(implicit.tokens, explicit.tokens, rtol=1e-12, atol=1e-12)
    # ...and the reference, which draws the recipe itself, agrees too.
    ref = run_ref(prob, 10, None, m=m, seed=seed, engine="fd")
    assert ref["margin"] > 1e-10 and ref["gate_margin"] > 1e-10
    assert_matches_reference(implicit, ref, scale=float(np.abs(prob.V).max()))


@pytest.mark.parametrize(("N", "K", "d_v", "clustered", "seed"), [(50, 10, 16, True, 500), (120, 24, 32, False, 600)])
def test_float32_close_to_float64(N, K, d_v, clustered, seed):
    m = 32
    # float32 moves psi_bar by ~1e-5 at most on these inputs; demand a 2e-4 margin.
    prob, U, _ = _separated_problem(N, K, d_v, clustered, m, 2e-4, seed)
    ref = run_ref(prob, K, U, m=m, engine="jvp")
    assert ref["margin"] > 2e-4 and ref["gate_margin"] > 2e-4
    cfg = cfg_of(m=m)  # default engine
    red32 = run_core(prob, K, cfg, U, dtype=torch.float32)
    red64 = run_core(prob, K, cfg, U, dtype=torch.float64)
    assert red32.tokens.dtype == torch.float32
    assert red64.tokens.dtype == torch.float64
    check_structure(red32, N, K)
    scale = float(np.abs(prob.V).max())
    for red in (red32, red64):
        np.testing.assert_allclose(to_np(red.psi_bar).astype(np.float64), ref["psi_bar"], atol=1e-3)
        np.testing.assert_array_equal(to_np(red.anchor_order), ref["anchor_order"])
        np.testing.assert_array_equal(to_np(red.signals), ref["signals"])
        np.testing.assert_allclose(to_np(red.tokens).astype(np.float64), ref["tokens"], rtol=1e-4, atol=1e-4 * scale)


def test_float32_fd_is_defined():
    prob = make_problem(44, 40, 8, True)
    red = run_core(prob, 8, cfg_of(engine="fd", m=16), dtype=torch.float32)
    check_structure(red, 40, 8)
    assert red.tokens.dtype == torch.float32


# ----------------------------------------------------------------------------- budget
@pytest.mark.parametrize(
    ("N", "ratio", "K"),
    [
        (576, 0.11, 63),
        (576, 0.222, 127),
        (10, 0.05, 1),
        (10, 1.0, 10),
        (100, 0.5, 50),
        (7, 0.5, 3),
        (3, 0.34, 1),
        (1, 0.5, 1),
        (1, 1.0, 1),
        (600, 0.25, 150),
    ],
)
def test_budget_from_ratio(N, ratio, K):
    assert K == max(1, math.floor(ratio * N)) == budget(N, ratio=ratio)
    prob = make_problem(45, N, 4, False)
    red = care_reduce(prob.features(), prob.projector(), prob.positions(), ratio=ratio, config=cfg_of(engine="fd", m=4))
    assert red.indices.shape == (K,) and red.tokens.shape == (K, 4)


def test_budget_keep():
    prob = make_problem(46, 30, 4, False)
    for K in (1, 7, 29, 30):
        red = care_reduce(prob.features(), prob.projector(), prob.positions(), keep=K, config=cfg_of(engine="fd", m=4))
        assert red.indices.shape == (K,)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ratio": 0.0},
        {"ratio": -0.1},
        {"ratio": 1.5},
        {"ratio": 1.0000001},
        {"ratio": float("nan")},
        {"ratio": float("inf")},
        {"ratio": 0.5, "keep": 3},
        {},
        {"ratio": None, "keep": None},
        {"keep": 31},
        {"keep": 0},
        {"keep": -2},
    ],
)
def test_budget_errors(kwargs):
    prob = make_problem(47, 30, 4, False)
    with pytest.raises(ValueError):
        care_reduce(prob.features(), prob.projector(), prob.positions(), config=cfg_of(m=4), **kwargs)
    with pytest.raises(ValueError):
        budget(30, **kwargs)


# ----------------------------------------------------------------------------- non-default hyperparameters
# Every case above runs at tau_g = tau_s (0.07) and with the gate threshold far from every c_r, so a core that
# swapped the two temperatures or used a strict gate would still pass. These cases draw each hyperparameter from
# a range where it changes the result (docs/design/care.md §Hyperparameters), with tau_g and tau_s at least a factor
# 2 apart, and put theta_c between two of the reference's own c_r values so the gate accepts and rejects.
RANDOM_HPARAM_SEEDS = list(range(8))


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def draw_hyperparameters(rng: np.random.Generator) -> dict:
    """Everything but theta_c (set from the data by `_split_gate`), away from the paper defaults."""
    while True:
        tau_g, tau_s = _log_uniform(rng, 0.02, 0.5), _log_uniform(rng, 0.02, 0.5)
        if max(tau_g, tau_s) >= 2 * min(tau_g, tau_s):
            break
    return {
        "h": _log_uniform(rng, 1e-4, 2e-3),  # Eq. 1 step; float64 fd keeps ~1e-12 relative at 1e-4
        "m": int(rng.integers(8, 49)),  # directions
        "lam": float(rng.uniform(0.0, 2.0)),  # risk penalty: 0 = mean only
        "eta": float(rng.uniform(0.0, 1.0)),  # spatial weight in Eq. 4 (cosine is in [-1, 1])
        "sigma_p": float(rng.uniform(0.05, 0.5)),  # spatial decay, positions in [0, 1]^2
        "theta_s": float(rng.uniform(0.1, 0.8)),  # c_sim threshold on the top affinity
        "tau_c": float(rng.uniform(0.03, 0.3)),
        "tau_g": tau_g,
        "tau_s": tau_s,
        "alpha": float(rng.uniform(0.05, 1.0)),  # injection strength
        "seed": int(rng.integers(0, 2**31 - 1)),
    }


def _split_gate(c: dict) -> float:
    """theta_c halfway across the widest gap between consecutive sorted c_r in the middle 60 % of them: accepted
    and rejected are both non-empty, and the gate margin is half that gap."""
    values = np.sort(np.fromiter(c.values(), dtype=np.float64))
    gaps = np.diff(values)
    lo, hi = max(1, len(values) // 5), max(2, (4 * len(values)) // 5)
    window = range(lo - 1, min(hi, len(gaps)))
    best = max(window, key=lambda i: (gaps[i], -i))
    return float((values[best] + values[best + 1]) / 2)


def hyperparameter_case(seed: int):
    """(problem, K, directions or None, config dict, reference result) for one random draw."""
    rng = np.random.default_rng(20_000 + seed)
    N = int(rng.integers(24, 121))
    K = int(rng.integers(4, N // 3))
    d_v = int(rng.integers(6, 33))
    prob = make_problem(30_000 + seed, N, d_v, clustered=bool(seed % 2 == 0))
    hp = draw_hyperparameters(rng)
    U = None if seed % 3 == 0 else random_directions(seed, hp["m"], d_v)  # default recipe with a random seed too
    first = run_ref(prob, K, U, engine="fd", **hp)
    hp["theta_c"] = _split_gate(first["c"])
    ref = run_ref(prob, K, U, engine="fd", **hp)
    return prob, K, U, hp, ref


@pytest.mark.parametrize("seed", RANDOM_HPARAM_SEEDS)
def test_random_hyperparameters_equal_reference(seed):
    prob, K, U, hp, ref = hyperparameter_case(seed)
    assert ref["margin"] > 1e-8, "near-tie in the greedy: pick another seed"
    assert ref["gate_margin"] > 1e-8, "near-tie at the gate: pick another seed"
    assert 0 < len(ref["signals"]) < prob.N - K, "the gate must both accept and reject"
    red = run_core(prob, K, cfg_of(engine="fd", **hp), U)
    check_structure(red, prob.N, K)
    assert_matches_reference(red, ref, scale=float(np.abs(prob.V).max()))
    residuals = to_np(red.residuals)
    np.testing.assert_allclose(
        to_np(red.confidence), [ref["c"][int(r)] for r in residuals], rtol=0, atol=TOL, err_msg="c_r"
    )


def test_random_hyperparameters_are_sensitive():
    """Guard: in the reference itself, swapping tau_g and tau_s changes the calibrated tokens (and usually R+) by
    far more than the tolerance, so the comparison above would see a core that mixed them up."""
    from tests.reference.care_reference import DEFAULTS, calibrate

    for seed in RANDOM_HPARAM_SEEDS[:4]:
        prob, _, _, hp, ref = hyperparameter_case(seed)
        cfg = {**DEFAULTS, **hp}
        swapped = {**cfg, "tau_g": cfg["tau_s"], "tau_s": cfg["tau_g"]}
        tokens, _, _ = calibrate(prob.V, prob.P, ref["indices"].tolist(), ref["psi_bar"], swapped)
        assert np.abs(tokens - ref["tokens"]).max() > 1e3 * TOL


# ----------------------------------------------------------------------------- the gate's boundary (c_r = theta_c)
# Eq. 6 accepts c_r >= theta_c. To tell >= from >, some residual's confidence must equal theta_c to the last bit
# in both implementations. c_r = c_sim (1 + c_ent) / 2 is exactly 1.0 in float64 whenever the top affinity
# clears theta_s by more than ~37 tau_c (the sigmoid rounds to 1) and c_ent = 1: K = 1 (k_f = 1, c_ent = 1 by
# definition), or a tau_g so small that pi is one-hot (its other entries underflow to exactly 0). theta_c = 1.0
# then sits exactly on those residuals' confidence.
@pytest.mark.parametrize(("K", "tau_g", "seed"), [(1, 0.07, 79), (12, 1e-4, 77)])
def test_confidence_equal_to_theta_c_is_a_signal(K, tau_g, seed):
    prob = make_problem(seed, 60, 12, True)
    U = random_directions(seed, 16, 12)
    hp = {"m": 16, "theta_s": 0.0, "tau_c": 0.01, "tau_g": tau_g, "tau_s": 0.2, "eta": 0.3, "theta_c": 1.0}
    ref = run_ref(prob, K, U, engine="fd", **hp)
    at_threshold = sorted(r for r, c in ref["c"].items() if c == 1.0)
    below = [c for c in ref["c"].values() if c != 1.0]
    assert at_threshold, "construction failed: no residual has c_r == theta_c exactly"
    assert below and max(below) < 1.0 - 1e-12, "the rest must be below the threshold by far more than rounding"
    assert ref["signals"].tolist() == at_threshold, "reference: c_r == theta_c is accepted (>=)"
    assert ref["margin"] > 1e-8
    red = run_core(prob, K, cfg_of(engine="fd", **hp), U)
    check_structure(red, prob.N, K)
    confidence = dict(zip(to_np(red.residuals).tolist(), to_np(red.confidence).tolist(), strict=True))
    assert all(confidence[r] == 1.0 for r in at_threshold), "core: c_r must be exactly theta_c for this test"
    np.testing.assert_array_equal(to_np(red.signals), at_threshold, err_msg="c_r == theta_c must be a signal")
    assert_matches_reference(red, {**ref, "gate_margin": 0.0}, scale=float(np.abs(prob.V).max()))


@pytest.mark.parametrize(("N", "K", "longer"), [(100, 11, 50), (600, 66, 300), (17, 5, 16)])
def test_the_first_k_of_a_longer_anchor_order_gives_the_reference_at_k(N, K, longer):
    """care_reduce given psi_bar and the first K of the order computed for a larger budget (what a memo shares
    between budgets): Eq. 3's order for K is a prefix of the longer one, so the result is the reference's at K.
    An order of another length, or not of indices, is an error."""
    prob = make_problem(N + K, N, 16, True)
    U = random_directions(N, 16, 16)
    cfg = cfg_of(engine="fd", m=16)
    ref = run_ref(prob, K, U, m=16, engine="fd")
    assert ref["margin"] > 1e-10 and ref["gate_margin"] > 1e-10, "a near-tie: pick another seed"
    first = run_core(prob, longer, cfg, U)
    red = care_reduce(prob.features(torch.float64), prob.projector(torch.float64), prob.positions(torch.float64),
                      keep=K, config=cfg, directions=torch.as_tensor(U), psi_bar=first.psi_bar,
                      anchor_order=first.anchor_order[:K].clone())  # fmt: skip
    assert_matches_reference(red, ref, scale=float(np.abs(prob.V).max()))
    for bad in (first.anchor_order, first.anchor_order[:K].double()):
        with pytest.raises(CareError, match="anchor_order"):
            care_reduce(prob.features(torch.float64), prob.projector(torch.float64), prob.positions(torch.float64),
                        keep=K, config=cfg, psi_bar=first.psi_bar, anchor_order=bad)  # fmt: skip
