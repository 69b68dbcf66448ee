"""LocalCluster: a cluster whose workers are in-process objects (what a SimSession builds).

Every Worker lives on the session's one background asyncio loop, driven by the same control
plane as a Ray run; calls dispatch as on :class:`~rollart_nb.runtime.ray.Cluster`. Sync methods
run on the loop, except a :class:`~rollart_nb.workers.roles.TrainerWorker`'s, which get a thread
per worker (a real train step would otherwise freeze the rollout and erase the overlap the
asynchronous modes are measured on); ``runs_on_loop = True`` or ``threaded=`` override it.
Arguments pass by reference (nothing is pickled): workers must not mutate what they get."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollart_nb.clock import resolve_time_scale
from rollart_nb.errors import ClusterError, StateError
from rollart_nb.resources.manager import Binding, ResourceManager
from rollart_nb.serverless.client import Endpoint
from rollart_nb.workers.cluster import ClusterBase
from rollart_nb.workers.roles import TrainerWorker
from rollart_nb.workers.worker import Worker, actor_class_for

if TYPE_CHECKING:
    from rollart_nb.clock import SimClock
    from rollart_nb.runtime.base import ClusterSpec

__all__ = ["LocalActor", "LocalCluster", "LocalFuture", "LocalRef", "LocalWorkerHandle", "turns_carried"]

TURN_METHODS = frozenset({"generate", "prefill"})
"""Generator methods whose call carries one turn (``prefill``: the first half of a PD turn)."""

BATCH_METHODS = frozenset({"submit", "exchange"})
"""Generator methods whose call carries a list of turns (``dispatch="batched"``): ``(client, items)``."""


def turns_carried(method: str, args: tuple) -> int:
    """How many turns a call of ``method`` with ``args`` hands a generator (0: not a turn)."""
    if method in TURN_METHODS:
        return 1
    if method in BATCH_METHODS and len(args) > 1 and isinstance(args[1], list):
        return len(args[1])
    return 0


class LocalRef:
    """The in-process ObjectRef: a call's pending result.

    Pass it as an argument to another LocalCluster call (it is resolved to its value there),
    ``await`` it from any event loop, or block on :meth:`result`.
    """

    def __init__(self, fut: concurrent.futures.Future, clock: SimClock) -> None:
        self.future, self._clock = fut, clock

    def result(self, timeout: float | None = None) -> Any:
        """Block until done (simulated time passes meanwhile); ``timeout`` in real seconds."""
        return self._clock.wait(self.future, timeout)

    def done(self) -> bool:
        return self.future.done()

    def __await__(self):  # noqa: ANN204
        return asyncio.wrap_future(self.future).__await__()

    def __repr__(self) -> str:
        return f"LocalRef({'done' if self.future.done() else 'pending'})"


class _LocalMethod:
    def __init__(self, actor: LocalActor, name: str) -> None:
        self._actor, self._name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Start the call; an asyncio Task on the loop thread, else a :class:`LocalRef`."""
        return self._actor._submit(self._name, args, kwargs)


class LocalActor:
    """An actor-handle stand-in for one in-process Worker: ``actor.m.remote(*a)`` calls ``worker.m(*a)``.

    Args:
        instance: the Worker object.
        clock: the session's :class:`~rollart_nb.clock.SimClock` (its loop runs every call).
        threaded: run sync methods in this actor's own thread instead of on the loop.
        call_latency_s: modelled seconds each call waits before it runs (a Ray actor call's round
            trip, which an in-process call would otherwise not pay), scaled as every modelled cost
            is (:func:`~rollart_nb.clock.resolve_time_scale`: 1 on a virtual clock).
    """

    def __init__(self, instance: Worker, clock: SimClock, threaded: bool, call_latency_s: float = 0.0) -> None:
        self.instance, self._clock, self._loop, self.threaded = instance, clock, clock.loop, threaded
        self.call_latency_s = call_latency_s
        # one thread per actor: a trainer's calls run in order, like a sync Ray actor's
        self._thread = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"sim-{instance.role}") if threaded else None
        )
        self.closed = False

    def __getattr__(self, name: str) -> _LocalMethod:
        if name.startswith("__"):
            raise AttributeError(name)
        return _LocalMethod(self, name)

    def _submit(self, name: str, args: tuple, kwargs: dict) -> Any:
        if self.closed:
            raise StateError(f"worker {self.instance.binding.worker if self.instance.binding else '?'} is closed")
        coro = self._invoke(name, args, kwargs)
        if _running_loop() is self._loop:
            return self._loop.create_task(coro)
        return LocalRef(asyncio.run_coroutine_threadsafe(coro, self._loop), self._clock)

    async def _invoke(self, name: str, args: tuple, kwargs: dict) -> Any:
        turns = turns_carried(name, args)
        if turns:  # the caller's control plane prepares them first, one turn at a time
            await self._clock.host.control_turns(turns, resolve_time_scale(None))
        if self.call_latency_s > 0:
            await asyncio.sleep(self.call_latency_s * resolve_time_scale(None))
        args = tuple([await _resolve(a) for a in args])
        kwargs = {k: await _resolve(v) for k, v in kwargs.items()}
        fn = getattr(self.instance, name)
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        if self._thread is not None:
            return await self._loop.run_in_executor(self._thread, functools.partial(fn, *args, **kwargs))
        res = fn(*args, **kwargs)
        return await res if inspect.isawaitable(res) else res

    def close(self) -> None:
        self.closed = True
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:
        return f"LocalActor({type(self.instance).__name__}, {'threaded' if self.threaded else 'loop'})"


@dataclass
class LocalWorkerHandle:
    """One in-process worker of a LocalCluster (the ``WorkerHandle`` of a Ray Cluster)."""

    actor: LocalActor
    binding: Binding
    inflight: int = 0
    calls: int = 0
    instance: Worker | None = field(default=None, repr=False)


class LocalFuture:
    """Result of a non-blocking LocalCluster call: ``.result(timeout)``, ``await fut``, ``.refs``."""

    def __init__(
        self, refs: list[LocalRef], combine: Callable[[list[Any]], Any], what: str, who: list[Binding]
    ) -> None:
        self._refs, self._combine, self._what, self._who = refs, combine, what, who

    @property
    def refs(self) -> list[LocalRef]:
        """One :class:`LocalRef` per worker called; pass one to another call instead of its value."""
        return list(self._refs)

    def result(self, timeout: float | None = None) -> Any:
        out = []
        for r, b in zip(self._refs, self._who, strict=True):
            try:
                out.append(r.result(timeout))
            except concurrent.futures.TimeoutError as e:
                raise ClusterError(f"{self._what} on {b.worker} did not finish within {timeout}s") from e
        return self._combine(out)

    def done(self) -> bool:
        return all(r.done() for r in self._refs)

    def __await__(self):  # noqa: ANN204
        async def run() -> Any:
            return self._combine([await r for r in self._refs])

        return run().__await__()


class LocalCluster(ClusterBase):
    """A role's Workers as in-process objects on a SimSession's event loop.

    Built by ``SimSession.cluster`` (through its
    :class:`~rollart_nb.runtime.sim.SimRuntime`); same interface as
    :class:`~rollart_nb.runtime.ray.Cluster`.

    Example:
        >>> sess = SimSession({"H800": 8, "H20": 8, "cpu": 4})                     # doctest: +SKIP
        >>> gen = sess.cluster("actor_gen", SimGenerator, pool="H20", replicas=8,   # doctest: +SKIP
        ...                    model=spec("qwen3-8b"))
        >>> gen.version()                                                           # doctest: +SKIP
        [0, 0, 0, 0, 0, 0, 0, 0]
    """

    _html_note = " &middot; in-process (simulated)"

    def __init__(
        self,
        resources: ResourceManager,
        spec: ClusterSpec,
        *,
        registry: Mapping[str, Endpoint],
        clock: SimClock,
        call_latency_s: float = 0.0,
    ) -> None:
        self._clock = clock  # its loop runs every worker and every call
        self.call_latency_s = call_latency_s
        threaded, cls = spec.threaded, spec.worker_cls
        if threaded is None:  # trainers block in their steps, unless they say they run on the loop
            threaded = issubclass(cls, TrainerWorker) and not getattr(cls, "runs_on_loop", False)
        self.threaded = bool(threaded)
        # re-entrant: a done-callback runs at once, under the lock, when the call already finished
        self._lock = threading.RLock()
        self._cls = actor_class_for(cls)
        self.workers: list[LocalWorkerHandle]
        super().__init__(resources, spec, registry)

    # -- construction ----------------------------------------------------------------
    def _spawn(self, index: int, world: int, binding: Binding | None = None) -> LocalWorkerHandle:
        b = binding or self._bind(index)
        try:
            # built on the loop thread: a worker may create loop-bound objects in __init__.
            # No log dir: in-process, a per-worker file handler would capture the driver's logs too.
            inst = self._clock.call(lambda: self._cls(b, world, None, **self.spec.init_kwargs))
        except Exception as e:
            self._resources.release(self.name, index)
            raise ClusterError(
                f"worker {b.worker} on pool {b.pool} did not start: {type(e).__name__}: {e}. "
                "Check the Worker's __init__ arguments"
            ) from e
        return LocalWorkerHandle(LocalActor(inst, self._clock, self.threaded, self.call_latency_s), b, instance=inst)

    # -- dispatch paths --------------------------------------------------------------
    def _start(self, h: LocalWorkerHandle, attr: str, args: tuple, kwargs: dict) -> LocalRef:
        fut = asyncio.run_coroutine_threadsafe(h.actor._invoke(attr, args, kwargs), self._clock.loop)
        # released on completion (not on .result()): routing sees the true in-flight count
        fut.add_done_callback(functools.partial(self._release, h))
        return LocalRef(fut, self._clock)

    def _stop(self, h: LocalWorkerHandle) -> None:
        h.actor.close()

    def _release(self, h: LocalWorkerHandle, _done: object = None) -> None:
        with self._lock:
            h.inflight -= 1

    def _finish(
        self, idx: list[int], refs: list[LocalRef], combine: Callable[[list[Any]], Any], blocking: bool, what: str
    ) -> Any:
        fut = LocalFuture(refs, combine, what, [self.workers[i].binding for i in idx])
        if not blocking:
            return fut
        if _running_loop() is self._clock.loop:
            raise StateError(
                f"{what}: a blocking call from inside the simulation's event loop would deadlock; "
                "call it with blocking=False and await the result"
            )
        return fut.result()

    # -- lifecycle -------------------------------------------------------------------
    def restart_worker(self, index: int) -> Binding:
        """Failover: drop worker ``index``, rebind its slot (another node if possible), build it again."""
        self._check_open()
        self.workers[index].actor.close()
        b = self._resources.rebind(self.name, index)
        self.workers[index] = self._spawn(index, len(self.workers), binding=b)
        return b

    def info(self) -> list[dict[str, Any]]:
        """Per worker: node, pid (this process), hardware, pool, rank."""
        return [
            {
                "node_id": h.binding.node,
                "pid": os.getpid(),
                "hardware": h.binding.hardware,
                "pool": h.binding.pool,
                "rank": h.binding.index,
            }
            for h in self.workers
        ]


async def _resolve(v: Any) -> Any:
    """A LocalRef argument becomes its value (as Ray resolves a top-level ObjectRef argument)."""
    return await v if isinstance(v, LocalRef) else v


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
