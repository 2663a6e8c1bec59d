"""The import graph (docs/design.md §Layers): every module in one layer, no import that climbs, no cycle.

Every ``import`` and ``from ... import`` statement counts, those inside functions too; relative imports are resolved.
Exempt: imports under ``if TYPE_CHECKING:`` (they never run) and what ``importlib`` imports by name (the packages'
lazy re-exports; the two registries' discovery of the family folders and the method modules on disk).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("care_core", "care_cli", "benchmarks", "scripts")

#: Bottom to top. A module (or package, with everything under it) may import its own layer or lower ones; a module
#: takes the layer of its longest entry here.
LAYERS: Mapping[int, tuple[str, ...]] = {
    1: (  # the shared vocabulary, errors, config, and the plumbing every layer uses
        "care_core",  # the package's face: lazy re-exports only
        "care_core.vocabulary",
        "care_core.errors",
        "care_core.config",
        "care_core.home",
        "care_core._lazy",
        "care_core._memo",
        "care_core.precision",
        "care_core.timing",
        "care_core.generation",
        "care_core.images",
        "care_core.architecture",
    ),
    2: (  # the equations
        "care_core.budget",
        "care_core._chunks",
        "care_core.kernels",
        "care_core.norm_first",
        "care_core.scoring",
        "care_core.anchors",
        "care_core.calibration",
        "care_core.care",
        "care_core.csr",
        "care_core.statistics",
    ),
    3: (  # methods; batched CaRe works on their inputs; a method checks its needs against the family records
        "care_core.methods",
        "care_core.care_batch",
        "care_core.backbones.families",
    ),
    4: (  # backbone adapters, loading, demos; the batch sizes and out-of-memory splitting their generation uses;
        # the reductions' CUDA graphs (captured like the decoder's, with the same out-of-memory rule);
        # the token counts of an image, which the families' care flops config readers use
        "care_core.backbones",
        "care_core.batch_sizes",
        "care_core.reduction_graphs",
        "care_core.flops.tokens",
    ),
    5: (  # what runs backbones and methods
        "care_core.pipeline",
        "care_core.prefetch",
        "care_core.runs",
        "care_core.dataset_csr",
        "care_core.dropin",
        "care_core.flops",
        "care_core.overlays",
        "care_core.figures",
        "care_core.synthetic",
    ),
    6: ("care_core.integrations",),
    7: ("care_cli",),
    8: ("benchmarks", "scripts"),
}

Graph = dict[str, set[str]]


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `packages` under `root` (a package is its ``__init__``)."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            skipped.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return skipped


def _owner(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module of `modules` a dotted import target lands in (its longest known prefix), None outside them."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imported_names(module: str, path: Path) -> list[str]:
    """Every dotted name `module` imports at run time: ``import a.b`` -> a.b, ``from a import b`` -> a.b (a module or
    a name in a), relative imports resolved, those under ``if TYPE_CHECKING:`` left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            names.extend(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph(modules: Mapping[str, Path]) -> Graph:
    """module -> the modules of `modules` it imports (``from pkg import name`` lands in pkg unless name is a module)."""
    graph: Graph = {}
    for module, path in modules.items():
        targets = {_owner(name, modules) for name in imported_names(module, path)}
        graph[module] = {target for target in targets if target is not None and target != module}
    return graph


def layer_of(module: str) -> int | None:
    """The layer of `module`'s longest entry in :data:`LAYERS`; None for a module in none."""
    best: tuple[int, int] | None = None  # (length of the entry, layer)
    for layer, entries in LAYERS.items():
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and (best is None or len(entry) > best[0]):
                best = (len(entry), layer)
    return None if best is None else best[1]


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = [stack.pop()]
            while component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph(module_files(ROOT, PACKAGES))


def test_every_module_has_a_layer(graph: Graph) -> None:
    assert [module for module in graph if layer_of(module) is None] == []


def test_no_import_climbs_to_a_higher_layer(graph: Graph) -> None:
    climbs = [
        f"{module} (layer {layer_of(module)}) -> {target} (layer {layer_of(target)})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if (layer_of(target) or 0) > (layer_of(module) or 0)
    ]
    assert climbs == []


def test_no_import_cycle(graph: Graph) -> None:
    assert cycles(graph) == []


def test_top_level_packages_import_one_way(graph: Graph) -> None:
    """benchmarks and scripts share a layer, yet only one of them may import the other."""
    packages: Graph = {}
    for module, targets in graph.items():
        packages.setdefault(module.split(".")[0], set()).update(t.split(".")[0] for t in targets)
    assert cycles({package: targets - {package} for package, targets in packages.items()}) == []


def test_imports_inside_functions_and_relative_ones_count(tmp_path: Path) -> None:
    """A hand-made package: a relative import inside a function, a ``from pkg import module``, a ``from pkg import
    name`` and a TYPE_CHECKING import give exactly the edges written here."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("NAME = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "low.py").write_text("")
    (pkg / "sub" / "mid.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import low\n"
        "def f():\n    from ..low import thing\n    from . import leaf\n"
    )
    (pkg / "sub" / "leaf.py").write_text("from pkg import NAME\nimport pkg.sub.mid\n")
    got = import_graph(module_files(tmp_path, ("pkg",)))
    assert got == {
        "pkg": set(),
        "pkg.low": set(),
        "pkg.sub": set(),
        "pkg.sub.mid": {"pkg.low", "pkg.sub.leaf"},
        "pkg.sub.leaf": {"pkg", "pkg.sub.mid"},
    }
    assert cycles(got) == [["pkg.sub.leaf", "pkg.sub.mid"]]
