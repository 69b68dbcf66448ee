"""ClusterSpec: what a session hands its runtime, checked as a whole (no Ray, no loop)."""

from __future__ import annotations

import dataclasses

import pytest

import rollart_nb as rn
from rollart_nb.errors import ConfigError
from rollart_nb.runtime.base import ClusterSpec
from rollart_nb.sim_session import SimSession
from rollart_nb.workers.roles import SimGenerator


class Plain(rn.Worker):
    default_pool = "H20"


def test_a_spec_reports_every_problem_at_once():
    with pytest.raises(ConfigError) as ei:
        ClusterSpec("", dict, replicas=0, slots=-1, max_concurrency=0, start_timeout_s=0)  # type: ignore[arg-type]
    msg = str(ei.value)
    assert len(ei.value.problems) == 6, msg
    for part in ("name must be", "worker_cls must be a rollart_nb.Worker subclass", "replicas must be an int >= 1"):
        assert part in msg, msg
    assert "slots must be > 0" in msg and "max_concurrency must be" in msg and "start_timeout_s must be" in msg


def test_a_spec_defaults_to_the_worker_pool_and_is_frozen():
    s = ClusterSpec("g", Plain)
    assert s.pool == "H20" and s.replicas == 1 and s.init_kwargs == {}
    assert ClusterSpec("g", Plain, pool="cpu").pool == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.replicas = 2  # type: ignore[misc]


def test_of_splits_spec_fields_from_init_kwargs():
    s = ClusterSpec.of("r", Plain, pool="cpu", replicas=2, fallback=None, threaded=True, envs=[1], config="c")
    assert (s.pool, s.replicas, s.threaded) == ("cpu", 2, True)
    assert s.init_kwargs == {"envs": [1], "config": "c"}


def test_a_runtime_builds_a_cluster_from_a_spec_and_replaces_one_of_its_name():
    with SimSession({"H20": 2, "cpu": 2}) as sess:
        m = rn.models.spec("qwen3-0.6b")
        gen = sess.runtime.cluster(ClusterSpec("g", SimGenerator, replicas=2, init_kwargs={"model": m}))
        assert gen.spec.pool == "H20" and len(gen) == 2 and sess.clusters["g"] is gen
        again = sess.runtime.cluster(ClusterSpec.of("g", SimGenerator, pool="H20", model=m))  # replaces the first
        assert gen.closed and sess.clusters["g"] is again and len(again) == 1 and again.model is m


def test_sess_cluster_hands_its_keywords_to_the_spec():
    with SimSession({"H20": 2, "cpu": 2}) as sess:
        c = sess.cluster("p", Plain, replicas=2, endpoints={"ep": "http://127.0.0.1:1/x"}, threaded=True)
        assert (c.spec.pool, c.spec.replicas, c.threaded) == ("H20", 2, True)
        assert c.spec.endpoints["ep"].url == "http://127.0.0.1:1/x"
        with pytest.raises(ConfigError, match=r"sess.cluster\('bad', \.\.\.\).*replicas must be an int >= 1"):
            sess.cluster("bad", Plain, replicas=0)
        assert "bad" not in sess.clusters
