"""Synthetic StepReports and Trajectories for the notebook-layer tests; a real Pipeline on a SimSession."""

from __future__ import annotations

import pytest

from rollart_nb.control.report import StepReport
from rollart_nb.trajectory import Status, Trajectory, TrajectoryList, Turn

T0 = 1_700_000_000.0


def make_report(step: int, *, mode: str = "rollart", reward: dict | None = None, **kw) -> StepReport:
    rep = StepReport(
        step=step,
        version=step,
        mode=mode,
        step_s=2.0,
        started_at=T0 + 10 * step,
        train_s=0.5,
        batch_size=8,
        tokens=800,
        throughput=400.0 + step,
        reward=reward or {"math": 0.1 * step, "fl": 0.5},
        staleness={0: 6, 1: 2},
        counts={"completed": 8, "aborted_stale": step},
    )
    rep.phases.update(rollout_wait=1.5, suspend=0.1, update=0.2, resume=0.05, train=0.15)
    for k, v in kw.items():
        setattr(rep, k, v)
    return rep


def make_trajectory(
    i: int,
    *,
    task: str = "math",
    status: Status = Status.COMPLETED,
    reward: float = 1.0,
    versions: tuple[int, ...] = (0, 0),
    reason: str = "",
    worker: str = "actor_gen/0",
) -> Trajectory:
    turns = [
        Turn(
            observation=f"obs {i}.{k}",
            action=f"act {i}.{k}",
            prompt_ids=[1, 2, 3],
            response_ids=[10, 11, 12],
            logprobs=[-0.1, -2.0, -5.0],
            loss_mask=[1, 1, 0],
            version=v,
            env_reward=0.0,
            timings={"t": T0 + i + k, "generate": 0.4, "env": 0.01},
            worker=worker,
        )
        for k, v in enumerate(versions)
    ]
    return Trajectory(
        task=task,
        seed=100 + i,
        group_id=f"g{i // 2}",
        id=f"traj{i:03d}",
        turns=turns,
        start_version=versions[0],
        status=status,
        reason=reason,
        reward=reward,
        reward_version=0,
        info={"answer": "3"},
        created_s=T0 + i,
        finished_s=T0 + i + 1,
    )


@pytest.fixture
def synth():
    """The factories, for tests that need their own variations."""
    return {"report": make_report, "trajectory": make_trajectory, "fake_pipeline": FakePipeline, "T0": T0}


@pytest.fixture
def trajectories() -> TrajectoryList:
    items = [
        make_trajectory(0, reward=1.0),
        make_trajectory(1, reward=0.0, versions=(0, 1, 1)),
        make_trajectory(
            2,
            task="fl",
            status=Status.FAILED,
            reward=float("nan"),
            reason="EnvError: injected failure",
            worker="actor_gen/1",
        ),
        make_trajectory(
            3,
            task="fl",
            status=Status.ABORTED_STALE,
            reward=float("nan"),
            versions=(0, 0, 0),
            reason="stale: started at v0, now v2",
        ),
        make_trajectory(4, task="math", reward=0.5, versions=(1, 2)),
    ]
    return TrajectoryList(items)


class FakePipeline:
    """The slice of Pipeline's public API the dashboard and viewer use."""

    def __init__(self, trajectories=(), reports=()):
        self.reports = list(reports)
        self.items = list(trajectories)
        self.state = "idle"
        self.error = None
        self.calls: list[tuple] = []
        self.history = [{"task": "math", "version": 0, "created": 0.0}]

    def trajectories(self, task=None, status=None, last=200, include_running=False):
        self.calls.append(("trajectories", task, status, last))
        out = [
            t for t in self.items if (task is None or t.task == task) and (status is None or t.status.value == status)
        ]
        return TrajectoryList(
            out[-last:] if last else out,
            source=self,
            filters={"task": task, "status": status, "last": last, "include_running": include_running},
        )

    def reward_history(self):
        return list(self.history)

    def step(self):
        self.calls.append(("step",))
        rep = make_report(len(self.reports))
        self.reports.append(rep)
        return rep

    def run(self, steps, *, background=False, progress=True, on_step=None):
        self.calls.append(("run", steps, background, progress))
        for _ in range(steps):
            rep = self.step()
            if on_step is not None:
                on_step(rep)

    def pause(self):
        self.calls.append(("pause",))

    def wait(self, timeout=None):
        self.calls.append(("wait",))


@pytest.fixture
def sim_pipeline():
    """A real Pipeline on an in-process SimSession (no Ray): steps take milliseconds."""
    import rollart_nb as rn
    from rollart_nb.models import spec
    from rollart_nb.sim import SimEnv
    from rollart_nb.workers import SimGenerator, SimTrainer

    sess = rn.Session.sim({"H800": 2, "H20": 2, "cpu": 2}, seed=1)
    m = spec("qwen3-0.6b")
    gen = sess.cluster("actor_gen", SimGenerator, pool="H20", model=m)
    train = sess.cluster("actor_train", SimTrainer, pool="H800", model=m)
    tasks = sess.tasks({"math": SimEnv("gem-math"), "lake": SimEnv("frozenlake")}, envs_per_task=4)
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4)
    yield sess, pipe
    sess.close()
