"""Cost models are read from the method classes: one per method, the right token count, per-backbone lists."""

from __future__ import annotations

import pytest

from care_core.errors import MethodError
from care_core.flops import formulas as fx
from care_core.flops.methods import canonical_method, cost_model_names, method_cost
from care_core.flops.report import flops_report, resolve_methods
from care_core.flops.specs import KNOWN_BACKBONES, resolve_backbone
from care_core.methods import method_names, methods_for_backbone

LLAVA15 = KNOWN_BACKBONES["llava-1.5-7b"]


def test_names_come_from_the_method_registry() -> None:
    assert cost_model_names() == method_names()
    assert canonical_method("sense-diversity") == "zoo-prune"
    assert canonical_method("full") == "baseline"
    with pytest.raises(MethodError, match="unknown method"):
        canonical_method("v2drop")  # not a method, so no cost model either


@pytest.mark.parametrize("backbone", ["llava-1.5", "llava-next", "qwen2.5-vl"])
def test_all_is_the_backbones_method_list(backbone: str) -> None:
    spec = resolve_backbone(backbone)
    report = flops_report(spec, methods=["all"], keeps=[64])
    assert report["methods"] == methods_for_backbone(spec.family)
    if backbone == "qwen2.5-vl":
        assert not {"visionzip", "prumerge+", "prumerge", "ficoco-v"} & set(report["methods"])
        with pytest.raises(MethodError, match=r"cannot run on qwen2\.5-vl"):
            resolve_methods(["visionzip"], spec.family)


@pytest.mark.parametrize("name", ["prumerge", "prumerge+"])
def test_prumerge_costs_its_own_k_tokens(name: str) -> None:
    n, k = 576, 64
    cost = method_cost(name, LLAVA15, n, k)
    assert cost.method == name and cost.tokens == k
    assert cost.schedule == fx.uniform_schedule(LLAVA15.lm, k)  # K - 1 kept + 1 summary row reach the LLM
    d_v = LLAVA15.projector.token_dim
    assert cost.residual["N_d d_v"] == (n - (k - 1)) * d_v  # the summary row sums the N - K + 1 pruned patches
    assert cost.residual["32 (K-1) d_v"] == 32 * (k - 1) * d_v


def test_prumerge_plus_pays_for_its_spatial_fill() -> None:
    plain, plus = method_cost("prumerge", LLAVA15, 576, 64), method_cost("prumerge+", LLAVA15, 576, 64)
    assert sum(plus.score.values()) - sum(plain.score.values()) == 576
    assert plain.residual == plus.residual


def test_tome_cost_follows_the_method_schedule() -> None:
    n, k = 576, 64
    cost = method_cost("tome", LLAVA15, n, k)
    assert cost.residual["Σ r d_v"] == (n - k) * LLAVA15.projector.token_dim  # every merged token costs d_v once
    assert "23 calls" in cost.note
