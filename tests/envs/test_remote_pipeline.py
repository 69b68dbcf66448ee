"""A code task trains through Session.local() with its envs on LocalLauncher replicas."""

import time

import pytest

from rollart_nb.envs import CodeTask, FrozenLake, LocalLauncher, RemoteEnv
from rollart_nb.errors import ConfigError
from rollart_nb.models import spec
from rollart_nb.workers.roles import SimGenerator, SimTrainer

M = spec("qwen3-0.6b")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait(cond, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_tasks_checks_launchers_and_replaces_them_on_a_rerun(local_session):
    sess = local_session
    lau = LocalLauncher(CodeTask, replicas=1, sandbox=False)
    with pytest.raises(ConfigError, match="the launcher serves CodeTask but the env given is FrozenLake"):
        sess.tasks({"lake": FrozenLake()}, launcher={"lake": lau})
    with pytest.raises(ConfigError, match="launcher for unknown task 'code'"):
        sess.tasks({"lake": FrozenLake()}, launcher={"code": lau})
    assert lau.state == "new"  # nothing started for a call that failed
    # a launcher can also stand in the envs mapping itself
    first = LocalLauncher("rollart_nb.envs:FrozenLake", {"size": 5}, replicas=1, sandbox=False)
    tasks = sess.tasks({"lake": first}, envs_per_task=2)
    assert tasks.envs["lake"].max_turns == FrozenLake(size=5).max_turns and first.started
    pid = first.replicas[0].pid
    second = LocalLauncher("rollart_nb.envs:FrozenLake", replicas=1, sandbox=False)
    sess.tasks({"lake": FrozenLake()}, launcher={"lake": second})  # a re-run cell: the old one stops
    assert first.state == "closed" and not _alive(pid) and second.started


def test_code_task_on_replicas_trains_and_survives_a_killed_replica(local_session):
    sess = local_session
    gen = sess.cluster("actor_gen", SimGenerator, pool="H20", model=M, time_scale=1e-4, mean_response_tokens=8)
    train = sess.cluster("actor_train", SimTrainer, pool="H800", model=M, time_scale=1e-4)
    lau = LocalLauncher(CodeTask, replicas=2, task="code", health_interval_s=0.3)  # replicas under bwrap
    tasks = sess.tasks({"code": CodeTask()}, envs_per_task=4, launcher={"code": lau})
    assert lau.started and len(lau.urls) == 2  # the session started it
    assert isinstance(tasks.envs["code"], RemoteEnv) and tasks.launchers == {"code": lau}
    assert tasks.validation_seeds()["code"] == CodeTask().validation_seeds()
    assert "on LocalLauncher" in repr(tasks)

    pipe = sess.pipeline(train, gen, tasks, batch_size=4, group_size=2, mode="rollart", name="remote")
    reps = pipe.run(2, progress=False)
    assert [r.batch_size for r in reps] == [4, 4] and all(0.0 <= r.reward["code"] <= 1.0 for r in reps)
    done = pipe.trajectories(task="code", status="completed", last=None)
    assert len(done) >= 8
    for t in done:
        # one step per CodeTask episode; the replica that served it is in the step's info
        assert t.info["replica"] in ("code-0", "code-1")
        assert [s["replica"] for s in t.info["step_info"]] == [t.info["replica"]]
        assert t.info["step_info"][0]["total"] == 3  # graded against the 3 hidden tests
    assert {t.info["replica"] for t in done} == {"code-0", "code-1"}  # spread over both replicas

    lau.kill(0)  # mid-run: rollouts in flight on the killed replica fail, training goes on
    reps = pipe.run(2, progress=False)
    assert [r.batch_size for r in reps] == [4, 4]
    later = pipe.trajectories(task="code", status="completed", last=None)
    done_ids = {t.id for t in done}
    assert len(later) >= 16 and sum(t.id not in done_ids for t in later) >= 4  # new batches formed
    failed = pipe.trajectories(task="code", status="failed", last=None)
    assert all("remote env" in t.reason for t in failed), [t.reason for t in failed]
    # the monitor replaced the killed replica, and new episodes reach it again
    assert _wait(lambda: lau.restarts == 1 and len(lau.urls) == 2)
    seen = {t.id for t in pipe.trajectories(task="code", last=None, include_running=True)}
    pipe.run(1, progress=False)

    def fresh_on_restarted():
        ts = pipe.trajectories(task="code", last=None, include_running=True)
        return any(t.id not in seen and t.info.get("replica") == "code-0" for t in ts)

    assert _wait(fresh_on_restarted)

    from rollart_nb.nb.viewer import trajectory_html

    html = trajectory_html(later[-1])
    assert f'class="rn-replica">{later[-1].info["replica"]}</code>' in html
    pipe.close()

    pids = [r.pid for r in lau.replicas]
    sess.close()  # stops the launcher too
    assert lau.state == "closed" and not any(_alive(p) for p in pids)
