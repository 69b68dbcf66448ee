"""Re-run cells: a live pipeline's clusters are not rebuilt under it, a pipeline rebuilt on trained
clusters starts at the trainer's version, and a closed pipeline's rollout points to the pipeline."""

from __future__ import annotations

import pytest

import rollart_nb as rn
from rollart_nb.envs import Arithmetic
from rollart_nb.errors import StateError
from rollart_nb.workers.roles import SimGenerator, SimTrainer

SPEC = rn.models.spec("qwen3-0.6b")


@pytest.fixture(scope="module")
def sess():
    with rn.Session.local({"H800": 1, "H20": 1, "cpu": 2}, serverless=False) as s:
        yield s


def build_gen(sess):
    return sess.cluster("actor_gen", SimGenerator, pool="H20", model=SPEC, time_scale=1e-4, mean_response_tokens=8)


def build_train(sess):
    return sess.cluster("actor_train", SimTrainer, pool="H800", model=SPEC, time_scale=1e-4)


def test_rebuilding_a_live_pipelines_generator_is_refused_and_changes_nothing(sess):
    gen, train = build_gen(sess), build_train(sess)
    tasks = sess.tasks({"math": Arithmetic()}, envs_per_task=4)
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, name="live")
    pipe.step()
    with pytest.raises(StateError, match=r"pipeline 'live'.*nothing was changed.*pipe\.close\(\)") as ei:
        build_gen(sess)  # the generator cell, run again
    assert "sess.pipeline(" in str(ei.value)
    with pytest.raises(StateError, match="pipeline 'live'"):
        sess.close_cluster("actor_train")
    with pytest.raises(StateError, match="pipeline 'live'"):
        sess.close_cluster("live.rollout")
    # the old clusters are intact and the pipeline goes on with them
    assert sess.clusters["actor_gen"] is gen and not gen.closed and not train.closed
    assert gen.version() == [pipe.version]
    rep = pipe.step()
    assert rep.batch_size == 8 and rep.version == pipe.version == 1 and gen.version() == [1]  # overlapped: v1 at step 2
    pipe.close()
    new_gen = build_gen(sess)  # once the pipeline is closed the cell runs again
    assert gen.closed and sess.clusters["actor_gen"] is new_gen and new_gen.version() == [0]
    sess.close_cluster("actor_gen")
    sess.close_cluster("actor_train")


def test_a_pipeline_rebuilt_on_trained_clusters_starts_at_the_trainers_version(sess):
    gen, train = build_gen(sess), build_train(sess)
    tasks = sess.tasks({"math": Arithmetic()}, envs_per_task=4)
    first = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, alpha=1, name="first")
    first.run(3, progress=False)
    first.close()  # overlapped mode: the trainer is a version ahead of what the generators served
    trained = int(train.version())
    assert trained >= 3 and gen.version() != [trained]
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, alpha=1, name="second")
    assert pipe.version == trained and pipe.stats()["version"] == trained and gen.version() == [trained]
    rep = pipe.step()
    assert rep.counts.get("aborted_stale", 0) == 0 and rep.batch_size == 8
    assert pipe.stats()["events"].get("aborted_stale", 0) == 0
    done = pipe.trajectories(status="completed", last=None)
    assert len(done) >= 8
    for t in done:
        assert t.start_version == trained
        assert t.turns and all(t.start_version <= v <= pipe.version for v in (s.version for s in t.versions))
    pipe.close()
    sess.close_cluster("actor_gen")
    sess.close_cluster("actor_train")


def test_a_closed_pipelines_rollout_points_to_the_pipeline_not_to_sess_cluster(sess):
    gen, train = build_gen(sess), build_train(sess)
    tasks = sess.tasks({"math": Arithmetic()}, envs_per_task=4)
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, name="gone")
    pipe.close()
    for call in (pipe.trajectories, pipe.stats, pipe.rollout.stats):
        with pytest.raises(StateError) as ei:
            call()
        msg = str(ei.value)
        assert "sess.cluster('gone.rollout'" not in msg and "sess.pipeline(" in msg and "'gone'" in msg
    # a user's own cluster still says how to build it again
    sess.close_cluster("actor_gen")
    with pytest.raises(StateError, match=r"sess\.cluster\('actor_gen', \.\.\.\)"):
        gen.version()
    sess.close_cluster("actor_train")
