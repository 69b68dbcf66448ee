"""The notebook layer: live dashboard, trajectory viewer, figures. A consumer of the public API.

Needs the ``nb`` extra (``pip install 'rollart_nb[nb]'``: ipywidgets, plotly, anywidget,
pandas). Names load on first use, so ``import rollart_nb.nb`` stays cheap:

* :class:`Dashboard` — ``pipe.dashboard()``: reward, step-time phases, staleness, pool
  utilization, throughput; Pause / Resume / Step.
* :class:`LogTailWidget` — ``sess.log_tail(...)``: the workers' logs as they come, with a
  worker filter, Pause and Clear.
* :class:`TrajectoryViewer` — ``pipe.trajectories(...)`` / ``pipe.viewer(...)``: turns, token
  loss masks, logprobs, per-turn policy versions, reward versions, export.
* :mod:`rollart_nb.nb.figures` — pure figure functions (StepReports in, plotly figures out);
  :mod:`~rollart_nb.nb.timeline` the pool utilization timeline, :mod:`~rollart_nb.nb.report` the
  curves SVG and the HTML report.
* :func:`trajectory_html` — one trajectory as HTML, without widgets.
"""

import importlib as _importlib
from typing import Any as _Any

__all__ = ["Dashboard", "LogTailWidget", "TrajectoryViewer", "figures", "trajectory_html"]

_WHERE = {
    "Dashboard": "dashboard",
    "LogTailWidget": "logtail",
    "TrajectoryViewer": "viewer",
    "trajectory_html": "viewer",
}


def __getattr__(name: str) -> _Any:
    if name == "figures":
        return _importlib.import_module("rollart_nb.nb.figures")
    if name in _WHERE:
        return getattr(_importlib.import_module(f"rollart_nb.nb.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'rollart_nb.nb' has no attribute {name!r}")
