"""Where notebook views live, by name, so the control plane never imports ``rollart_nb.nb``.

``Pipeline.dashboard()`` and ``Pipeline.viewer()`` ask for a view here; the view's module is
imported only when a person asks for it (and needs the ``nb`` extra).
"""

from __future__ import annotations

import importlib
from typing import Any

from rollart_nb.errors import ConfigError

__all__ = ["VIEWS", "view"]

VIEWS: dict[str, str] = {
    "dashboard": "rollart_nb.nb.dashboard:Dashboard",
    "trajectories": "rollart_nb.nb.viewer:TrajectoryViewer",
    "trajectory_html": "rollart_nb.nb.viewer:trajectory_html",
}


def view(kind: str, *args: Any, **kwargs: Any) -> Any:
    """Build the notebook view ``kind`` (see :data:`VIEWS`)."""
    module, attr = VIEWS[kind].split(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"the {kind} view needs the notebook extra: pip install 'rollart_nb[nb]' ({e})") from e
    return getattr(mod, attr)(*args, **kwargs)
