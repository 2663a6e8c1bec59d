"""A backbone spec's image layout: read from the one geometry it states, two are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

from care_core.flops.specs import KNOWN_BACKBONES


@pytest.mark.parametrize(("name", "layout"), [("llava-1.5-7b", "one_view"), ("llava-next-7b", "anyres"),
                                              ("llava-onevision-7b", "anyres"), ("qwen2.5-vl-7b", "merged_grid"),
                                              ("qwen3-vl-8b", "merged_grid"), ("internvl3-8b", "tiles")])  # fmt: skip
def test_image_layout_follows_the_geometry_a_spec_states(name: str, layout: str) -> None:
    assert KNOWN_BACKBONES[name].image_layout == layout


def test_a_spec_stating_two_image_layouts_is_refused() -> None:
    with pytest.raises(ValueError, match="states grid_pinpoints and max_tiles: give one image layout"):
        replace(KNOWN_BACKBONES["llava-next-7b"], max_tiles=12)
