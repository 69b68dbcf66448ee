"""The package's import graph has no cycle.

Edges are every ``import`` / ``from ... import`` of a ``rollart_nb`` module, at module level and
inside functions (a deferred import is still a dependency, only a later one), except those under
``if TYPE_CHECKING:`` (annotations only). ``from pkg import name`` depends on ``pkg.name`` when
that is a module, else on ``pkg`` (its ``__init__``); the implicit dependency of a module on its
parent package's ``__init__`` is not counted (Python loads it first either way, and a package
that re-exports its submodules would otherwise be a cycle by construction).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "rollart_nb"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

Edges = dict[str, dict[str, list[int]]]
"""module -> module it imports -> line numbers of those imports."""


def package_modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``pkg/__init__.py`` is ``pkg``)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = (package, *f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, skipping the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _import_nodes(ast.Module(body=[other], type_ignores=[]))
        else:
            yield from _import_nodes(child)


def imports_of(source: str, module: str, is_package: bool, modules: set[str]) -> dict[str, list[int]]:
    """The package modules ``source`` (the text of ``module``) imports -> line numbers."""
    here = module if is_package else module.rpartition(".")[0]
    out: dict[str, list[int]] = {}

    def add(target: str, line: int) -> None:
        while target and target not in modules:  # ``import pkg.mod.Name`` cannot happen; be safe
            target = target.rpartition(".")[0]
        if target and target != module:
            out.setdefault(target, []).append(line)

    for node in _import_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == module.split(".")[0]:
                    add(alias.name, node.lineno)
            continue
        if node.level:
            parts = here.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        if base.split(".")[0] != module.split(".")[0]:
            continue
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            add(sub if sub in modules else base, node.lineno)
    return out


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> Edges:
    mods = package_modules(root, package)
    names = set(mods)
    return {
        name: imports_of(f.read_text(encoding="utf-8"), name, f.name == "__init__.py", names)
        for name, f in mods.items()
    }


def cycles(graph: dict[str, dict[str, list[int]]] | dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (each one or more cycles), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the package is far shallower than the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def describe(graph: Edges, found: list[list[str]]) -> str:
    """Each cycle with the imports that make it (``a -> b  (a's file:line)``): cut one per cycle."""
    mods = package_modules()
    lines = []
    for comp in found:
        members = set(comp)
        lines.append(f"cycle of {len(comp)} modules: {', '.join(comp)}")
        for src in comp:
            path = mods[src].relative_to(ROOT.parent) if src in mods else src
            for dst, at in sorted(graph[src].items()):
                if dst in members:
                    lines.append(f"    {src} -> {dst}  ({path}:{','.join(map(str, at))})")
    return "\n".join(lines)


def test_the_package_imports_without_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 50, f"found only {len(graph)} modules under {ROOT}"
    found = cycles(graph)
    assert not found, (
        "rollart_nb's imports form cycles; make each module import from sibling modules (not its package's "
        "__init__) and pass objects in instead of importing their owners:\n" + describe(graph, found)
    )


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"g"}}
    assert cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_are_collected_as_the_rules_say() -> None:
    mods = {"p", "p.a", "p.b", "p.c", "p.sub", "p.sub.x", "p.sub.y", "p.typed", "p.late", "p.rel"}
    source = """
from __future__ import annotations
import os
from typing import TYPE_CHECKING
from p import a, Name
from p.sub import x
import p.b as b_mod
if TYPE_CHECKING:
    from p import typed
else:
    from p import c
def f():
    from p import late
    from . import rel
    from .x import Thing
    from .. import Other
"""
    got = imports_of(source, "p.sub.y", False, mods)
    # ``Name`` and ``Other`` are not modules: they depend on ``p`` (its __init__); ``typed`` is
    # under TYPE_CHECKING and not counted; function-level imports count.
    assert set(got) == {"p.a", "p", "p.sub.x", "p.b", "p.c", "p.late", "p.sub"}
    assert got["p"] == [5, 16]
    assert got["p.late"] == [13]
    # ``from . import rel`` in p.sub.y names p.sub.rel, which is no module: p.sub's __init__
    assert "p.rel" not in got and got["p.sub"] == [14]
    # a package's own relative imports resolve against itself
    assert imports_of("from . import a\nfrom .sub import x", "p", True, mods) == {"p.a": [1], "p.sub.x": [2]}
