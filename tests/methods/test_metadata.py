"""One source of truth per concept: listing order, cost models, score labels and served backbones are class
metadata, and every consumer (registry, flops, overlays, adapters) reads them from there."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from care_core.backbones.families import BackboneFamily, backbone_family, family_names, register_family
from care_core.errors import MethodError
from care_core.methods import build_method, method_class, method_names, methods_for_backbone, score_label
from care_core.vocabulary import PROBES

from .conftest import make_inputs

METHODS = method_names()
ROOT = Path(__file__).resolve().parents[2]
CLS_PROBES = {"cls_attention", "attention_logits", "keys", "hidden_with_cls", "last_layer_qk"}


def test_listing_order_is_the_documented_one() -> None:
    """CaRe, its ablations (the paper's Table 3 rows) and ZOO-Prune first, then the peers: pre-LLM selection,
    merging, in-LLM pruning, and the two baselines last, as the README's tables list them."""
    assert METHODS == [
        "care", "prca-only", "simple-calib", "confidence-calib", "prca+simple-calib", "zoo-prune",
        "divprune", "visionzip", "prumerge+", "prumerge", "tome", "ficoco-v", "fastv", "sparsevlm", "random", "pool",
    ]  # fmt: skip
    assert len({method_class(name).rank for name in METHODS}) == len(METHODS)  # no two methods tie


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


def test_one_spelling_per_family() -> None:
    assert family_names() == ["llava-1.5", "llava-next", "qwen2.5-vl", "qwen3-vl", "qwen3.5", "internvl3",
                              "llava-onevision", "gemma3"]  # fmt: skip
    assert backbone_family("internvl").name == backbone_family("InternVL3").name == "internvl3"
    # a config.json model_type finds its family, case-insensitively; the family keeps its one name
    assert backbone_family("Qwen2_5_VL").name == backbone_family("qwen2.5-vl").name == "qwen2.5-vl"
    assert backbone_family("llava").name == "llava-1.5" and backbone_family("llava_next").name == "llava-next"
    with pytest.raises(MethodError, match="unknown backbone family"):
        method_class("care").serves("gpt4")


def test_methods_for_backbone() -> None:
    qwen = methods_for_backbone("qwen2.5-vl")
    assert set(METHODS) - set(qwen) == {"visionzip", "prumerge+", "prumerge", "ficoco-v"}  # no CLS token
    assert methods_for_backbone("qwen3-vl") == qwen  # no CLS token either, one grid
    assert backbone_family("Qwen3_VL").name == "qwen3-vl"
    assert set(METHODS) - set(methods_for_backbone("llava-next")) == {"pool"}  # two views, no single grid
    assert set(METHODS) - set(methods_for_backbone("llava-onevision")) == {*set(METHODS) - set(qwen), "pool"}
    assert methods_for_backbone("llava-1.5") == METHODS
    # InternVL3: no CLS probe through the pixel shuffle, and tiles + thumbnail are no single grid
    assert set(METHODS) - set(methods_for_backbone("internvl3")) == {"visionzip", "prumerge+", "prumerge", "ficoco-v",
                                                                     "pool"}  # fmt: skip
    assert qwen == [name for name in METHODS if name in qwen]  # listing order kept


def test_a_new_family_is_served_from_its_record_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Methods state requirements (a CLS token, one grid); a family registered later is served by what its record
    offers, with no edit in the methods."""
    from care_core.backbones import families

    monkeypatch.setattr(families, "_FAMILIES", dict(families._FAMILIES))  # the registration ends with the test
    monkeypatch.setattr(families, "_KEYS", dict(families._KEYS))
    register_family(BackboneFamily(name="test-grid-no-cls", display="T", model_types=("test_grid_no_cls",),
                                   adapter="x:Y", has_cls_token=False, single_grid=False, crops=True, flops_spec="",
                                   lmms_eval_model="care"))  # fmt: skip
    served = methods_for_backbone("test_grid_no_cls")
    assert set(METHODS) - set(served) == {"visionzip", "prumerge+", "prumerge", "ficoco-v", "pool"}
    assert method_class("pool").why_not_served("test-grid-no-cls") == "the visual tokens to form one raster grid"
    with pytest.raises(RuntimeError, match="claimed"):
        register_family(dataclasses.replace(families.backbone_family("llava-1.5"), name="llava-again"))


@pytest.mark.parametrize("name", METHODS)
def test_a_served_backbone_gives_what_the_method_needs(name: str) -> None:
    """Qwen2.5-VL offers no CLS probes and LLaVA-NeXT no single grid: a method serving them runs without."""
    cls = method_class(name)
    assert cls.needs <= set(PROBES)
    inputs = make_inputs(n=36, seed=2)
    no_cls = make_inputs(n=36, seed=2)
    no_cls.probes = {k: v for k, v in no_cls.probes.items() if k not in CLS_PROBES}
    no_grid = make_inputs(n=36, seed=2)
    no_grid.grid = None
    method = build_method(name)
    assert method(inputs, 6).num_tokens == 6  # LLaVA-1.5 offers everything
    for family, degraded in (("qwen2.5-vl", no_cls), ("llava-next", no_grid)):
        if cls.serves(family):
            assert method(degraded, 6).num_tokens == 6
        else:
            with pytest.raises(MethodError):
                method(degraded, 6)


def test_each_family_loads_through_its_own_adapter() -> None:
    from care_core.backbones.internvl3.adapter import InternVLAdapter
    from care_core.backbones.llava_1_5.adapter import LlavaAdapter
    from care_core.backbones.llava_next.adapter import LlavaNextAdapter
    from care_core.backbones.llava_onevision.adapter import LlavaOnevisionAdapter
    from care_core.backbones.loading import adapter_class
    from care_core.backbones.qwen2_5_vl.adapter import Qwen2_5_VLAdapter

    expected = {"llava": LlavaAdapter, "llava_next": LlavaNextAdapter, "qwen2_5_vl": Qwen2_5_VLAdapter,
                "internvl": InternVLAdapter, "llava_onevision": LlavaOnevisionAdapter}  # fmt: skip
    for model_type, adapter in expected.items():
        assert adapter_class(model_type) is adapter
        assert backbone_family(model_type).name == adapter.family  # the adapter names its own record
    # Qwen2.5-VL's capabilities are exactly what the methods serving it may need
    qwen_offers = Qwen2_5_VLAdapter.capabilities.fget(None)  # type: ignore[attr-defined]
    for name in METHODS:
        assert method_class(name).serves("qwen2.5-vl") == (method_class(name).needs <= qwen_offers), name
    # InternVL3's too, where the method needs no single grid
    internvl_offers = InternVLAdapter.capabilities.fget(None)  # type: ignore[attr-defined]
    for name in METHODS:
        if "single_grid" not in method_class(name).requires:
            assert method_class(name).serves("internvl3") == (method_class(name).needs <= internvl_offers), name
    # LLaVA-OneVision offers the same probes; beyond them only its two grids turn methods away
    ov_offers = LlavaOnevisionAdapter.capabilities.fget(None)  # type: ignore[attr-defined]
    assert ov_offers == qwen_offers
    for name in METHODS:
        cls = method_class(name)
        assert cls.serves("llava-onevision") == (cls.needs <= ov_offers and "single_grid" not in cls.requires), name


def test_metadata_imports_without_torch() -> None:
    code = (
        "import care_core.methods, care_core.flops, sys; "
        "from care_core.methods import method_names, method_class; "
        "[method_class(n).hyperparameters for n in method_names()]; "
        "from care_core.flops import flops_report, resolve_backbone; "
        "flops_report(resolve_backbone('qwen2.5-vl'), methods=['all'], keeps=[64]); "
        "import care_core.backbones.families, care_cli.options; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
