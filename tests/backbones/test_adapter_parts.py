"""Adapters are composed, not stacked: every shipped family's adapter derives from ChatAdapter alone and takes what it
shares with other families from the shared-part modules, so adding a family never means editing another's class."""

from __future__ import annotations

import pytest

from care_core.backbones.chat_adapter import ChatAdapter
from care_core.backbones.families import families, import_path

ADAPTERS = {family.name: import_path(family.adapter) for family in families()}


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_every_family_adapter_derives_from_chat_adapter_directly(name: str) -> None:
    assert ADAPTERS[name].__bases__ == (ChatAdapter,)


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_no_family_adapter_inherits_another_familys_adapter(name: str) -> None:
    others = {cls for family, cls in ADAPTERS.items() if family != name}
    assert not others & set(ADAPTERS[name].__mro__)


def test_every_shipped_family_is_checked() -> None:
    assert {"llava-1.5", "llava-next", "llava-onevision", "qwen2.5-vl", "qwen3-vl", "internvl3"} <= set(ADAPTERS)
