"""LLMProxy at engine scale: streamed batched dispatch, engine capacity, history misses, forgetting.

In-process generators (LocalHandle + LocalGenerator) over a backend whose per-trajectory latency
the test sets, so what arrives when is exact.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from rollart_nb.control.local import LocalGenerator, LocalHandle
from rollart_nb.control.proxy import FORGET_BATCH, GenTarget, LLMProxy
from rollart_nb.errors import GenerationError, HistoryMiss
from rollart_nb.protocols import GenerationRequest, GenerationResult


class TimedBackend:
    """Answers each turn after ``delay[traj_id]`` seconds (default ``base_s``), one token."""

    def __init__(self, base_s: float = 0.01, capacity: int | None = None) -> None:
        self.base_s, self.capacity = base_s, capacity
        self.delay: dict[str, float] = {}
        self.running = self.peak = 0
        self.forgotten: list[str] = []
        self.aborted: list[str] = []
        self.miss: set[str] = set()
        self.version = 0

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        if req.traj_id in self.miss and req.prefix_len:
            raise HistoryMiss(f"no history of {req.traj_id}", traj_id=req.traj_id, expected=req.prefix_len)
        if req.traj_id == "boom":
            raise ValueError("engine fault")
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.delay.get(req.traj_id, self.base_s))
        finally:
            self.running -= 1
        return GenerationResult(req.traj_id, [7], [-0.1], self.version, "stop")

    async def abort(self, traj_id: str) -> None:
        self.aborted.append(traj_id)

    def forget(self, traj_id: str) -> None:
        self.forgotten.append(traj_id)


def proxy_over(*backends: TimedBackend, dispatch: str = "batched", **kw) -> LLMProxy:
    targets = [GenTarget(LocalHandle(LocalGenerator(b)), f"gen/{i}", "H20", "H20") for i, b in enumerate(backends)]
    return LLMProxy(targets, {}, dispatch=dispatch, **kw)


def req(tid: str, prefix_len: int = 0) -> GenerationRequest:
    return GenerationRequest(tid, "t", [1, 2, 3], 4, 0.0, prefix_len=prefix_len)


def test_batched_results_stream_out_as_they_finish():
    """A slow turn submitted with fast ones does not hold them back (continuous, not static, batching)."""

    async def main():
        b = TimedBackend(base_s=0.01)
        b.delay["slow"] = 1.5
        proxy = proxy_over(b)
        done_at: dict[str, float] = {}
        t0 = time.monotonic()

        async def one(tid):
            await proxy.generate(req(tid))
            done_at[tid] = time.monotonic() - t0

        await asyncio.gather(one("slow"), *(one(f"f{i}") for i in range(20)))
        return done_at, proxy.stats()

    done_at, st = asyncio.run(main())
    fast = [v for k, v in done_at.items() if k != "slow"]
    assert max(fast) < 0.5 < done_at["slow"], done_at
    assert st["batches"] <= 3 and st["collects"] >= 2  # turns shared submit calls; results came in several


def test_every_turn_of_a_busy_engine_runs_at_once_up_to_its_capacity():
    """512 concurrent turns on one worker that reports capacity 512: all run together."""

    async def main():
        b = TimedBackend(base_s=0.2, capacity=512)
        proxy = proxy_over(b)
        t0 = time.monotonic()
        await asyncio.gather(*(proxy.generate(req(f"t{i}")) for i in range(512)))
        return time.monotonic() - t0, b.peak, proxy

    took, peak, proxy = asyncio.run(main())
    assert peak == 512 and took < 1.5, (peak, took)
    assert proxy.capacity == [512] and proxy.limits() == [512]


def test_new_trajectories_go_to_the_worker_with_room_by_capacity():
    """Routing counts a worker busy at its engine's capacity, not at the proxy-wide max_inflight."""

    async def main():
        small, big = TimedBackend(base_s=0.3, capacity=2), TimedBackend(base_s=0.3, capacity=50)
        targets = [
            GenTarget(LocalHandle(LocalGenerator(small)), "gen/0", "H20", "H20"),
            GenTarget(LocalHandle(LocalGenerator(big)), "gen/1", "H800", "H800"),
        ]
        proxy = LLMProxy(targets, {"t": "H20"}, dispatch="direct", max_inflight=256)
        tasks = [asyncio.ensure_future(proxy.generate(req(f"t{i}"))) for i in range(10)]
        await asyncio.sleep(0.1)
        engines = proxy.engines()
        await asyncio.gather(*tasks)
        return engines, proxy

    engines, proxy = asyncio.run(main())
    assert [e["capacity"] for e in engines] == [2, 50]
    assert engines[0]["inflight"] == 2 and engines[1]["inflight"] == 8  # the preferred H20 is full at 2
    assert engines[0]["occupancy"] == 1.0 and engines[1]["occupancy"] == pytest.approx(8 / 50)
    assert proxy.router.fallbacks == 8


@pytest.mark.parametrize("dispatch", ["direct", "batched"])
def test_a_history_miss_reaches_the_sender_unwrapped(dispatch):
    async def main():
        b = TimedBackend()
        b.miss.add("a")
        proxy = proxy_over(b, dispatch=dispatch)
        with pytest.raises(HistoryMiss) as e:
            await proxy.generate(req("a", prefix_len=10))
        ok = await proxy.generate(req("a", prefix_len=0))  # resent whole
        with pytest.raises(GenerationError, match="engine fault") as boom:
            await proxy.generate(req("boom"))
        return e.value, ok, boom.value, proxy.stats()

    miss, ok, boom, st = asyncio.run(main())
    assert type(miss) is HistoryMiss and miss.traj_id == "a" and miss.expected == 10
    assert ok.token_ids == [7] and st["history_misses"] == 1
    assert not isinstance(boom, HistoryMiss) and "gen/0" in str(boom)


def test_ended_trajectories_are_forgotten_on_their_worker_in_batches():
    async def main():
        b = TimedBackend(base_s=0)
        proxy = proxy_over(b, dispatch="direct")
        ids = [f"t{i}" for i in range(FORGET_BATCH + 5)]
        await asyncio.gather(*(proxy.generate(req(t)) for t in ids))
        for t in ids:
            proxy.forget(t)
        await asyncio.sleep(0.05)
        return ids, b.forgotten

    ids, forgotten = asyncio.run(main())
    assert forgotten == ids[:FORGET_BATCH]  # one call for the first batch; the rest wait for more


def test_a_cancelled_batched_turn_is_aborted_on_its_worker():
    async def main():
        b = TimedBackend(base_s=5.0)
        proxy = proxy_over(b)
        task = asyncio.ensure_future(proxy.generate(req("x")))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        return b.aborted, proxy.stats()

    aborted, st = asyncio.run(main())
    assert aborted == ["x"] and st["inflight"] == [0]


def test_engine_rows_merge_over_shards_and_show_in_the_status_line():
    from rollart_nb.control.report import StepReport
    from rollart_nb.control.shards import merge_engines
    from rollart_nb.nb.figures import engines_line

    a = [{"name": "gen/0", "inflight": 100, "queued": 3, "capacity": 512, "occupancy": 0.2, "dead": False}]
    b = [{"name": "gen/0", "inflight": 156, "queued": 0, "capacity": 512, "occupancy": 0.3, "dead": False}]
    c = [{"name": "gen/1", "inflight": 7, "queued": 0, "capacity": None, "occupancy": None, "dead": False}]
    merged = merge_engines([a + c, b])
    assert merged[0]["inflight"] == 256 and merged[0]["queued"] == 3 and merged[0]["occupancy"] == 0.5
    assert merged[1]["occupancy"] is None
    rep = StepReport(step=0, version=1, mode="rollart", engines=merged)
    assert engines_line(rep) == "engines: gen/0 256/512 (50%) +3 queued, gen/1 7 in flight"
    assert rep.row()["engine_occupancy"] == 0.5  # the mean over engines that report a capacity
    assert engines_line(StepReport(step=0, version=0, mode="rollart")) == ""
