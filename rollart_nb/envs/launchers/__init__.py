"""Launchers: place env-server replicas somewhere and keep them alive.

* :class:`LocalLauncher`: ``rollart-nb env-server`` processes on 127.0.0.1, optionally each
  under bubblewrap, health-checked and restarted by a monitor thread.
* :class:`KubernetesLauncher`: a Deployment + Service per env type through the official
  ``kubernetes`` client (extra ``k8s``).

A launcher has ``start()``, ``scale(n)``, ``close()``, ``urls`` and ``handle()``. The handle is
a small picklable :class:`ReplicaSet` (``replicas() -> [(replica id, url), ...]``, healthy ones
only) that :class:`~rollart_nb.envs.RemoteEnv` copies carry into other processes (the
rollout actor); the launcher itself owns processes and threads and stays where it was made.

Example:
    >>> from rollart_nb.envs import LocalLauncher, RemoteEnv
    >>> with LocalLauncher("rollart_nb.envs:FrozenLake", replicas=2, sandbox=False) as lau:  # doctest: +SKIP
    ...     env = RemoteEnv(launcher=lau)
    ...     obs, info = env.reset(seed=0)     # info["replica"] names the replica that served it
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from rollart_nb.envs.launchers._procs import Replica, env_spec
from rollart_nb.envs.launchers.kubernetes import KubernetesLauncher
from rollart_nb.envs.launchers.local import LocalLauncher

__all__ = ["KubernetesLauncher", "Launcher", "LocalLauncher", "Replica", "ReplicaSet", "env_spec"]


@runtime_checkable
class ReplicaSet(Protocol):
    """What a RemoteEnv needs from a launcher in any process: the healthy replicas."""

    def replicas(self) -> list[tuple[str, str]]: ...


@runtime_checkable
class Launcher(Protocol):
    """Places env-server replicas (see the module docstring)."""

    state: str

    def start(self) -> Any: ...

    def scale(self, n: int) -> None: ...

    def close(self) -> None: ...

    def handle(self) -> ReplicaSet: ...

    @property
    def urls(self) -> list[str]: ...
