"""Two sessions on one multi-node Ray cluster (ray.cluster_utils), from two processes: pools are
shared through the metadata store, a held pool is refused at once naming its holder, a dead
holder's slots come back, and a lost node is named in the fallback reason."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

import rollart_nb as rn
from rollart_nb import _ray
from rollart_nb.errors import PoolHeldError


class Probe(rn.Worker):
    @rn.register()
    def where(self):
        return self._rn_info()


_CHILD = textwrap.dedent("""
    import json, sys
    import rollart_nb as rn

    class Probe(rn.Worker):
        @rn.register()
        def where(self):
            return self._rn_info()

    sess = rn.Session.attach(sys.argv[1], timeout_s=60)
    clusters = {}
    print(json.dumps({"id": sess.id, "holder": sess.runtime.resources.holder.name}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["do"] == "cluster":
            c = sess.cluster(cmd["name"], Probe, pool=cmd["pool"], replicas=cmd["replicas"], fallback=[])
            clusters[cmd["name"]] = c
            print(json.dumps([b.node for b in c.bindings]), flush=True)
        elif cmd["do"] == "where":
            print(json.dumps({n: [w["node_id"] for w in c.where()] for n, c in clusters.items()}), flush=True)
        elif cmd["do"] == "close":
            sess.close()
            print(json.dumps("closed"), flush=True)
            break
""")


class Driver:
    """A session in a process of its own, driven line by line over its stdin and stdout."""

    def __init__(self, address: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # a HOME of its own: a token in ~/.ray/auth_token would turn token auth on in the child
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "HOME": tempfile.mkdtemp(prefix="rn_home")},
        )
        self.info = self._read()

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"driver exited: {self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def ask(self, **cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    # this cluster runs without auth: a token left in ~/.ray/auth_token must not turn it on here
    mp = pytest.MonkeyPatch()
    mp.setenv("HOME", tempfile.mkdtemp(prefix="rn_home"))

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    nodes = {
        "h800": c.add_node(num_cpus=1, num_gpus=2, resources={"accelerator_type:H800": 1}),
        "h20": c.add_node(num_cpus=1, num_gpus=2, resources={"accelerator_type:H20": 1}),
    }
    c.wait_for_nodes()
    yield c, nodes
    c.shutdown()
    mp.undo()


def test_second_session_sees_held_pool_fails_fast_naming_holder_then_both_run(ray_cluster):
    cluster, nodes = ray_cluster
    first = Driver(cluster.address)
    try:
        assert first.ask(do="cluster", name="actor_train", pool="H800", replicas=2) == [nodes["h800"].node_id] * 2
        assert first.ask(do="cluster", name="actor_gen", pool="H20", replicas=2) == [nodes["h20"].node_id] * 2
        sess = rn.Session.attach(cluster.address, timeout_s=60)
        try:
            # the second session sees what the first holds
            assert (sess.pools["H800"].free, sess.pools["H20"].free) == (0, 0)
            assert sess.runtime.resources.held_elsewhere("H800") == {first.info["holder"]: 2.0}
            t = time.monotonic()
            with pytest.raises(PoolHeldError, match="H800 full") as ei:
                sess.cluster("actor_train", Probe, pool="H800")
            assert time.monotonic() - t < 5
            assert ei.value.holders == [first.info["holder"]]
            assert f"session {first.info['id']} (pid {first.proc.pid}" in str(ei.value)
            assert "close that session" in str(ei.value) and "accelerator_type:H800" in str(ei.value)
            assert "actor_train" not in sess.clusters

            # the pool grows: the second session's request now fits on the new node, and both run
            extra = cluster.add_node(num_cpus=1, num_gpus=2, resources={"accelerator_type:H800": 1})
            cluster.wait_for_nodes()
            train = sess.cluster("actor_train", Probe, pool="H800", replicas=2)
            assert [w["node_id"] for w in train.where()] == [extra.node_id] * 2
            assert all(not b.fell_back for b in train.bindings)
            held = first.ask(do="where")
            assert held == {"actor_train": [nodes["h800"].node_id] * 2, "actor_gen": [nodes["h20"].node_id] * 2}

            # the first session closes: its slots are free for the second
            assert first.ask(do="close") == "closed"
            sess.close_cluster("actor_train")
            train = sess.cluster("actor_train", Probe, pool="H800", replicas=4)
            assert sorted(w["node_id"] for w in train.where()) == sorted(
                [nodes["h800"].node_id] * 2 + [extra.node_id] * 2
            )
            assert sess.runtime.resources.held_elsewhere("H800") == {}
        finally:
            sess.close()
    finally:
        first.kill()


def test_a_killed_sessions_slots_are_released(ray_cluster):
    cluster, nodes = ray_cluster
    holder = Driver(cluster.address)
    try:
        assert holder.ask(do="cluster", name="actor_gen", pool="H20", replicas=2) == [nodes["h20"].node_id] * 2
        with rn.Session.attach(cluster.address, timeout_s=60) as sess:
            with pytest.raises(PoolHeldError, match=f"session {holder.info['id']}"):
                sess.cluster("actor_gen", Probe, pool="H20", fallback=[])
            holder.kill()  # no close(): the GCS marks its job dead
            deadline = time.monotonic() + 30
            while True:
                try:
                    gen = sess.cluster("actor_gen", Probe, pool="H20", replicas=2, fallback=[])
                    break
                except PoolHeldError:
                    assert time.monotonic() < deadline, "a dead session's holdings were never released"
                    time.sleep(0.5)
            assert [w["node_id"] for w in gen.where()] == [nodes["h20"].node_id] * 2
            assert sess.store.get("pools/H20")["held_elsewhere"] == 0
    finally:
        holder.kill()


def test_a_token_left_in_home_does_not_break_a_cluster_without_auth(ray_cluster):
    cluster, nodes = ray_cluster
    os.makedirs(os.path.expanduser("~/.ray"), exist_ok=True)
    token = os.path.expanduser("~/.ray/auth_token")  # as a plain ray.init() elsewhere leaves it
    with open(token, "w") as f:
        f.write("0" * 64)
    try:
        with rn.Session.attach(cluster.address, timeout_s=60) as sess:
            assert sess.token_path is None
            gen = sess.cluster("actor_gen", Probe, pool="H20")
            assert gen.where()[0]["node_id"] == nodes["h20"].node_id
    finally:
        os.unlink(token)


def test_node_loss_fallback_names_the_dead_node_and_reattach_warns(ray_cluster):
    """Runs last in this module: it removes the H20 node."""
    cluster, nodes = ray_cluster
    h20 = nodes["h20"].node_id
    with rn.Session.attach(cluster.address, timeout_s=60) as sess:
        gen = sess.cluster("actor_gen", Probe, pool="H20")
        assert gen.bindings[0].node == h20
        cluster.remove_node(nodes["h20"], allow_graceful=False)
        b = gen.restart_worker(0)
        assert b.fell_back and b.pool == "H800" and b.hardware == "H800"
        assert f"node {h20[:8]} of H20 died" in b.reason and "H20 has no live node left" in b.reason
        assert "full" not in b.reason.split(";")[0]
        assert gen.where()[0]["hardware"] == "H800"
        assert sess.pools["H20"].capacity == 0 and sess.runtime.resources.dead_nodes == {h20: "H20"}
        deadline = time.monotonic() + 90  # the GCS's health checks notice the dead raylet later
        while not (_ray.node_lost(h20) or "").startswith("the GCS marks it dead"):
            assert time.monotonic() < deadline, "the GCS never marked the removed node dead"
            time.sleep(1)
    with rn.Session.attach(cluster.address, timeout_s=60) as sess:
        assert "H20" not in sess.pools
        with pytest.warns(UserWarning, match=r"pool 'H20' is not in this cluster \(H20 absent\).*accelerator_type:H20"):
            gen = sess.cluster("actor_gen", Probe, pool="H20")
        assert gen.bindings[0].pool == "H800"
