"""One source of truth per concept: listing order, cost models, score labels and served backbones are class
metadata, and every consumer (registry, flops, overlays, adapters) reads them from there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from care_core.errors import MethodError
from care_core.methods import (
    BACKBONE_FAMILIES,
    build_method,
    canonical_family,
    method_class,
    method_names,
    methods_for_backbone,
    score_label,
)
from care_core.methods.base import PROBES

from .conftest import make_inputs

METHODS = method_names()
ROOT = Path(__file__).resolve().parents[2]
CLS_PROBES = {"cls_attention", "attention_logits", "keys", "hidden_with_cls", "last_layer_qk"}


def test_listing_order_is_the_rank() -> None:
    ranks = [method_class(name).rank for name in METHODS]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)
    assert METHODS[:6] == ["care", "prca-only", "simple-calib", "confidence-calib", "prca+simple-calib", "zoo-prune"]


@pytest.mark.parametrize("name", METHODS)
def test_every_method_has_its_own_cost_model(name: str) -> None:
    from care_core.flops.methods import _MODELS, canonical_method

    assert method_class(name).cost_model in _MODELS
    assert canonical_method(name) == name
    for alias in method_class(name).aliases:
        assert canonical_method(alias) == name


def test_cost_models_are_not_shared() -> None:
    keys = [method_class(name).cost_model for name in METHODS]
    assert len(set(keys)) == len(keys)  # e.g. prumerge is not costed as prumerge+


def test_score_labels() -> None:
    assert {name for name in METHODS if score_label(name) == "psi_bar"} == {"care", "prca-only", "prca+simple-calib"}
    assert all(score_label(name) in (None, "psi_bar") for name in METHODS)


def test_family_names() -> None:
    assert canonical_family("qwen2.5-vl") == canonical_family("Qwen2_5_VL") == "qwen2_5_vl"
    assert canonical_family("llava-1.5") == "llava" and canonical_family("llava-next") == "llava_next"
    with pytest.raises(MethodError, match="unknown backbone family"):
        canonical_family("gpt4")


def test_methods_for_backbone() -> None:
    qwen = methods_for_backbone("qwen2.5-vl")
    assert set(METHODS) - set(qwen) == {"visionzip", "prumerge+", "prumerge", "ficoco-v"}
    assert set(METHODS) - set(methods_for_backbone("llava-next")) == {"pool"}
    assert methods_for_backbone("llava") == METHODS
    assert qwen == [name for name in METHODS if name in qwen]  # listing order kept


@pytest.mark.parametrize("name", METHODS)
def test_a_served_backbone_gives_what_the_method_needs(name: str) -> None:
    """Qwen2.5-VL offers no CLS probes and LLaVA-NeXT no single grid: a method serving them runs without."""
    cls = method_class(name)
    assert cls.backbones and cls.backbones <= set(BACKBONE_FAMILIES) and cls.needs <= set(PROBES)
    inputs = make_inputs(n=36, seed=2)
    no_cls = make_inputs(n=36, seed=2)
    no_cls.probes = {k: v for k, v in no_cls.probes.items() if k not in CLS_PROBES}
    no_grid = make_inputs(n=36, seed=2)
    no_grid.grid = None
    method = build_method(name)
    assert method(inputs, 6).num_tokens == 6  # LLaVA-1.5 offers everything
    for family, degraded in (("qwen2_5_vl", no_cls), ("llava_next", no_grid)):
        if cls.serves(family):
            assert method(degraded, 6).num_tokens == 6
        else:
            with pytest.raises(MethodError):
                method(degraded, 6)


def test_adapters_registered_from_their_model_types() -> None:
    from care_core.backbones.llava import LlavaAdapter
    from care_core.backbones.llava_next import LlavaNextAdapter
    from care_core.backbones.loading import _adapter_registry
    from care_core.backbones.qwen2_5_vl import Qwen2_5_VLAdapter

    adapters = (LlavaAdapter, LlavaNextAdapter, Qwen2_5_VLAdapter)
    registry = _adapter_registry()
    assert set(registry) == {t for a in adapters for t in a.model_types} == set(BACKBONE_FAMILIES)
    for adapter in adapters:
        assert all(registry[t] is adapter for t in adapter.model_types)
        assert canonical_family(adapter.family) == adapter.model_types[0]  # the adapters' family names resolve
    # Qwen2.5-VL's capabilities are exactly what the methods serving it may need
    qwen_offers = Qwen2_5_VLAdapter.capabilities.fget(None)  # type: ignore[attr-defined]
    for name in METHODS:
        assert method_class(name).serves("qwen2_5_vl") == (method_class(name).needs <= qwen_offers), name


def test_metadata_imports_without_torch() -> None:
    code = (
        "import care_core.methods.all, care_core.flops, sys; "
        "from care_core.methods import method_names, method_class; "
        "[method_class(n).hyperparameters for n in method_names()]; "
        "from care_core.flops import flops_report, resolve_backbone; "
        "flops_report(resolve_backbone('qwen2.5-vl'), methods=['all'], keeps=[64]); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
