"""A family registered from outside the package (here, the test) is served by `care flops` from its record alone:
its name, its spec names and aliases, its config.json reader, its vision tower kind; care_core.flops names none."""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import care_core.flops
from care_core.architecture import BackboneSpec
from care_core.backbones.families import (
    BackboneFamily,
    backbone_family,
    families,
    register_family,
    unregister_family,
)
from care_core.flops.specs import KNOWN_BACKBONES, BackboneSpecError, from_config, resolve_backbone

LLAVA_7B = KNOWN_BACKBONES["llava-1.5-7b"]
#: LLaVA-1.5-7B's tower and projector on a 2-layer Vicuna-7B: its own numbers, not those of any shipped spec
TOY_SPEC = replace(LLAVA_7B, name="toy-vl-1b", display="Toy-VL-1B", family="toy-vl", lm=replace(LLAVA_7B.lm, layers=2),
                   paper_key=None, source="a test", aliases=("toy/toy-vl-1b",))  # fmt: skip
#: prefill of the 2 layers on W = 64 text + 576 visual tokens, by hand: 2 (8 W H² + 6 W H I + 4 W² H),
#: H = 4096, I = 11008
TOY_BASELINE_FLOPS = 2 * (8 * 640 * 4096**2 + 6 * 640 * 4096 * 11008 + 4 * 640**2 * 4096)


def read_toy_config(raw: Mapping[str, Any], path: Path, family: BackboneFamily) -> BackboneSpec:
    """The toy family's config.json reader: its layer count from the file."""
    return replace(TOY_SPEC, name=f"config:{path}", display=f"{family.display} (config)", source=str(path),
                   lm=replace(TOY_SPEC.lm, layers=raw["layers"]))  # fmt: skip


def _toy(**changes: Any) -> BackboneFamily:
    base = replace(backbone_family("llava-1.5"), name="toy-vl", display="Toy-VL", model_types=("toy_vl",),
                   demos=(), flops_spec="toy-vl-1b", flops_specs=(TOY_SPEC,),
                   flops_config=f"{__name__}:read_toy_config")  # fmt: skip
    return replace(base, **changes)


@pytest.fixture
def toy_family() -> Iterator[BackboneFamily]:
    family = register_family(_toy())
    try:
        yield family
    finally:
        unregister_family(family.name)


@pytest.fixture
def bare_family() -> Iterator[BackboneFamily]:
    """A family with neither flops specs nor a config reader."""
    family = register_family(_toy(name="toy-bare", model_types=("toy_bare",), flops_spec="", flops_specs=(),
                                  flops_config=None))  # fmt: skip
    try:
        yield family
    finally:
        unregister_family(family.name)


def _config(folder: Path, data: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


@pytest.mark.parametrize("name", ["toy-vl", "toy-vl-1b", "TOY/Toy-VL-1B"])
def test_resolve_backbone_serves_a_registered_family_by_its_name_spec_or_alias(toy_family, name: str) -> None:
    assert resolve_backbone(name) == TOY_SPEC
    assert KNOWN_BACKBONES["toy-vl-1b"] == TOY_SPEC


def test_an_unregistered_family_is_gone_from_care_flops() -> None:
    family = register_family(_toy())
    unregister_family(family.name)
    assert "toy-vl-1b" not in KNOWN_BACKBONES
    with pytest.raises(BackboneSpecError, match="unknown backbone 'toy-vl'"):
        resolve_backbone("toy-vl")


def test_care_flops_counts_a_registered_family_from_its_record(care, toy_family) -> None:
    run = care("flops", "--backbone", "toy-vl", "--json")
    assert run.code == 0, run.err
    report = run.json()
    assert (report["backbone"]["name"], report["backbone"]["family"]) == ("toy-vl-1b", "toy-vl")
    assert report["N"] == 576 and report["budgets"] == [192, 128, 64]
    assert report["rows"][0]["method"] == "baseline" and report["rows"][0]["flops"] == TOY_BASELINE_FLOPS
    assert care("flops", "--backbone", "toy-vl-1b", "--json").json()["rows"] == report["rows"]
    typo = care("flops", "--backbone", "toy-vlx")
    assert typo.code == 2 and "did you mean toy-vl" in typo.err


def test_a_registered_family_reusing_a_tower_kind_gets_its_tower_cost(care, toy_family) -> None:
    """The toy spec has LLaVA-1.5-7B's CLIP tower on one view: the same vision-tower term, with no edit in flops."""
    toy = care("flops", "--backbone", "toy-vl", "--vision-tower", "--json").json()["rows"][0]["terms"]
    llava = care("flops", "--backbone", "llava-1.5-7b", "--vision-tower", "--json").json()["rows"][0]["terms"]
    assert toy["vision_tower"] == llava["vision_tower"] > 0


def test_a_tower_kind_care_flops_cannot_count_is_one_line(care, toy_family) -> None:
    strange = replace(TOY_SPEC, name="toy-vl-strange", aliases=(), vision=replace(TOY_SPEC.vision, kind="strange"))
    family = register_family(_toy(name="toy-strange", model_types=(), flops_spec=strange.name,
                                  flops_specs=(replace(strange, family="toy-strange"),)))  # fmt: skip
    try:
        assert care("flops", "--backbone", "toy-strange", "--json").code == 0  # the tower is an optional term
        run = care("flops", "--backbone", "toy-strange", "--vision-tower")
    finally:
        unregister_family(family.name)
    assert run.code == 2 and run.out == "" and len(run.err.strip().splitlines()) == 1
    assert "--vision-tower cannot count a vision tower of kind 'strange'" in run.err


def test_a_config_of_a_registered_family_is_read_by_its_records_reader(care, toy_family, tmp_path: Path) -> None:
    three = from_config(_config(tmp_path / "three", {"model_type": "toy_vl", "layers": 3}))
    assert (three.lm.layers, three.family, three.display) == (3, "toy-vl", "Toy-VL (config)")
    # a config with exactly a spec's dims takes that spec's display name
    assert from_config(_config(tmp_path / "two", {"model_type": "toy_vl", "layers": 2})).display == "Toy-VL-1B"
    run = care("flops", "--backbone", tmp_path / "three", "--json")
    assert run.code == 0, run.err
    assert run.json()["backbone"]["lm"]["layers"] == 3


def test_a_family_without_flops_specs_or_config_reader_says_so_in_one_line(care, bare_family, tmp_path) -> None:
    folder = _config(tmp_path / "bare", {"model_type": "toy_bare"})
    for args, needle in ((["--backbone", folder], "care flops cannot read a config of family toy-bare"),
                         (["--backbone", "toy-bare"], "backbone family toy-bare has no care flops spec")):  # fmt: skip
        run = care("flops", *args)
        assert run.code == 2 and run.out == "", run.err
        assert len(run.err.strip().splitlines()) == 1 and needle in run.err, run.err


def test_a_record_whose_flops_spec_is_not_among_its_specs_is_refused() -> None:
    with pytest.raises(ValueError, match="flops_spec 'toy-vl-7b' must name one of its flops_specs"):
        _toy(flops_spec="toy-vl-7b")


def test_a_spec_name_or_alias_of_another_familys_spec_is_refused_at_registration() -> None:
    clash = replace(TOY_SPEC, aliases=("LLaVA15",))  # llava-1.5-7b's alias, for other dims
    with pytest.raises(RuntimeError, match=r"'llava15' is claimed by 'llava-1\.5' and 'toy-vl'"):
        register_family(_toy(flops_specs=(clash,)))
    assert "toy-vl" not in [family.name for family in families()]


def test_a_family_copied_from_a_record_stands_for_the_spec_it_copied(care) -> None:
    """A plug-in made with dataclasses.replace of a shipped record keeps its specs: same names, same specs."""
    family = register_family(replace(backbone_family("llava-1.5"), name="toy-copy", model_types=("toy_copy",),
                                     demos=()))  # fmt: skip
    try:
        run = care("flops", "--backbone", "toy-copy", "--json")
        assert resolve_backbone("llava-1.5-7b") == LLAVA_7B
    finally:
        unregister_family(family.name)
    assert run.code == 0, run.err
    assert run.json()["backbone"]["name"] == "llava-1.5-7b"
    assert run.json()["rows"] == care("flops", "--backbone", "llava-1.5", "--json").json()["rows"]


def _literals(path: Path) -> set[str]:
    """The string constants of a module's code (docstrings left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
        and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }  # fmt: skip
    constants = (node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str))
    return {node.value for node in constants if id(node) not in docstrings}


def test_care_core_flops_names_no_family_model_type_or_model_size() -> None:
    """What care flops knows of a family comes from the registry: its code spells no family, model type or spec."""
    words = {word for family in families()
             for word in (family.name, *family.model_types, *(spec.name for spec in family.flops_specs))}  # fmt: skip
    folder = Path(care_core.flops.__file__).parent
    named = {path.name: sorted(_literals(path) & words) for path in sorted(folder.glob("*.py"))}
    assert {name: found for name, found in named.items() if found} == {}
