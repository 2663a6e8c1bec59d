"""Deferred imports, so that `care --help`, `care methods` and `care flops` start without torch.

Modules that must stay importable without torch (the method registry, the flops model, the CLI's
option parsing) write ``from care_core._lazy import torch`` instead of ``import torch``: the name
resolves to the real module on first attribute access. Type checkers see the real module.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any


class LazyModule(types.ModuleType):
    """A stand-in for a module that imports it on first attribute access."""

    def __init__(self, name: str) -> None:
        super().__init__(name)

    def _load(self) -> types.ModuleType:
        # kept after the first import: import_module on every attribute read cost ~2 us each (a hot path reads
        # several per call); attributes are still read from the module itself, so a patched one is seen
        loaded = self.__dict__.get("_loaded")
        if loaded is None:
            loaded = self.__dict__["_loaded"] = importlib.import_module(self.__name__)
        return loaded

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._load(), attr)

    def __dir__(self) -> list[str]:
        return dir(self._load())


def lazy_exports(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's module-level ``__getattr__``: each name in ``homes`` is imported from its submodule
    (``homes[name]``, relative to ``package``) on first use, so importing the package stays cheap."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{homes[name]}"), name)

    return __getattr__


if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F
else:
    torch = LazyModule("torch")
    F = LazyModule("torch.nn.functional")

__all__ = ["F", "LazyModule", "lazy_exports", "torch"]
