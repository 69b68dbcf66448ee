"""Runtime: where a session's workers run, and what its pipelines get from it.

A session (:class:`~rollart_nb.Session` or :class:`~rollart_nb.sim_session.SimSession`) owns one
runtime; the runtime owns the session's clusters and pipelines by name and everything that
differs between Ray and the in-process simulation. The layers, each importing only the ones
below it::

    Session / SimSession        the notebook API: argument checks, tasks, rewards, lifecycle
      Runtime                   RayRuntime (this module) or SimRuntime (rollart_nb.runtime.sim)
        Pipeline                gets the runtime: the rollout cluster, weight transport, reward deployment
        Cluster / LocalCluster  get the ResourceManager (and a log dir or the sim clock), not the session

so nothing below the session calls back into it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from rollart_nb.errors import ConfigError
from rollart_nb.resources.manager import ResourceManager
from rollart_nb.serverless.client import Endpoint
from rollart_nb.workers.cluster import Cluster, ClusterBase
from rollart_nb.workers.worker import Worker

if TYPE_CHECKING:
    from rollart_nb.protocols import WeightTransport

__all__ = ["Closers", "RayRuntime", "Runtime", "close_all"]

log = logging.getLogger(__name__)

C = TypeVar("C", bound=ClusterBase)


Closers = Sequence[tuple[str, Callable[[], None]]]
"""(what, how) pairs: ``("stopping Ray Serve", serve.shutdown)``."""


class Runtime(Protocol):
    """What a session hands its pipelines, and what a session delegates to: workers, weights, rewards.

    Attributes:
        resources: the pools' slot accounting; clusters bind their workers through it.
        seed: the session's base seed (a pipeline without its own seed uses it).
        log_dir: where worker logs go ("" when workers run in this process).
        clusters: cluster name -> cluster, every cluster of the session (pipelines' rollouts included).
        pipelines: pipeline name -> pipeline, registered by the session, removed by the pipeline's close.
        endpoints: serverless endpoint name -> endpoint, for ``@register_serverless`` methods.
    """

    resources: ResourceManager
    seed: int
    log_dir: str
    clusters: dict[str, ClusterBase]
    pipelines: dict[str, Any]
    endpoints: dict[str, Endpoint]

    def clock(self) -> float:
        """Seconds for step timing: wall time, or a simulation's virtual time."""
        ...

    def cluster(
        self,
        name: str,
        worker_cls: type[Worker],
        *,
        pool: str,
        replicas: int = 1,
        fallback: list[str] | None = None,
        slots: float = 1.0,
        endpoints: dict[str, Endpoint] | None = None,
        affinity: dict[str, str] | None = None,
        **init_kwargs: Any,
    ) -> ClusterBase:
        """Start ``replicas`` workers as the cluster ``name`` (closing one of that name first) and register it."""
        ...

    def close_cluster(self, name: str) -> None:
        """Drop a cluster's workers and free its slots (nothing if there is none)."""
        ...

    def weight_transport(self, weights: Any, name: str) -> WeightTransport | None:
        """The transport pipeline ``name`` moves weights with (None: trainer -> generators directly)."""
        ...

    def deploy_reward(self, task: str, fn: Any, **serve_options: Any) -> Endpoint:
        """Serve ``fn`` as ``task``'s next reward version; raises ConfigError where it cannot."""
        ...

    def close(self, after_pipelines: Closers = ()) -> None:
        """Close the pipelines, run ``after_pipelines`` (what the session started for them, e.g.
        env launchers), stop what the runtime started, close the clusters. Idempotent."""
        ...


def register_cluster(runtime: Runtime, name: str, build: Callable[[], C]) -> C:
    """Close the cluster ``name`` if there is one, then build the new one and register it."""
    if name in runtime.clusters:
        log.info("replacing cluster %s", name)
        runtime.close_cluster(name)
    c = build()
    runtime.clusters[name] = c
    return c


def close_all(runtime: Runtime, closers: Closers = ()) -> None:
    """Close ``runtime``'s pipelines, then run ``closers`` in order, then close its clusters; each
    failure is logged, so one broken part never keeps the others running."""
    for pipe in list(runtime.pipelines.values()):
        _try(f"closing pipeline {pipe.name}", pipe.close)
    for what, fn in closers:
        _try(what, fn)
    for name in list(runtime.clusters):
        _try(f"closing cluster {name}", functools.partial(runtime.close_cluster, name))


def _try(what: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as e:
        log.warning("%s: %s", what, e)


class RayRuntime:
    """The :class:`Runtime` of a Ray session: workers are Ray actors placed by their bindings.

    Weights move directly, through the object store or through Mooncake (a master on 127.0.0.1
    started on first use); serverless rewards are Ray Serve deployments (started on first use).
    """

    def __init__(self, resources: ResourceManager, *, seed: int, log_dir: str, session_id: str) -> None:
        self.resources, self.seed, self.log_dir, self._id = resources, seed, log_dir, session_id
        self.clusters: dict[str, ClusterBase] = {}
        self.pipelines: dict[str, Any] = {}
        self.endpoints: dict[str, Endpoint] = {}
        self._serve: Any = None
        self._mooncake: Any = None

    def clock(self) -> float:
        return time.monotonic()

    def cluster(
        self,
        name: str,
        worker_cls: type[Worker],
        *,
        pool: str,
        replicas: int = 1,
        fallback: list[str] | None = None,
        slots: float = 1.0,
        endpoints: dict[str, Endpoint] | None = None,
        affinity: dict[str, str] | None = None,
        max_concurrency: int | None = None,
        start_timeout_s: float = 120.0,
        **init_kwargs: Any,
    ) -> Cluster:
        return register_cluster(
            self,
            name,
            lambda: Cluster(
                self.resources,
                name,
                worker_cls,
                replicas=replicas,
                pool=pool,
                fallback=fallback,
                slots=slots,
                init_kwargs=init_kwargs,
                endpoints=endpoints or {},
                registry=self.endpoints,
                affinity=affinity,
                log_dir=self.log_dir,
                max_concurrency=max_concurrency,
                start_timeout_s=start_timeout_s,
            ),
        )

    def close_cluster(self, name: str) -> None:
        c = self.clusters.pop(name, None)
        if c is not None:
            c.close()

    def serve_manager(self) -> Any:
        """The session's Ray Serve manager (started on first use)."""
        if self._serve is None:
            from rollart_nb.serverless.serve import ServeManager

            self._serve = ServeManager()
        return self._serve

    def weight_transport(self, weights: Any, name: str) -> WeightTransport | None:
        """``"direct"`` (None), ``"object_store"``, ``"mooncake"`` (a master on 127.0.0.1), or a transport."""
        if weights in (None, "direct"):
            return None
        if weights == "object_store":
            from rollart_nb.weights.object_store import ObjectStoreTransport

            return ObjectStoreTransport(name=f"rollart_nb/{self._id}/{name}/weights")
        if weights == "mooncake":
            from rollart_nb.weights.mooncake import MooncakeMaster, MooncakeTransport

            if self._mooncake is None:
                self._mooncake = MooncakeMaster().start()
            return MooncakeTransport(self._mooncake.address, prefix=f"{self._id}/{name}", segment_bytes=256 * 2**20)
        if hasattr(weights, "publish") and hasattr(weights, "pull"):
            return weights
        raise ConfigError(f"weights={weights!r}: use 'direct', 'object_store', 'mooncake' or a WeightTransport")

    def deploy_reward(self, task: str, fn: Any, **serve_options: Any) -> Endpoint:
        """Deploy ``fn`` under a new route per version, so the dispatcher's switch is atomic:
        a trajectory is scored by exactly the version it records (old routes scale to zero)."""
        mgr = self.serve_manager()
        n = sum(1 for name in mgr.deployments if name.startswith(f"reward-{task}-v"))
        return mgr.deploy(f"reward-{task}-v{n}", fn, **serve_options)

    def close(self, after_pipelines: Closers = ()) -> None:
        closers = list(after_pipelines)
        if self._serve is not None:
            closers.append(("stopping Ray Serve", self._serve.shutdown))
        if self._mooncake is not None:
            closers.append(("stopping mooncake_master", self._mooncake.stop))
        close_all(self, closers)
        self._serve = self._mooncake = None
