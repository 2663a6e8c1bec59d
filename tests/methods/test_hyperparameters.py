"""Every CaRe hyperparameter reaches every method that reads it, and no other (metadata drives the cases)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from care_core import CaReConfig
from care_core.methods import MethodResult, build_method, method_class, method_names

from .conftest import make_inputs

# `kernel` chooses how the maths runs (fused or PyTorch), not what it computes: tests/core checks it.
FIELDS = [name for name in CaReConfig.field_names() if name != "kernel"]
FAMILY = ("care", "prca-only", "simple-calib", "confidence-calib", "prca+simple-calib")
# theta_c = 0: every residual passes the gate (c_r >= 0), so the calibration fields act on the tokens
BASE = CaReConfig(m=8, theta_c=0.0)
CHANGED = {"h": 0.3, "m": 5, "lam": 2.0, "eta": 2.0, "theta_s": 0.9, "theta_c": 1.0, "alpha": 0.8, "sigma_p": 0.05,
           "tau_g": 0.5, "tau_c": 0.5, "tau_s": 0.5, "eps": 0.01, "seed": 7, "engine": "fd",
           "matmul_precision": "bf16"}  # fmt: skip
# Where a change must show. h acts only through the finite-difference engine, matmul_precision only through jvp.
BASE_FOR = {"h": {"engine": "fd"}, "matmul_precision": {"engine": "jvp", "matmul_precision": "float32"}}
SCORING = ("h", "m", "lam", "seed", "engine", "matmul_precision")  # Eq. 1–2: the per-token scores change
GATE = ("eta", "theta_s", "sigma_p", "tau_g", "tau_c")  # Eq. 4–6: every residual's c_r changes
INJECTION = ("alpha", "tau_s")  # Eq. 7–9: the calibrated tokens change


@pytest.fixture(scope="module")
def inputs():
    return make_inputs(n=64, seed=11)


def observable(field: str, name: str) -> str:
    if field in SCORING:
        return "scores"
    if field in GATE:
        return "confidence"
    if field in INJECTION:
        return "tokens"
    if field == "theta_c":
        return "signals"
    assert field == "eps"
    # PRCA: min-max normalisation of psi (scores); ZOO-Prune anchors: only w_r = psi_bar_r + eps (tokens)
    return "scores" if "lam" in method_class(name).hyperparameters else "tokens"


def view(result: MethodResult, what: str) -> torch.Tensor:
    if what == "confidence":
        return result.info["confidence"]
    value = getattr(result, what)
    assert value is not None
    return value


def everything(result: MethodResult) -> list[torch.Tensor | None]:
    tensors = [result.tokens, result.token_index, result.scores, result.assignment, result.signals]
    return tensors + [v for v in result.info.values() if isinstance(v, torch.Tensor)]


def same(a: MethodResult, b: MethodResult) -> bool:
    pairs = zip(everything(a), everything(b), strict=True)
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in pairs)


USED = [(name, f) for name in [*FAMILY, "zoo-prune"] for f in FIELDS if f in method_class(name).hyperparameters]
IGNORED = [(name, f) for name in method_names() for f in FIELDS if f not in method_class(name).hyperparameters]


def test_metadata_names_config_fields() -> None:
    for name in method_names():
        assert method_class(name).hyperparameters <= set(FIELDS), name
    assert method_class("care").hyperparameters == set(FIELDS)
    assert method_class("zoo-prune").hyperparameters == {"h", "m", "seed"}
    assert method_class("random").hyperparameters == {"seed"} == method_class("sparsevlm").hyperparameters


@pytest.mark.parametrize(("name", "field"), USED, ids=[f"{n}-{f}" for n, f in USED])
def test_a_used_hyperparameter_changes_the_output(name: str, field: str, inputs) -> None:
    base = dataclasses.replace(BASE, **BASE_FOR.get(field, {}))
    assert getattr(base, field) != CHANGED[field]
    first = build_method(name, base)(inputs, 12)
    second = build_method(name, dataclasses.replace(base, **{field: CHANGED[field]}))(inputs, 12)
    what = observable(field, name)
    a, b = view(first, what), view(second, what)
    assert a.shape != b.shape or not torch.equal(a, b), f"{name}: {field} did not change the {what}"


@pytest.mark.parametrize(("name", "field"), IGNORED, ids=[f"{n}-{f}" for n, f in IGNORED])
def test_an_ignored_hyperparameter_changes_nothing(name: str, field: str, inputs) -> None:
    base = dataclasses.replace(BASE, **BASE_FOR.get(field, {}))
    first_method = build_method(name, base)
    second_method = build_method(name, dataclasses.replace(base, **{field: CHANGED[field]}))
    if first_method == second_method:
        return  # the config did not reach the instance at all
    assert same(first_method(inputs, 12), second_method(inputs, 12)), f"{name} reads {field}"


def test_theta_c_bounds_the_gate(inputs) -> None:
    """c_r lies in (0, 1]: theta_c = 0 accepts every residual token, theta_c = 1 none here (c_sim < 1; Eq. 6)."""
    for name in ("care", "confidence-calib"):
        everyone = build_method(name, BASE)(inputs, 12)
        nobody = build_method(name, dataclasses.replace(BASE, theta_c=1.0))(inputs, 12)
        assert everyone.signals.numel() == 64 - 12 and nobody.signals.numel() == 0
        assert torch.equal(nobody.tokens, inputs.features[nobody.token_index])


@pytest.mark.parametrize("name", method_names())
def test_build_method_passes_the_config(name: str) -> None:
    config = CaReConfig(m=9, h=0.02, seed=123)
    method = build_method(name, config)
    if hasattr(method, "config"):
        assert method.config == config
    for field in method_class(name).hyperparameters & {f.name for f in dataclasses.fields(method)}:
        assert getattr(method, field) == getattr(config, field)
    if "seed" in method_class(name).hyperparameters:
        assert (getattr(method, "config", None) or method).seed == 123
