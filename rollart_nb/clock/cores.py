"""A host's CPU cores shared by what runs on them: processor sharing on the simulation's loop.

A :class:`~rollart_nb.sim_session.SimSession` normally gives every device its own time; on one
CPU machine the generator, the trainer and the control plane share a few cores.
:class:`SharedCores` models that: each job (one thread's burst of work) starts on the core with
the least work left and shares its time equally with the jobs there (``w`` core-seconds take
``2 w`` beside one other job). :class:`Host` bundles the shared cores (``None``: own time) and
the control plane's CPU seconds per turn (spent one turn at a time). Sim workers find it through
their clock: work priced on a ``"cpu"`` device runs on its cores.

Example:
    >>> import asyncio
    >>> from rollart_nb.clock import SimClock
    >>> clock = SimClock()
    >>> cores = SharedCores(2)
    >>> async def three_jobs():
    ...     await asyncio.gather(cores.run(1.0), cores.run(1.0), cores.run(1.0))
    ...     return clock.now()
    >>> clock.run(three_jobs(), timeout=5)   # the third job shares core 0 with the first
    2.0
    >>> clock.close()
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

from rollart_nb.errors import ConfigError

__all__ = ["Host", "SharedCores"]

_EPS = 1e-12


class _Job:
    __slots__ = ("core", "done", "left")

    def __init__(self, work: float, core: int, done: asyncio.Future[None]) -> None:
        self.left, self.core, self.done = work, core, done


class SharedCores:
    """``cores`` CPU cores shared by the jobs running on them, as an OS scheduler shares them.

    Each job is one thread's work (a generator's forward pass, a train step, a control-plane
    turn). It starts on the core with the least work left on it (ties: the lowest index), stays
    there, and shares that core's time equally with the jobs already on it. This approximates
    Linux's scheduler with a few single-threaded processes: a long train step keeps its core and
    is slowed little while the short, bursty rollout work piles onto the other cores. All
    methods run on the simulation's event loop; time is that loop's ``time()``.

    Args:
        cores: how many cores (a whole number >= 1).

    Attributes:
        busy_s: core-seconds of work done so far (``busy_s / (cores * elapsed)`` is utilisation).
    """

    def __init__(self, cores: int) -> None:
        if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
            raise ConfigError(f"cores must be a whole number >= 1, got {cores!r}", where="SharedCores")
        self.cores = cores
        self.busy_s = 0.0
        self._jobs: dict[int, _Job] = {}
        self._ids = itertools.count()
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None

    @property
    def running(self) -> int:
        """Jobs on the cores now."""
        return len(self._jobs)

    def _count(self) -> list[int]:
        n = [0] * self.cores
        for j in self._jobs.values():
            n[j.core] += 1
        return n

    def _pick(self) -> int:
        """The core with the least work left on it (ties: the lowest index)."""
        left = [0.0] * self.cores
        for j in self._jobs.values():
            left[j.core] += j.left
        return min(range(self.cores), key=lambda c: (left[c], c))

    async def run(self, work: float, interrupt: asyncio.Event | None = None) -> float | None:
        """Do ``work`` core-seconds on one of the cores; returns None when done, or, when
        ``interrupt`` is set first, the core-seconds done by then (the rest is dropped)."""
        if work <= 0:
            return None
        loop = asyncio.get_running_loop()
        self._advance(loop.time())
        key = next(self._ids)
        job = _Job(float(work), self._pick(), loop.create_future())
        self._jobs[key] = job
        self._reschedule(loop)
        waiter: asyncio.Future[Any] | None = None
        try:
            if interrupt is None:
                await job.done
                return None
            waiter = loop.create_task(interrupt.wait())
            pending: set[asyncio.Future[Any]] = {job.done, waiter}
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if job.done.done():
                return None
            self._leave(key, loop)
            if job.done.done():  # it finished at the very instant of the interrupt
                return None
            return max(float(work) - max(job.left, 0.0), 0.0)
        finally:
            if waiter is not None:
                waiter.cancel()
            self._leave(key, loop)  # cancelled: its progress is accounted, the rest dropped

    def _leave(self, key: int, loop: asyncio.AbstractEventLoop) -> None:
        if key in self._jobs:
            self._advance(loop.time())
            if key in self._jobs:
                del self._jobs[key]
                self._reschedule(loop)

    def _advance(self, now: float) -> None:
        """Charge every running job its core's share of the time since the last change; finish those done."""
        dt = now - self._last
        self._last = now
        if dt <= 0 or not self._jobs:
            return
        n = self._count()
        self.busy_s += dt * sum(1 for c in n if c)
        for key, job in list(self._jobs.items()):
            job.left -= dt / n[job.core]
            if job.left <= _EPS * max(1.0, dt):
                del self._jobs[key]
                if not job.done.done():
                    job.done.set_result(None)

    def _reschedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """One timer, at the instant the next job will finish."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._jobs:
            return
        n = self._count()
        first = min(max(j.left, 0.0) * n[j.core] for j in self._jobs.values())
        self._timer = loop.call_at(self._last + first, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        before = len(self._jobs)
        self._advance(loop.time())
        if len(self._jobs) == before and self._jobs:  # float rounding left the next job a hair short
            n = self._count()
            key = min(self._jobs, key=lambda k: self._jobs[k].left * n[self._jobs[k].core])
            job = self._jobs.pop(key)
            if not job.done.done():
                job.done.set_result(None)
        self._reschedule(loop)

    def __repr__(self) -> str:
        return f"SharedCores({self.cores}, running={self.running}, busy_s={self.busy_s:.3f})"


@dataclass
class Host:
    """What a simulation knows about the machine its CPU devices and control plane share.

    Attributes:
        cores: the host's shared cores, or None (every device has its own time; the default,
            right for GPU clusters, where each device computes on its own).
        turn_cpu_s: CPU seconds the control plane spends per turn (the env manager's
            tokenizing and bookkeeping, the proxy, the client side of the call), spent one turn
            at a time, as on a rollout worker's one event loop; 0 leaves it out. It is CPU, not
            latency: a sim worker call still waits its round trip (``call_latency_s``) besides.
    """

    cores: SharedCores | None = None
    turn_cpu_s: float = 0.0
    _control: asyncio.Lock | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.turn_cpu_s, int | float) and self.turn_cpu_s >= 0):
            raise ConfigError(f"turn_cpu_s must be a number of seconds >= 0, got {self.turn_cpu_s!r}", where="Host")

    async def compute(self, seconds: float, interrupt: asyncio.Event | None = None) -> float | None:
        """``seconds`` of one core's work: on the shared cores if any, else an ``asyncio.sleep``
        (interrupted early when ``interrupt`` is set). Returns None when done, else the seconds
        done by the interrupt (as :meth:`SharedCores.run`)."""
        if self.cores is not None:
            return await self.cores.run(seconds, interrupt)
        if seconds <= 0:
            return None
        if interrupt is None:
            await asyncio.sleep(seconds)
            return None
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            await asyncio.wait_for(interrupt.wait(), seconds)
        except TimeoutError:
            return None
        return min(loop.time() - t0, seconds)

    async def control_turns(self, turns: int, scale: float = 1.0) -> None:
        """Spend the control plane's CPU for ``turns`` turns (``turn_cpu_s * turns * scale``
        loop seconds of work), after the turns queued before them."""
        if turns <= 0 or self.turn_cpu_s <= 0 or scale <= 0:
            return
        if self._control is None:
            self._control = asyncio.Lock()
        async with self._control:
            await self.compute(self.turn_cpu_s * turns * scale)
