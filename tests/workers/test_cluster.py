"""Worker/Cluster on a real local Ray (one Session.local per module)."""

import inspect
import os
import time

import pytest

import rollart_nb as rn
from rollart_nb.errors import ConfigError, StateError, UnknownPoolError, WorkerDiedError
from rollart_nb.runtime.ray import ClusterFuture


class Echo(rn.Worker):
    default_pool = "H20"

    def __init__(self, k: int = 1):
        self.k = k

    @rn.register()
    def scale(self, x: int) -> tuple[int, str, int]:
        """Return (rank, hardware, k * x) from every worker."""
        return (self.rank, self.hardware, self.k * x)

    @rn.register("one")
    def first(self) -> int:
        return self.rank

    @rn.register("scatter")
    def shard(self, xs, bias=0):
        return (self.rank, xs + bias)

    @rn.hw_mapping({"math": "bandwidth", "frozenlake": "H800"}, max_inflight=1)
    def generate(self, prompt: str, tag_name: str | None = None, delay: float = 0.0) -> str:
        time.sleep(delay)
        return self.hardware

    @rn.register()
    def die(self):
        os._exit(1)

    def not_exposed(self):
        return 1


class NotAWorker:
    pass


@pytest.fixture(scope="module")
def sess(local_session):
    return local_session


def test_register_all_one_scatter(sess):
    c = sess.cluster("echo", Echo, pool="H20", replicas=2, k=3)
    assert c.scale(2) == [(0, "H20", 6), (1, "H20", 6)]
    assert c.first() == 0
    assert c.shard([10, 20], bias=1) == [(0, 11), (1, 21)]
    with pytest.raises(ConfigError, match="scatter argument has 3 items for 2 workers"):
        c.shard([1, 2, 3])
    assert not hasattr(c, "not_exposed")
    sess.close_cluster("echo")


def test_methods_keep_signature_and_doc(sess):
    c = sess.cluster("echo", Echo, replicas=1)
    sig = inspect.signature(c.scale)
    assert list(sig.parameters) == ["x", "blocking"]
    assert sig.parameters["blocking"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "Return (rank, hardware, k * x)" in c.scale.__doc__
    assert "scale" in dir(c)
    fut = c.scale(5, blocking=False)
    assert isinstance(fut, ClusterFuture)
    assert fut.result(timeout=30) == [(0, "H20", 5)]
    sess.close_cluster("echo")


def test_workers_land_on_preferred_pool_then_fall_back(sess):
    c = sess.cluster("mixed", Echo, pool="H20", replicas=3)
    pools = [b.pool for b in c.bindings]
    assert pools[:2] == ["H20", "H20"] and pools[2] == "H800"
    rec = sess.store.get("bindings/mixed/2")
    assert rec["fell_back"] is True and "H20 full" in rec["reason"]
    assert [h for _, h, _ in c.scale(1)] == ["H20", "H20", "H800"]
    sess.close_cluster("mixed")
    assert sess.pools["H20"].free == 2 and sess.store.get("bindings/mixed/2") is None


def test_hw_mapping_routes_by_tag_and_falls_back_when_busy(sess):
    c = sess.cluster("gen", Echo, pool="H20", replicas=1)
    assert c.generate("1+1", tag_name="math") == "H20"
    sess.close_cluster("gen")
    sess.cluster("gen_big", Echo, pool="H800", replicas=1)  # occupies one H800 slot
    # a cluster of mixed hardware: affinity picks the H800 worker for frozenlake
    mixed = sess.cluster("gen_mix", Echo, pool="H800", replicas=2, fallback=["H20"])  # 1 H800 left, then H20
    hws = sorted(b.hardware for b in mixed.bindings)
    assert hws == ["H20", "H800"]
    assert {mixed.generate("go", tag_name="frozenlake") for _ in range(4)} == {"H800"}
    assert {mixed.generate("go", "math") for _ in range(4)} == {"H20"}
    # the H20 worker is busy (max_inflight=1): the next math call falls back to the H800 one
    slow = mixed.generate("x", tag_name="math", delay=1.5, blocking=False)
    time.sleep(0.2)
    assert mixed.generate("y", tag_name="math") == "H800"
    assert mixed.fallbacks["generate"] == 1
    assert slow.result(timeout=30) == "H20"
    for name in ("gen_big", "gen_mix"):
        sess.close_cluster(name)


def test_rebuilding_a_cluster_replaces_it(sess):
    c1 = sess.cluster("again", Echo, pool="H800", replicas=2)
    pid1 = {i["pid"] for i in c1.info()}
    c2 = sess.cluster("again", Echo, pool="H800", replicas=2)
    assert c1.closed and not c2.closed
    with pytest.raises(StateError, match=r"closed; build it again with sess.cluster\('again'"):
        c1.scale(1)
    assert {i["pid"] for i in c2.info()}.isdisjoint(pid1)
    assert sess.pools["H800"].used == 2
    sess.close_cluster("again")


def test_bad_inputs_are_clear(sess):
    with pytest.raises(UnknownPoolError, match="unknown pool 'H8000'"):
        sess.cluster("bad", Echo, pool="H8000")
    with pytest.raises(ConfigError, match="replicas must be an int >= 1"):
        sess.cluster("bad", Echo, replicas=0)
    with pytest.raises(ConfigError, match="rollart_nb.Worker subclass"):
        sess.cluster("bad", NotAWorker)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"threaded=\.\.\.\): Ray workers are processes; drop it"):
        sess.cluster("bad", Echo, threaded=True)
    assert "bad" not in sess.clusters


def test_worker_death_is_wrapped_and_restart_rebinds(sess):
    c = sess.cluster("fragile", Echo, pool="cpu", replicas=2)
    with pytest.raises(WorkerDiedError) as ei:
        c.die()
    assert "fragile/" in str(ei.value) and ei.value.pool == "cpu" and "restart_worker" in ei.value.fix
    b = c.restart_worker(0)
    c.restart_worker(1)
    assert b.pool == "cpu"
    assert c.scale(1) == [(0, "CPU", 1), (1, "CPU", 1)]
    sess.close_cluster("fragile")


def test_html_reprs(sess):
    c = sess.cluster("shown", Echo, replicas=1)
    h = sess._repr_html_()
    assert "simulated" in h and "shown/0" in h
    assert "<table>" in c._repr_html_() and "H20" in c._repr_html_()
    assert "shown" in repr(sess)
    sess.close_cluster("shown")
