"""Virtual time for the simulator: an event loop whose clock jumps to the next timer.

A :class:`~rollart_nb.sim_session.SimSession` runs its workers on one event loop whose
``time()`` jumps to the earliest timer when nothing is ready, no thread works for the loop, and
somebody waits for a result (a discrete-event simulation): Python's CPU time costs no simulated
time, so a run gives the same numbers on a laptop and on a loaded CI box. The jump is safe because:

- **Threads hold time**: work handed to threads counts as busy until the loop has seen its
  result; a thread passes modelled time with :func:`sleep`.
- **Time passes only for a waiter** (:meth:`SimClock.wait`); between two driver calls it stands
  still, so a session left alone in a notebook does not run ahead.
- **All counters change on the loop thread**, so a jump never races a result.
- **Other threads act between instants**: what they post waits until nothing is left to run at
  the current instant, so a driver's ``take_batch`` sees everything that finished at it.

Real I/O works but takes no simulated time: give a SimSession local reward functions.

Example:
    >>> import asyncio
    >>> clock = SimClock()
    >>> async def two_hours():
    ...     await asyncio.sleep(7200)
    ...     return clock.now()
    >>> clock.run(two_hours(), timeout=5)   # returns at once: no real sleeping
    7200.0
    >>> clock.close()
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import logging
import selectors
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple

from rollart_nb.clock.cores import Host
from rollart_nb.errors import StateError

__all__ = [
    "REAL_TIME_SCALE", "SimClock", "VirtualEventLoop", "current", "host_for", "is_virtual", "resolve_time_scale",
    "sleep",
]  # fmt: skip

REAL_TIME_SCALE = 1e-3
"""Default ``time_scale`` of sim backends and envs off a virtual clock (a 10 s turn sleeps 10 ms)."""

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")

_tls = threading.local()  # .clock: the SimClock this thread works for; .held: it holds time


class _Selector:
    """Wraps the loop's real selector; ``select`` may advance virtual time instead of blocking."""

    def __init__(self, real: selectors.BaseSelector) -> None:
        self.real = real
        self.loop: VirtualEventLoop | None = None

    def select(self, timeout: float | None = None) -> list:
        loop = self.loop
        if loop is None:  # real time
            return self.real.select(timeout)
        if timeout is not None and timeout <= 0:  # callbacks or timers due at this instant
            return self.real.select(0)
        events = self.real.select(0)
        if loop.drain_inbox() or events:  # the instant is quiet: other threads' posts run now
            return events
        if timeout is not None and loop.may_advance():
            loop.advance(timeout)
            return []
        # Nothing may run in simulated time now: block (really) until another thread wakes the loop.
        return self.real.select(None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class VirtualEventLoop(asyncio.SelectorEventLoop):
    """A selector event loop with a virtual ``time()``. ``busy`` counts executor jobs not yet seen
    back on the loop, ``waiters`` threads blocked in :meth:`SimClock.wait`; time advances only when
    ``busy == 0 < waiters``."""

    if TYPE_CHECKING:  # private asyncio.BaseEventLoop state used below; typeshed does not declare it
        _ready: collections.deque[asyncio.Handle]
        _scheduled: list[asyncio.TimerHandle]

        def _check_closed(self) -> None: ...

        def _write_to_self(self) -> None: ...

    def __init__(self, virtual: bool = True) -> None:
        sel = _Selector(selectors.DefaultSelector())
        super().__init__(selector=sel)  # type: ignore[arg-type]
        sel.loop = self if virtual else None  # a real-time loop: select() blocks as usual
        self.virtual = virtual
        self._vnow = 0.0
        self._inbox: collections.deque[asyncio.Handle] = collections.deque()
        self.busy = 0
        self.waiters = 0
        self.clock: SimClock | None = None
        self.set_default_executor(concurrent.futures.ThreadPoolExecutor(thread_name_prefix="rollart-sim"))

    def time(self) -> float:
        return self._vnow if self.virtual else super().time()

    def call_soon_threadsafe(
        self,
        callback: Callable[[*_Ts], object],
        *args: *_Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.Handle:
        if not self.virtual:
            return super().call_soon_threadsafe(callback, *args, context=context)
        self._check_closed()
        handle = asyncio.Handle(callback, args, self, context)
        self._inbox.append(handle)  # deque.append is thread-safe
        self._write_to_self()
        return handle

    def drain_inbox(self) -> bool:
        """Move other threads' posts to the ready queue (only when this instant is quiet)."""
        moved = False
        while self._inbox:
            self._ready.append(self._inbox.popleft())
            moved = True
        return moved

    def may_advance(self) -> bool:
        return self.busy == 0 and self.waiters > 0

    def advance(self, dt: float) -> None:
        now = self._vnow + dt
        if self._scheduled:  # land exactly on the timer (float sums can fall a hair short)
            now = max(now, self._scheduled[0].when())
        self._vnow = now

    def run_in_executor(
        self, executor: concurrent.futures.Executor | None, func: Callable[[*_Ts], _T], *args: *_Ts
    ) -> asyncio.Future[_T]:
        self.busy += 1  # run_in_executor is called on the loop thread
        clock = self.clock

        def job() -> _T:
            _tls.clock, _tls.held = clock, True
            try:
                return func(*args)
            finally:
                _tls.held = False

        try:
            fut = super().run_in_executor(executor, job)
        except BaseException:
            self.busy -= 1
            raise
        fut.add_done_callback(self._job_done)  # done callbacks run on the loop thread
        return fut

    def _job_done(self, _fut: asyncio.Future) -> None:
        self.busy -= 1


class SimClock:
    """The simulation's event loop on a thread of its own, and the ways threads wait on it.

    ``clock()`` (or :meth:`now`) reads the simulated seconds since the clock started.

    Args:
        virtual: virtual time (the default; see the module docstring). ``False`` gives a plain
            real-time loop, where sim backends sleep their modelled time times ``time_scale``.
        name: the loop thread's name.
    """

    def __init__(self, virtual: bool = True, name: str = "rollart-sim") -> None:
        self.virtual = virtual
        self.loop = VirtualEventLoop(virtual)
        self.loop.clock = self
        #: The machine the simulated CPU devices and the control plane share
        #: (:class:`~rollart_nb.clock.cores.Host`; by default every device has its own time).
        self.host = Host()
        self._sleepers: set[threading.Event] = set()
        self._lock = threading.Lock()
        self.closed = False
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        _tls.clock, _tls.held = self, False
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def now(self) -> float:
        """Simulated seconds since the clock started."""
        return self.loop.time()

    __call__ = now

    def wait(self, fut: concurrent.futures.Future, timeout: float | None = None) -> Any:
        """Block this (non-loop) thread until ``fut`` is done, letting simulated time pass.

        ``fut`` must be completed on the loop thread (e.g. from ``run_coroutine_threadsafe``).
        ``timeout`` is in real seconds: a guard against a stuck simulation, not a model time.
        """
        if fut.done():
            return fut.result()
        if threading.current_thread() is self.thread:
            raise StateError("a blocking wait on the simulation's own loop thread would deadlock; await it instead")
        held = bool(getattr(_tls, "held", False)) and getattr(_tls, "clock", None) is self

        def done(_f: concurrent.futures.Future) -> None:  # on the loop thread
            self.loop.waiters -= 1
            if held:
                self.loop.busy += 1

        def arm() -> None:
            if fut.done():
                return
            self.loop.waiters += 1
            if held:
                self.loop.busy -= 1
            fut.add_done_callback(done)

        self._post(arm)
        return fut.result(timeout)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        """Run ``coro`` on the loop and wait for it (simulated time passes meanwhile)."""
        return self.wait(asyncio.run_coroutine_threadsafe(coro, self.loop), timeout)

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn()`` on the loop thread and return its result (no simulated time passes)."""
        if threading.current_thread() is self.thread:
            return fn()
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller, raised there
                fut.set_exception(e)

        self._post(run)
        return self.wait(fut, timeout)

    def sleep(self, seconds: float) -> None:
        """Pass ``seconds`` of simulated time on this (non-loop) thread, releasing its hold."""
        if seconds <= 0 or self.closed:
            return
        if not self.virtual:
            time.sleep(seconds)
            return
        if threading.current_thread() is self.thread:
            raise StateError("sleep() on the simulation's loop thread would stop the clock; use asyncio.sleep")
        held = bool(getattr(_tls, "held", False)) and getattr(_tls, "clock", None) is self
        ev = threading.Event()
        with self._lock:
            self._sleepers.add(ev)

        def wake() -> None:
            if held:
                self.loop.busy += 1
            ev.set()

        def arm() -> None:
            if held:
                self.loop.busy -= 1
            self.loop.call_later(seconds, wake)

        try:
            self._post(arm)
            ev.wait()
        finally:
            with self._lock:
                self._sleepers.discard(ev)

    def _post(self, fn: Callable[[], None]) -> None:
        if self.closed:
            raise StateError("the simulation clock is closed")
        self.loop.call_soon_threadsafe(fn)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel what still runs on the loop, release sleeping threads, stop and close the loop."""
        if self.closed:
            return
        try:
            self.run(_cancel_all(), timeout)
        except Exception as e:
            log.warning("cancelling leftover tasks: %s", e)
        self.closed = True
        with self._lock:
            for ev in self._sleepers:  # a trainer thread asleep in simulated time: let it finish
                ev.set()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)
        if not self.thread.is_alive():
            self.loop.close()

    def __repr__(self) -> str:
        kind = "virtual" if self.virtual else "real-time"
        return f"SimClock({kind}, t={self.now():.3f}s, busy={self.loop.busy}, waiters={self.loop.waiters})"


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def current() -> SimClock | None:
    """The virtual clock this thread works for (its loop thread or one of its executor threads), if any."""
    clock = getattr(_tls, "clock", None)
    return clock if clock is not None and not clock.closed else None


def sleep(seconds: float) -> None:
    """Blocking sleep (sync sim code's): simulated time on a virtual clock's thread, else ``time.sleep``."""
    clock = current()
    if clock is None:
        if seconds > 0:
            time.sleep(seconds)
        return
    if threading.current_thread() is clock.thread:
        # A sync call on the loop thread cannot block in simulated time; it passes none.
        log.debug("sim.clock.sleep(%g) on the loop thread: no simulated time passes", seconds)
        return
    clock.sleep(seconds)


_OWN_TIME = Host()
"""The host of a device that computes on its own time (no shared cores): its work is a sleep."""


def host_for(hardware: Any) -> Host:
    """Where a device of ``hardware`` works: the simulation's host for a CPU (``kind == "cpu"``)
    on a virtual clock's thread, else a host without shared cores (its ``compute`` sleeps)."""
    clock = current()
    if clock is None or getattr(hardware, "kind", None) != "cpu":
        return _OWN_TIME
    return clock.host


def is_virtual() -> bool:
    """True on a virtual clock's loop or executor threads (where simulated time is in use)."""
    clock = current()
    if clock is not None:
        return clock.virtual
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return False
    return isinstance(loop, VirtualEventLoop) and loop.virtual


def resolve_time_scale(time_scale: float | None) -> float:
    """``time_scale`` as given, or the default here: 1.0 on a virtual clock, else :data:`REAL_TIME_SCALE`."""
    if time_scale is not None:
        return float(time_scale)
    return 1.0 if is_virtual() else REAL_TIME_SCALE
