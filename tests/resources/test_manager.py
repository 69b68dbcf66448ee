import pytest

from rollart_nb.errors import NoCapacityError, UnknownPoolError
from rollart_nb.resources.manager import ResourceManager
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
