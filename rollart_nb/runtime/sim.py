"""SimRuntime: the :class:`~rollart_nb.runtime.Runtime` of a SimSession.

Workers are in-process objects (:class:`~rollart_nb.runtime.local.LocalCluster`) on the one loop
of a :class:`~rollart_nb.clock.SimClock`, which it owns; step timing reads that clock (virtual
seconds by default). Weights move directly only (sim weights are a version number), and there is
no Ray Serve to deploy rewards on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollart_nb.clock import SimClock
from rollart_nb.errors import ConfigError
from rollart_nb.resources.manager import ResourceManager
from rollart_nb.runtime.base import Closers, ClusterSpec, close_all, register_cluster
from rollart_nb.runtime.local import LocalCluster
from rollart_nb.serverless.client import Endpoint
from rollart_nb.workers.cluster import ClusterBase

if TYPE_CHECKING:
    from rollart_nb.protocols import WeightTransport

__all__ = ["SimRuntime"]


NO_SERVE = (
    "a SimSession cannot deploy serverless rewards (Ray Serve needs a real session); pass a local "
    "function, or use rn.Session.local() for serverless=True"
)


class SimRuntime:
    """Workers on one in-process event loop, timed by a :class:`~rollart_nb.clock.SimClock`.

    Args:
        resources: the simulated pools' slot accounting.
        seed: the session's base seed.
        virtual: simulated time (default) or real time on the loop.
        name: the loop thread's name.
        call_latency_s: modelled seconds of every call to a worker (see
            :class:`~rollart_nb.sim_session.SimSession`).
    """

    def __init__(
        self,
        resources: ResourceManager,
        *,
        seed: int,
        virtual: bool = True,
        name: str = "rollart-sim",
        call_latency_s: float = 0.0,
    ):
        self.resources, self.seed, self.call_latency_s = resources, seed, call_latency_s
        self.log_dir = ""  # in-process workers log to this process's handlers
        #: The simulation's loop and time (``sim_clock()`` reads simulated seconds).
        self.sim_clock = SimClock(virtual, name=name)
        self.clusters: dict[str, ClusterBase] = {}
        self.pipelines: dict[str, Any] = {}
        self.endpoints: dict[str, Endpoint] = {}

    def clock(self) -> float:
        return self.sim_clock.now()

    def cluster(self, spec: ClusterSpec) -> LocalCluster:
        def build(s: ClusterSpec) -> LocalCluster:
            return LocalCluster(
                self.resources, s, registry=self.endpoints, clock=self.sim_clock, call_latency_s=self.call_latency_s
            )

        return register_cluster(self, spec, build)

    def close_cluster(self, name: str) -> None:
        c = self.clusters.pop(name, None)
        if c is not None:
            c.close()

    def weight_transport(self, weights: Any, name: str) -> WeightTransport | None:
        """Only ``"direct"`` (None): sim trainers hand over a ``{"version": v}`` stand-in."""
        if weights in (None, "direct"):
            return None
        raise ConfigError(
            f"weights={weights!r}: a SimSession only supports weights='direct' (sim weights are a "
            "version number; use rn.Session.local() to exercise object_store / mooncake transports)"
        )

    def deploy_reward(self, task: str, fn: Any, **serve_options: Any) -> Endpoint:
        raise ConfigError(NO_SERVE)

    def close(self, after_pipelines: Closers = ()) -> None:
        """Close pipelines and clusters, cancel what still runs on the loop, stop the loop thread."""
        close_all(self, after_pipelines)
        self.sim_clock.close()
