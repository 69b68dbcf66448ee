import pytest

from rollart_nb.errors import ConfigError
from rollart_nb.resources.pools import discover_pools
from rollart_nb.resources.profiles import PROFILES, profile


def test_profiles_classify_compute_vs_bandwidth():
    assert profile("H800").compute_optimized and not profile("H800").bandwidth_optimized
    assert profile("h20").bandwidth_optimized
    # H20 has less compute but more bandwidth than H800: the premise of hardware affinity
    assert PROFILES["H20"].bf16_tflops < PROFILES["H800"].bf16_tflops
    assert PROFILES["H20"].mem_bw_gbps > PROFILES["H800"].mem_bw_gbps
    assert profile("H20").flops_per_byte < profile("H800").flops_per_byte


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(ConfigError, match="H800"):
        profile("H8000")


def test_discovery_from_node_resources():
    nodes = [
        {"node_id": "a", "resources": {"CPU": 8, "GPU": 8, "accelerator_type:H800": 1}},
        {"node_id": "b", "resources": {"CPU": 8, "GPU": 4, "accelerator_type:H800": 1}},
        {"node_id": "c", "resources": {"CPU": 8, "GPU": 8, "my_h20": 8}},
        {"node_id": "d", "resources": {"CPU": 32}},
        {"node_id": "e", "resources": {"CPU": 2, "rollart_pool_H20": 3}},
    ]
    pools = discover_pools(nodes, pool_map={"my_h20": "H20"}, serverless=True)
    assert pools["H800"].capacity == 12 and sorted(pools["H800"].nodes) == ["a", "b"]
    assert not pools["H800"].simulated and pools["H800"].resource == "GPU"
    assert pools["H20"].slots_per_node == {"c": 8, "e": 3}
    assert pools["cpu"].nodes == ["d"] and pools["cpu"].capacity == 32
    assert pools["serverless"].hardware.kind == "serverless"
    # GPU pools are listed first
    assert list(pools)[:2] == ["H20", "H800"]


def test_unknown_accelerator_type_is_ignored_not_fatal():
    pools = discover_pools([{"node_id": "x", "resources": {"CPU": 4, "GPU": 1, "accelerator_type:T4": 1}}])
    assert "T4" not in pools and "cpu" not in pools
