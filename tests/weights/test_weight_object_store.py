"""ObjectStoreTransport on a real (small) Ray instance."""

from __future__ import annotations

import os

import pytest
import torch

from rollart_nb.errors import WeightSyncError
from rollart_nb.protocols import WeightTransport
from rollart_nb.weights.object_store import ObjectStoreTransport
from rollart_nb.weights.puller import WeightPuller

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_local():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def state(v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {
        "emb": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "proj": torch.randn(64, 64, generator=g).to(torch.float16),
        "big": torch.randn(20000, generator=g),  # 80 kB > 32 kB buckets: chunked
        "step": torch.tensor(v, dtype=torch.int64),
    }


def same(a, b) -> bool:
    return list(a) == list(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_round_trip_in_driver(ray_local):
    t = ObjectStoreTransport("t-roundtrip", bucket_bytes=32 << 10)
    assert isinstance(t, WeightTransport)
    assert t.latest() is None
    m = t.publish(1, state(1))
    assert m.num_buckets > 3 and t.latest() == 1
    got = t.pull(1)
    assert same(got, state(1))
    got["emb"].add_(1)  # copy=True gives writable tensors
    assert same(t.pull(), state(1))  # the store is untouched
    assert t.metrics.pulls == 2 and t.metrics.push_s > 0
    t.close()


@ray.remote
def _pull_in_worker(name: str):
    t = ObjectStoreTransport(name)
    return os.getpid(), t.latest(), t.pull()


def test_pull_from_another_worker_process(ray_local):
    t = ObjectStoreTransport("t-remote", bucket_bytes=32 << 10)
    t.publish(5, state(5))
    pid, latest, got = ray.get(_pull_in_worker.remote("t-remote"))
    assert pid != os.getpid()
    assert latest == 5 and same(got, state(5))
    t.close()


def test_gc_keeps_last_n_versions(ray_local):
    t = ObjectStoreTransport("t-gc", bucket_bytes=32 << 10)
    for v in range(1, 5):
        t.publish(v, state(v))
    t.gc(keep=2)
    assert t.versions() == [3, 4]
    with pytest.raises(WeightSyncError, match="version 1 is not published"):
        t.pull(1)
    assert same(t.pull(3), state(3))
    t.close()


def test_puller_over_object_store(ray_local):
    t = ObjectStoreTransport("t-puller", bucket_bytes=32 << 10)
    with WeightPuller(ObjectStoreTransport("t-puller"), poll_interval_s=0.02) as p:
        t.publish(1, state(1))
        got = p.wait_for(1, timeout=30)
        assert same(got, state(1)) and p.current_version == 1
    t.close()
