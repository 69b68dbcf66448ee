"""A simulated host's shared cores: placement, sharing, interrupts, and the control plane's turns."""

from __future__ import annotations

import asyncio

import pytest

from rollart_nb.clock import SimClock
from rollart_nb.clock.cores import Host, SharedCores
from rollart_nb.errors import ConfigError


@pytest.fixture
def clock():
    c = SimClock()
    yield c
    c.close()


def _finish_times(clock: SimClock, cores: SharedCores, jobs: list[tuple[float, float]]) -> list[float]:
    """Start each (at, work) job at simulated time ``at``; return when each finished."""

    async def one(at: float, work: float) -> float:
        await asyncio.sleep(at)
        await cores.run(work)
        return clock.now()

    async def main() -> list[float]:
        return list(await asyncio.gather(*(one(at, w) for at, w in jobs)))

    return clock.run(main(), timeout=10)


def test_jobs_on_idle_cores_run_at_full_speed(clock):
    assert _finish_times(clock, SharedCores(2), [(0, 1.0), (0, 0.5)]) == pytest.approx([1.0, 0.5])


def test_a_third_job_shares_the_least_loaded_core(clock):
    # 0: a 4 s job on core 0; 1: a 1 s job on core 1; at 0.5 s a 1 s job joins core 1 (0.5 s
    # left there against 3.5 s on core 0): both halve their speed until the first ends.
    done = _finish_times(clock, SharedCores(2), [(0, 4.0), (0, 1.0), (0.5, 1.0)])
    assert done[0] == pytest.approx(4.0)  # the long job kept its core to itself
    assert done[1] == pytest.approx(1.5)  # 0.5 s alone, then 0.5 s of work at half speed
    assert done[2] == pytest.approx(2.0)  # 0.5 s of work at half speed, then 0.5 s alone


def test_one_core_is_processor_shared(clock):
    cores = SharedCores(1)
    assert _finish_times(clock, cores, [(0, 1.0), (0, 1.0), (0, 2.0)]) == pytest.approx([3.0, 3.0, 4.0])
    assert cores.busy_s == pytest.approx(4.0)  # every core-second of work, none twice
    assert cores.running == 0


def test_an_interrupt_returns_the_work_done_and_frees_the_core(clock):
    cores = SharedCores(1)

    async def main() -> tuple[float | None, float]:
        ev = asyncio.Event()
        other = asyncio.ensure_future(cores.run(1.0))
        asyncio.get_running_loop().call_later(1.0, ev.set)
        done = await cores.run(3.0, ev)  # at half speed for 1 s: 0.5 done
        await other
        return done, clock.now()

    done, t = clock.run(main(), timeout=10)
    assert done == pytest.approx(0.5)
    assert t == pytest.approx(1.5)  # the other job, alone after the interrupt, had 0.5 left


def test_a_cancelled_job_leaves_the_cores(clock):
    cores = SharedCores(1)

    async def main() -> float:
        long = asyncio.ensure_future(cores.run(10.0))
        await asyncio.sleep(1.0)
        long.cancel()
        await cores.run(1.0)
        return clock.now()

    assert clock.run(main(), timeout=10) == pytest.approx(2.0)
    assert cores.running == 0


def test_the_control_plane_spends_its_turns_one_at_a_time(clock):
    host = Host(None, turn_cpu_s=0.01)

    async def main() -> float:
        await asyncio.gather(*(host.control_turns(1) for _ in range(5)), host.control_turns(3))
        return clock.now()

    assert clock.run(main(), timeout=10) == pytest.approx(0.08)  # 8 turns in a row, not in parallel


def test_the_control_plane_shares_the_host_cores(clock):
    host = Host(SharedCores(1), turn_cpu_s=0.5)

    async def main() -> float:
        await asyncio.gather(host.compute(1.0), host.control_turns(1))
        return clock.now()

    assert clock.run(main(), timeout=10) == pytest.approx(1.5)


def test_bad_settings_are_config_errors():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="cores"):
            SharedCores(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="turn_cpu_s"):
        Host(None, turn_cpu_s=-0.1)
