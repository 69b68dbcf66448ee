"""SimSession + LocalCluster: the Session/Cluster API in one process, driving the real Pipeline."""

from __future__ import annotations

import asyncio
import inspect
import threading

import pytest

import rollart_nb as rn
from rollart_nb import Worker, hw_mapping, register
from rollart_nb.control.env_manager import RolloutConfig
from rollart_nb.control.pipeline import Pipeline
from rollart_nb.control.rollout_worker import RolloutWorker
from rollart_nb.control.scheduler import RolloutScheduler
from rollart_nb.errors import ClusterError, ConfigError, NoCapacityError, StateError
from rollart_nb.models.spec import spec
from rollart_nb.runtime.local import LocalCluster, LocalRef
from rollart_nb.sim import SimEnv, response_tokens_fn, workload
from rollart_nb.sim_session import SimSession
from rollart_nb.workers.roles import SimGenerator, SimTrainer, TrainerWorker


class Calc(Worker):
    """A worker with every dispatch kind."""

    default_pool = "cpu"

    def __init__(self, base: int = 0) -> None:
        self.base = base

    @register()
    def add(self, x: int) -> int:
        """Add the base and this worker's rank."""
        return x + self.base + self.rank

    @register("one")
    def produce(self, n: int) -> list[int]:
        return list(range(n))

    @register("one")
    async def total(self, xs: list[int]) -> int:
        await asyncio.sleep(0)
        return sum(xs)

    @register("scatter")
    def take(self, x: int) -> int:
        return x * 10

    @hw_mapping({"math": "bandwidth", "game": "compute"})
    def where(self, tag_name: str | None = None) -> str:
        return self.hardware

    @register()
    def thread(self) -> str:
        return threading.current_thread().name


@pytest.fixture()
def sess():
    s = SimSession({"H800": 16, "H20": 16, "cpu": 8}, seed=0)
    yield s
    s.close()


def test_pools_are_simulated_and_sized(sess):
    assert {n: p.capacity for n, p in sess.pools.items()} == {"H800": 16, "H20": 16, "cpu": 8}
    assert all(p.simulated for p in sess.pools.values())
    assert len(sess.pools["H800"].nodes) == 2  # 8 GPUs per node


def test_register_dispatch_and_signature(sess):
    c = sess.cluster("calc", Calc, pool="cpu", replicas=3, base=100)
    assert isinstance(c, LocalCluster)
    assert c.add(1) == [101, 102, 103]
    assert c.produce(3) == [0, 1, 2]
    assert c.take([1, 2, 3]) == [10, 20, 30]
    with pytest.raises(ConfigError, match="scatter"):
        c.take([1, 2])
    sig = inspect.signature(c.add)
    assert list(sig.parameters) == ["x", "blocking"] and c.add.__doc__.startswith("Add the base")
    assert [b.worker for b in sess.bindings("calc")] == ["calc/0", "calc/1", "calc/2"]


def test_nonblocking_future_and_refs_pass_between_calls(sess):
    c = sess.cluster("calc", Calc, pool="cpu", replicas=2)
    fut = c.produce(5, blocking=False)
    assert len(fut.refs) == 1 and isinstance(fut.refs[0], LocalRef)
    assert c.total(fut.refs[0]) == 10  # the ref is resolved to its value inside the callee
    assert fut.result(timeout=5) == [0, 1, 2, 3, 4]
    assert asyncio.run(_await(c.add(1, blocking=False))) == [1, 2]


async def _await(fut):
    return await fut


def test_hw_mapping_routes_by_tag(sess):
    gen = sess.cluster("mixed", Calc, pool="H800", replicas=4, fallback=["H20"], slots=8)
    assert [b.hardware for b in gen.bindings] == ["H800", "H800", "H20", "H20"]
    assert gen.where(tag_name="math") == "H20"
    assert gen.where(tag_name="game") == "H800"
    assert gen.affinity("where", "math") == "bandwidth"
    with pytest.raises(NoCapacityError):
        sess.cluster("too_big", Calc, pool="H800", replicas=1, fallback=[], slots=8)


def test_sync_methods_on_loop_but_blocking_trainers_threaded(sess):
    c = sess.cluster("calc", Calc, pool="cpu", replicas=1)
    assert c.thread() == [sess._thread.name]  # bookkeeping calls share the loop thread
    t = sess.cluster("calc_t", Calc, pool="cpu", replicas=1, threaded=True)
    assert t.thread()[0] != sess._thread.name
    torch_like = type("Blocking", (TrainerWorker,), {"make_backend": lambda self, model, **kw: None})
    assert sess.cluster("real_train", torch_like, pool="H800", model=None).threaded
    # the sim trainer's step is a coroutine on the loop (no thread to race the virtual clock)
    train = sess.cluster("actor_train", SimTrainer, pool="H800", model=spec("qwen3-0.6b"), time_scale=0)
    assert not train.threaded and not sess.cluster("g", SimGenerator, pool="H20", model=spec("qwen3-0.6b")).threaded
    assert train.train_step([])["version"] == 1


def test_actor_remote_on_loop_returns_task(sess):
    gen = sess.cluster("g", SimGenerator, pool="H20", replicas=1, model=spec("qwen3-0.6b"), time_scale=0)

    async def call() -> tuple[bool, int]:
        t = gen.workers[0].actor.version.remote()
        return isinstance(t, asyncio.Task), await t

    assert sess.run(call(), timeout=10) == (True, 0)
    ref = gen.workers[0].actor.version.remote()  # off the loop: a LocalRef
    assert isinstance(ref, LocalRef) and ref.result(5) == 0


def test_blocking_call_on_loop_is_refused(sess):
    c = sess.cluster("calc", Calc, pool="cpu", replicas=1)

    async def bad() -> None:
        c.add(1)

    with pytest.raises(StateError, match="blocking=False"):
        sess.run(bad(), timeout=10)


def test_serverless_needs_a_real_session(sess):
    with pytest.raises(ConfigError, match="real session"):
        sess.reward("math", lambda t: 1.0, serverless=True)
    with pytest.raises(ConfigError, match="real session"):
        sess.runtime.deploy_reward("math", lambda t: 1.0)
    assert sess.runtime.weight_transport("direct", "p") is None
    with pytest.raises(ConfigError):
        sess.runtime.weight_transport("mooncake", "p")


def test_rebuild_replaces_and_close_frees(sess):
    sess.cluster("calc", Calc, pool="cpu", replicas=4)
    sess.cluster("calc", Calc, pool="cpu", replicas=2)
    assert sess.pools["cpu"].used == 2
    sess.close()
    assert sess.state == "closed" and not sess._thread.is_alive()
    with pytest.raises(StateError, match="closed"):
        sess.cluster("calc", Calc)


@pytest.mark.parametrize("mode", ["sync", "sync+", "one-off", "areal", "rollart"])
def test_pipeline_steps_on_sim_session(sess, mode):
    ts = 2e-4
    m = spec("qwen3-0.6b")
    wl = {"lake": workload("frozenlake"), "math": workload("gem-math")}
    gen = sess.cluster(
        "actor_gen",
        SimGenerator,
        pool="H800",
        replicas=4,
        fallback=["H20"],
        slots=4,
        model=m,
        time_scale=ts,
        response_tokens=response_tokens_fn(wl),
    )
    train = sess.cluster("actor_train", SimTrainer, pool="H800", model=m, time_scale=ts, gpus=8, slots=8)
    tasks = sess.tasks({k: SimEnv(w, time_scale=ts) for k, w in wl.items()}, envs_per_task=8)
    pipe = sess.pipeline(
        train,
        gen,
        tasks,
        batch_size=16,
        group_size=4,
        mode=mode,
        rollout=RolloutConfig(max_turns=20, max_new_tokens=8192, max_context=32768),
    )
    assert type(pipe) is Pipeline  # the real pipeline, not a sim copy
    rw = pipe.rollout.workers[0].instance
    assert isinstance(rw, RolloutWorker) and type(rw.sched) is RolloutScheduler
    reps = pipe.run(2, progress=False)
    assert [r.batch_size for r in reps] == [16, 16]
    # in-step training bumps the version every step; overlapped modes apply step k's training in step k+1
    assert [r.version for r in reps] == ([1, 2] if mode in ("sync", "sync+") else [0, 1])
    assert set(reps[-1].reward) == {"lake", "math"} and reps[-1].tokens > 0
    stats = pipe.stats()
    assert stats["proxy"]["requests"] > 0
    assert sum(gen.stats()[i]["requests"] for i in range(4)) >= stats["proxy"]["requests"]
    pipe.close()
    assert "pipeline.rollout" not in sess.clusters


def test_session_sim_alias_saves_and_resumes_in_simulated_time(tmp_path):
    """rn.Session.sim is a SimSession with the shared session API, resume_from included; its step
    reports are in simulated seconds (far longer than the wall time they took)."""
    import time

    import rollart_nb as rn

    m = spec("qwen3-8b")

    def build(s):
        gen = s.cluster("actor_gen", SimGenerator, pool="H20", replicas=2, model=m)
        train = s.cluster("actor_train", SimTrainer, pool="H800", model=m)
        return gen, train, s.tasks({"math": SimEnv("gem-math")}, envs_per_task=8)

    with rn.Session.sim({"H800": 2, "H20": 2, "cpu": 2}, seed=1) as s:
        assert isinstance(s, SimSession) and s.virtual
        gen, train, tasks = build(s)
        pipe = s.pipeline(train, gen, tasks, batch_size=8, group_size=4, mode="sync")
        t0 = time.monotonic()
        reps = pipe.run(2, progress=False)
        wall = time.monotonic() - t0
        assert sum(r.step_s for r in reps) > 10 * wall  # Qwen3-8B decoding thousands of tokens: simulated minutes
        pipe.save(str(tmp_path / "ckpt"))
    with rn.Session.sim({"H800": 2, "H20": 2, "cpu": 2}, seed=1) as s:
        gen, train, tasks = build(s)
        pipe = s.pipeline(
            train, gen, tasks, batch_size=8, group_size=4, mode="sync", resume_from=str(tmp_path / "ckpt")
        )
        assert pipe.version == 2 and gen.version() == [2, 2]
        assert pipe.step().version == 3


def test_pipeline_takes_a_config_and_keywords_override_it(sess):
    """``config=`` and keywords of the same names: keywords win, ``pipe.config`` is what is in
    force and what the scheduler uses; bad values come back together and change nothing."""
    ts = 2e-4
    m = spec("qwen3-0.6b")
    gen = sess.cluster("actor_gen", SimGenerator, pool="H800", model=m, time_scale=ts)
    train = sess.cluster("actor_train", SimTrainer, pool="H800", model=m, time_scale=ts)
    tasks = sess.tasks({"math": SimEnv(workload("gem-math"), time_scale=ts)}, envs_per_task=8)
    cfg = rn.PipelineConfig(batch_size=8, alpha=2, mode="sync", rollout=RolloutConfig(max_turns=3))
    pipe = sess.pipeline(train, gen, tasks, group_size=4, config=cfg, alpha=0, name="cfg")
    assert pipe.config == cfg.replace(alpha=0)
    assert (pipe.cfg.alpha, pipe.cfg.batch_size, pipe.cfg.rollout.max_turns, pipe.mode.name) == (0, 8, 3, "sync")
    assert pipe.run_config()["rollout"]["max_turns"] == 3  # trackers see the whole config
    with pytest.raises(ConfigError) as e:
        sess.pipeline(train, gen, tasks, group_size=4, batch_size=6, alpha=-1, mode="rolart", name="cfg")
    assert len(e.value.problems) == 3 and "did you mean 'rollart'" in str(e.value)
    assert pipe.state != "closed" and sess.runtime.pipelines["cfg"] is pipe  # left as it was
    with pytest.raises(ConfigError, match="batch_size=6 must be a multiple of the group size 4"):
        sess.pipeline(train, gen, tasks, group_size=4, batch_size=6, name="cfg")
    with pytest.raises(ConfigError, match="must be a PipelineConfig"):
        sess.pipeline(train, gen, tasks, config={"alpha": 1}, name="cfg")
    pipe.close()


def test_help_shows_every_pipeline_setting_with_its_default():
    import dataclasses

    params = inspect.signature(rn.Session.pipeline).parameters
    defaults = rn.PipelineConfig()
    for f in dataclasses.fields(rn.PipelineConfig):
        assert params[f.name].default == getattr(defaults, f.name), f.name
        assert f"``{f.name}`` (" in rn.Session.pipeline.__doc__
    assert SimSession.pipeline is rn.Session.pipeline  # the simulated session shares the method


def test_call_latency_is_paid_by_every_worker_call_in_simulated_time():
    async def timed(s: SimSession) -> float:
        t0 = asyncio.get_running_loop().time()
        await s.clusters["calc"].workers[0].actor.total.remote([1, 2])
        await s.clusters["calc"].workers[0].actor.add.remote(1)
        return asyncio.get_running_loop().time() - t0

    spent = {}
    for lat in (0.0, 0.004):
        with rn.Session.sim({"cpu": 2}, call_latency_s=lat) as s:
            c = s.cluster("calc", Calc, pool="cpu")
            assert c.add(1) == [1]  # same results
            spent[lat] = s.run(timed(s))
    assert spent[0.0] == pytest.approx(0.0, abs=1e-6)
    assert spent[0.004] == pytest.approx(0.008, abs=1e-6)  # two calls, one round trip each
    with pytest.raises(ConfigError, match="call_latency_s"):
        SimSession({"cpu": 1}, call_latency_s=-1)


def test_a_batching_engine_holds_every_turn_for_its_wait():
    w = workload("gem-math")

    def turn_s(batch_wait_s: float) -> float:
        with SimSession({"H20": 1, "cpu": 1}) as s:
            gen = s.cluster("g", SimGenerator, pool="H20", model=spec("qwen3-8b"), batch_wait_s=batch_wait_s)
            req = rn.protocols.GenerationRequest("t", "math", [5] * w.prompt_tokens, max_new_tokens=8)

            async def one() -> float:
                t0 = asyncio.get_running_loop().time()
                await gen.workers[0].actor.generate.remote(req)
                return asyncio.get_running_loop().time() - t0

            return s.run(one())

    assert turn_s(0.005) == pytest.approx(turn_s(0.0) + 0.005, rel=1e-6)
    with pytest.raises(ClusterError, match="batch_wait_s must be >= 0"):
        with SimSession({"H20": 1, "cpu": 1}) as s:
            s.cluster("g", SimGenerator, pool="H20", model=spec("qwen3-8b"), batch_wait_s=-1)


def _cpu_host_run(mode: str, **host: object) -> tuple[float, float, float]:
    """Mean (step_s, rollout_wait, turns per step) of 3 steps of a small pipeline whose generator
    and trainer are the two devices of one CPU pool, on a SimSession with ``host`` settings."""
    from rollart_nb.resources.profiles import PROFILES, HardwareProfile
    from rollart_nb.sim import Workload

    name = "CPU-TEST-HOST"
    PROFILES[name] = HardwareProfile(name, "cpu", 0.5, 20.0, 64.0, 0.0, "general")
    m = spec("qwen3-0.6b")
    wl = Workload("math", "decode", (1, 2), 60, (10.0, 0.0), (20.0, 0.0), (0.001, 0.0), max_response_tokens=64)
    try:
        with SimSession({name: 2, "cpu": 2}, seed=0, **host) as s:  # type: ignore[arg-type]
            gen = s.cluster("g", SimGenerator, pool=name, model=m, response_tokens=response_tokens_fn({"math": wl}))
            train = s.cluster("t", SimTrainer, pool=name, model=m)
            tasks = s.tasks({"math": SimEnv(wl)}, envs_per_task=8)
            pipe = s.pipeline(train, gen, tasks, batch_size=8, group_size=4, mode=mode)
            pipe.run(1, progress=False)
            before = gen.stats()[0]["requests"]
            reps = pipe.run(3, progress=False)
            turns = (gen.stats()[0]["requests"] - before) / 3
            pipe.close()
    finally:
        PROFILES.pop(name, None)
    return (
        sum(r.step_s for r in reps) / 3,
        sum(r.phases["rollout_wait"] for r in reps) / 3,
        turns,
    )


def test_a_shared_host_slows_overlapped_work_only_when_it_has_too_few_cores():
    own = _cpu_host_run("one-off")
    assert _cpu_host_run("one-off", host_cores=2) == pytest.approx(own, rel=1e-9)  # a core each: no change
    one = _cpu_host_run("one-off", host_cores=1)
    assert one[0] > 1.2 * own[0]  # generation and the overlapped train step now share one core


def test_the_control_plane_cost_per_turn_bounds_the_rollout():
    base = _cpu_host_run("sync")
    step_s, rollout_wait, turns = _cpu_host_run("sync", turn_cpu_s=1.0)
    assert rollout_wait >= turns * 1.0 > base[1]  # every turn's control work, one turn at a time
    with pytest.raises(ConfigError, match="host_cores"):
        SimSession({"cpu": 1}, host_cores=0)
    with pytest.raises(ConfigError, match="turn_cpu_s"):
        rn.Session.sim({"cpu": 1}, turn_cpu_s=-1)
    with rn.Session.sim({"cpu": 1}, host_cores=3, turn_cpu_s=0.001) as s:
        assert s.clock.host.cores is not None and s.clock.host.cores.cores == 3 and s.clock.host.turn_cpu_s == 0.001


def test_state_is_a_str_enum_from_attached_to_closed():
    s = SimSession({"cpu": 1})
    assert s.state is rn.SessionState.ATTACHED and s.state == "attached" and f"{s.state}" == "attached"
    assert "attached" in repr(s)
    s.close()
    assert s.state is rn.SessionState.CLOSED and s.state == "closed"
    with pytest.raises(StateError, match=r"SimSession is closed; create a new one with SimSession\(pools=\.\.\.\)"):
        s.tasks({"math": rn.envs.Arithmetic()})


def test_pools_given_as_a_list_name_the_expected_shape():
    with pytest.raises(ConfigError, match=r"pools=\['H800'\] must map pool name -> slot count, e.g. \{'H800': 2"):
        SimSession(["H800"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="needs a positive integer count, got 1.5"):
        SimSession({"cpu": 1.5})  # type: ignore[dict-item]
