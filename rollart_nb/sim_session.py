"""SimSession: a whole simulated cluster in one process, for what-if studies.

``Session.local()`` runs every worker as a Ray actor: right for real backends, but a hundred
sim generation workers would be a hundred processes on a laptop. A :class:`SimSession` instead
builds :class:`~rollart_nb.runtime.local.LocalCluster` s whose Workers live in this process on one
background asyncio loop thread. Everything else is the real thing: pools, the
:class:`~rollart_nb.resources.manager.ResourceManager` and its bindings, the
:class:`~rollart_nb.control.pipeline.Pipeline`, the RolloutWorker with its LLMProxy and
RolloutScheduler. Time comes only from the sim backends, envs and trainer sleeping their
modelled time on that loop's clock: by default a virtual clock
(:class:`~rollart_nb.clock.SimClock`) that jumps to the next event, so results do not
depend on how fast or loaded the machine is; ``virtual=False`` sleeps really (modelled time
times each backend's ``time_scale``).

Lifecycle: ``attached -> closed`` (it is attached from construction; nothing to connect to).
The API shared with a Ray session is :class:`~rollart_nb.session_base.SessionBase`; where workers
run is the session's :class:`~rollart_nb.runtime.sim.SimRuntime`.
"""

from __future__ import annotations

import html
import logging
import threading
import uuid
from typing import Any

from rollart_nb.clock.cores import Host, SharedCores
from rollart_nb.errors import ConfigError, StateError
from rollart_nb.resources.manager import ResourceManager
from rollart_nb.resources.pools import SERVERLESS_SLOTS, Pool, canonical_name, hardware_for_pool, pool_problems
from rollart_nb.resources.store import MemoryStore
from rollart_nb.runtime.local import LocalCluster
from rollart_nb.runtime.sim import SimRuntime
from rollart_nb.session_base import SessionBase, SessionState

__all__ = ["DEFAULT_SIM_POOLS", "SimSession"]

log = logging.getLogger(__name__)

DEFAULT_SIM_POOLS: dict[str, int] = {"H800": 96, "H20": 32, "cpu": 64}
"""Pools of a :class:`SimSession` when none are given (pool name -> devices / CPU slots)."""


class SimSession(SessionBase[SimRuntime, LocalCluster]):
    """An in-process simulated cluster with the Session API (clusters, tasks, rewards, pipelines).

    Args:
        pools: pool name -> device count ("H800", "H20", "H100", "A100", "cpu", "serverless").
            Default :data:`DEFAULT_SIM_POOLS`.
        seed: base seed (pipelines derive theirs from it).
        gpus_per_node: GPUs per simulated node (bindings name a node; a worker with
            ``slots=k`` must fit on one node, as a TP group must).
        virtual: simulated time (default). Backends then take ``time_scale=1`` (one modelled
            second is one simulated second); :class:`~rollart_nb.control.pipeline.Pipeline`
            step reports are in simulated seconds. ``False``: real time, scaled by ``time_scale``.
        call_latency_s: modelled seconds every call to a worker takes before it runs (the round
            trip of a Ray actor call, which in-process calls do not pay). 0 (default) leaves the
            control plane's calls out, as at GPU scale, where a turn or a step lasts seconds;
            :func:`rollart_nb.bench.calibrate.call_latency` measures it on a running Ray.
        host_cores: the number of CPU cores that work on ``cpu``-kind devices (a measured
            profile's) and the control plane share (:mod:`rollart_nb.clock.cores`: each burst of
            work on the least loaded core), as on one machine running ``Session.local()``. None
            (default): every device computes on its own time, as GPUs do.
        turn_cpu_s: CPU seconds the control plane spends per turn, one turn at a time (a
            rollout worker's one event loop), on the host's cores when ``host_cores`` is given.
            0 (default) leaves it out; :func:`rollart_nb.bench.calibrate.measure_control_plane`
            measures it for a real session.

    Example:
        >>> from rollart_nb.models import spec
        >>> from rollart_nb.workers.roles import SimGenerator, SimTrainer
        >>> with SimSession({"H800": 8, "H20": 8, "cpu": 4}) as sess:
        ...     gen = sess.cluster("actor_gen", SimGenerator, pool="H20", replicas=8, model=spec("qwen3-8b"))
        ...     gen.version()
        [0, 0, 0, 0, 0, 0, 0, 0]
    """

    _reopen = "SimSession(pools=...)"

    def __init__(
        self,
        pools: dict[str, int] | None = None,
        seed: int = 0,
        *,
        gpus_per_node: int = 8,
        virtual: bool = True,
        call_latency_s: float = 0.0,
        host_cores: int | None = None,
        turn_cpu_s: float = 0.0,
    ) -> None:
        super().__init__()
        pools = DEFAULT_SIM_POOLS if pools is None else pools
        problems = pool_problems(pools, whole=True)
        if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            problems.append(f"gpus_per_node must be an int >= 1, got {gpus_per_node!r}")
        if not (isinstance(call_latency_s, int | float) and call_latency_s >= 0):
            problems.append(f"call_latency_s must be a number of seconds >= 0, got {call_latency_s!r}")
        if host_cores is not None and (
            isinstance(host_cores, bool) or not isinstance(host_cores, int) or host_cores < 1
        ):
            problems.append(f"host_cores must be a whole number of cores >= 1 or None, got {host_cores!r}")
        if not (isinstance(turn_cpu_s, int | float) and turn_cpu_s >= 0):
            problems.append(f"turn_cpu_s must be a number of seconds >= 0, got {turn_cpu_s!r}")
        if problems:
            raise ConfigError(problems, where="SimSession")
        self.id = uuid.uuid4().hex[:8]
        self.mode, self.address, self.seed = "sim", "in-process", seed
        self.pools: dict[str, Pool] = {
            canonical_name(n): _make_pool(canonical_name(n), c, gpus_per_node) for n, c in pools.items()
        }
        self.store = MemoryStore(prefix=f"sessions/{self.id}/")
        self._runtime = SimRuntime(
            ResourceManager(self.pools, self.store),
            seed=seed,
            virtual=virtual,
            name=f"rollart-sim-{self.id}",
            call_latency_s=float(call_latency_s),
        )
        self.virtual = virtual
        #: The simulation's loop and time: ``sess.clock()`` reads simulated seconds.
        self.clock = self._runtime.sim_clock
        self.clock.host = Host(None if host_cores is None else SharedCores(host_cores), float(turn_cpu_s))
        self._loop, self._thread = self.clock.loop, self.clock.thread
        self.state = SessionState.ATTACHED

    # -- the loop --------------------------------------------------------------------
    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the simulation's loop from the driver and wait for its result."""
        self._check()
        if threading.current_thread() is self._thread:
            raise StateError("SimSession.run() was called on the simulation loop itself; await the coroutine")
        return self.clock.run(coro, timeout)

    # -- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        """Close pipelines and clusters, cancel what still runs on the loop, stop the loop thread."""
        if self.state == "closed":
            return
        self.runtime.close(after_pipelines=[("stopping env launchers and log tails", self._close_own_parts)])
        self.store.clear()
        self.state = SessionState.CLOSED

    def __repr__(self) -> str:
        pools = ", ".join(f"{n}:{p.free:g}/{p.capacity:g}*" for n, p in self.pools.items())
        return f"SimSession(id={self.id}, {self.state}, pools=[{pools}], clusters={sorted(self.clusters)})"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td><b>{html.escape(n)}</b></td><td>{p.hardware.name} ({p.hardware.optimized_for})</td>"
            f"<td>{len(p.nodes)}</td><td>{p.free:g} / {p.capacity:g}</td><td>${p.hardware.price_per_hour:.2f}/h</td></tr>"
            for n, p in self.pools.items()
        )
        clusters = "".join(f"<li>{html.escape(repr(c))}</li>" for c in self.clusters.values())
        return (
            f"<div><b>rollart_nb SimSession</b> <code>{self.id}</code> &middot; in-process, simulated "
            f"&middot; {self.state}<table><tr><th>pool</th><th>hardware</th><th>nodes</th>"
            f"<th>free / capacity</th><th>price</th></tr>{rows}</table>"
            f"<ul>{clusters or '<li>no clusters yet</li>'}</ul></div>"
        )


def _make_pool(name: str, count: int, gpus_per_node: int) -> Pool:
    """A simulated pool of ``count`` slots over nodes of ``gpus_per_node`` (one node for cpu/serverless)."""
    hw = hardware_for_pool(name)
    if hw.kind == "gpu":
        nodes = {
            f"sim-{name}-{k}": float(min(gpus_per_node, count - k * gpus_per_node))
            for k in range(-(-count // gpus_per_node))
        }
    else:
        nodes = {f"sim-{name}-0": float(SERVERLESS_SLOTS if name == "serverless" else count)}
    return Pool(name, hw, nodes, resource="", simulated=True)
