"""A family defined here, outside the package, and registered through the public call (``register_family``) is
served by ``care reduce``, ``care flops``, ``care eval``, the drop-in and ``care methods``, with no edit anywhere else.

The throwaway family "toy-vl" has a model class of its own (LLaVA's architecture under the model type ``toy_vl``,
which no shipped family loads), an adapter that reuses LLaVA-1.5's, one demo, one ``care flops`` spec and an
lmms-eval model id of its own.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import LlavaConfig, LlavaForConditionalGeneration

import care_core
from care_core.backbones import families
from care_core.backbones.families import (
    BackboneFamily,
    DemoBackbone,
    backbone_family,
    family_names,
    register_family,
    unregister_family,
)
from care_core.backbones.llava_1_5.adapter import LlavaAdapter
from care_core.backbones.llava_1_5.demo import build_tiny_llava

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHAPES = EXAMPLES / "tasks" / "care_shapes_examples"
NAME, MODEL_TYPE, DEMO, SPEC, LMMS_ID = "toy-vl", "toy_vl", "tiny-toy-vl", "toy-vl-7b", "care_toy_vl"


class ToyVLConfig(LlavaConfig):
    model_type = MODEL_TYPE


class ToyVLForConditionalGeneration(LlavaForConditionalGeneration):
    config_class = ToyVLConfig


class ToyVLAdapter(LlavaAdapter):
    """The plug-in's adapter: LLaVA-1.5's behaviour, its own family and model class."""

    family = NAME
    model_class = f"{__name__}:ToyVLForConditionalGeneration"


def build_toy_vl(seed: int = 0) -> tuple[Any, Any]:
    """The plug-in's demo: LLaVA-1.5's tiny random model, as a ``toy_vl`` model."""
    llava, processor = build_tiny_llava(seed)
    settings = {key: value for key, value in llava.config.to_dict().items() if key != "model_type"}
    model = ToyVLForConditionalGeneration(ToyVLConfig(**settings))
    assert model.config.model_type == MODEL_TYPE
    model.load_state_dict(llava.state_dict())
    return model.eval(), processor


@pytest.fixture
def toy_family() -> Iterator[BackboneFamily]:
    """The throwaway family, registered for the test and removed after it."""
    llava_spec = backbone_family("llava-1.5").flops_specs[0]
    spec = dataclasses.replace(llava_spec, name=SPEC, display="Toy-VL-7B", family=NAME, aliases=())
    family = register_family(BackboneFamily(
        name=NAME, display="Toy-VL", model_types=(MODEL_TYPE,), adapter=f"{__name__}:ToyVLAdapter",
        has_cls_token=True, single_grid=True, crops=False, flops_spec=SPEC, lmms_eval_model=LMMS_ID,
        demos=(DemoBackbone(DEMO, 1, NAME, f"{__name__}:build_toy_vl", "Toy-VL: tiny random weights; demo only"),),
        rank=999, flops_specs=(spec,),
    ))  # fmt: skip
    yield family
    if NAME in family_names():
        unregister_family(NAME)


def test_care_reduce_runs_the_plugin_familys_demo(care: Any, toy_family: BackboneFamily) -> None:
    result = care("reduce", EXAMPLES / "astronaut.jpg", "--model", DEMO, "--method", "care", "--keep", "16",
                  "--json", "--device", "cpu")  # fmt: skip
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["backbone"]["family"] == NAME and report["backbone"]["demo"] is True
    assert (report["N"], report["K"], len(report["token_index"])) == (576, 16, 16)


def test_care_flops_counts_the_plugin_familys_spec(care: Any, toy_family: BackboneFamily) -> None:
    ours = care("flops", "--backbone", NAME, "--keep", "64", "--json")
    llava = care("flops", "--backbone", "llava-1.5-7b", "--keep", "64", "--json")
    assert ours.code == 0 and llava.code == 0, ours.err
    ours_report, llava_report = json.loads(ours.out), json.loads(llava.out)
    assert (ours_report["backbone"]["name"], ours_report["backbone"]["family"]) == (SPEC, NAME)
    # the same dims as LLaVA-1.5-7B's, so the same counts: nothing in care flops knows the family
    counts = [[{key: value for key, value in row.items() if key != "backbone"} for row in report["rows"]]
              for report in (ours_report, llava_report)]  # fmt: skip
    assert counts[0] == counts[1]


def test_care_eval_evaluates_the_plugin_familys_demo(care: Any, toy_family: BackboneFamily) -> None:
    pytest.importorskip("lmms_eval", reason="care eval needs the eval extra (lmms-eval)")
    from care_core.integrations.lmms_eval import model_class  # the plugin imports lmms-eval

    assert model_class(LMMS_ID).families == (NAME,)
    result = care("eval", "--model", DEMO, "--method", "care", "--keep", "16", "--tasks", SHAPES, "--limit", "2",
                  "--json", "--device", "cpu")  # fmt: skip
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert [s["setting"] for s in report["settings"]] == ["none", "care K=16"]
    assert [row["visual_tokens"] for row in report["tables"]["care_shapes_examples"]] == [576, 16]


def test_the_drop_in_reduces_the_plugin_familys_model_as_llavas_adapter_does(toy_family: BackboneFamily) -> None:
    """The toy model holds LLaVA-1.5's tiny weights: reduced through the plug-in's adapter it answers as the same
    weights do through LLaVA-1.5's."""
    model, processor = build_toy_vl(0)
    llava, _ = build_tiny_llava(0)
    image = Image.open(EXAMPLES / "astronaut.jpg").convert("RGB")
    inputs = processor(images=image, text="USER: <image>\nWhat is shown? ASSISTANT:", return_tensors="pt")
    with care_core.reduce_visual_tokens(model, processor=processor, keep=16) as reduction, torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert reduction.adapter.family == NAME
    with care_core.reduce_visual_tokens(llava, processor=processor, keep=16), torch.no_grad():
        expected = llava.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, expected)


def test_care_methods_lists_the_plugin_family(care: Any, toy_family: BackboneFamily) -> None:
    served = care("methods", "visionzip", "--json")
    assert served.code == 0, served.err
    assert NAME in json.loads(served.out)["methods"][0]["backbones"]
    no_cls = dataclasses.replace(toy_family, name="toy-vl-no-cls", model_types=("toy_vl_no_cls",),
                                 has_cls_token=False, demos=(), lmms_eval_model="care_toy_vl_no_cls")  # fmt: skip
    register_family(no_cls)
    try:
        refused = json.loads(care("methods", "visionzip", "--json").out)["methods"][0]
        assert refused["not_served"]["toy-vl-no-cls"] == "the vision tower's CLS token"
    finally:
        unregister_family("toy-vl-no-cls")


def _installed(monkeypatch: pytest.MonkeyPatch, *entries: importlib.metadata.EntryPoint) -> None:
    """Installed packages offering ``entries`` in the plug-in group (and nothing else), read afresh."""
    real = importlib.metadata.entry_points

    def entry_points(**selection: Any) -> Any:
        if selection.get("group") == families.PLUGIN_GROUP:
            return importlib.metadata.EntryPoints(entries)
        return real(**selection)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    families.installed_plugins.cache_clear()


def test_an_installed_packages_family_is_found_through_its_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """A package that names a BackboneFamily in the ``care.families`` entry-point group is served with no call at
    all; a broken entry is skipped with one warning line, the shipped families kept."""
    toy = BackboneFamily(name=NAME, display="Toy-VL", model_types=(MODEL_TYPE,), adapter=f"{__name__}:ToyVLAdapter",
                         has_cls_token=True, single_grid=True, crops=False, flops_spec="", lmms_eval_model=LMMS_ID,
                         rank=999)  # fmt: skip
    monkeypatch.setattr(sys.modules[__name__], "INSTALLED_TOY", toy, raising=False)
    group = families.PLUGIN_GROUP
    good = importlib.metadata.EntryPoint("toy", f"{__name__}:INSTALLED_TOY", group)
    broken = importlib.metadata.EntryPoint("broken", "no_such_module_here:FAMILY", group)
    _installed(monkeypatch, good, broken)
    try:
        with pytest.warns(UserWarning, match=r"backbone plug-in 'broken' \(no_such_module_here:FAMILY\) failed"):
            names = family_names()
        assert names[-1] == NAME and "llava-1.5" in names
        assert backbone_family(MODEL_TYPE) is toy
    finally:
        if NAME in family_names():
            unregister_family(NAME)
        _installed(monkeypatch)
