"""Envs and rewards that hang or break must not take training down.

Scheduler-level tests run RolloutScheduler + LLMProxy + EnvManager in one event loop on the sim
backend (no Ray); the last test runs a Pipeline on a local Ray and reads its StepReports.
Hanging sync code blocks on an Event (like ``time.sleep(3600)``, but released at the end, so
no hung thread outlives its test in this process).
"""

import asyncio
import itertools
import re
import threading
import time

import pytest

from rollart_nb.config import PipelineConfig
from rollart_nb.control.env_manager import EnvManager, RolloutConfig
from rollart_nb.control.local import LocalGenerator, LocalHandle
from rollart_nb.control.proxy import GenTarget, LLMProxy
from rollart_nb.control.report import StepReport
from rollart_nb.control.reward import RewardDispatcher
from rollart_nb.control.scheduler import RolloutScheduler
from rollart_nb.control.shards import plan_rollout
from rollart_nb.envs import Arithmetic, WithFailures
from rollart_nb.envs.base import BlockingPool
from rollart_nb.models.spec import spec
from rollart_nb.resources.profiles import PROFILES
from rollart_nb.sim import SimBackend, SimTokenizer
from rollart_nb.trajectory import Status, Trajectory

M = spec("qwen3-0.6b")
# more hung calls than the loop's default executor has threads on any machine (min(32, cpus + 4))
MANY = 40


def make(
    envs,
    *,
    batch=8,
    group=4,
    alpha=1,
    redundancy=0,
    rewards=None,
    timeout=0.2,
    max_turns=2,
    mode="rollart",
    max_abandoned=1024,
    proxy_cls=LLMProxy,
):
    backends = [SimBackend(M, PROFILES["H20"], time_scale=1e-4, mean_response_tokens=8, name=f"g{i}") for i in range(2)]
    targets = [GenTarget(LocalHandle(LocalGenerator(b)), f"gen/{i}", "H20", "H20") for i, b in enumerate(backends)]
    cfg = PipelineConfig(
        batch_size=batch,
        alpha=alpha,
        mode=mode,
        redundancy=redundancy,
        rollout=RolloutConfig(
            max_turns=max_turns, max_new_tokens=8, env_timeout_s=timeout, max_abandoned_threads=max_abandoned
        ),
    )
    plan = plan_rollout(envs, cfg, group)
    s = RolloutScheduler(plan, SimTokenizer(), proxy_cls(targets, {}), rewards or RewardDispatcher())
    s.backends = backends  # a test bumping the version loads the weights first, as the pipeline does
    return s


class HangingStep:
    """A plain sync env (an Arithmetic inside) whose ``step`` blocks on every ``every``-th call,
    counted across all its copies."""

    _calls = itertools.count(1)
    _lock = threading.Lock()

    def __init__(self, release: threading.Event, every: int = 4) -> None:
        self.inner, self.release, self.every = Arithmetic(max_turns=2), release, every

    def __deepcopy__(self, memo):  # the Event is shared: one release ends every hang
        return HangingStep(self.release, self.every)

    def reset(self, seed=None):
        return self.inner.reset(seed)

    def step(self, action):
        with self._lock:
            n = next(self._calls)
        if n % self.every == 0:
            self.release.wait(3600)
        return self.inner.step(action)


@pytest.fixture
def release():
    ev = threading.Event()
    yield ev
    ev.set()  # the abandoned threads return and leave


def assert_accounted(s):
    acc = s.accounting()
    assert acc["unaccounted"] == 0, acc
    return acc


def test_many_hanging_sync_envs_do_not_stall_training(release):
    async def go():
        s = make({"math": [HangingStep(release) for _ in range(12)]})
        t0, batches = time.monotonic(), 0
        while s.stats()["env"]["timeouts"] < MANY or batches < 3:
            batch = await s.get_batch(8, timeout_s=30)  # training keeps getting batches
            assert len(batch) == 8 and all(t.status is Status.COMPLETED for t in batch)
            batches += 1
            assert_accounted(s)
            assert time.monotonic() - t0 < 60, s.stats()
        env = s.stats()["env"]
        failed = [t for t in s.ledger.ended if t.status is Status.FAILED]
        await s.close()
        return s, env, failed

    s, env, failed = asyncio.run(go())
    assert env["abandoned_threads"] >= MANY and env["timeouts"] >= MANY
    assert env["hung_threads"] >= MANY - 1 and env["threads"] <= env["thread_cap"] and not env["at_cap"]
    assert env["restarts"] == env["timeouts"]  # each timed-out env was replaced
    # the reasons name the env that hung, its call, task and manager -- never a healthy reset
    assert failed and all(
        re.search(
            r"HangingStep did not answer step within 0.2s.*\[env #\d+ \(task 'math', "
            r"HangingStep\), step of turn \d, trajectory \w+; env replaced\]",
            t.reason,
        )
        for t in failed
    ), failed[0].reason
    acc = assert_accounted(s)
    assert acc["running"] == acc["scoring"] == 0 and acc["failed"] == len(failed) >= MANY


def test_a_blocking_sync_reward_does_not_stall_rollout_or_blame_the_env(release):
    calls = itertools.count(1)

    def reward(traj):  # blocks on every third call
        if next(calls) % 3 == 0:
            release.wait(3600)
        return 1.0

    async def go():
        rw = RewardDispatcher()
        rw.set("math", reward, timeout_s=0.2, retries=0)
        s = make({"math": [Arithmetic() for _ in range(8)]}, rewards=rw, timeout=5.0)
        t0 = time.monotonic()
        while rw.timeouts < MANY:
            await s.get_batch(8, timeout_s=30)
            assert time.monotonic() - t0 < 60, s.stats()
        stats = s.stats()
        await s.close()
        return s, stats

    s, stats = asyncio.run(go())
    failed = [t for t in s.ledger.ended if t.status is Status.FAILED]
    assert stats["rewards"]["abandoned_threads"] >= MANY and stats["rewards"]["timeouts"] >= MANY
    assert stats["env"]["timeouts"] == stats["env"]["restarts"] == 0  # no env was blamed
    assert failed and all(
        re.match(
            r"reward: reward \S*reward v0 for task 'math' \(trajectory \w+\) failed after 1 "
            r"attempt\(s\): timed out after 0.2s",
            t.reason,
        )
        for t in failed
    ), failed[0].reason
    assert_accounted(s)


def test_hung_envs_at_the_thread_cap_are_reported_in_the_stall_error(release, caplog):
    from rollart_nb.errors import RolloutStalledError

    async def go():
        # every step hangs, and only 2 hung calls get a replacement thread
        s = make({"math": [HangingStep(release, every=1) for _ in range(4)]}, batch=4, group=4, max_abandoned=2)
        with pytest.raises(RolloutStalledError) as e:
            await s.wait_ready(4, timeout_s=60)
        env = s.stats()["env"]
        await s.close()
        return str(e.value), env

    msg, env = asyncio.run(go())
    # 4 threads (one per env) + 2 replacements, all hung: the pool stops there and says so
    assert env["at_cap"] and env["cap_hits"] >= 1 and env["hung_threads"] == env["thread_cap"] == 6
    assert "task 'math' all failed" in msg and "HangingStep did not answer step" in msg
    assert "env thread pool: 6 threads, 6 hung call(s) abandoned, cap 6 AT ITS CAP" in msg, msg
    assert re.search(r"\(on env #\d+(, env #\d+)*\)", msg), msg  # which managers it hit
    assert any("'env' is at its cap" in r.getMessage() for r in caplog.records)


def test_with_failures_envs_fail_at_their_own_rate_and_every_trajectory_is_accounted():
    async def go():
        envs = {
            "math": [
                WithFailures(Arithmetic(max_turns=2), p_raise=0.1, p_hang=0.1, hang_s=3600, seed=i) for i in range(8)
            ]
        }
        s = make(envs, redundancy=1, alpha=0)
        for v in range(1, 5):
            await s.get_batch(8, timeout_s=30)
            assert_accounted(s)
            for b in s.backends:
                b.load_weights({}, v)
            await s.set_version(v)
            assert_accounted(s)
        await s.close()
        return s

    s = asyncio.run(go())
    acc = assert_accounted(s)
    assert acc["running"] == acc["scoring"] == acc["pending_reward"] == 0
    assert acc["completed"] >= 32 and acc["failed"] >= 1 and acc["cancelled"] >= 1
    reasons = [t.reason for t in s.ledger.ended if t.status is Status.FAILED]
    assert any("injected failure in Arithmetic" in r for r in reasons)
    assert any("did not answer" in r for r in reasons)
    assert all("[env #" in r and "task 'math'" in r for r in reasons)


class FlakyProxy(LLMProxy):
    """A proxy with a bug: every 5th request raises something that is not a GenerationError."""

    n = 0

    async def generate(self, request):
        FlakyProxy.n += 1
        if FlakyProxy.n % 5 == 0:
            raise KeyError("routing table")
        return await super().generate(request)


def test_an_unexpected_error_fails_the_trajectory_and_its_group_is_refilled():
    async def go():
        s = make({"math": [Arithmetic() for _ in range(4)]}, batch=4, group=4, proxy_cls=FlakyProxy)
        for _ in range(3):  # before: the lost member left its group one short forever
            batch = await s.get_batch(4, timeout_s=30)
            assert len({t.group_id for t in batch}) == 1
        await s.close()
        return s

    s = asyncio.run(go())
    reasons = [t.reason for t in s.ledger.ended if t.status is Status.FAILED]
    assert reasons and all(r.startswith("rollout error: KeyError: 'routing table' [env #") for r in reasons)
    assert assert_accounted(s)["failed"] == len(reasons)


def test_a_cancel_during_a_blocking_step_replaces_the_env(release):
    async def go():
        pool = BlockingPool("env", size=1)
        s = make({"math": [Arithmetic()]}, batch=4, group=4)
        m = EnvManager(0, "math", HangingStep(release, every=1), s.tok, s.proxy, s.config.rollout, pool=pool)
        old = m.env
        task = asyncio.ensure_future(m.run(Trajectory("math", seed=0, group_id="g")))
        while not pool.stats()["busy"]:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await s.close()
        return m, old, pool

    m, old, pool = asyncio.run(go())
    assert m.env is not old and m.restarts == 1 and m.abandoned == 1 and pool.stats()["hung"] == 1
    assert m.timeouts == 0  # a cancel is not a timeout


def test_step_report_env_faults_round_trip():
    rep = StepReport(step=0, version=0, mode="rollart", env={"restarts": 2, "timeouts": 1, "abandoned_threads": 1})
    back = StepReport.from_dict(rep.to_dict())
    assert back == rep and back.row()["env_restarts"] == 2 and "env restarts: 2" in rep._repr_html_()
    assert StepReport.from_dict({k: v for k, v in rep.to_dict().items() if k != "env"}).env == {}  # old lines


def test_dashboard_line_and_figure_show_env_faults():
    from rollart_nb.nb import figures

    reps = [
        StepReport(
            step=i,
            version=i,
            mode="rollart",
            counts={"failed": i},
            env={"restarts": i, "timeouts": i, "abandoned_threads": 1},
        )
        for i in range(3)
    ]
    assert figures.env_faults_line(reps) == "env faults: 3 restarts, 3 timeouts, 3 abandoned threads"
    assert figures.env_faults_line(reps[:1][:0]) == ""
    fig = figures.failures_figure(reps)
    assert [t.name for t in fig.data] == [
        "trajectories failed",
        "env restarts",
        "env timeouts",
        "env abandoned threads",
    ]
    assert list(fig.data[1].y) == [0, 1, 2]


# -- the same through a Pipeline on a local Ray ------------------------------------------------
def test_pipeline_reports_env_faults_per_step_and_accounts_for_every_trajectory(local_session):
    from rollart_nb.workers.roles import SimGenerator, SimTrainer

    class SleepyStep:  # defined here so cloudpickle ships it to the rollout actor by value
        n = 0

        def __init__(self):
            self.inner = Arithmetic(max_turns=2)

        def reset(self, seed=None):
            return self.inner.reset(seed)

        def step(self, action):
            SleepyStep.n += 1
            if SleepyStep.n % 4 == 0:
                time.sleep(3600)  # a daemon thread of the rollout actor; gone when the pipeline closes
            return self.inner.step(action)

    sess = local_session
    gen = sess.cluster(
        "actor_gen", SimGenerator, pool="H20", replicas=1, model=M, time_scale=1e-4, mean_response_tokens=8
    )
    train = sess.cluster("actor_train", SimTrainer, pool="H800", model=M, time_scale=1e-4)
    tasks = sess.tasks({"math": SleepyStep()}, envs_per_task=8)
    pipe = sess.pipeline(
        train,
        gen,
        tasks,
        batch_size=8,
        group_size=4,
        name="faults",
        rollout=RolloutConfig(max_turns=2, max_new_tokens=8, env_timeout_s=0.3),
    )
    try:
        reps = pipe.run(4, progress=False)
        stats = pipe.stats()
    finally:
        pipe.close()
    assert [r.batch_size for r in reps] == [8] * 4
    timeouts, abandoned = (sum(r.env[k] for r in reps) for k in ("timeouts", "abandoned_threads"))
    # every hang times out, is abandoned and its env replaced; a stale abort mid-hang abandons one too
    assert 1 <= timeouts <= abandoned and sum(r.env["restarts"] for r in reps) >= timeouts
    assert stats["env"]["timeouts"] >= timeouts and stats["accounting"]["unaccounted"] == 0
    assert any("SleepyStep did not answer step" in reason for r in reps for rs in r.failures.values() for reason in rs)


def test_a_step_that_validated_shows_in_a_notebook_and_its_task_counts_round_trip():
    rep = StepReport(step=3, version=4, mode="rollart", task_counts={"math": {"aborted_stale": 2, "penalized": 1}})
    rep.phases["validation"] = 1.5
    assert "validation 1.50s" in rep._repr_html_()
    back = StepReport.from_dict(rep.to_dict())
    assert back.task_counts == rep.task_counts and back.row()["aborted/math"] == 2
    assert StepReport.from_dict({k: v for k, v in rep.to_dict().items() if k != "task_counts"}).task_counts == {}
