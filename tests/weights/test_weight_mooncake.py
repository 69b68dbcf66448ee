"""MooncakeTransport against a real mooncake_master on 127.0.0.1 (skipped without the extra)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import time

import pytest
import torch

from rollart_nb.errors import WeightSyncError
from rollart_nb.protocols import WeightTransport
from rollart_nb.weights.mooncake import MooncakeTransport
from rollart_nb.weights.mooncake_master import MooncakeMaster, find_master_binary
from rollart_nb.weights.puller import WeightPuller

pytestmark = pytest.mark.mooncake

pytest.importorskip("mooncake.store", reason="mooncake extra (and libibverbs1) not installed")
if find_master_binary() is None:
    pytest.skip("mooncake_master binary not found", allow_module_level=True)

LEASE_MS = 1000
BUCKET = 32 << 10


@pytest.fixture(scope="module")
def master():
    m = MooncakeMaster(kv_lease_ttl_ms=LEASE_MS).start(timeout=30)
    yield m
    m.stop()
    assert not m.running


@pytest.fixture(scope="module")
def publisher(master):
    # The publisher contributes the memory the buckets live in (a CPU-resident store).
    t = MooncakeTransport(master, prefix="test", bucket_bytes=BUCKET, segment_bytes=64 << 20).connect()
    yield t
    t.close()


@pytest.fixture(scope="module")
def reader(master):
    t = MooncakeTransport(master.address, prefix="test").connect()
    yield t
    t.close()


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


def _listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(ip, port) of every TCP socket ``pid`` listens on, read from /proc (no psutil needed)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                hexip, hexport = f[1].split(":")
                if len(hexip) == 8:
                    ip = socket.inet_ntop(socket.AF_INET, bytes.fromhex(hexip)[::-1])
                else:
                    ip = "v6:" + hexip
                out.append((ip, int(hexport, 16)))
    return out


def test_master_listens_only_on_loopback(master):
    listening = _listening_sockets(master._proc.pid)
    assert {port for _, port in listening} >= {master.rpc_port, master.metrics_port}
    assert all(ip == "127.0.0.1" for ip, _ in listening), listening


def test_round_trip_between_two_clients(publisher, reader):
    assert isinstance(reader, WeightTransport)
    m = publisher.publish(1, state(1))
    assert m.num_buckets > 3
    assert reader.latest() == 1
    got = reader.pull(1)
    assert same(got, state(1))
    got["emb"].add_(1)  # pulled tensors are writable memory of this process
    assert reader.metrics.bytes == m.total_bytes


def test_republishing_a_version_is_refused(publisher):
    publisher.publish(2, state(2))
    with pytest.raises(WeightSyncError, match="already in the store"):
        publisher.publish(2, state(3))


def _pull_in_child(address: str, q) -> None:
    t = MooncakeTransport(address, prefix="test")
    s = t.pull()
    q.put({k: (str(v.dtype), tuple(v.shape), v.reshape(-1).view(torch.uint8).numpy().tobytes()) for k, v in s.items()})
    t.close()


def test_pull_from_another_process(master, publisher):
    publisher.publish(10, state(10))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_pull_in_child, args=(master.address, q))
    p.start()
    got = q.get(timeout=60)
    p.join(30)
    want = state(10)
    assert list(got) == list(want)
    for k, (dtype, shape, raw) in got.items():
        assert dtype == str(want[k].dtype) and shape == tuple(want[k].shape)
        assert raw == want[k].reshape(-1).view(torch.uint8).numpy().tobytes()


def _overwrite_bucket(t: MooncakeTransport, version: int, i: int) -> None:
    key = t.bucket_key(version, i)
    size = t.store.get_size(key)
    time.sleep(LEASE_MS / 1000 + 0.2)  # let any read lease lapse
    assert t.store.remove(key, True) == 0
    assert t.store.put(key, b"\x5a" * size) == 0


def test_corrupt_bucket_is_detected_and_puller_keeps_old_version(publisher, reader, caplog):
    publisher.publish(20, state(20))
    # A long poll interval: the puller looks again only when kicked (or waited on). The puller
    # does not own its transport: the test closes the client it opened.
    with MooncakeTransport(reader.master_address, prefix="test") as own, WeightPuller(own, poll_interval_s=60) as p:
        got = p.wait_for(20, timeout=30)
        assert same(got, state(20))
        time.sleep(0.3)  # let the thread's post-pull latest() check finish before v21 appears
        m = publisher.publish(21, state(21))
        assert m.num_buckets > 2
        _overwrite_bucket(publisher, 21, 1)
        with pytest.raises(WeightSyncError, match="bucket 1 failed its"):
            reader.pull(21)
        with caplog.at_level(logging.WARNING, logger="rollart_nb.weights.puller"):
            with pytest.raises(WeightSyncError, match="did not arrive"):
                p.wait_for(21, timeout=2)
        assert p.current_version == 20 and p.poll() is None
        assert any("bucket 1 failed" in r.getMessage() for r in caplog.records)
        publisher.publish(22, state(22))
        assert same(p.wait_for(22, timeout=30), state(22))


def test_missing_bucket_is_a_partial_version(publisher, reader):
    publisher.publish(30, state(30))
    time.sleep(LEASE_MS / 1000 + 0.2)
    assert publisher.store.remove(publisher.bucket_key(30, 0), True) == 0
    with pytest.raises(WeightSyncError, match="partial: bucket 0"):
        reader.pull(30)


def test_gc_keeps_the_last_n_versions(master):
    with (
        MooncakeTransport(master, prefix="gc", bucket_bytes=BUCKET, segment_bytes=32 << 20) as t,
        MooncakeTransport(master.address, prefix="gc") as r,
    ):
        for v in range(1, 5):
            t.publish(v, state(v))
        r.pull(2)  # a fresh read lease on v2's buckets: gc must wait for it, not break it
        t.gc(keep=2)
        for v in (1, 2):
            with pytest.raises(WeightSyncError, match="not in the Mooncake store"):
                r.pull(v)
        assert same(r.pull(3), state(3)) and same(r.pull(4), state(4))
        time.sleep(LEASE_MS / 1000 + 0.3)
        t.gc(keep=2)  # retries the buckets that were leased
        old = [t.bucket_key(v, i) for v in (1, 2) for i in range(4)]
        assert t.store.batch_is_exist(old) == [0] * len(old)
        assert t._pending_gc == []


def test_missing_master_is_a_connect_error():
    from rollart_nb.errors import ConnectError
    from rollart_nb.weights.mooncake_master import _free_port

    with pytest.raises(ConnectError):
        MooncakeTransport(f"127.0.0.1:{_free_port('127.0.0.1')}").connect()


def test_clients_left_open_are_closed_at_exit(master):
    from rollart_nb.weights import mooncake

    t = MooncakeTransport(master.address, prefix="exit").connect()
    closed = MooncakeTransport(master.address, prefix="exit").connect()
    closed.close()
    assert t in mooncake._open and closed not in mooncake._open
    mooncake._close_open_clients()  # what the atexit hook runs, before interpreter teardown
    assert t._store is None and t not in mooncake._open
    t.close()  # idempotent
