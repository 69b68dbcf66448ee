"""Live means live: env and reward code can be debugged while a run is live.

Their ``print`` and ``logging`` reach ``sess.logs()``; their exceptions carry the user's file and
line; ``rn.envs.check`` (and ``sess.tasks``) catch a broken env before any trajectory runs; a
task whose every trajectory fails with one error stops the run early with that traceback.
"""

from __future__ import annotations

import inspect
import logging
import time

import pytest

import rollart_nb as rn
from rollart_nb.envs import Arithmetic, FrozenLake, WithFailures
from rollart_nb.errors import EnvError, RewardError, RolloutStalledError
from rollart_nb.logs import read_logs, user_traceback
from rollart_nb.workers.roles import SimGenerator, SimTrainer

M = rn.models.spec("qwen3-0.6b")
HERE = __file__


class Chatty(Arithmetic):
    """Arithmetic that prints and logs from its env code."""

    def reset(self, seed=None):
        print(f"chatty-print reset {seed}")
        logging.getLogger("my_env").info("chatty-logging reset %s", seed)
        return super().reset(seed)


class BrokenStep(Arithmetic):
    """An env with a typo in step: a NameError on every step."""

    def step(self, action):
        return undefined_name  # noqa: F821  # the bug under test


class RaisesInStep(Arithmetic):
    def step(self, action):
        raise ValueError("the env cannot parse this")  # RAISE-LINE


def _line_of(marker: str) -> int:
    lines = inspect.getsource(inspect.getmodule(_line_of)).splitlines()
    return next(i for i, ln in enumerate(lines, 1) if marker in ln and "next(" not in ln)


@pytest.fixture(scope="module")
def sess():
    with rn.Session.local({"H800": 1, "H20": 1, "cpu": 2}, serverless=False) as s:
        yield s


@pytest.fixture(scope="module")
def workers(sess):
    gen = sess.cluster("actor_gen", SimGenerator, pool="H20", model=M, time_scale=1e-4, mean_response_tokens=8)
    train = sess.cluster("actor_train", SimTrainer, pool="H800", model=M, time_scale=1e-4)
    return train, gen


# -- rn.envs.check --------------------------------------------------------------------------
def test_check_passes_the_built_in_envs_quickly():
    for env in (Arithmetic(), FrozenLake(), FrozenLake(size=6, is_slippery=True)):
        t0 = time.monotonic()
        report = rn.envs.check(env, task="t", reward=lambda traj: 1.0)
        assert time.monotonic() - t0 < 1.0
        assert report.episodes == 4 and report.steps >= 4 and report.rewards == [1.0] * 4 and not report.skipped
        assert "episodes" in repr(report)


def test_check_does_not_touch_the_env_given():
    env = Arithmetic()
    rn.envs.check(env)
    assert env._answer is None  # the check ran on a copy


def test_check_names_the_users_file_and_line_of_a_name_error():
    with pytest.raises(EnvError) as e:
        rn.envs.check(BrokenStep(), task="math")
    msg = str(e.value)
    line = _line_of("return undefined_name")
    assert "task 'math'" in msg and "NameError" in msg and "undefined_name" in msg
    assert f'File "{HERE}", line {line}, in step' in msg
    assert "rollart_nb/envs/check.py" not in msg  # the library's frames are trimmed


def test_check_scores_with_the_reward_and_reports_a_broken_one():
    def bad_reward(traj):
        return traj.turns[0].nope  # REWARD-LINE

    with pytest.raises(RewardError) as e:
        rn.envs.check(Arithmetic(), reward=bad_reward)
    assert "AttributeError" in str(e.value) and f'"{HERE}", line {_line_of("REWARD-LINE")}' in str(e.value)
    with pytest.raises(RewardError, match="not a finite number"):
        rn.envs.check(Arithmetic(), reward=lambda traj: float("nan"))


def test_check_notes_an_envs_own_env_errors_and_stops_a_hung_env_within_its_budget():
    report = rn.envs.check(WithFailures(Arithmetic(), p_raise=1.0))
    assert report.episodes == 4 and report.steps == 0 and all("injected failure" in s for s in report.skipped)

    class Hangs(Arithmetic):
        def step(self, action):
            time.sleep(3600)  # a daemon thread of the check: abandoned

    t0 = time.monotonic()
    report = rn.envs.check(Hangs(), budget_s=0.3)
    assert time.monotonic() - t0 < 1.0 and "budget" in report.skipped[-1]


def test_check_refuses_a_protocol_violation():
    class NoInfo(Arithmetic):
        def reset(self, seed=None):
            return "obs"

    with pytest.raises(EnvError, match=r"expected \(obs, info\)"):
        rn.envs.check(NoInfo())


def test_user_traceback_drops_library_frames_and_is_bounded():
    try:
        rn.envs.check(RaisesInStep())
    except EnvError as e:
        tb = user_traceback(e.__cause__)
    assert tb.startswith("Traceback (user code") and f"line {_line_of('RAISE-LINE')}" in tb
    assert "rollart_nb" not in tb.replace(HERE, "") and "threading" not in tb
    try:
        raise ValueError("x" * 10_000)
    except ValueError as e:
        assert len(user_traceback(e, limit_chars=1500)) < 1700


# -- through a session ---------------------------------------------------------------------
def test_sess_tasks_refuses_a_broken_env_unless_told_not_to_check(sess):
    with pytest.raises(EnvError, match=r"NameError[\s\S]*line \d+, in step"):
        sess.tasks({"math": BrokenStep()})
    tasks = sess.tasks({"math": BrokenStep()}, check=False)
    assert list(tasks.envs) == ["math"]
    sess.tasks({"math": Arithmetic(), "lake": FrozenLake()})  # the built-in envs pass


def test_env_print_and_logging_reach_sess_logs(sess, workers):
    train, gen = workers
    tasks = sess.tasks({"math": Chatty()}, envs_per_task=2)
    pipe = sess.pipeline(train, gen, tasks, batch_size=4, group_size=4, mode="sync", name="chatty")
    try:
        pipe.run(1, progress=False)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            logs = sess.logs("chatty.rollout", last=200)
            if "chatty-print reset" in logs and "chatty-logging reset" in logs:
                break
            time.sleep(0.2)
    finally:
        pipe.close()
    assert "chatty-print reset" in logs and "chatty-logging reset" in logs
    assert "STDOUT chatty-print" in logs and "INFO my_env: chatty-logging" in logs
    assert len(sess.logs("chatty.rollout", last=3).splitlines()) == 3
    everything = sess.logs(last=500)
    assert "chatty-print reset" in everything and "[" in everything  # lines say their worker
    assert repr(logs) == str(logs)  # a cell shows the text as is
    assert read_logs(sess.log_dir, "no-such-worker") == ""


def test_env_exception_reason_names_the_users_file_and_line_and_the_run_stops_early(sess, workers):
    train, gen = workers
    tasks = sess.tasks({"math": RaisesInStep()}, envs_per_task=4, check=False)
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, mode="sync", name="broken")
    t0 = time.monotonic()
    try:
        with pytest.raises(RolloutStalledError) as e:
            pipe.run(1, progress=False)
        took = time.monotonic() - t0
        stats = pipe.stats()
    finally:
        pipe.close()
    msg = str(e.value)
    assert "all failed with the same error" in msg and "stopping early" in msg
    assert f'File "{HERE}", line {_line_of("RAISE-LINE")}, in step' in msg
    assert "ValueError: the env cannot parse this" in msg
    # well before the slow stall rule (16+ failures here): a group's worth, plus those in flight
    assert took < 20
    assert 4 <= stats["counts"]["failed"] <= 4 + 4 and stats["accounting"]["unaccounted"] == 0
    reasons = [r for _, r in stats["failures"]]
    assert reasons and all(f"line {_line_of('RAISE-LINE')}" in r and "env: " in r for r in reasons)
    # the rollout worker's log has the failure too
    assert "the env cannot parse this" in sess.logs("broken.rollout", last=200)


def test_a_reward_that_always_raises_stops_the_run_early_with_its_traceback(sess, workers):
    train, gen = workers

    def typo_reward(traj):
        return traj.reward_of_turn  # REWARD-TYPO

    tasks = sess.tasks({"math": Arithmetic()}, envs_per_task=2)
    sess.reward("math", typo_reward, retries=0)
    pipe = sess.pipeline(train, gen, tasks, batch_size=4, group_size=4, mode="sync", name="badreward")
    try:
        with pytest.raises(RolloutStalledError) as e:
            pipe.run(1, progress=False)
        stats = pipe.stats()
    finally:
        pipe.close()
        sess.reward("math", lambda traj: 0.0)
    msg = str(e.value)
    assert "stopping early" in msg and "AttributeError" in msg
    assert f'"{HERE}", line {_line_of("REWARD-TYPO")}, in typo_reward' in msg
    assert stats["counts"]["failed"] <= 4 + 2


class Talker(rn.Worker):
    """A worker whose own code prints and logs."""

    @rn.register("one")
    def say(self, text: str) -> str:
        print(f"talker-print {text}")
        logging.getLogger("my_worker").info("talker-logging %s", text)
        return text


def test_a_workers_print_and_logging_reach_sess_logs(sess):
    talker = sess.cluster("talker", Talker, pool="cpu")
    assert talker.say("hello") == "hello"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = str(sess.logs("talker", last=50))
        if "talker-print hello" in text and "talker-logging hello" in text:
            break
        time.sleep(0.2)
    assert "talker-print hello" in text and "talker-logging hello" in text, text
    sess.close_cluster("talker")
