"""The package layout: every module imports, no import cycle, no import from a higher layer.

Layers, lowest first (a module may import its own layer and the ones below it):

    errors, atomic,  one error type, one atomic writer, one registry type, the cache root,
    registry, paths, the ranks of a torchrun run, cache keys and memoisation, YAML reading
    distributed,
    memo, yamlio
    core             the method on one layer: schedule, projection + fold, experts
    model            a Hugging Face model: arch adapters, loading, surgery, presets, wrap/merge, hooks
    pruning          pruning criteria
    data             documents, packing, the feature cache
    recovery         objectives, trainer, sampler, recovery methods
    eval             perplexity, latency, benchmarks, retained performance, offline tasks
    app              config, pipeline, compare, reports, export, cli (the only argparse)

Every ``import`` in a file counts, also those inside functions (a lazy import is still a
dependency) and those under ``if TYPE_CHECKING:`` (a type a lower layer names is a
dependency on the layer that defines it, even if the import never runs). The package root
(``overrep/__init__.py``: ``__version__`` and the public re-exports) sits above everything; only
``__version__`` may be read from it. The subpackage names are not names the root exports
(``overrep.prune`` would shadow the function ``overrep.prune`` once imported).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "overrep"
LAYERS = [("errors", "atomic", "registry", "paths", "distributed", "memo", "yamlio"), ("core",), ("model",), ("pruning",), ("data",), ("recovery",), ("eval",), ("app",)]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
FACADES = {"overrep", "overrep.__main__"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """The overrep modules ``name`` imports (type-only imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.split(".")[0] == "overrep")
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - child.level + 1]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.split(".")[0] != "overrep":
                    continue
                subs = [f"{target}.{a.name}" for a in child.names if f"{target}.{a.name}" in MODULES]
                found.update(subs or [target])
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found.discard(name)
    return {m for m in found if m in MODULES}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> int:
    if name in FACADES:
        return len(LAYERS)
    return RANK[name.split(".")[1]]


def test_every_module_has_a_layer():
    assert {n for n in MODULES if n not in FACADES and n.split(".")[1] not in RANK} == set()


@pytest.mark.parametrize("name", [n for n in MODULES if not n.endswith("__main__")])
def test_module_imports(name):
    importlib.import_module(name)


def test_no_upward_imports():
    bad = []
    for name, deps in GRAPH.items():
        for dep in deps:
            if dep == "overrep":  # the root: only __version__ is read from it
                continue
            if _layer(dep) > _layer(name):
                bad.append(f"{name} imports {dep}")
    assert bad == []


def test_subpackages_do_not_shadow_the_public_api():
    import overrep

    assert {n.split(".")[1] for n in MODULES if n.count(".") >= 1} & set(overrep.__all__) == set()


def test_no_import_cycles():
    """Tarjan's strongly connected components: any component of two or more modules is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            connect(v)
    assert cycles == []


def test_the_graph_sees_imports():
    """The checks above would pass vacuously on an empty graph."""
    assert "overrep.core.schedule" in GRAPH["overrep.core.projection"]
    assert "overrep.model.arch" in GRAPH["overrep.model.surgery"]
    assert "overrep.app.pipeline" in GRAPH["overrep.app.commands"]  # a lazy import counts
    assert "overrep.recovery.options" in GRAPH["overrep.recovery.trainer"]


def test_type_only_imports_count(tmp_path):
    """An import under ``if TYPE_CHECKING:`` is seen like any other."""
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..app.config import RunConfig\n"
    path = tmp_path / "trainer.py"
    path.write_text(source)
    assert "overrep.app.config" in _imports("overrep.recovery.trainer", path)
