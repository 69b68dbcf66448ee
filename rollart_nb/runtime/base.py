"""Runtime: where a session's workers run, and what its pipelines get from it.

A session (:class:`~rollart_nb.Session` or :class:`~rollart_nb.sim_session.SimSession`) owns one
runtime; the runtime owns the session's clusters and pipelines by name and everything that
differs between Ray and the in-process simulation. The layers, each importing only the ones
below it::

    Session / SimSession        the notebook API: argument checks, tasks, rewards, lifecycle
      Runtime                   RayRuntime (rollart_nb.runtime.ray) or SimRuntime (rollart_nb.runtime.sim)
        Pipeline                gets the runtime: the rollout cluster, weight transport, reward deployment
        Cluster / LocalCluster  get a ClusterSpec and the ResourceManager (and a log dir or the sim clock)

so nothing below the session calls back into it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from rollart_nb.errors import ConfigError
from rollart_nb.resources.manager import ResourceManager
from rollart_nb.serverless.client import Endpoint
from rollart_nb.workers.cluster import ClusterBase
from rollart_nb.workers.worker import Worker

if TYPE_CHECKING:
    from rollart_nb.protocols import WeightTransport

__all__ = ["ClusterSpec", "Closers", "Runtime", "close_all", "register_cluster"]

log = logging.getLogger(__name__)

C = TypeVar("C", bound=ClusterBase)


Closers = Sequence[tuple[str, Callable[[], None]]]
"""(what, how) pairs: ``("stopping Ray Serve", serve.shutdown)``."""


@dataclass(frozen=True)
class ClusterSpec:
    """One cluster to start: what ``sess.cluster(...)`` was given, handed whole from the session
    to its runtime and on to the cluster class. Every problem is reported at once (ConfigError).

    Example:
        >>> spec = ClusterSpec("actor_gen", SimGenerator, pool="H20", replicas=2)   # doctest: +SKIP
        >>> sess.runtime.cluster(spec)                                              # doctest: +SKIP
    """

    name: str
    """Role name ("actor_train", "actor_gen", "reward", ...): one cluster per name in a session."""
    worker_cls: type[Worker]
    """The :class:`~rollart_nb.Worker` subclass every worker is an instance of."""
    pool: str = ""
    """Preferred pool; "" (default): ``worker_cls.default_pool``."""
    replicas: int = 1
    """Number of workers (>= 1)."""
    fallback: list[str] | None = None
    """Pools to try if ``pool`` is full or absent (None: the compatible pools)."""
    slots: float = 1.0
    """Pool slots per worker (GPUs of one TP group on a GPU pool; they fit on one node)."""
    endpoints: dict[str, Endpoint] = field(default_factory=dict)
    """This cluster's own serverless endpoints (name -> endpoint) for ``@register_serverless`` methods."""
    affinity: dict[str, str] | None = None
    """Tag -> hardware overrides for ``@hw_mapping`` methods."""
    max_concurrency: int | None = None
    """Ray actors: concurrent calls one worker accepts (None: ``worker_cls.max_concurrency``)."""
    start_timeout_s: float = 120.0
    """Ray actors: seconds a worker may take to start before ClusterError."""
    threaded: bool | None = None
    """In-process workers: run sync methods on a thread of their own (None: trainers only; see
    :mod:`rollart_nb.runtime.local`)."""
    init_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to ``worker_cls.__init__``."""

    def __post_init__(self) -> None:
        p = []
        if not self.name or not isinstance(self.name, str):
            p.append("name must be a non-empty string")
        if not (isinstance(self.worker_cls, type) and issubclass(self.worker_cls, Worker)):
            p.append(f"worker_cls must be a rollart_nb.Worker subclass, got {self.worker_cls!r}")
        elif not self.pool:
            object.__setattr__(self, "pool", str(getattr(self.worker_cls, "default_pool", "cpu")))
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool) or self.replicas < 1:
            p.append(f"replicas must be an int >= 1, got {self.replicas!r}")
        if not isinstance(self.slots, int | float) or self.slots <= 0:
            p.append(f"slots must be > 0, got {self.slots!r}")
        if self.max_concurrency is not None and (not isinstance(self.max_concurrency, int) or self.max_concurrency < 1):
            p.append(f"max_concurrency must be an int >= 1 or None, got {self.max_concurrency!r}")
        if not isinstance(self.start_timeout_s, int | float) or self.start_timeout_s <= 0:
            p.append(f"start_timeout_s must be a number of seconds > 0, got {self.start_timeout_s!r}")
        if p:
            raise ConfigError(p, where=f"sess.cluster({self.name!r}, ...)")

    @classmethod
    def of(cls, name: str, worker_cls: type[Worker], **options: Any) -> ClusterSpec:
        """A spec from ``sess.cluster``-style keywords: those naming a field set it, the rest are
        ``init_kwargs``."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"name", "worker_cls", "init_kwargs"}
        own = {k: options.pop(k) for k in fields & options.keys()}
        return cls(name, worker_cls, **own, init_kwargs=options)


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

    def cluster(self, spec: ClusterSpec) -> ClusterBase:
        """Start ``spec``'s workers as the cluster ``spec.name`` (closing one of that name first) and
        register it."""
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


def register_cluster(
    runtime: Runtime,
    spec: ClusterSpec,
    build: Callable[[ClusterSpec], C],
) -> C:
    """Close the cluster ``spec.name`` if there is one, then build the new one and register it."""
    if spec.name in runtime.clusters:
        log.info("replacing cluster %s", spec.name)
        runtime.close_cluster(spec.name)
    c = build(spec)
    runtime.clusters[spec.name] = c
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
