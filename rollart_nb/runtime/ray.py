"""The Ray runtime: a session's workers are Ray actors, each pinned to the node of its binding.

:class:`RayRuntime` is the :class:`~rollart_nb.runtime.base.Runtime` of a :class:`~rollart_nb.Session`;
:class:`Cluster` drives one role's actors as one object (its dispatch rules are
:class:`~rollart_nb.workers.cluster.ClusterBase`'s, shared with the in-process
:class:`~rollart_nb.runtime.local.LocalCluster`). ``cluster.compute_gradients(...)`` has the Worker
method's own signature and docstring plus a keyword-only ``blocking`` flag: ``blocking=False``
returns a :class:`ClusterFuture` (``.result()`` or ``await``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import rollart_nb._ray as _ray
from rollart_nb.errors import ClusterError, ConfigError
from rollart_nb.resources.manager import Binding, ResourceManager
from rollart_nb.runtime.base import Closers, ClusterSpec, close_all, register_cluster
from rollart_nb.serverless.client import Endpoint
from rollart_nb.workers.cluster import ClusterBase
from rollart_nb.workers.worker import actor_class_for

if TYPE_CHECKING:
    from rollart_nb.protocols import WeightTransport

__all__ = ["Cluster", "ClusterFuture", "RayRuntime", "WorkerHandle"]


@dataclass
class WorkerHandle:
    """One worker actor of a Cluster, with its binding and in-flight call count."""

    actor: Any
    binding: Binding
    inflight: int = 0
    calls: int = 0


class ClusterFuture:
    """Result of a non-blocking cluster call: ``.result(timeout)`` or ``await fut``."""

    def __init__(
        self,
        refs: list[Any],
        combine: Callable[[list[Any]], Any],
        what: str,
        on_done: Callable[[], None],
        who: list[Binding],
    ):
        self._refs, self._combine, self._what, self._on_done = refs, combine, what, on_done
        self._who = who
        self._done = False

    @property
    def refs(self) -> list[Any]:
        """The underlying Ray object refs (pass them to other workers without a driver copy)."""
        return list(self._refs)

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._on_done()

    def result(self, timeout: float | None = None) -> Any:
        try:
            # one get per worker, so a failure names the worker and pool it came from
            return self._combine(
                [
                    _ray.get(r, timeout_s=timeout, what=self._what, worker=b.worker, pool=b.pool)
                    for r, b in zip(self._refs, self._who, strict=True)
                ]
            )
        finally:
            self._finish()

    def __await__(self):  # noqa: ANN204
        async def run() -> Any:
            try:
                return self._combine([await r for r in self._refs])
            finally:
                self._finish()

        return run().__await__()


class Cluster(ClusterBase):
    """A role-specific group of Workers, driven as one object.

    Built by :meth:`rollart_nb.Session.cluster`; not constructed directly.

    Example:
        >>> gen = sess.cluster("actor_gen", MyGen, pool="H20", replicas=2)   # doctest: +SKIP
        >>> gen.generate("2 + 2 =", tag_name="math")                         # doctest: +SKIP
    """

    _node_chars = 8  # Ray node ids are 56 hex characters
    _register_hint = True

    def __init__(
        self, resources: ResourceManager, spec: ClusterSpec, *, registry: Mapping[str, Endpoint], log_dir: str
    ) -> None:
        self._log_dir = log_dir  # workers write their logs here
        self._max_concurrency = spec.max_concurrency or spec.worker_cls.max_concurrency
        self._lock = threading.Lock()
        self.restarts: dict[int, int] = {}  # worker index -> restarts so far
        self._probes: dict[int, tuple[Any, Any]] = {}  # worker index -> (health probe in flight, its actor)
        self.workers: list[WorkerHandle]
        super().__init__(resources, spec, registry)

    # -- construction ----------------------------------------------------------------
    def _spawn(self, index: int, world: int, binding: Binding | None = None) -> WorkerHandle:
        b = binding or self._bind(index)
        res: dict[str, float] = {}
        num_gpus = num_cpus = 0.0
        if b.resource == "GPU":
            num_gpus = b.slots
        elif b.resource == "CPU":
            num_cpus = b.slots
        elif b.resource:
            res[b.resource] = b.slots
        opts = _ray.actor_options(
            node_id=b.node,
            num_gpus=num_gpus,
            num_cpus=num_cpus,
            resources=res,
            name=None,
            max_concurrency=self._max_concurrency,
        )
        _ray.ship_by_value(self.worker_cls)
        cls = _ray.remote_class(actor_class_for(self.worker_cls), **opts)
        actor = cls.remote(b, world, self._log_dir, **self.spec.init_kwargs)
        _ray.register_actor(actor, b.worker, b.pool)
        return WorkerHandle(actor, b)

    def _wait_ready(self, indices: range | list[int]) -> None:
        for i in indices:
            h = self.workers[i]
            try:
                info = _ray.get(
                    h.actor._rn_info.remote(),
                    timeout_s=self.spec.start_timeout_s,
                    what="start",
                    worker=h.binding.worker,
                    pool=h.binding.pool,
                )
            except ClusterError as e:
                raise ClusterError(
                    f"worker {h.binding.worker} on pool {h.binding.pool} did not start: {e}. Check the "
                    f"Worker's __init__ (and {self._log_dir} for its log)"
                ) from e
            if info["node_id"] != h.binding.node:  # the scheduler must honour the binding
                raise ClusterError(f"worker {h.binding.worker} landed on node {info['node_id']}, not its binding")

    # -- dispatch paths --------------------------------------------------------------
    def _start(self, h: WorkerHandle, attr: str, args: tuple, kwargs: dict) -> Any:
        return getattr(h.actor, attr).remote(*args, **kwargs)

    def _stop(self, h: WorkerHandle) -> None:
        _ray.kill(h.actor)

    def _release(self, idx: list[int]) -> None:
        with self._lock:
            for i in idx:
                self.workers[i].inflight -= 1

    def _finish(
        self, idx: list[int], refs: list[Any], combine: Callable[[list[Any]], Any], blocking: bool, what: str
    ) -> Any:
        fut = ClusterFuture(refs, combine, what, lambda: self._release(idx), [self.workers[i].binding for i in idx])
        return fut.result() if blocking else fut

    # -- lifecycle -------------------------------------------------------------------
    def restart_worker(self, index: int) -> Binding:
        """Failover: kill worker ``index``, rebind its slot (another node if possible, by the
        pool's fallback rules; the binding records why), respawn it and wait until it is up.

        A pipeline using this cluster notices the new worker at its next step: a generator
        loads the served weights before it gets requests, a trainer is restored from the
        pipeline's newest autosave.
        """
        self._check_open()
        if not 0 <= index < len(self.workers):
            raise ConfigError(f"{self.name} has workers 0..{len(self.workers) - 1}, not {index}")
        old = self.workers[index]
        _ray.kill(old.actor)
        b = self._resources.rebind(self.name, index)
        self.workers[index] = self._spawn(index, len(self.workers), binding=b)
        self.restarts[index] = self.restarts.get(index, 0) + 1
        self._wait_ready([index])
        return self.workers[index].binding

    def dead_workers(self, timeout_s: float = 0.0) -> dict[int, str]:
        """Health probe: index -> reason for every worker whose process is gone.

        Probes are sent ahead and answered in the background, so a call costs no wait: it
        reports what the probes that came back found (waiting up to ``timeout_s`` for those in
        flight) and sends fresh ones. A worker that is only slow to answer never counts as dead.
        """
        r = _ray.ray()
        with self._lock:
            for i, h in enumerate(self.workers):
                probe = self._probes.get(i)
                if probe is None or probe[1] is not h.actor:  # none in flight, or one to a replaced worker
                    self._probes[i] = (h.actor._rn_info.remote(), h.actor)
            refs = {ref: i for i, (ref, _) in self._probes.items()}
        ready, _ = _ray.wait(list(refs), num_returns=len(refs), timeout_s=timeout_s)
        out = {}
        for ref in ready:
            i = refs[ref]
            self._probes.pop(i, None)  # answered: the next call sends a fresh one
            try:
                r.get(ref, timeout=0)
            except r.exceptions.RayActorError as e:
                out[i] = f"{type(e).__name__}: {_ray._short(e, 200)}"
            except Exception:  # noqa: S110 - alive, only the probe failed
                pass
        return out

    def info(self) -> list[dict[str, Any]]:
        """Live info from every worker (node, pid, hardware); raises WorkerDiedError for a dead one."""
        return [
            _ray.get(h.actor._rn_info.remote(), timeout_s=30, what="info", worker=h.binding.worker, pool=h.binding.pool)
            for h in self.workers
        ]


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

    def cluster(self, spec: ClusterSpec) -> Cluster:
        def build(s: ClusterSpec) -> Cluster:
            if s.threaded is not None:
                raise ConfigError(f"sess.cluster({s.name!r}, threaded=...): Ray workers are processes; drop it")
            return Cluster(self.resources, s, registry=self.endpoints, log_dir=self.log_dir)

        return register_cluster(self, spec, build)

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
