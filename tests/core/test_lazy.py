"""Deferred imports (care_core/_lazy.py): a lazy module imports its module on the first attribute read only, and
reads every attribute from that module (a patched attribute is the one seen)."""

from __future__ import annotations

import importlib
import json
from types import ModuleType

import pytest

from care_core._lazy import LazyModule


def test_a_lazy_module_imports_once_and_reads_the_modules_own_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    imports: list[str] = []
    real = importlib.import_module

    def counting(name: str, package: str | None = None) -> ModuleType:
        imports.append(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", counting)
    lazy = LazyModule("json")
    assert imports == []  # nothing imported until an attribute is read
    assert lazy.dumps is json.dumps and lazy.loads is json.loads and lazy.JSONDecodeError is json.JSONDecodeError
    assert imports == ["json"]  # once, however many reads follow
    monkeypatch.setattr(json, "dumps", lambda value: "patched")
    assert lazy.dumps(1) == "patched"
    assert imports == ["json"]
