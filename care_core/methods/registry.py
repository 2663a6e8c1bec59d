"""The method registry: name -> method class, filled by ``@register`` in each method's module."""

from __future__ import annotations

import difflib
from typing import Any

from care_core.errors import MethodError
from care_core.methods.base import Method

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


def _load_all() -> None:
    import care_core.methods.all  # noqa: F401  (imports every method module once)


def method_names() -> list[str]:
    """Registered method names (aliases excluded): CaRe and its ablations first, then the peers."""
    from care_core.methods.all import LISTING_ORDER

    _load_all()
    rank = {name: i for i, name in enumerate(LISTING_ORDER)}
    return sorted(_METHODS, key=lambda name: rank.get(name, len(rank)))


def canonical_name(name: str) -> str:
    _load_all()
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


def create_method(name: str, **options: Any) -> Method:
    """An instance of the named method with its default hyperparameters, overridden by `options`."""
    return method_class(name)(**options)
