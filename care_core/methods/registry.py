"""The method registry: name -> method class, filled by ``@register`` in each method's module.

Every module of this package is found and imported on first use (:func:`_discover`, as the family registry finds
the family folders), so no module here imports the method modules by name and the import graph has no cycle.
Everything else about a method (listing rank, cost model, score label, backbones it serves, CaRe
hyperparameters it reads) is metadata on its class; the functions here only read it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import pkgutil
from typing import TYPE_CHECKING, Any

from care_core.errors import MethodError
from care_core.methods.base import Method

if TYPE_CHECKING:
    from care_core.config import CaReConfig

_PACKAGE = __name__.rpartition(".")[0]  # care_core.methods: where every method's module lives
_METHODS: dict[str, type[Method]] = {}
_ALIASES: dict[str, str] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: add a method (and its aliases) to the registry; duplicate names are an error."""
    for key in (cls.name, *cls.aliases):
        if key in _METHODS or key in _ALIASES:
            raise RuntimeError(f"method name {key!r} is registered twice")
    _METHODS[cls.name] = cls
    for alias in cls.aliases:
        _ALIASES[alias] = cls.name
    return cls


@functools.cache
def _discover() -> None:
    """Import every module of this package once: each method's module registers its classes as it loads (the
    contract, this registry and the helpers register nothing). Modules are found on disk, not named here."""
    package = importlib.import_module(_PACKAGE)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")


def method_names() -> list[str]:
    """Registered method names (aliases excluded) by their class's ``rank``: CaRe and its ablations first."""
    _discover()
    return sorted(_METHODS, key=lambda name: (_METHODS[name].rank, name))


def methods_for_backbone(family: str) -> list[str]:
    """The registered methods that can run on backbone `family` ("llava-1.5", "llava-next", "qwen2.5-vl", ...),
    in listing order: the list every ``--method all`` uses."""
    return [name for name in method_names() if _METHODS[name].serves(family)]


def canonical_name(name: str) -> str:
    _discover()
    key = name.strip().lower()
    if key in _METHODS:
        return key
    if key in _ALIASES:
        return _ALIASES[key]
    choices = list(_METHODS) + list(_ALIASES)
    close = difflib.get_close_matches(key, choices, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise MethodError(f"unknown method {name!r}{hint} (known: {', '.join(method_names())}; see 'care methods')")


def method_class(name: str) -> type[Method]:
    return _METHODS[canonical_name(name)]


def build_method(name: str, config: CaReConfig | None = None, **options: Any) -> Method:
    """The named method. With `config` (the user's CaRe configuration) the CaRe family and ZOO-Prune take their
    hyperparameters from it and peers that draw random numbers its seed (which fields each method reads is its
    class's ``hyperparameters``); without, every field keeps the method's default. `options` override fields."""
    cls = method_class(name)
    if config is None:
        return cls(**options)
    method = cls.from_config(config)
    return dataclasses.replace(method, **options) if options else method  # type: ignore[type-var]


def score_label(name: str) -> str | None:
    """What the method's per-token scores are ("psi_bar" for the PRCA-based methods), or None."""
    return method_class(name).score_label
