import asyncio
import logging
import threading
import time

import pytest

from rollart_nb.envs import Arithmetic, AsyncEnv, WithLatency, env_reset, env_step
from rollart_nb.envs.base import BlockingPool
from rollart_nb.errors import EnvError, StateError
from rollart_nb.protocols import Env


class Broken:
    def reset(self, seed=None):
        raise ValueError("boom")

    def step(self, action):
        return "", 0.0, True, False, {}


class AsyncOnly:
    """Records which method was called, to show the helpers prefer async ones."""

    def __init__(self):
        self.calls = []

    def reset(self, seed=None):
        self.calls.append("reset")
        return "", {}

    def step(self, action):
        self.calls.append("step")
        return "", 0.0, True, False, {}

    async def areset(self, seed=None):
        self.calls.append("areset")
        return "", {"thread": threading.current_thread().name}

    async def astep(self, action):
        self.calls.append("astep")
        return "", 1.0, True, False, {}


def test_sync_env_runs_in_a_thread():
    env = Arithmetic()

    async def main():
        obs, info = await env_reset(env, 2)
        return await env_step(env, info["answer"])

    assert asyncio.run(main())[1] == 1.0


def test_async_methods_are_preferred_and_run_on_the_loop_thread():
    env = AsyncOnly()

    async def main():
        _, info = await env_reset(env, 0)
        await env_step(env, "x")
        return info

    info = asyncio.run(main())
    assert env.calls == ["areset", "astep"]
    assert info["thread"] == threading.main_thread().name


def test_env_exceptions_become_env_error_with_cause():
    with pytest.raises(EnvError, match="Broken raised in reset: ValueError: boom") as e:
        asyncio.run(env_reset(Broken(), 0))
    assert isinstance(e.value.__cause__, ValueError)


def test_protocol_checks():
    assert isinstance(Arithmetic(), Env) and not isinstance(Arithmetic(), AsyncEnv)
    assert isinstance(WithLatency(Arithmetic(), 0, 0), AsyncEnv)


# -- BlockingPool: sync env calls off the loop's default executor, hung calls abandoned ---------
class Hangs:
    """A plain sync env whose step blocks until ``release`` is set (a stand-in for time.sleep(3600))."""

    def __init__(self, release):
        self.release = release

    def reset(self, seed=None):
        return "q", {}

    def step(self, action):
        self.release.wait(3600)
        return "", 0.0, True, False, {}


def test_hung_sync_calls_beyond_the_default_executor_are_abandoned_and_the_rest_still_run():
    release = threading.Event()
    pool = BlockingPool("test", size=2)
    loop_threads = []

    async def main():
        loop = asyncio.get_running_loop()
        # 12 hung steps: twice what the loop's default executor holds on a small machine
        for _ in range(12):
            with pytest.raises(EnvError, match=r"Hangs did not answer step within 0.05s; the call was abandoned"):
                await env_step(Hangs(release), "x", timeout_s=0.05, pool=pool)
        # the control plane's executor was never touched, and a healthy env still answers at once
        loop_threads.append(await loop.run_in_executor(None, lambda: threading.current_thread().name))
        t0 = time.perf_counter()
        _, info = await env_reset(Arithmetic(), 1, timeout_s=1.0, pool=pool)
        return time.perf_counter() - t0, info

    try:
        elapsed, info = asyncio.run(main())
        st = pool.stats()
        assert "answer" in info and elapsed < 0.5
        assert st["abandoned"] == st["hung"] == 12 and st["threads"] <= st["cap"]
        assert not loop_threads[0].startswith("rollart-")
    finally:
        release.set()
    deadline = time.time() + 5
    while pool.stats()["hung"] and time.time() < deadline:
        time.sleep(0.01)
    assert pool.stats()["hung"] == 0 and pool.stats()["returned_late"] == 12
    pool.shutdown()


def test_pool_at_its_cap_says_so_and_calls_wait_for_a_thread(caplog):
    release = threading.Event()
    pool = BlockingPool("capped", size=1, max_replacements=1)
    abandoned = []

    async def main():
        for _ in range(2):  # the base thread and the one replacement both hang
            with pytest.raises(EnvError):
                await env_step(Hangs(release), "x", timeout_s=0.05, pool=pool, on_abandon=lambda: abandoned.append(1))
        with pytest.raises(
            EnvError, match=r"capped thread pool: 2 threads, 2 hung call\(s\) abandoned, cap 2 AT ITS CAP"
        ):
            await env_reset(Arithmetic(), 0, timeout_s=0.1, pool=pool)  # healthy, but no thread is free
        release.set()  # the hung calls return: capacity is back
        return await env_reset(Arithmetic(), 0, timeout_s=2.0, pool=pool)

    with caplog.at_level(logging.WARNING, logger="rollart_nb.envs.base"):
        try:
            asyncio.run(main())
        finally:
            release.set()
    st = pool.stats()
    assert len(abandoned) == 2 and st["cap_hits"] >= 1 and st["abandoned"] == 2
    assert any("'capped' is at its cap of 2 threads" in r.getMessage() for r in caplog.records)
    pool.shutdown()


def test_pool_threads_are_daemons_and_separate_from_the_loop_executor():
    pool = BlockingPool("daemons", size=1)

    async def main():
        return await pool.call(lambda: (threading.current_thread().daemon, threading.current_thread().name))

    daemon, name = asyncio.run(main())
    assert daemon and name.startswith("rollart-daemons-")
    pool.shutdown()


def test_wrong_result_shape_is_an_env_error():
    class Bad(Broken):
        def reset(self, seed=None):
            return "only obs"

    with pytest.raises(EnvError, match=r"Bad reset returned str 'only obs', expected \(obs, info\)"):
        asyncio.run(env_reset(Bad(), 0))


def test_an_abandoned_call_keeps_a_virtual_clock_running():
    """A sync env passing simulated time (sim.clock.sleep) that times out: its thread's hold on
    the clock must stay balanced, or simulated time would freeze for every other coroutine."""
    from rollart_nb.clock import SimClock
    from rollart_nb.clock import sleep as sim_sleep

    class SimHang(Broken):
        def reset(self, seed=None):
            sim_sleep(3600)
            return "", {}

    clock, pool = SimClock(), BlockingPool("sim", size=1)

    async def main():
        with pytest.raises(EnvError, match="did not answer reset within 1s"):
            await env_reset(SimHang(), 0, timeout_s=1.0, pool=pool)
        t = clock.now()
        await asyncio.sleep(7200)
        return t, clock.now() - t

    try:
        t, passed = clock.run(main(), timeout=10)
    finally:
        clock.close()
    assert t == pytest.approx(1.0) and passed == pytest.approx(7200)
    assert pool.stats()["abandoned"] == 1 and pool.stats()["returned_late"] == 1  # it woke at t=3600
    pool.shutdown()


def test_submit_to_a_shut_down_pool_is_a_state_error():
    pool = BlockingPool("closed", size=1)
    pool.shutdown()
    with pytest.raises(StateError, match="shut down; create a new one"):
        pool.submit(lambda: None)
