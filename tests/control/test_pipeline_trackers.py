"""A pipeline feeds every step to its trackers; a tracker that fails is dropped, training goes on."""

from __future__ import annotations

import logging

import pytest

import rollart_nb as rn
from rollart_nb.envs import Arithmetic
from rollart_nb.errors import ConfigError
from rollart_nb.trackers import Tracker, step_scalars
from rollart_nb.workers.roles import SimGenerator, SimTrainer


class Recorder(Tracker):
    def __init__(self) -> None:
        self.config, self.steps, self.samples, self.closed = None, [], [], False

    def log_samples(self, step, rows):
        self.samples.append((step, rows))

    def start(self, config):
        self.config = config

    def log_step(self, report):
        self.steps.append((report.step, step_scalars(report)))

    def close(self):
        self.closed = True


class Broken(Tracker):
    calls = 0

    def log_step(self, report):
        self.calls += 1
        raise ConnectionError("tracking server unreachable")


@pytest.fixture(scope="module")
def sess():
    with rn.Session.local({"H800": 1, "H20": 1, "cpu": 2}, serverless=False) as s:
        yield s


def test_every_step_reaches_each_tracker_and_a_failing_one_is_dropped(sess, caplog):
    spec = rn.models.spec("qwen3-0.6b")
    gen = sess.cluster("actor_gen", SimGenerator, pool="H20", model=spec, time_scale=1e-4, mean_response_tokens=8)
    train = sess.cluster("actor_train", SimTrainer, pool="H800", model=spec, time_scale=1e-4)
    tasks = sess.tasks({"math": Arithmetic()}, envs_per_task=8)
    rec, broken = Recorder(), Broken()
    with pytest.raises(ConfigError, match="not a tracker"):
        sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, name="tr", trackers=[object()])
    pipe = sess.pipeline(
        train,
        gen,
        tasks,
        algo=rn.GRPO(group_size=4),
        batch_size=8,
        mode="sync",
        name="tr",
        trackers=[rec, broken],
        tracker_sample_every=2,
        tracker_sample_size=3,
    )
    with caplog.at_level(logging.WARNING, logger="rollart_nb.control.report"):
        pipe.run(3, progress=False)
    assert [s for s, _ in rec.steps] == [0, 1, 2]
    assert rec.steps[-1][1]["step/version"] == 3.0 and "reward/math" in rec.steps[-1][1]
    assert rec.config["mode"] == "sync" and rec.config["batch_size"] == 8 and rec.config["algo"] == "GRPO"
    assert rec.config["rollout"]["max_turns"] == pipe.config.rollout.max_turns  # the whole config
    # a table of the batch every 2nd step: trajectories of this step, from the batch trained on
    ((step, rows),) = rec.samples
    assert step == 1 and len(rows) == 3 and {r["task"] for r in rows} == {"math"}
    assert all(r["status"] == "completed" and r["max_version"] <= 1 and r["tokens"] > 0 for r in rows)
    # the sim decodes random ids; a one-token answer is just eos, so its text may be empty
    assert all(r["prompt"] and isinstance(r["response"], str) for r in rows)
    assert broken.calls == 1 and broken.failed  # dropped after its first failure, reported once
    assert sum("tracking server unreachable" in r.getMessage() for r in caplog.records) == 1
    pipe.close()
    assert rec.closed
    gen.close()
    train.close()
