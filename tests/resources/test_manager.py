import time

import pytest

from rollart_nb.errors import NoCapacityError, PoolHeldError, UnknownPoolError
from rollart_nb.resources.manager import Holder, ResourceManager
from rollart_nb.resources.pools import discover_pools
from rollart_nb.resources.store import MemoryStore


def make(nodes=None):
    nodes = nodes or [
        {"node_id": "h800a", "resources": {"CPU": 4, "GPU": 2, "accelerator_type:H800": 1}},
        {"node_id": "h20a", "resources": {"CPU": 4, "GPU": 1, "accelerator_type:H20": 1}},
        {"node_id": "cpu", "resources": {"CPU": 4}},
    ]
    store = MemoryStore()
    return ResourceManager(discover_pools(nodes), store), store


def test_binds_preferred_pool_and_records():
    rm, store = make()
    b = rm.bind("actor_train", 0, prefer="H800")
    assert (b.pool, b.node, b.hardware, b.fell_back) == ("H800", "h800a", "H800", False)
    rec = store.get("bindings/actor_train/0")
    assert rec["pool"] == "H800" and rec["fell_back"] is False and rec["node"] == "h800a"
    assert store.get("pools/H800")["used"] == 1


def test_falls_back_when_full_with_reason():
    rm, store = make()
    rm.bind("gen", 0, prefer="H20")
    b = rm.bind("gen", 1, prefer="H20")
    assert b.fell_back and b.pool == "H800" and "H20 full (1/1" in b.reason
    assert store.get("bindings/gen/1")["reason"] == b.reason


def test_absent_known_hardware_falls_back_unknown_name_errors():
    rm, _ = make()
    b = rm.bind("gen", 0, prefer="H100")
    assert b.fell_back and "H100 absent" in b.reason
    with pytest.raises(UnknownPoolError, match=r"unknown pool 'H8000'.*pools \['H20', 'H800', 'cpu'\]"):
        rm.bind("gen", 1, prefer="H8000")


def test_no_capacity_names_pools_and_fix():
    rm, _ = make()
    rm.bind("t", 0, prefer="H800", slots=2)
    rm.bind("t", 1, prefer="H20")
    with pytest.raises(NoCapacityError, match="H800 full.*H20 full"):
        rm.bind("t", 2, prefer="H800")


def test_explicit_fallback_list_is_respected():
    rm, _ = make()
    rm.bind("t", 0, prefer="H20")
    b = rm.bind("t", 1, prefer="H20", fallback=["cpu"])
    assert b.pool == "cpu" and b.fell_back


def test_release_and_rebind_avoids_dead_node():
    nodes = [
        {"node_id": "n1", "resources": {"GPU": 1, "accelerator_type:H800": 1}},
        {"node_id": "n2", "resources": {"GPU": 1, "accelerator_type:H800": 1}},
    ]
    rm, store = make(nodes)
    b0 = rm.bind("t", 0, prefer="H800")
    b1 = rm.rebind("t", 0)
    assert b1.node != b0.node and rm.free("H800") == 1
    rm.release("t")
    assert rm.free("H800") == 2 and store.get("bindings/t/0") is None


def shared_pair(dead_jobs=lambda: set()):
    """Two managers (two sessions) over the same nodes and one shared store."""
    nodes = [{"node_id": "h800a" + "0" * 51, "resources": {"GPU": 2, "accelerator_type:H800": 1}}]
    shared = MemoryStore()
    a_holder = Holder.of_session("aaaa1111", pid=11, host="hostA", created=0.0, job="01000000")
    b_holder = Holder.of_session("bbbb2222", pid=22, host="hostB", created=0.0, job="02000000")
    a = ResourceManager(discover_pools(nodes), MemoryStore(), shared=shared, holder=a_holder, dead_jobs=dead_jobs)
    b = ResourceManager(discover_pools(nodes), MemoryStore(), shared=shared, holder=b_holder, dead_jobs=dead_jobs)
    return a, b, shared


def test_sessions_sharing_a_store_see_each_others_holdings_and_name_the_holder():
    a, b, shared = shared_pair()
    a.bind("train", 0, prefer="H800")
    b.bind("train", 0, prefer="H800")  # the second slot
    assert a.free("H800") == 1  # a's view as last read ...
    a.refresh()  # ... and read again
    assert a.free("H800") == 0 and a.held_elsewhere("H800") == {
        "session bbbb2222 (pid 22 on hostB, since 00:00:00 UTC)": 1
    }
    with pytest.raises(PoolHeldError, match=r"H800 full \(2/2 slots used; 1 held by session bbbb2222") as ei:
        a.bind("gen", 0, prefer="H800")
    assert ei.value.holders == ["session bbbb2222 (pid 22 on hostB, since 00:00:00 UTC)"]
    assert "close that session" in str(ei.value) and shared.get("holders.lock") is None
    b.release("train")
    assert a.bind("gen", 0, prefer="H800").pool == "H800"
    b.close()
    assert shared.keys("holders/") == ["holders/aaaa1111"]


def test_a_dead_jobs_holdings_are_released_and_a_stale_lock_is_broken():
    dead: set[str] = set()
    a, b, shared = shared_pair(dead_jobs=lambda: dead)
    b.bind("t", 0, prefer="H800", slots=2)
    with pytest.raises(PoolHeldError):
        a.bind("t", 0, prefer="H800")
    dead.add("02000000")  # b's driver died without closing
    shared.put("holders.lock", {"holder": "session cccc3333", "time": time.time() - 60})  # and left a lock
    assert a.bind("t", 0, prefer="H800", slots=2).pool == "H800"
    assert shared.get("holders/bbbb2222") is None and shared.get("holders.lock") is None
