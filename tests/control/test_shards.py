"""A pipeline's rollout over several RolloutWorker shards: exact batch shares, whole groups from
one shard, one staleness rule, exact accounting, distinct ids; one shard is the rollout of before.
Real Ray (one local session for the module), sim workers."""

from __future__ import annotations

import collections
import time

import pytest
import ray

import rollart_nb as rn
from rollart_nb import SimSession
from rollart_nb.config import PipelineConfig
from rollart_nb.control.buffer import split_quota
from rollart_nb.control.shards import ENVS_PER_SHARD, auto_shards, max_shards, plan_rollout, plan_shards
from rollart_nb.envs import Arithmetic
from rollart_nb.errors import ConfigError
from rollart_nb.sim import SimEnv
from rollart_nb.workers.roles import SimGenerator, SimTrainer

M = rn.models.spec("qwen3-0.6b")
WEIGHTS = {"fl": 2.0, "math": 1.0}


@pytest.fixture(scope="module")
def sess():
    s = rn.Session.local({"H800": 2, "H20": 3, "cpu": 4}, serverless=False)
    yield s
    s.close()


@pytest.fixture(scope="module")
def parts(sess):
    gen = sess.cluster(
        "actor_gen", SimGenerator, pool="H20", replicas=2, model=M, time_scale=1e-4, mean_response_tokens=8
    )
    train = sess.cluster("actor_train", SimTrainer, pool="H800", model=M, time_scale=1e-4)
    tasks = sess.tasks(
        {"fl": SimEnv("frozenlake", time_scale=1e-4), "math": Arithmetic()}, envs_per_task=9, weights=WEIGHTS
    )
    return gen, train, tasks


def recording(pipe) -> list[list]:
    """Record every batch the pipeline takes (the batch itself goes to the trainer)."""
    batches: list[list] = []
    take = pipe.rollout.take_batch

    def take_and_record(n):
        batch = take(n)
        batches.append(batch)
        return batch

    pipe.rollout.take_batch = take_and_record
    return batches


def shard_of(pipe) -> dict[str, int]:
    """Trajectory id -> index of the shard that ran it (no id on two shards)."""
    per = [{t.id for t in c.trajectories(None, None, None, False)} for c in pipe.rollout.clusters]
    owner = {i: s for s, ids in enumerate(per) for i in ids}
    assert len(owner) == sum(map(len, per))  # trajectory ids are unique across shards
    return owner


# -- planning ------------------------------------------------------------------------------------
def envs_of(counts: dict[str, int]) -> dict[str, list[object]]:
    return {t: [object() for _ in range(n)] for t, n in counts.items()}


@pytest.mark.parametrize("n", [2, 3, 5])
def test_a_plan_splits_every_tasks_envs_and_groups_exactly(n):
    envs = envs_of({"a": 7, "b": 4, "c": 3})
    whole = plan_rollout(envs, PipelineConfig(batch_size=48), 4, seed=7, task_weights={"a": 3, "b": 2, "c": 1})
    quota = split_quota(whole.batch_groups, {"a": 3, "b": 2, "c": 1})
    assert whole.quota == quota and whole.batch_size == 48
    plans = plan_shards(whole, n)
    assert len(plans) == n
    for task, templates in envs.items():
        held = [e for p in plans for e in p.envs.get(task, [])]
        assert sorted(map(id, held)) == sorted(map(id, templates))  # disjoint, nothing lost
        assert sum(p.quota.get(task, 0) for p in plans) == quota[task]
    for p in plans:
        assert p.envs and all(p.quota[t] >= 1 for t in p.envs)  # a shard runs only tasks it supplies
        assert p.batch_size == sum(p.quota.values()) * 4 and p.config is whole.config
        # the shard's scheduler splits its batch into exactly its quota
        assert split_quota(p.batch_groups, p.weights) == p.quota
    assert sum(p.batch_size for p in plans) == 48
    assert len({p.seed for p in plans}) == n and all(p.seed != 7 for p in plans)
    sizes = [sum(map(len, p.envs.values())) for p in plans]
    assert max(sizes) - min(sizes) <= len(envs)  # balanced


def test_one_shard_is_the_unsharded_rollout_and_too_many_shards_say_how_many_fit():
    envs = envs_of({"a": 2, "b": 8})
    whole = plan_rollout(envs, PipelineConfig(batch_size=12), 4, seed=3)  # 3 groups: a 2, b 1 (largest remainder)
    (one,) = plan_shards(whole, 1)
    assert one is whole and one.envs is envs and one.seed == 3
    assert max_shards(whole) == 3  # per task min(envs, groups): a 2, b 1
    assert len(plan_shards(whole, 3)) == 3
    with pytest.raises(ConfigError, match=r"rollout_shards=4.*at most 3 shard\(s\).*rollout_shards<=3"):
        plan_shards(whole, 4)


def test_a_task_without_a_share_runs_beside_tasks_that_have_one():
    envs = envs_of({"a": 4, "zero": 4})
    plans = plan_shards(plan_rollout(envs, PipelineConfig(batch_size=16), 4, task_weights={"a": 1.0, "zero": 0.0}), 2)
    assert [p.quota["a"] for p in plans] == [2, 2] and [p.quota["zero"] for p in plans] == [0, 0]
    assert sum(len(p.envs["zero"]) for p in plans) == 4


def test_the_automatic_count_follows_the_envs_within_cpus_and_groups():
    def auto(envs: int, cpus: float | None) -> int:
        return auto_shards(plan_rollout(envs_of({"a": envs}), PipelineConfig(batch_size=64), 8), cpus)  # 8 groups

    assert auto(16, 64) == 1
    assert auto(ENVS_PER_SHARD, 64) == 1
    assert auto(ENVS_PER_SHARD + 1, 64) == 2
    assert auto(3 * ENVS_PER_SHARD, None) == 3
    assert auto(3 * ENVS_PER_SHARD, 2) == 2  # the CPU pool's free slots
    assert auto(3 * ENVS_PER_SHARD, 0) == 1
    assert auto(20 * ENVS_PER_SHARD, None) == 8  # the batch's groups


def test_rollout_shards_is_checked():
    assert PipelineConfig().rollout_shards is None
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ConfigError, match=r"rollout_shards=.* must be a whole number >= 1"):
            PipelineConfig(rollout_shards=bad)
    with pytest.raises(ConfigError, match=r"rollout_shards=9 must be <= batch_size=8"):
        PipelineConfig(batch_size=8, rollout_shards=9)


# -- pipelines -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("shards", "alpha"), [(2, 0), (3, 1)])
def test_sharded_batches_are_exact_whole_groups_within_the_staleness_bound(sess, parts, shards, alpha):
    gen, train, tasks = parts
    pipe = sess.pipeline(
        train, gen, tasks, batch_size=24, group_size=4, alpha=alpha, rollout_shards=shards, name="sharded"
    )
    assert pipe.rollout.shards == shards and pipe.E == 18
    assert {f"sharded.rollout.{i}" for i in range(shards)} <= set(sess.clusters)
    batches = recording(pipe)
    versions = [pipe.version]
    for _ in range(5):
        versions.append(pipe.step().version)
    st = pipe.stats()
    assert set(pipe.validate(["math"])) == {"math"} and pipe.last_validation["math"]["n"] > 0
    pipe.rollout.shutdown()  # every trajectory ends (cancelled if in flight): the record is complete
    owner = shard_of(pipe)
    quota = split_quota(6, WEIGHTS)
    for before, batch in zip(versions[:-1], batches, strict=True):
        assert len(batch) == 24
        groups = collections.defaultdict(list)
        for t in batch:
            groups[t.group_id].append(t)
        assert all(len(m) == 4 for m in groups.values())  # whole groups, exact size
        assert all(len({owner[t.id] for t in m}) == 1 for m in groups.values())  # each from one shard
        assert collections.Counter(m[0].task for m in groups.values()) == quota  # the unsharded composition
        assert all(t.min_version >= before - alpha for t in batch)  # one staleness rule over all shards
        assert [t.task for t in batch] == sorted((t.task for t in batch), key=["fl", "math"].index)
    assert st["accounting"]["unaccounted"] == 0 and len(st["shards"]) == shards
    assert st["accounting"]["started"] == sum(s["accounting"]["started"] for s in st["shards"])
    assert st["envs"] == 18 and st["version"] == pipe.version
    assert st["events"]["completed"] == sum(kinds.get("completed", 0) for kinds in st["task_events"].values())
    assert st["proxy"]["requests"] == sum(s["proxy"]["requests"] for s in st["shards"])
    assert [s["batch_size"] for s in st["shards"]] == [p.batch_size for p in pipe.rollout.plans]
    # one row per engine over all shards (their turns add up), in the stats and every report
    engines = st["proxy"]["engines"]
    assert [e["name"] for e in engines] == ["actor_gen/0", "actor_gen/1"]
    assert [e["inflight"] for e in engines] == [
        sum(s["proxy"]["engines"][i]["inflight"] for s in st["shards"]) for i in range(2)
    ]
    assert all(
        len(r.engines) == 2 and {"inflight", "queued", "capacity", "occupancy"} <= set(r.engines[0])
        for r in pipe.reports
    )
    if alpha == 0:  # every update aborts what every shard has in flight
        assert all(s["accounting"]["aborted_stale"] > 0 for s in st["shards"]), st["shards"]
    every = pipe.trajectories(last=None)
    assert len({t.id for t in every}) == len(every) == len(owner)
    assert len({t.group_id for t in every}) == len({(owner[t.id], t.group_id) for t in every})  # group ids too
    assert [t.finished_s for t in every] == sorted(t.finished_s for t in every)  # newest last
    assert pipe.stats()["accounting"]["running"] == 0
    assert pipe.run_config()["rollout_shards"] == shards
    pipe.close()
    assert not any(n.startswith("sharded.rollout") for n in sess.clusters)


def first_wave(pipe) -> set[tuple[str, str, int]]:
    """(id, group, seed) of the trajectories the rollout launched first (one per env, at once)."""
    pipe.rollout.shutdown()  # what is in flight ends (cancelled) and is recorded with the rest
    every = sorted(pipe.trajectories(last=None), key=lambda t: t.created_s)
    return {(t.id, t.group_id, t.seed) for t in every[: pipe.E]}


def test_one_shard_launches_what_the_unsharded_rollout_launches(sess, parts):
    gen, train, tasks = parts
    waves = []
    for shards in (None, 1, 2):
        kw = {} if shards is None else {"rollout_shards": shards}
        pipe = sess.pipeline(train, gen, tasks, batch_size=24, group_size=4, seed=11, name="same", **kw)
        pipe.step()
        assert pipe.rollout.shards == (shards or 1)
        waves.append(first_wave(pipe))
        pipe.close()
    default, one, two = waves
    assert len(default) == 18 and one == default  # same ids, groups and seeds
    assert not {i for i, _, _ in two} & {i for i, _, _ in default}


def test_an_impossible_shard_count_is_refused_before_anything_starts(sess, parts):
    gen, train, tasks = parts
    before = set(sess.clusters)
    with pytest.raises(ConfigError, match=r"at most 2 shard\(s\).*rollout_shards<=2"):
        sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, rollout_shards=3, name="toomany")
    assert set(sess.clusters) == before and "toomany" not in sess.runtime.pipelines


def test_a_killed_generator_is_replaced_in_every_shard(sess, parts):
    gen, train, tasks = parts
    pipe = sess.pipeline(train, gen, tasks, batch_size=24, group_size=4, rollout_shards=2, name="heal")
    pipe.run(2, progress=False)
    old = gen.workers[0].actor
    pipe.run(6, background=True, progress=False)
    while len(pipe.reports) < 3:
        time.sleep(0.01)
    ray.kill(old)
    pipe.wait(timeout=300)
    assert len(pipe.reports) == 8
    events = [e for r in pipe.reports for e in r.events]
    assert [e["kind"] for e in events] == ["generator_replaced"], events
    st = pipe.stats()
    assert all(s["proxy"]["replaced"] == 1 and s["proxy"]["dead"] == {} for s in st["shards"])
    assert st["accounting"]["unaccounted"] == 0 and gen.version() == [pipe.version, pipe.version]
    pipe.close()


def test_a_sharded_pipeline_saves_and_resumes_with_its_shards(sess, parts, tmp_path):
    gen, train, tasks = parts
    pipe = sess.pipeline(train, gen, tasks, batch_size=24, group_size=4, mode="sync", rollout_shards=2, name="ck")
    pipe.run(2, progress=False)
    path, saved = pipe.save(tmp_path / "ck"), pipe.version
    pipe.close()
    pipe = sess.pipeline(train, gen, tasks, name="ck2", resume_from=path)
    assert pipe.config.rollout_shards == 2 and pipe.rollout.shards == 2 and pipe.version == saved
    rep = pipe.step()
    assert (rep.step, rep.version, rep.batch_size) == (2, saved + 1, 24)
    assert pipe.stats()["accounting"]["unaccounted"] == 0
    pipe.close()


def test_running_trajectories_can_be_read_from_every_shard_while_they_grow(sess, parts):
    gen, train, tasks = parts
    pipe = sess.pipeline(train, gen, tasks, batch_size=24, group_size=4, rollout_shards=2, name="live")
    pipe.run(3, background=True, progress=False)
    running = 0
    for _ in range(200):  # each read races the turns that extend the running trajectories' tokens
        running += sum(t.status.value == "running" for t in pipe.trajectories(last=None, include_running=True))
    pipe.wait(timeout=120)
    assert running > 0
    pipe.close()


def test_a_sim_session_shards_its_rollout_the_same_way():
    with SimSession({"H800": 2, "H20": 2, "cpu": 4}) as sim:
        gen = sim.cluster("actor_gen", SimGenerator, pool="H20", replicas=2, model=M, mean_response_tokens=8)
        train = sim.cluster("actor_train", SimTrainer, pool="H800", model=M)
        tasks = sim.tasks({"fl": SimEnv("frozenlake"), "math": Arithmetic()}, envs_per_task=6, weights=WEIGHTS)
        pipe = sim.pipeline(train, gen, tasks, batch_size=24, group_size=4, rollout_shards=2, name="simshards")
        reps = pipe.run(3, progress=False)
        assert [r.batch_size for r in reps] == [24, 24, 24] and set(reps[-1].reward) == {"fl", "math"}
        st = pipe.stats()
        assert [s["name"] for s in st["shards"]] == ["simshards.rollout.0", "simshards.rollout.1"]
        assert st["accounting"]["unaccounted"] == 0 and st["envs"] == 12
        pipe.close()
        assert not any(n.startswith("simshards.rollout") for n in sim.clusters)
