"""Execute every notebook and tutorial headless on a clean kernel, in one module, one at a time.

Cells tagged ``notest`` are skipped. The stored files must carry no outputs. Set
``ROLLART_NB_ONLY=02_live`` to run only the notebooks whose name contains that string.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted([*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("tutorials/*.ipynb")])
CELL_TIMEOUT_S = 240
TIMES: dict[str, float] = {}


def _ids() -> list[str]:
    return [f"{p.parent.name}/{p.stem}" for p in NOTEBOOKS]


def test_there_are_notebooks_and_tutorials():
    names = _ids()
    assert sum(n.startswith("notebooks/") for n in names) >= 4
    assert [n.split("/")[1][:2] for n in names if n.startswith("tutorials/")] == [f"{i:02d}" for i in range(1, 10)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids())
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: clear outputs before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids())
def test_executes(path, tmp_path):
    only = os.environ.get("ROLLART_NB_ONLY")
    if only and only not in path.stem:
        pytest.skip(f"ROLLART_NB_ONLY={only}")
    nb = nbformat.read(path, as_version=4)
    nb.cells = [c for c in nb.cells if "notest" not in c.get("metadata", {}).get("tags", [])]
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    t0 = time.monotonic()
    client.execute()  # raises CellExecutionError with the failing cell and traceback
    TIMES[path.stem] = time.monotonic() - t0
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors


def teardown_module(module):
    if TIMES:
        lines = "\n".join(f"  {k:<32} {v:6.1f}s" for k, v in TIMES.items())
        print(f"\nnotebook run times (total {sum(TIMES.values()):.0f}s):\n{lines}")
