"""``sim`` is a plain timing library: nothing in it imports the layers built on top of it."""

import ast
from pathlib import Path

import rollart_nb.sim

ABOVE = ("control", "runtime", "session", "session_base", "sim_session", "workers", "bench", "config", "train")


def test_sim_imports_nothing_above_it():
    found = []
    for f in Path(rollart_nb.sim.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{f.name}: {n}" for n in names if n.split(".")[:2][-1] in ABOVE and n.startswith("rollart_nb.")]
    assert not found, found
