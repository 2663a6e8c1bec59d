"""A shipped family is its folder: the builders its record names (demos, full-size model) live in it."""

from __future__ import annotations

import importlib

from care_core.backbones.families import BackboneFamily, import_path, shipped_packages


def _shipped() -> dict[str, BackboneFamily]:
    """Package folder name -> the family its record defines."""
    return {module.split(".")[2]: importlib.import_module(module).FAMILY for module in shipped_packages()}


def test_each_shipped_familys_builders_live_in_its_own_folder() -> None:
    shipped = _shipped()
    assert set(shipped) == {"llava_1_5", "llava_next", "llava_onevision", "qwen2_5_vl", "qwen3_vl", "qwen3_5",
                            "internvl3", "gemma3"}  # fmt: skip
    for package, family in shipped.items():
        assert family.full_size is not None, family.name
        paths = [family.full_size.builder]
        paths += [path for demo in family.demos for path in (demo.builder, demo.trained_builder) if path is not None]
        assert all(path.startswith(f"care_core.backbones.{package}.demo:") for path in paths), paths
        assert all(callable(import_path(path)) for path in paths)
