"""The package's shape stays one a new maintainer can hold, measured over the AST.

- no module over :data:`MAX_MODULE_LINES` lines;
- at most :data:`MAX_LONG_FUNCTIONS` function bodies over :data:`LONG_BODY` lines (signature and
  docstring not counted), none over :data:`MAX_BODY`;
- no import cycle between units (a unit is a subpackage or a top-level module of ``rollart_nb``),
  counting module-level imports (those under ``if TYPE_CHECKING:`` aside): a unit is a floor, and
  a floor imports only those below it.

``python tests/test_package_shape.py`` prints the measures (and the total line count).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_import_graph import ROOT, _is_type_checking, cycles, imports_of, package_modules  # noqa: E402

MAX_MODULE_LINES = 600
LONG_BODY = 60
MAX_LONG_FUNCTIONS = 8
MAX_BODY = 100


def body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the last one of ``fn``'s body."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body[-1].end_lineno - body[0].lineno + 1 if body else 0  # type: ignore[operator]


def long_functions(limit: int = LONG_BODY) -> list[tuple[int, str]]:
    """(body lines, ``module:function``) of every function whose body is over ``limit`` lines."""
    out = []
    for name, f in package_modules().items():
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (n := body_lines(node)) > limit:
                out.append((n, f"{name}:{node.name} (line {node.lineno})"))
    return sorted(out, reverse=True)


def module_lines() -> dict[str, int]:
    return {name: len(f.read_text(encoding="utf-8").splitlines()) for name, f in package_modules().items()}


def unit_of(module: str) -> str:
    """``rollart_nb.control.scheduler`` -> ``rollart_nb.control``; a top-level module is its own unit."""
    return ".".join(module.split(".")[:2])


def _module_level(tree: ast.Module) -> ast.Module:
    """The import statements that run when the module loads (not in functions or TYPE_CHECKING)."""
    found: list[ast.stmt] = []

    def walk(body: list[ast.stmt]) -> None:
        for st in body:
            if isinstance(st, ast.Import | ast.ImportFrom):
                found.append(st)
            elif isinstance(st, ast.If):
                walk(st.orelse if _is_type_checking(st.test) else st.body + st.orelse)
            elif isinstance(st, ast.Try):
                walk(st.body + st.orelse + st.finalbody + [s for h in st.handlers for s in h.body])

    walk(tree.body)
    return ast.Module(body=found, type_ignores=[])


def unit_graph(root: Path = ROOT, package: str = "rollart_nb") -> dict[str, dict[str, list[str]]]:
    """unit -> unit it imports at module level -> the ``module -> module`` imports that make the edge."""
    mods = package_modules(root, package)
    graph: dict[str, dict[str, list[str]]] = {}
    for name, f in mods.items():
        src = ast.unparse(_module_level(ast.parse(f.read_text(encoding="utf-8"))))
        edges = graph.setdefault(unit_of(name), {})
        for target in imports_of(src, name, f.name == "__init__.py", set(mods)):
            if unit_of(target) != unit_of(name):
                edges.setdefault(unit_of(target), []).append(f"{name} -> {target}")
    return graph


def test_no_module_is_over_the_limit() -> None:
    big = {m: n for m, n in module_lines().items() if n > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them by responsibility): {big}"


def test_long_functions_are_few_and_bounded() -> None:
    found = long_functions()
    assert len(found) <= MAX_LONG_FUNCTIONS, f"{len(found)} function bodies over {LONG_BODY} lines: {found}"
    over = [f for f in found if f[0] > MAX_BODY]
    assert not over, f"function bodies over {MAX_BODY} lines (name their steps): {over}"


def test_units_import_without_cycles() -> None:
    graph = unit_graph()
    assert {"rollart_nb.control", "rollart_nb.sim", "rollart_nb.sandbox"} <= set(graph)
    found = cycles({u: set(e) for u, e in graph.items()})
    why = [f"{a} -> {b}: {graph[a][b]}" for comp in found for a in comp for b in graph[a] if b in comp]
    assert not found, "import cycles between units (import downwards only):\n" + "\n".join(why)


def test_the_measures_see_what_they_measure(tmp_path: Path) -> None:
    fn = ast.parse('def f(x):\n    """Doc."""\n    a = 1\n\n    return a\n').body[0]
    assert isinstance(fn, ast.FunctionDef) and body_lines(fn) == 3
    files = {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/x.py": "from pkg import b\n",  # a -> b at load time
        "b.py": "def f():\n    from pkg.a import x\n",  # b -> a only when f runs: no edge
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a.x\n",  # annotations only
        "d.py": "try:\n    import pkg.e\nexcept ImportError:\n    pass\n",
        "e.py": "import pkg.d\n",
    }
    for rel, text in files.items():
        (tmp_path / "pkg" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / rel).write_text(text)
    graph = unit_graph(tmp_path / "pkg", "pkg")
    assert graph["pkg.a"] == {"pkg.b": ["pkg.a.x -> pkg.b"]}
    assert graph["pkg.b"] == {} and graph["pkg.c"] == {}
    assert cycles({u: set(e) for u, e in graph.items()}) == [["pkg.d", "pkg.e"]]


if __name__ == "__main__":
    lines = module_lines()
    print(f"{sum(lines.values())} lines in {len(lines)} modules")
    print(f"modules over {MAX_MODULE_LINES}:", {m: n for m, n in lines.items() if n > MAX_MODULE_LINES} or "none")
    long = long_functions()
    print(f"function bodies over {LONG_BODY} lines: {len(long)}")
    for n, where in long:
        print(f"  {n:4d}  {where}")
    graph = unit_graph()
    print("unit cycles:", cycles({u: set(e) for u, e in graph.items()}) or "none")
