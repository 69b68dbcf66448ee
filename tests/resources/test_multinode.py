"""Multi-node placement on a simulated Ray cluster (ray.cluster_utils), both metadata stores."""

import pytest

import rollart_nb as rn


class Probe(rn.Worker):
    @rn.register()
    def where(self):
        return self._rn_info()


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    nodes = {
        "h800a": c.add_node(num_cpus=1, num_gpus=2, resources={"accelerator_type:H800": 1}),
        "h800b": c.add_node(num_cpus=1, num_gpus=1, resources={"accelerator_type:H800": 1}),
        "h20": c.add_node(num_cpus=1, num_gpus=2, resources={"accelerator_type:H20": 1}),
    }
    c.wait_for_nodes()
    yield c, {k: n.node_id for k, n in nodes.items()}
    c.shutdown()


@pytest.mark.parametrize("store", ["gcs", "redis"])
def test_placement_and_fallback_recorded_in_store(ray_cluster, store, request):
    cluster, ids = ray_cluster
    url = request.getfixturevalue("redis_url") if store == "redis" else None
    sess = rn.Session.attach(cluster.address, store=url, timeout_s=60)
    try:
        assert sess.store.kind == store
        assert sess.pools["H800"].capacity == 3 and sess.pools["H20"].capacity == 2
        assert set(sess.pools["H800"].nodes) == {ids["h800a"], ids["h800b"]}
        assert "cpu" in sess.pools  # the head node has CPUs and no GPU

        train = sess.cluster("actor_train", Probe, pool="H800", replicas=2)
        gen = sess.cluster("actor_gen", Probe, pool="H20", replicas=3)  # 2 H20 slots: one falls back
        train_nodes = {w["node_id"] for w in train.where()}
        assert train_nodes <= {ids["h800a"], ids["h800b"]}
        gen_info = gen.where()
        assert [w["node_id"] for w in gen_info[:2]] == [ids["h20"], ids["h20"]]
        # the third generator falls back to the compatible GPU pool with a free slot
        b = gen.bindings[2]
        assert b.fell_back and "H20 full" in b.reason and b.pool == "H800"
        assert gen_info[2]["node_id"] in {ids["h800a"], ids["h800b"]} and gen_info[2]["hardware"] == "H800"
        rec = sess.store.get("bindings/actor_gen/2")
        assert rec["fell_back"] is True and rec["reason"] == b.reason and rec["node"] == gen_info[2]["node_id"]
        assert sess.store.get("pools/H20")["used"] == 2
        assert len(sess.store.keys("bindings/")) == 5
        with pytest.raises(rn.errors.NoCapacityError, match="H20 full.*H800 full"):
            sess.cluster("more", Probe, pool="H20", replicas=1)
    finally:
        sess.close()
    if store == "redis":  # close() cleans up the session's keys in the shared store
        import redis

        assert not list(redis.Redis.from_url(url).scan_iter(match=f"sessions/{sess.id}/*"))


def test_redis_url_password_is_masked():
    from rollart_nb.errors import StoreError
    from rollart_nb.resources.store import RedisStore

    with pytest.raises(StoreError) as ei:
        RedisStore("redis://:s3cret-pw@127.0.0.1:1/0", timeout_s=0.5)
    assert "s3cret-pw" not in str(ei.value) and "***@" in str(ei.value)
