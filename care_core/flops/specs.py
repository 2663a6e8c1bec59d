"""The ``care flops`` backbone specs: every registered family's, read from its record, and ``from_config(path)``.

Each family's record (``care_core/backbones/<family>/__init__.py``, or a plug-in's ``register_family``) holds its
specs (``BackboneFamily.flops_specs``: the published numbers and their sources) and names the reader of its
``config.json`` (``BackboneFamily.flops_config``); nothing here names a family or a model size.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from care_core.architecture import BackboneSpec, BackboneSpecError
from care_core.backbones.config_reading import brief, load_json
from care_core.backbones.families import backbone_family, families, import_path, model_types
from care_core.errors import CareError


def known_backbones() -> dict[str, BackboneSpec]:
    """Spec name -> spec over every registered family's record, in the families' listing order."""
    return {spec.name: spec for family in families() for spec in family.flops_specs}


class _KnownBackbones(Mapping[str, BackboneSpec]):
    """:data:`KNOWN_BACKBONES`: :func:`known_backbones` read at each use, so a family registered later is in it."""

    def __getitem__(self, name: str) -> BackboneSpec:
        return known_backbones()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(known_backbones())

    def __len__(self) -> int:
        return len(known_backbones())


#: spec name -> spec of every registered family (a live view of the registry)
KNOWN_BACKBONES: Mapping[str, BackboneSpec] = _KnownBackbones()


def short_names() -> dict[str, str]:
    """Family name -> the spec it stands for (`llava-1.5` -> `llava-1.5-7b`, ...): each family record's
    ``flops_spec``, for the families that have specs."""
    return {family.name: family.flops_spec for family in families() if family.flops_specs}


def _aliases() -> dict[str, str]:
    """Lower-cased alias -> spec name."""
    return {alias.lower(): spec.name for spec in known_backbones().values() for alias in spec.aliases}


def _by_key(lowered: str) -> BackboneSpec | None:
    """The spec a lower-cased spec name, alias or family name stands for; None if none."""
    known = {name.lower(): spec for name, spec in known_backbones().items()}
    aliases = {alias: known[name.lower()] for alias, name in _aliases().items()}
    by_family = {family.lower(): known[name.lower()] for family, name in short_names().items()}
    return known.get(lowered) or aliases.get(lowered) or by_family.get(lowered)


def resolve_backbone(name: str) -> BackboneSpec:
    """A spec name or alias (case-insensitive), a family name, a config.json, or a model folder holding one."""
    key = name.strip()
    if not key:
        raise BackboneSpecError("is empty", parameter="backbone")
    lowered = key.lower()
    found = _by_key(lowered)
    if found is not None:
        return found
    path = Path(key).expanduser()
    if path.exists():
        return from_config(path)
    looks_like_path = key.endswith(".json") or key.startswith((".", "/", "~")) or "\\" in key
    if looks_like_path:
        raise BackboneSpecError(f"no such file or folder: {key}")
    without = [family.name for family in families() if not family.flops_specs and family.name.lower() == lowered]
    if without:
        raise BackboneSpecError(f"backbone family {without[0]} has no care flops spec (its record lists none)")
    known = [*short_names(), *known_backbones()]
    starting = [family for family in short_names() if family.startswith(lowered)]
    if len(starting) > 1:  # "llava", "qwen": a family name would be a guess
        raise BackboneSpecError(f"{name!r} is ambiguous: give one of {', '.join(starting)} (or a full name such as "
                                f"{short_names()[starting[0]]})", parameter="backbone")  # fmt: skip
    # suggestions by the names the error lists: an alias that is close stands for its spec's name
    choices = {**{key: key for key in known}, **_aliases()}
    close = [choices[match] for match in difflib.get_close_matches(lowered, list(choices), n=3, cutoff=0.5)]
    hint = f"; did you mean {', '.join(dict.fromkeys(close))}?" if close else ""
    raise BackboneSpecError(f"unknown backbone {name!r}{hint} (known: {', '.join(known)}; or a local config.json or "
                            "model folder)")  # fmt: skip


# ---------------------------------------------------------------------------------------------- config.json


def from_config(path: str | Path) -> BackboneSpec:
    """Build a spec from a Hugging Face `config.json` (a model_type of a registered family) with the reader its
    family's record names (``BackboneFamily.flops_config``).

    Missing fields take the defaults transformers itself would use (the config classes are asked), so the
    `llava-hf` configs, whose `text_config` names only the Vicuna checkpoint, resolve to Vicuna's dims.
    """
    path = Path(path).expanduser()
    folder = path if path.is_dir() else path.parent
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise BackboneSpecError(f"{folder} has no config.json (give a model folder or its config.json)")
    raw = load_json(path)
    model_type = raw.get("model_type")
    if model_type not in model_types():
        raise BackboneSpecError(
            f"{path}: model_type {model_type!r} is not supported (supported: {', '.join(model_types())})"
        )
    family = backbone_family(model_type)
    if family.flops_config is None:
        raise BackboneSpecError(f"{path}: care flops cannot read a config of family {family.name} (its record "
                                "names no flops_config reader)")  # fmt: skip
    try:
        spec: BackboneSpec = import_path(family.flops_config)(raw, path, family)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError) as exc:
        if isinstance(exc, CareError):
            raise
        raise BackboneSpecError(f"{path}: malformed {model_type} config ({brief(exc)})") from None
    return _match_paper(spec)


def _signature(spec: BackboneSpec) -> tuple[Any, ...]:
    return (spec.family, spec.lm, spec.projector, spec.vision, spec.grid_pinpoints, spec.max_tiles, spec.max_crops)


def _match_paper(spec: BackboneSpec) -> BackboneSpec:
    """A config with exactly a registry backbone's dims takes that backbone's display name and paper rows."""
    for known in known_backbones().values():
        if _signature(known) == _signature(spec):
            return replace(spec, display=known.display, paper_key=known.paper_key,
                           default_tokens=known.default_tokens, default_tokens_note=known.default_tokens_note,
                           paper_budgets=known.paper_budgets)  # fmt: skip
    return spec
