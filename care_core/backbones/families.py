"""The backbone-family registry: one frozen record per family, read by everything that needs a backbone fact.

A record says how the family is spelled (its one user-facing name, e.g. ``llava-1.5``), which ``config.json``
``model_type`` values it loads, which adapter class wraps it (a lazy ``module:attribute`` path), what its
vision tokens offer the methods (a CLS token, one raster grid), its embedded demos, its ``care flops`` specs, its
lmms-eval model id and how the GPU benchmarks build it at full size. The loader, the methods
(:meth:`care_core.methods.Method.serves`), ``care flops``, the demos, the lmms-eval plugin, the CLI and the
benchmarks read these records; nothing else lists families.

The families shipped with care are found, not listed: every sub-package of ``care_core.backbones`` whose
``__init__`` defines ``FAMILY`` (its record) is registered on the registry's first read. A family
defined elsewhere (a user's plug-in, a test) calls :func:`register_family` itself and is served the same way.
How to add one: docs/design/families.md §Adding a family.

This module imports neither torch nor transformers (``care --help`` reads the demo names from it).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import pkgutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from care_core.architecture import BackboneSpec
from care_core.errors import CareError
from care_core.vocabulary import TRAITS, Trait

RANDOM_DEMO_NOTE = "demo backbone: random weights — its numbers say nothing about a real model"
TRAINED_DEMO_NOTE = (
    "demo backbone: tiny model trained on synthetic shapes — it knows coloured shapes only; "
    "its numbers say nothing about a real model"
)


#: where trained demo weights ship (``<file>.safetensors`` + ``manifest.json``: file name -> sha256, bytes, training)
WEIGHTS_DIR = Path(__file__).resolve().parent / "demo_weights"
MANIFEST = "manifest.json"


def weights_dir() -> Path:
    """The folder of the shipped demo weights (read at call time: tests point it at a temporary folder)."""
    return WEIGHTS_DIR


def read_manifest(folder: Path | None = None) -> dict[str, Any]:
    """``demo_weights/manifest.json``: file name -> {"sha256", "bytes", ...}; {} when there is none."""
    try:
        data = json.loads(((folder or weights_dir()) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def import_path(path: str) -> Any:
    """The object a ``"package.module:attribute"`` path names (imported now)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class DemoBackbone:
    """One embedded demo: its name, version, family and how to build it (model, processor) from a seed.

    A demo with ``weights`` loads that file of ``demo_weights/`` into its builder's skeleton. With a
    ``trained_builder`` too, the weights are optional: until the file is in the manifest (installed by
    ``python -m scripts.train_demo --install-from``) the demo is not :attr:`shipped` (left out of the user's lists,
    refused on load with one line; :meth:`build` gives ``builder``'s random model), and once it is, the trained
    skeleton with the shipped weights (another cache folder, see :attr:`folder_name`)."""

    name: str
    version: int
    family: str
    builder: str  # "module:function", function(seed) -> (model, processor); imported only when a demo is built
    description: str
    seed: int = 0
    #: file name of the trained weights shipped in ``demo_weights/`` (None: random weights from ``seed``)
    weights: str | None = None
    #: "module:function" of the trained skeleton when it differs from ``builder`` (weights optional, see above)
    trained_builder: str | None = None

    def build(self, seed: int) -> tuple[Any, Any]:
        """The demo's (model, processor) from ``seed``: the trained skeleton when :attr:`trained`."""
        builder = self.trained_builder if self.trained and self.trained_builder else self.builder
        return import_path(builder)(seed)  # type: ignore[no-any-return]

    def build_trained(self, seed: int) -> tuple[Any, Any]:
        """The skeleton the shipped weights load into (what training starts from), installed or not."""
        if self.weights is None:
            raise CareError(f"demo {self.name} has no trained weights")
        return import_path(self.trained_builder or self.builder)(seed)  # type: ignore[no-any-return]

    @property
    def folder_name(self) -> str:
        optional = self.trained_builder is not None and self.trained
        return f"{self.name}-v{self.version}" + ("-trained" if optional else "")

    @property
    def trained(self) -> bool:
        """True when the demo loads shipped weights (an optional file: only once the manifest lists it)."""
        if self.weights is None:
            return False
        return self.trained_builder is None or self.weights in read_manifest()

    @property
    def shipped(self) -> bool:
        """False for a demo with optional weights that this care does not list in its manifest (not trained yet):
        it is left out of the lists a user sees and refused on load (:func:`unshipped_reason`)."""
        return self.trained_builder is None or self.trained

    @property
    def note(self) -> str:
        """The one-line demo note shown wherever the demo's results are."""
        return TRAINED_DEMO_NOTE if self.trained else RANDOM_DEMO_NOTE


@dataclass(frozen=True)
class FullSizeModel:
    """How the GPU benchmarks (``benchmarks/models.py``) build the family at full size: the widths of its
    :attr:`BackboneFamily.flops_spec`, seeded random weights, built directly on the device."""

    image_side_px: int  # the square image side the latency gate feeds it
    #: "module:function", function(spec, device, dtype, tiny) -> (model, processor), with ``spec`` the flops spec
    #: (care_core.architecture.BackboneSpec) and ``tiny`` the same geometry at small widths; imported only when built
    builder: str


@dataclass(frozen=True)
class BackboneFamily:
    """Everything care knows about one backbone family, in one place."""

    name: str  # the one spelling, everywhere (JSON, metadata, care methods, flops): e.g. "llava-1.5"
    display: str  # e.g. "LLaVA-1.5"
    model_types: tuple[str, ...]  # the config.json model_type values this family loads
    adapter: str  # "module:Class" of its VLMAdapter, imported when a model is loaded
    has_cls_token: bool  # the vision tower has a CLS token (CLS-attention methods can run)
    single_grid: bool  # the visual tokens form one raster grid (LLaVA-NeXT: a base view + high-res tiles)
    crops: bool  # the image is cut into several crops (base view + tiles), each through the vision tower
    flops_spec: str  # the name of the spec in flops_specs the family name stands for in care flops
    lmms_eval_model: str  # the lmms-eval model id serving the family (care_core.integrations.lmms_eval)
    #: every language-model decoder layer is softmax attention, so any layer has an attention map (FastV, SparseVLM
    #: read one at an early layer); False for hybrid decoders such as Qwen3.5's (Gated DeltaNet linear layers)
    lm_attention_maps: bool = True
    demos: tuple[DemoBackbone, ...] = field(default=(), compare=False)
    rank: int = 100  # listing order (lower first); families of the same rank list by name
    #: the family's model sizes as care flops counts them (``care flops --backbone <name or alias>``)
    flops_specs: tuple[BackboneSpec, ...] = field(default=(), compare=False)
    #: "module:function" turning a read config.json into a spec: function(raw, path, family) -> BackboneSpec, where
    #: raw is the JSON object, path the config.json (its folder holds the processor's config); None: care flops
    #: cannot read the family's configs
    flops_config: str | None = None
    #: more names lmms-eval accepts for :attr:`lmms_eval_model` (e.g. ``care_llava_next`` for ``care_llava``)
    lmms_eval_aliases: tuple[str, ...] = ()

    full_size: FullSizeModel | None = None  # the GPU benchmarks' full-size model (None: the family has none)

    def __post_init__(self) -> None:
        names = [spec.name for spec in self.flops_specs]
        if len(set(names)) < len(names) or (names and self.flops_spec not in names):
            raise ValueError(f"backbone family {self.name!r}: flops_spec {self.flops_spec!r} must name one of its "
                             f"flops_specs, each once (got {', '.join(names)})")  # fmt: skip

    @property
    def traits(self) -> frozenset[Trait]:
        offered = {"cls_token": self.has_cls_token, "single_grid": self.single_grid,
                   "lm_attention_maps": self.lm_attention_maps}  # fmt: skip
        return frozenset(trait for trait in TRAITS if offered[trait])

    def missing(self, requires: frozenset[Trait]) -> list[Trait]:
        """The traits of ``requires`` this family does not offer, in :data:`TRAITS` order."""
        return [trait for trait in TRAITS if trait in requires and trait not in self.traits]


_FAMILIES: dict[str, BackboneFamily] = {}
_KEYS: dict[str, str] = {}  # lower-cased name or model_type -> family name
FAMILY_PACKAGE = "care_core.backbones"  # each of its sub-packages whose __init__ defines FAMILY is a family
#: the entry-point group through which an installed package offers families: each entry names a BackboneFamily
#: (``[project.entry-points."care.families"] mine = "my_package:FAMILY"``)
PLUGIN_GROUP = "care.families"


@functools.cache
def shipped_packages() -> tuple[str, ...]:
    """The sub-packages of ``care_core.backbones`` (``care_core.backbones.<family>``), by name; each that defines
    ``FAMILY`` in its ``__init__`` (torch-free) is a shipped family."""
    package = importlib.import_module(FAMILY_PACKAGE)
    return tuple(sorted(f"{FAMILY_PACKAGE}.{m.name}" for m in pkgutil.iter_modules(package.__path__) if m.ispkg))


@functools.cache
def installed_plugins() -> tuple[BackboneFamily, ...]:
    """The families installed packages offer through :data:`PLUGIN_GROUP`, loaded once per process. An entry that
    fails to load, or names no :class:`BackboneFamily`, is skipped with a one-line warning: one broken plug-in must
    not take the shipped families with it."""
    found = []
    for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        try:
            family = entry.load()
        except Exception as exc:
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            warnings.warn(f"care: backbone plug-in {entry.name!r} ({entry.value}) failed to load: {reason}",
                          stacklevel=2)  # fmt: skip
            continue
        if not isinstance(family, BackboneFamily):
            warnings.warn(f"care: backbone plug-in {entry.name!r} ({entry.value}) is not a BackboneFamily",
                          stacklevel=2)  # fmt: skip
            continue
        found.append(family)
    return tuple(found)


def _discover_shipped() -> None:
    """Register each shipped family's ``FAMILY`` record, then each installed plug-in's, where not registered yet."""
    for module in shipped_packages():
        family = getattr(importlib.import_module(module), "FAMILY", None)
        if isinstance(family, BackboneFamily) and family.name not in _FAMILIES:
            register_family(family)
    for family in installed_plugins():
        if family.name not in _FAMILIES:
            register_family(family)


def _registered() -> dict[str, BackboneFamily]:
    """Every family: the shipped ones (found on first use) and those registered by a call, by rank then name."""
    _discover_shipped()
    return dict(sorted(_FAMILIES.items(), key=lambda item: (item[1].rank, item[0])))


def register_family(family: BackboneFamily) -> BackboneFamily:
    """Add a family; its name and model types must be new (RuntimeError otherwise)."""
    keys = [family.name.lower(), *(t.lower() for t in family.model_types)]
    for key in keys:
        if key in _KEYS and _KEYS[key] != family.name:
            raise RuntimeError(f"backbone family key {key!r} is claimed by {_KEYS[key]!r} and {family.name!r}")
    if family.name in _FAMILIES:
        raise RuntimeError(f"backbone family {family.name!r} is registered twice")
    _check_flops_names_are_new(family)
    _FAMILIES[family.name] = family
    _KEYS.update(dict.fromkeys(keys, family.name))
    return family


def _flops_keys(family: BackboneFamily) -> dict[str, BackboneSpec]:
    """The lower-cased names and aliases ``care flops`` finds the family's specs by, each with its spec."""
    return {key.lower(): spec for spec in family.flops_specs for key in (spec.name, *spec.aliases)}


def _check_flops_names_are_new(family: BackboneFamily) -> None:
    """RuntimeError when a name or alias of the family's care flops specs is another family's for another spec (a
    family copied from a record may keep its specs: the same name stands for the same spec)."""
    mine = _flops_keys(family)
    for other in _FAMILIES.values():
        for key, spec in _flops_keys(other).items():
            if key in mine and mine[key] != spec:
                raise RuntimeError(f"care flops spec name {key!r} is claimed by {other.name!r} and {family.name!r}")


def unregister_family(name: str) -> None:
    """Remove the family registered as ``name`` (a plug-in's test cleans up with this); CareError if unknown."""
    family = backbone_family(name)
    del _FAMILIES[family.name]
    for key in [key for key, owner in _KEYS.items() if owner == family.name]:
        del _KEYS[key]


def families() -> list[BackboneFamily]:
    """Every registered family, in listing order (:attr:`BackboneFamily.rank`)."""
    return list(_registered().values())


def family_names() -> list[str]:
    return list(_registered())


def backbone_family(key: str) -> BackboneFamily:
    """The family named ``key``, or loading config.json model_type ``key`` (case-insensitive); CareError if none."""
    known_families = _registered()
    found = _KEYS.get(key.strip().lower())
    if found is None:
        known = ", ".join(known_families)
        raise CareError(f"unknown backbone family {key!r} (known: {known})")
    return _FAMILIES[found]


def model_types() -> list[str]:
    """Every config.json model_type some family loads."""
    return [t for family in families() for t in family.model_types]


def demo_backbones() -> dict[str, DemoBackbone]:
    """Demo name -> demo, over every family."""
    return {demo.name: demo for family in families() for demo in family.demos}


def shipped_demos() -> list[str]:
    """The demo names a user is offered (``--model`` help, error messages): every demo but those whose optional
    trained weights this care does not ship yet (:attr:`DemoBackbone.shipped`)."""
    return [name for name, demo in demo_backbones().items() if demo.shipped]


def unshipped_reason(demo: DemoBackbone) -> str:
    """One line on a demo that is not :attr:`DemoBackbone.shipped`: what is missing and what to load instead (the
    family's random demo)."""
    family = backbone_family(demo.family)
    instead = [d.name for d in family.demos if d.weights is None]
    hint = f"; load {instead[0]} (random weights) instead" if instead else ""
    return (f"{demo.name}: its trained weights ({demo.weights}) are not shipped with this care yet (not in "
            f"{weights_dir() / MANIFEST}){hint}")  # fmt: skip


def served_families(lmms_eval_model: str) -> tuple[str, ...]:
    """The families whose records name ``lmms_eval_model`` as their lmms-eval model id."""
    return tuple(family.name for family in families() if family.lmms_eval_model == lmms_eval_model)


#: the demo every tool uses when no model is given
DEFAULT_DEMO = "tiny-llava"
#: the demos whose weights file is optional: trained or random is the record's ``trained`` (its marker's "weights")
OPTIONAL_WEIGHTS = "tiny weights (trained on synthetic shapes where shipped, else random); demo only"
