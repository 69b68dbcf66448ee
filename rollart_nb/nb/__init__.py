"""The notebook layer: live dashboard, trajectory viewer, figures. A consumer of the public API.

Needs the ``nb`` extra (``pip install 'rollart_nb[nb]'``). Names load on first use, so
``import rollart_nb.nb`` stays cheap: :class:`Dashboard` (``pipe.dashboard()``),
:class:`LogTailWidget` (``sess.log_tail(...)``), :class:`TrajectoryViewer`
(``pipe.viewer(...)``), :func:`trajectory_html`, :func:`token_html` and :func:`compare` (token
overlays, :mod:`rollart_nb.nb.overlay`), and the pure figure functions of
:mod:`rollart_nb.nb.figures`, :mod:`~rollart_nb.nb.timeline` and :mod:`~rollart_nb.nb.report`.
"""

import importlib as _importlib
from typing import Any as _Any

__all__ = ["Dashboard", "LogTailWidget", "TrajectoryViewer", "compare", "figures", "token_html", "trajectory_html"]

_WHERE = {
    "Dashboard": "dashboard",
    "LogTailWidget": "logtail",
    "TrajectoryViewer": "viewer",
    "trajectory_html": "viewer",
    "token_html": "overlay",
    "compare": "overlay",
}


def __getattr__(name: str) -> _Any:
    if name == "figures":
        return _importlib.import_module("rollart_nb.nb.figures")
    if name in _WHERE:
        return getattr(_importlib.import_module(f"rollart_nb.nb.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'rollart_nb.nb' has no attribute {name!r}")
