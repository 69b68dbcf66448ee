"""The simulator's virtual clock: time jumps to the next event, only while somebody waits, and
never while a thread is working for the loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rollart_nb import clock as simclock
from rollart_nb.clock import SimClock
from rollart_nb.errors import StateError


@pytest.fixture
def clock():
    c = SimClock()
    yield c
    c.close()


def test_hours_of_timers_pass_in_no_real_time(clock):
    async def main():
        await asyncio.sleep(3600)
        a = clock.now()
        await asyncio.wait_for(asyncio.sleep(7200), timeout=9000)
        return a, clock.now()

    t0 = time.monotonic()
    assert clock.run(main(), timeout=10) == (3600.0, 10800.0)
    assert time.monotonic() - t0 < 2.0


def test_concurrent_timers_fire_in_simulated_order(clock):
    order = []

    async def at(t, name):
        await asyncio.sleep(t)
        order.append((name, clock.now()))

    async def main():
        await asyncio.gather(at(5, "b"), at(1, "a"), at(30, "c"))

    clock.run(main(), timeout=10)
    assert order == [("a", 1.0), ("b", 5.0), ("c", 30.0)]


def test_a_thread_doing_real_work_holds_simulated_time(clock):
    """CPU time in a worker thread costs no simulated time, and no timer fires while it runs."""

    def work():
        time.sleep(0.3)  # real work, no simulated time
        return clock.now()

    async def main():
        loop = asyncio.get_running_loop()
        timer = asyncio.ensure_future(asyncio.sleep(1))  # would fire if time jumped during work()
        seen = await loop.run_in_executor(None, work)
        fired_during_work = timer.done()
        await timer
        return seen, fired_during_work, clock.now()

    assert clock.run(main(), timeout=10) == (0.0, False, 1.0)


def test_thread_sleep_is_simulated_and_overlaps_loop_timers(clock):
    """The sim trainer's blocking sleep passes simulated time; the loop runs on meanwhile."""

    def trainer():
        simclock.sleep(100)
        return clock.now()

    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, trainer)
        await asyncio.sleep(30)
        at_30 = clock.now()
        return at_30, await fut

    t0 = time.monotonic()
    assert clock.run(main(), timeout=10) == (30.0, 100.0)
    assert time.monotonic() - t0 < 2.0


def test_time_stands_still_between_driver_calls(clock):
    """Nobody waiting: a running simulation does not race ahead while the driver thinks."""
    ticks = []

    async def ticker():
        while True:
            await asyncio.sleep(1)
            ticks.append(clock.now())

    clock.call(lambda: asyncio.ensure_future(ticker()))
    time.sleep(0.3)  # the driver "thinks" (no wait on the loop)
    assert clock.now() == 0.0 and ticks == []
    clock.run(asyncio.sleep(5), timeout=10)  # waiting lets time pass
    assert clock.now() == 5.0 and ticks[:4] == [1.0, 2.0, 3.0, 4.0]


def test_blocking_waits_on_the_loop_thread_are_refused(clock):
    async def main():
        with pytest.raises(StateError, match="deadlock"):
            clock.wait(asyncio.run_coroutine_threadsafe(asyncio.sleep(0), clock.loop))
        with pytest.raises(StateError, match="asyncio.sleep"):
            clock.sleep(1)

    clock.run(main(), timeout=10)


def test_close_releases_a_thread_asleep_in_simulated_time():
    c = SimClock()
    done = threading.Event()

    def sleeper():
        simclock.sleep(10**9)
        done.set()

    async def start():
        asyncio.get_running_loop().run_in_executor(None, sleeper)

    c.run(start(), timeout=10)
    c.close()
    assert done.wait(5)
    assert c.closed and not c.thread.is_alive()


def test_real_time_mode_sleeps_for_real():
    c = SimClock(virtual=False)
    try:
        t0 = time.monotonic()
        c.run(asyncio.sleep(0.2), timeout=10)
        assert time.monotonic() - t0 >= 0.19
    finally:
        c.close()


def test_default_time_scale_follows_the_clock(clock):
    assert simclock.resolve_time_scale(None) == simclock.REAL_TIME_SCALE  # driver thread, no clock
    assert simclock.resolve_time_scale(0.5) == 0.5
    assert clock.call(lambda: simclock.resolve_time_scale(None)) == 1.0


def test_other_threads_posts_wait_for_a_quiet_instant(clock):
    """A driver's call lands only when nothing is left to run at the current simulated instant."""
    log = []
    started = threading.Event()

    def chain(k):  # a long run of zero-delay callbacks at one instant
        if k == 0:
            started.set()
        log.append(k)
        if k < 200000:
            clock.loop.call_soon(chain, k + 1)

    clock.call(lambda: clock.loop.call_soon(chain, 0))
    assert started.wait(5)
    clock.call(lambda: log.append("driver"))  # posted mid-chain from this thread
    assert log[-1] == "driver" and log[-2] == 200000
