"""CaRe and its Table S5 ablations: one code path with care_reduce, stage timing, and each variant's behaviour
against the independent numpy reference (tests/reference/care_reference.py) and independent ungated calibration."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from care_core import CaReConfig, care_reduce
from care_core.methods import MethodInputs, build_method
from care_core.methods.care_family import reduction_result
from tests.core._problems import make_problem, to_np
from tests.reference import care_reference as ref

from .conftest import make_inputs

CALIBRATED = ("care", "simple-calib", "confidence-calib", "prca+simple-calib")
FAMILY = ("prca-only", *CALIBRATED)
# every field differs from the paper's default (Supp. C)
CONFIG = {"h": 1e-3, "m": 16, "lam": 0.3, "eta": 0.6, "theta_s": 0.3, "theta_c": 0.8, "alpha": 0.25, "sigma_p": 0.3,
          "tau_g": 0.1, "tau_c": 0.15, "tau_s": 0.1, "eps": 1e-7, "seed": 5, "engine": "fd"}  # fmt: skip
TOL = 1e-9


def problem_inputs(seed: int = 3, n: int = 60, d_v: int = 12):
    prob = make_problem(seed, n, d_v, clustered=True)
    return prob, MethodInputs(prob.features(), prob.projector(), prob.positions())


def ungated_reference(v: np.ndarray, anchors: list[int], weights: np.ndarray, cfg: dict) -> np.ndarray:
    """Simple calibration written out from the paper: R+ = R, c_r = 1, w_r = psi_bar_r + eps, then Eq. 7–9."""
    eps, residuals = cfg["eps"], [r for r in range(v.shape[0]) if r not in set(anchors)]
    num = np.zeros((len(anchors), v.shape[1]))
    den = np.zeros(len(anchors))
    for r in residuals:
        q = ref.softmax(np.array([ref.cos(v[r], v[j], eps) / cfg["tau_s"] for j in anchors]))  # Eq. 7
        num += (weights[r] + eps) * q[:, None] * v[r][None, :]
        den += (weights[r] + eps) * q
    out = np.empty_like(num)
    for a, j in enumerate(anchors):
        shifted = v[j] + cfg["alpha"] * num[a] / (den[a] + eps)  # Eq. 8
        out[a] = np.linalg.norm(v[j]) / (np.linalg.norm(shifted) + eps) * shifted  # Eq. 9
    return out


def reference_prca(prob, k: int) -> tuple[list[int], np.ndarray, float]:
    """(anchor order, psi_bar, greedy margin) of PRCA (Eq. 1–3) by the reference."""
    cfg = {**ref.DEFAULTS, **CONFIG}
    u = ref.default_directions(cfg["m"], prob.d_v, cfg["seed"])
    responses = ref.responses_fd(prob.V, *prob.weights(), u, cfg["h"])
    _, _, psi_bar = ref.robust_scores(responses, cfg["lam"], cfg["eps"])
    order, margin = ref.greedy_anchors(prob.V, psi_bar, k, cfg["eps"])
    return order, psi_bar, margin


# ------------------------------------------------------------------------------------------ one code path
@pytest.mark.parametrize("engine", ["jvp", "fd"])
def test_registered_care_is_care_reduce(engine: str) -> None:
    config = CaReConfig(**{**CONFIG, "engine": engine})
    inputs = make_inputs(n=100, seed=9)
    result = build_method("care", config)(inputs, 17)
    red = care_reduce(inputs.features, inputs.projector, inputs.positions, keep=17, config=config)
    assert torch.equal(result.tokens, red.tokens)
    assert torch.equal(result.token_index, red.indices)
    assert torch.equal(result.signals, red.signals)
    assert torch.equal(result.scores, red.psi_bar)
    assert torch.equal(result.info["selection_order"], red.anchor_order)
    assert torch.equal(result.info["confidence"], red.confidence)
    assert result.signals.numel() > 0  # the comparison covers calibration


def test_reduction_result_sends_signals_to_their_anchor() -> None:
    inputs = make_inputs(n=64, seed=2)
    red = care_reduce(inputs.features, inputs.projector, inputs.positions, keep=9, config=CaReConfig(m=8))
    result = reduction_result(red)
    assignment = result.assignment
    assert torch.equal(assignment[red.indices], torch.arange(9))
    assert torch.equal(red.indices[assignment[red.signals]], red.signal_targets)
    dropped = torch.ones(64, dtype=torch.bool)
    dropped[red.indices] = False
    dropped[red.signals] = False
    assert bool((assignment[dropped] == -1).all())


@pytest.mark.parametrize("name", [*FAMILY, "zoo-prune"])
def test_stages_are_timed_through_the_contract(name: str) -> None:
    seen: list[str] = []

    @contextmanager
    def timer(stage: str) -> Iterator[None]:
        seen.append(stage)
        yield

    inputs = make_inputs(n=49, seed=1)
    inputs.stage_timer = timer
    build_method(name, CaReConfig(m=8))(inputs, 7)
    expected = ["scoring", "anchors", "calibration"] if name in CALIBRATED else ["scoring", "anchors"]
    assert seen == expected


# ------------------------------------------------------------------------------------------ Table S5 behaviour
def test_care_is_prca_anchors_plus_the_gate() -> None:
    prob, inputs = problem_inputs()
    k = 9
    out = ref.reference_care(prob.V, *prob.weights(), prob.P, k, cfg=dict(CONFIG))
    assert out["margin"] > 1e-9 and out["gate_margin"] > 1e-9  # no near-ties
    result = build_method("care", CaReConfig(**CONFIG))(inputs, k)
    assert to_np(result.token_index).tolist() == out["indices"].tolist()
    assert to_np(result.signals).tolist() == out["signals"].tolist()
    assert 0 < len(out["signals"]) < prob.N - k  # the gate accepts some residual tokens and rejects others
    np.testing.assert_allclose(to_np(result.scores), out["psi_bar"], rtol=0, atol=TOL)
    np.testing.assert_allclose(to_np(result.tokens), out["tokens"], rtol=TOL, atol=TOL)


def test_prca_only_hands_over_the_prca_anchors_unchanged() -> None:
    prob, inputs = problem_inputs()
    k = 9
    order, psi_bar, margin = reference_prca(prob, k)
    assert margin > 1e-9
    result = build_method("prca-only", CaReConfig(**CONFIG))(inputs, k)
    assert to_np(result.info["selection_order"]).tolist() == order
    assert to_np(result.token_index).tolist() == sorted(order)
    assert torch.equal(result.tokens, inputs.features[result.token_index])  # exactly, no calibration
    assert result.signals is None
    np.testing.assert_allclose(to_np(result.scores), psi_bar, rtol=0, atol=TOL)


def test_prca_simple_calib_injects_every_residual_into_prca_anchors() -> None:
    prob, inputs = problem_inputs()
    k = 9
    order, psi_bar, _ = reference_prca(prob, k)
    result = build_method("prca+simple-calib", CaReConfig(**CONFIG))(inputs, k)
    anchors = sorted(order)
    assert to_np(result.token_index).tolist() == anchors
    residuals = [r for r in range(prob.N) if r not in set(anchors)]
    assert to_np(result.signals).tolist() == residuals  # R+ = R
    assert bool((result.info["confidence"] == 1).all())  # c_r = 1
    expected = ungated_reference(prob.V, anchors, psi_bar, {**ref.DEFAULTS, **CONFIG})
    np.testing.assert_allclose(to_np(result.tokens), expected, rtol=TOL, atol=TOL)


def test_simple_calib_injects_every_residual_into_zoo_prune_anchors() -> None:
    prob, inputs = problem_inputs()
    k = 9
    config = CaReConfig(**CONFIG)
    zoo = build_method("zoo-prune", config)(inputs, k)
    result = build_method("simple-calib", config)(inputs, k)
    assert torch.equal(result.info["selection_order"], zoo.info["selection_order"])
    assert torch.equal(result.token_index, zoo.token_index)
    assert torch.equal(result.scores, zoo.scores)  # ZOO-Prune's normalised sensitivity plays psi_bar
    anchors = to_np(zoo.token_index).tolist()
    residuals = [r for r in range(prob.N) if r not in set(anchors)]
    assert to_np(result.signals).tolist() == residuals
    assert bool((result.info["confidence"] == 1).all())
    expected = ungated_reference(prob.V, anchors, to_np(zoo.scores), {**ref.DEFAULTS, **CONFIG})
    np.testing.assert_allclose(to_np(result.tokens), expected, rtol=TOL, atol=TOL)


def test_confidence_calib_gates_zoo_prune_anchors() -> None:
    prob, inputs = problem_inputs()
    k = 9
    config = CaReConfig(**CONFIG)
    zoo = build_method("zoo-prune", config)(inputs, k)
    result = build_method("confidence-calib", config)(inputs, k)
    assert torch.equal(result.token_index, zoo.token_index)
    anchors = to_np(zoo.token_index).tolist()
    tokens, signals, diag = ref.calibrate(prob.V, prob.P, anchors, to_np(zoo.scores), {**ref.DEFAULTS, **CONFIG})
    assert min(abs(c - CONFIG["theta_c"]) for c in diag["c"].values()) > 1e-9  # no near-ties at the gate
    assert to_np(result.signals).tolist() == list(signals)
    assert 0 < len(signals) < prob.N - k
    np.testing.assert_allclose(to_np(result.tokens), tokens, rtol=TOL, atol=TOL)
    confidence = [diag["c"][r] for r in sorted(diag["c"])]
    np.testing.assert_allclose(to_np(result.info["confidence"]), confidence, rtol=0, atol=TOL)


def test_ablations_differ_where_the_table_says() -> None:
    """Same config and inputs: the variants share anchors or calibration exactly as Table S5 pairs them."""
    inputs = make_inputs(n=100, seed=6)
    config = CaReConfig(m=16)
    out = {name: build_method(name, config)(inputs, 12) for name in FAMILY}
    assert torch.equal(out["care"].token_index, out["prca-only"].token_index)
    assert torch.equal(out["care"].token_index, out["prca+simple-calib"].token_index)
    assert torch.equal(out["simple-calib"].token_index, out["confidence-calib"].token_index)
    assert not torch.equal(out["care"].token_index, out["simple-calib"].token_index)  # PRCA != ZOO-Prune here
    assert out["care"].signals.numel() < out["prca+simple-calib"].signals.numel() == 100 - 12
    assert not math.isclose(float((out["care"].tokens - out["prca-only"].tokens).abs().max()), 0.0)


def test_build_method_takes_the_config_then_the_options() -> None:
    assert build_method("care").config == CaReConfig()  # no config: the method's defaults
    assert build_method("care", CaReConfig(m=8)).config.m == 8
    assert build_method("random").seed is None  # its default: the inputs' seed
    assert build_method("random", CaReConfig(seed=5)).seed == 5
    assert build_method("random", CaReConfig(seed=5), seed=7).seed == 7  # an option overrides the config
