"""WeightPuller: background pulls, atomic swaps, fallback on bad versions."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from rollart_nb.errors import WeightSyncError
from rollart_nb.weights.local import LocalTransport
from rollart_nb.weights.puller import WeightPuller


def state(v: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64, 64), float(v)), "b": torch.full((7,), v, dtype=torch.int64)}


class GatedTransport(LocalTransport):
    """Pulls block until the test opens the gate, like a slow cross-cluster link."""

    def __init__(self) -> None:
        super().__init__(bucket_bytes=4096)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def pull(self, version=None):
        self.entered.set()
        assert self.gate.wait(10)
        return super().pull(version)


def wait_until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_keeps_serving_old_version_until_pull_completes():
    t = GatedTransport()
    t.publish(1, state(1))
    with WeightPuller(t, current_version=0, poll_interval_s=0.01) as p:
        assert t.entered.wait(5)
        assert p.pulling == 1
        for _ in range(20):  # the worker polls between requests while the pull is in flight
            assert p.poll() is None
            assert p.current_version == 0
            time.sleep(0.005)
        t.gate.set()
        assert wait_until(lambda: p.pulling is None)
        got = p.poll()
        assert got is not None and p.current_version == 1
        assert torch.equal(got["w"], state(1)["w"])
        assert p.poll() is None  # handed out once
    assert p.metrics.pull_s > 0 and p.metrics.pulls == 1


def test_corrupt_version_is_skipped_and_old_one_kept(caplog):
    t = LocalTransport(bucket_bytes=4096)
    t.publish(1, state(1))
    with WeightPuller(t, current_version=0, poll_interval_s=0.01, max_attempts=2) as p:
        assert p.wait_for(1, timeout=5) is not None
        t.publish(2, state(2))
        # Corrupt in place; the puller may already be pulling v2, so retries must see it too.
        t.buckets(2)[0][100] ^= 0xFF
        with caplog.at_level(logging.WARNING, logger="rollart_nb.weights.puller"):
            with pytest.raises(WeightSyncError, match="did not arrive"):
                p.wait_for(2, timeout=0.5)
        assert p.current_version == 1
        assert p.poll() is None
        assert any("checksum" in r.getMessage() and "still serving version 1" in r.getMessage() for r in caplog.records)
        t.publish(3, state(3))
        got = p.wait_for(3, timeout=5)
        assert got is not None and p.current_version == 3 and int(got["b"][0]) == 3


def test_only_the_newest_ready_version_is_handed_out():
    t = LocalTransport(bucket_bytes=4096)
    with WeightPuller(t, current_version=0, poll_interval_s=0.01) as p:
        t.publish(1, state(1))
        assert wait_until(lambda: p.metrics.pulls >= 1)
        t.publish(2, state(2))
        assert wait_until(lambda: p.metrics.pulls >= 2)
        got = p.poll()
        assert p.current_version == 2 and int(got["b"][0]) == 2


def test_wait_for_counts_exposed_time_and_returns_none_when_current():
    t = GatedTransport()
    t.publish(1, state(1))
    p = WeightPuller(t, current_version=0, poll_interval_s=0.01)
    threading.Timer(0.3, t.gate.set).start()
    got = p.wait_for(1, timeout=5)
    p.close()
    assert got is not None
    assert p.wait_for(1) is None
    m = p.take_metrics()
    assert m.exposed_pull_s >= 0.25
    assert m.pull_s >= m.exposed_pull_s - 0.05
    assert p.metrics.exposed_pull_s == 0.0  # take_metrics reset the counters
