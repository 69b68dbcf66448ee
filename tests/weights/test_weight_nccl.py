"""NcclTransport: a real torch.distributed broadcast (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from rollart_nb.errors import ConnectError, WeightSyncError
from rollart_nb.protocols import WeightTransport
from rollart_nb.weights.nccl import NcclTransport


def state(v: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    s = {
        "emb": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "proj": torch.randn(64, 64, generator=g).to(torch.float16),
        "big": torch.randn(20000, generator=g),  # 80 kB > 32 kB buckets: chunked
        "step": torch.tensor(v, dtype=torch.int64),
    }
    return {k: t.to(device) for k, t in s.items()}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, backend: str, expect: int, q) -> None:
    import torch.distributed as dist

    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        t = NcclTransport(src=0, bucket_bytes=32 << 10)
        if rank == 0:
            t.publish(7, state(7, device))
            q.put((rank, "ok", None))
        else:
            try:
                got = t.pull(expect)
            except WeightSyncError as e:
                q.put((rank, "error", str(e)))
                return
            want = state(7, device)
            ok = list(got) == list(want) and all(
                got[k].dtype == want[k].dtype and got[k].device == want[k].device and torch.equal(got[k], want[k])
                for k in want
            )
            q.put((rank, "ok" if ok and t.latest() == 7 else "mismatch", None))
    finally:
        dist.destroy_process_group()


def _run(backend: str, world: int, expect: int) -> dict[int, tuple[str, str | None]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, backend, expect, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    for _ in range(world):
        rank, status, msg = q.get(timeout=120)
        out[rank] = (status, msg)
    for p in procs:
        p.join(30)
    return out


def test_importable_and_a_weight_transport_without_cuda():
    t = NcclTransport()
    assert isinstance(t, WeightTransport)
    assert t.latest() is None
    t.gc(keep=1)  # nothing to free, must not fail


def test_needs_an_initialised_process_group():
    with pytest.raises(ConnectError, match="init_process_group"):
        NcclTransport().publish(1, state(1))


def test_broadcast_round_trip_over_gloo():
    out = _run("gloo", world=2, expect=7)
    assert out == {0: ("ok", None), 1: ("ok", None)}


def test_receiver_rejects_an_unexpected_version_after_the_collective():
    out = _run("gloo", world=2, expect=8)
    assert out[0] == ("ok", None)  # the sender was not left hanging
    assert out[1][0] == "error" and "expected weight version 8" in out[1][1]


@pytest.mark.gpu
def test_broadcast_round_trip_over_nccl():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    world = min(2, torch.cuda.device_count())
    out = _run("nccl", world=world, expect=7)
    assert all(v == ("ok", None) for v in out.values()) and len(out) == world
