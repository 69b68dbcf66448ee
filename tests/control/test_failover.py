"""Workers die, runs go on: generator replacement, trainer restore from autosave, bounded
restarts, errors that name the worker that died. Real Ray, sim workers (fast, same control plane)."""

from __future__ import annotations

import time

import pytest
import ray

import rollart_nb as rn
from rollart_nb.control.checkpoint import run_checkpoints
from rollart_nb.envs import Arithmetic
from rollart_nb.errors import WorkerDiedError
from rollart_nb.workers import Worker, register
from rollart_nb.workers.roles import SimGenerator, SimTrainer

POOLS = {"H800": 2, "H20": 3, "cpu": 2}
SPEC = "qwen3-0.6b"


@pytest.fixture(scope="module")
def sess():
    s = rn.Session.local(POOLS, serverless=False)
    yield s
    s.close()


def build(sess, gens=2, time_scale=2e-3):
    spec = rn.models.spec(SPEC)
    gen = sess.cluster(
        "actor_gen", SimGenerator, pool="H20", replicas=gens, model=spec, time_scale=time_scale, mean_response_tokens=16
    )
    train = sess.cluster("actor_train", SimTrainer, pool="H800", model=spec, time_scale=1e-4)
    tasks = sess.tasks({"math": Arithmetic()}, envs_per_task=16)
    return train, gen, tasks


def close_all(sess, *things):
    for t in things:
        t.close()


def accounted(pipe) -> dict:
    acc = pipe.stats()["accounting"]
    assert acc["unaccounted"] == 0, acc
    return acc


@pytest.mark.parametrize("dispatch", ["direct", "batched"])
def test_a_killed_generator_is_replaced_and_the_run_goes_on_without_failures(sess, dispatch):
    train, gen, tasks = build(sess)
    pipe = sess.pipeline(
        train, gen, tasks, batch_size=16, group_size=4, mode="rollart", name="gfail", dispatch=dispatch
    )
    pipe.run(2, progress=False)
    old = gen.workers[0].actor
    pipe.run(8, background=True, progress=False)
    while len(pipe.reports) < 3:  # mid-run: turns are in flight on both generators
        time.sleep(0.01)
    ray.kill(old)
    pipe.wait(timeout=300)
    assert len(pipe.reports) == 10
    events = [e for r in pipe.reports for e in r.events]
    assert [e["kind"] for e in events] == ["generator_replaced"], events
    ev = events[0]
    assert ev["worker"] == "actor_gen/0" and ev["pool"] == "H20" and not ev["by_hand"]
    assert "ActorDiedError" in ev["reason"] and ev["version"] >= 2
    assert gen.workers[0].actor is not old and gen.restarts == {0: 1}
    # no trajectory failed: the dead worker's turns went again to a live one (KV recomputed from the history)
    assert sum(r.counts.get("failed", 0) for r in pipe.reports) == 0
    assert gen.version() == [pipe.version, pipe.version]  # the replacement serves the current weights
    proxy = pipe.stats()["proxy"]
    assert proxy["replaced"] == 1 and proxy["dead"] == {}
    accounted(pipe)
    assert ev in pipe.events and "generator_replaced" in pipe.reports[-1].__class__.__doc__
    close_all(sess, pipe, gen, train)


def test_restart_worker_by_hand_reaches_the_same_state(sess):
    train, gen, tasks = build(sess)
    pipe = sess.pipeline(train, gen, tasks, batch_size=16, group_size=4, mode="areal", name="hand")
    pipe.run(3, progress=False)
    gen.restart_worker(1)  # a fresh worker: initial weights, not routed to yet
    assert gen.call_worker(1, "version") == 0
    served = pipe.version
    rep = pipe.step()
    assert [(e["kind"], e["worker"], e["by_hand"]) for e in rep.events] == [("generator_replaced", "actor_gen/1", True)]
    assert rep.events[0]["version"] == served > 0  # it loaded the served version before it took requests
    pipe.run(2, progress=False)
    assert gen.version() == [pipe.version] * 2
    assert sum(r.counts.get("failed", 0) for r in pipe.reports) == 0
    accounted(pipe)
    close_all(sess, pipe, gen, train)


def test_restarts_are_bounded_per_worker_then_a_clear_error(sess):
    train, gen, tasks = build(sess)
    pipe = sess.pipeline(
        train, gen, tasks, batch_size=16, group_size=4, mode="rollart", name="bound", max_worker_restarts=1
    )
    pipe.step()
    ray.kill(gen.workers[1].actor)
    pipe.run(2, progress=False)
    assert [e["worker"] for e in pipe.events] == ["actor_gen/1"]
    ray.kill(gen.workers[1].actor)
    with pytest.raises(
        WorkerDiedError,
        match=r"actor_gen/1 \(pool H20\) died .* restarted it 1 time\(s\) already, "
        r"the most max_worker_restarts=1 allows.*restart_worker\(1\)",
    ) as e:
        pipe.run(3, progress=False)
    assert e.value.worker == "actor_gen/1"
    close_all(sess, pipe, gen, train)


def test_a_killed_trainer_is_restored_from_the_newest_autosave(sess, tmp_path):
    train, gen, tasks = build(sess)
    run_dir = tmp_path / "t"
    pipe = sess.pipeline(
        train, gen, tasks, batch_size=16, group_size=4, mode="rollart", name="tfail", run_dir=run_dir, autosave_every=2
    )
    pipe.run(5, progress=False)
    assert [p.name for p in run_checkpoints(run_dir)] == ["step-000002", "step-000004"]
    served = pipe.version
    old = train.workers[0].actor
    ray.kill(old)
    reps = pipe.run(3, progress=False)  # no error: restored, then on
    events = [e for r in reps for e in r.events]
    assert [e["kind"] for e in events] == ["trainer_restored"], events
    ev = events[0]
    assert ev["worker"] == "actor_train/0" and ev["checkpoint"].endswith("step-000004")
    assert ev["versions_lost"] == served - ev["version"] >= 0
    assert train.workers[0].actor is not old
    # the version went back to the autosave's once, on purpose, and goes on from there
    assert train.version() - pipe.version in (0, 1)  # overlapped: the last batch may still be training
    assert gen.version() == [pipe.version] * 2 and pipe.version > ev["version"]
    # nothing generated by the lost weights was trained on after the restore
    last = reps[-1]
    assert all(gap >= 0 for gap in last.staleness)
    accounted(pipe)
    close_all(sess, pipe, gen, train)


def test_a_trainer_restarted_by_hand_without_autosave_is_refused_and_nothing_goes_backwards(sess):
    train, gen, tasks = build(sess)
    pipe = sess.pipeline(train, gen, tasks, batch_size=16, group_size=4, mode="sync", name="noauto")
    pipe.run(3, progress=False)
    assert pipe.version == 3
    train.restart_worker(0)  # a fresh trainer: version 0, initial weights
    with pytest.raises(
        WorkerDiedError,
        match=r"trainer actor_train/0 lost its state .* no autosave .* up to "
        r"version 3 .* autosave_every=N",
    ) as e:
        pipe.step()
    assert e.value.worker == "actor_train/0"
    assert pipe.version == 3 and gen.version() == [3, 3]  # nothing served went backwards
    close_all(sess, pipe, gen, train)


class Slow(Worker):
    @register("one")
    def produce(self) -> int:
        time.sleep(30)
        return 1


class Consumer(Worker):
    @register("one")
    def consume(self, x: int) -> int:
        return x


def test_a_death_is_named_after_the_worker_that_died_not_the_one_that_saw_it(sess):
    a = sess.cluster("producer", Slow, pool="H800")
    b = sess.cluster("consumer", Consumer, pool="cpu")
    ref = a.produce(blocking=False).refs[0]
    fut = b.consume(ref, blocking=False)  # b waits for a's result
    time.sleep(0.5)
    ray.kill(a.workers[0].actor)
    with pytest.raises(WorkerDiedError, match=r"worker producer/0 \(pool H800\) died .*\(seen by consumer/0\)") as e:
        fut.result(timeout=60)
    assert e.value.worker == "producer/0" and e.value.pool == "H800"
    close_all(sess, a, b)
