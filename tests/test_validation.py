"""Bad config values are refused at once with a ConfigError that names the field and the value;
valid edge values still pass. The dataclasses need no Ray; sess.reward / sess.pipeline use one
local session with sim workers."""

from __future__ import annotations

import math

import numpy as np
import pytest

import rollart_nb as rn
from rollart_nb.control.env_manager import RolloutConfig
from rollart_nb.control.modes import MODES
from rollart_nb.control.reward import RewardDispatcher
from rollart_nb.control.shards import plan_rollout
from rollart_nb.envs import Arithmetic
from rollart_nb.envs.code import CodeTask
from rollart_nb.errors import ConfigError, RollartError
from rollart_nb.models import ModelSpec
from rollart_nb.sandbox.run import _check_args
from rollart_nb.serverless.client import Endpoint
from rollart_nb.workers.roles import SimGenerator, SimTrainer

NAN, INF = math.nan, math.inf


def refused(make, field: str, value, **kwargs) -> ConfigError:
    """``make(**{field: value}, **kwargs)`` raises a ConfigError naming ``field`` and ``value``."""
    with pytest.raises(ConfigError) as ei:
        make(**{field: value}, **kwargs)
    msg = str(ei.value)
    assert isinstance(ei.value, RollartError)
    assert field in msg and repr(value) in msg, msg
    return ei.value


# -- ModelSpec ---------------------------------------------------------------------------------
DENSE = {
    "name": "dense-1b",
    "params": 1e9,
    "active_params": 1e9,
    "layers": 16,
    "hidden": 2048,
    "kv_heads": 8,
    "head_dim": 64,
}


def model_spec(**kw):
    return ModelSpec(**{**DENSE, **kw})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("params", -1),
        ("params", 0),
        ("params", NAN),
        ("params", INF),
        ("params", "1e9"),
        ("active_params", 0),
        ("active_params", 2e9),
        ("layers", 0),
        ("layers", 2.5),
        ("layers", True),
        ("hidden", -5),
        ("kv_heads", 0),
        ("head_dim", 0),
        ("bytes_per_param", 0),
        ("bytes_per_param", -2),
        ("name", ""),
        ("name", None),
    ],
)
def test_model_spec_refuses_bad_sizes(field, value):
    refused(model_spec, field, value)


def test_model_spec_reports_every_problem_at_once():
    with pytest.raises(ConfigError) as ei:
        model_spec(params=-1, layers=0, hidden=-5)
    assert len(ei.value.problems) == 3


def test_model_spec_valid_edges():
    moe = model_spec(active_params=1e8)
    assert moe.moe and not model_spec().moe
    assert (
        model_spec(
            params=600_000_000, active_params=600_000_000, layers=1, kv_heads=1, head_dim=1, bytes_per_param=1
        ).kv_bytes_per_token
        == 2
    )
    assert model_spec(layers=np.int64(4), params=np.float64(1e9)).layers == 4
    assert all(s.params > 0 for s in rn.models.SPECS.values())  # the shipped specs pass


# -- RolloutConfig -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_turns", 0),
        ("max_turns", 1.5),
        ("max_turns", True),
        ("max_new_tokens", 0),
        ("max_new_tokens", -3),
        ("max_context", 8),
        ("max_context", 0),
        ("temperature", -1),
        ("temperature", NAN),
        ("temperature", INF),
        ("temperature", "hot"),
        ("env_timeout_s", 0),
        ("env_timeout_s", -1),
        ("env_timeout_s", INF),
        ("env_timeout_s", "60"),
        ("max_abandoned_threads", -1),
        ("user_tag", None),
    ],
)
def test_rollout_config_refuses_bad_values(field, value):
    refused(RolloutConfig, field, value)


def test_rollout_config_reports_every_problem_at_once():
    with pytest.raises(ConfigError) as ei:
        RolloutConfig(max_turns=0, temperature=-1, env_timeout_s=0)
    assert len(ei.value.problems) == 3


def test_rollout_config_valid_edges():
    cfg = RolloutConfig(
        max_turns=1,
        max_new_tokens=1,
        max_context=1,
        temperature=0,
        env_timeout_s=None,
        max_abandoned_threads=0,
        user_tag="",
        assistant_tag="",
    )
    assert cfg.temperature == 0 and cfg.env_timeout_s is None
    assert RolloutConfig(env_timeout_s=0.01, temperature=2.5).env_timeout_s == 0.01


# -- CodeTask ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout_s", -1),
        ("timeout_s", 0),
        ("timeout_s", NAN),
        ("timeout_s", INF),
        ("timeout_s", 86_401),
        ("timeout_s", True),
        ("timeout_s", "5"),
        ("memory_mb", 0),
        ("memory_mb", 31),
        ("memory_mb", 64.5),
        ("memory_mb", True),
        ("memory_mb", 2**21),
        ("isolation", "chroot"),
        ("problems", ()),
    ],
)
def test_code_task_refuses_bad_values(field, value):
    refused(CodeTask, field, value)


def test_code_task_limits_are_the_sandboxes():
    for timeout_s, memory_mb in ((86_400, 32), (0.5, 2**20)):  # accepted by both
        env = CodeTask(timeout_s=timeout_s, memory_mb=memory_mb, isolation="none")
        assert (env.timeout_s, env.memory_mb) == (timeout_s, memory_mb)
        _check_args(timeout_s, memory_mb, "none")
    for timeout_s, memory_mb in ((86_401, 32), (5, 31), (5, 2**20 + 1)):  # refused by both
        with pytest.raises(ConfigError):
            _check_args(timeout_s, memory_mb, "none")
        with pytest.raises(ConfigError):
            CodeTask(timeout_s=timeout_s, memory_mb=memory_mb)


# -- the rollout plan (every pipeline path builds one from its PipelineConfig) ---------------------
def rollout_plan(batch_size=8, group_size=4, mode="rollart", **kw):
    envs = {"math": [Arithmetic()], "other": [Arithmetic()]}
    return plan_rollout(envs, rn.PipelineConfig(batch_size=batch_size, mode=mode), group_size, **kw)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("alpha", 0.5),
        ("alpha", -1),
        ("alpha", True),
        ("alpha", "1"),
        ("batch_size", 0),
        ("batch_size", 8.0),
        ("mode", "async"),
        ("mode", 3),
        ("redundancy", -1),
        ("max_group_failures", 0),
        ("max_group_failures", 2.5),
    ],
)
def test_the_loop_settings_the_scheduler_reads_are_checked_in_the_config(field, value):
    refused(rn.PipelineConfig, field, value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("batch_size", 6),
        ("group_size", 0),
        ("group_size", 2.0),
        ("seed", None),
        ("seed", 1.5),
        ("task_weights", {"math": NAN}),
        ("task_weights", {"math": -1.0}),
        ("task_weights", {"math": 0.0}),
        ("task_weights", [1.0]),
        ("curricula", [1]),
    ],
)
def test_the_plan_refuses_what_only_the_algorithm_and_tasks_decide(field, value):
    refused(rollout_plan, field, value)


def test_the_plan_suggests_the_mode_and_batch_size_and_reports_every_problem():
    with pytest.raises(ConfigError, match=r"did you mean 'rollart'"):
        rollout_plan(mode="rolart")
    with pytest.raises(ConfigError, match=r"batch_size=8 or 12"):
        rollout_plan(batch_size=10)
    with pytest.raises(ConfigError) as ei:
        rollout_plan(group_size=0, seed=None, task_weights={"math": -1.0})
    assert len(ei.value.problems) == 3
    with pytest.raises(ConfigError, match="no environments"):
        plan_rollout({"math": []}, rn.PipelineConfig(batch_size=4), 4)


def test_the_plan_valid_edges():
    plan = rollout_plan(batch_size=4, mode="sync", seed=-3, task_weights={"math": 1.0, "other": 0})
    assert plan.mode is MODES["sync"] and plan.alpha == plan.config.alpha == 1
    assert plan.batch_groups == 1 and plan.quota == {"math": 1, "other": 0} and plan.seed == -3
    assert rollout_plan(batch_size=np.int64(8), mode=MODES["areal"], task_weights={}).batch_groups == 2
    assert rn.PipelineConfig(max_group_failures=1, alpha=0, redundancy=0).max_group_failures == 1


# -- RewardDispatcher.set ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("fn", 3),
        ("fn", "exact"),
        ("timeout_s", 0),
        ("timeout_s", NAN),
        ("retries", -1),
        ("retries", True),
        ("validate_with", "exact"),
        ("endpoint", "http://127.0.0.1:1/score"),
    ],
)
def test_reward_dispatcher_refuses_bad_arguments(field, value):
    d = RewardDispatcher()
    base = {} if field in ("fn", "endpoint") else {"fn": len}
    refused(lambda **kw: d.set("math", **kw), field, value, **base)
    assert not d.current and not d.validators  # nothing registered


def test_reward_dispatcher_valid_edges():
    d = RewardDispatcher()
    assert d.set("math", len, timeout_s=0.01, retries=0).version == 0
    assert d.set("math", endpoint=Endpoint("ep", "http://127.0.0.1:1/score")).version == 1


# -- sess.reward / sess.pipeline --------------------------------------------------------------
@pytest.fixture(scope="module")
def parts():
    sess = rn.Session.local({"H800": 1, "H20": 1, "cpu": 2}, serverless=False)
    m = rn.models.spec("qwen3-0.6b")
    gen = sess.cluster("actor_gen", SimGenerator, pool="H20", model=m, time_scale=1e-4, mean_response_tokens=4)
    train = sess.cluster("actor_train", SimTrainer, pool="H800", model=m, time_scale=1e-4)
    yield sess, train, gen
    sess.close()


@pytest.mark.parametrize(
    ("field", "value", "kwargs"),
    [
        ("fn", 42, {}),
        ("fn", "exact_answer", {}),
        ("fn", "http://127.0.0.1:1/score", {}),
        ("timeout_s", 0, {"fn": len}),
        ("timeout_s", -1.0, {"fn": len}),
        ("retries", -1, {"fn": len}),
        ("validate_with", "exact", {"fn": len}),
        ("task", "", {"fn": len}),
    ],
)
def test_session_reward_refuses_bad_arguments_at_once(parts, field, value, kwargs):
    sess, _, _ = parts
    others = {k: v for k, v in {"task": "math", **kwargs}.items() if k != field}
    e = refused(lambda **kw: sess.reward(kw.pop("task"), **kw), field, value, **others)
    assert not sess._rewards, sess._rewards  # nothing registered
    if value == "http://127.0.0.1:1/score":
        assert "url=" in str(e)


def test_session_reward_refuses_serve_options_without_serverless(parts):
    sess, _, _ = parts
    with pytest.raises(ConfigError, match=r"min_replicas: options of serverless=True only"):
        sess.reward("math", len, min_replicas=1)
    assert not sess._rewards


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"alpha": 0.5}, "alpha=0.5"),
        ({"alpha": True}, "alpha=True"),
        ({"alpha": -1}, "alpha=-1"),
        ({"batch_size": 6, "group_size": 4}, "batch_size=6"),
        ({"group_size": 0}, "group_size=0"),
        ({"mode": "rolart"}, "'rolart'"),
        ({"redundancy": -2}, "redundancy=-2"),
        ({"rollout": RolloutConfig(temperature=0)}, None),
    ],
)
def test_session_pipeline_checks_its_arguments(parts, kwargs, shown):
    sess, train, gen = parts
    tasks = sess.tasks({"math": Arithmetic()}, envs_per_task=2)
    args = {"batch_size": 4, "group_size": 4, "mode": "sync", "name": "v", **kwargs}
    if shown is None:  # valid edge values: alpha=0, temperature=0
        sess.pipeline(train, gen, tasks, alpha=0, **args).close()
        return
    with pytest.raises(ConfigError) as ei:
        sess.pipeline(train, gen, tasks, **args)
    assert shown in str(ei.value), str(ei.value)


def _sim_parts() -> tuple[rn.SimSession, object, object]:
    sess = rn.SimSession({"H800": 1, "H20": 1, "cpu": 2})
    m = rn.models.spec("qwen3-0.6b")
    gen = sess.cluster("actor_gen", SimGenerator, pool="H20", model=m, mean_response_tokens=4)
    return sess, sess.cluster("actor_train", SimTrainer, pool="H800", model=m), gen


def test_a_reward_for_an_unknown_task_is_refused_at_pipeline_time():
    sess, train, gen = _sim_parts()  # a fresh session: it knows no task yet
    with sess:
        sess.reward("mth", lambda t: 1.0)  # a typo: accepted here, the tasks are not known yet
        tasks = sess.tasks({"math": Arithmetic(), "count": Arithmetic()}, envs_per_task=2)
        with pytest.raises(ConfigError, match="TaskSet"):
            sess.pipeline(train, gen, {"math": Arithmetic()}, batch_size=4, group_size=4, name="u")
        with pytest.raises(ConfigError) as ei:
            sess.pipeline(train, gen, tasks, batch_size=4, group_size=4, mode="sync", name="u")
        msg = str(ei.value)
        assert "'mth'" in msg and "['count', 'math']" in msg and "did you mean 'math'?" in msg, msg
        # the bad registration was dropped: with the name fixed, the same call works
        sess.reward("math", lambda t: 1.0)
        pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, mode="sync", name="u")
        assert pipe.step().reward["math"] == 1.0
        pipe.close()
        # a reward for a task of an earlier pipeline is kept for a pipeline that leaves that task out
        only_count = sess.tasks({"count": Arithmetic()}, envs_per_task=2)
        sess.pipeline(train, gen, only_count, batch_size=4, group_size=4, mode="sync", name="u").close()
        assert "math" in sess._rewards


def test_a_reward_for_a_task_the_session_does_not_know_is_refused_at_once():
    sess, _, _ = _sim_parts()
    with sess:
        sess.tasks({"math": Arithmetic(), "count": Arithmetic()}, envs_per_task=2)
        with pytest.raises(ConfigError) as ei:
            sess.reward("mth", lambda t: 1.0)
        msg = str(ei.value)
        assert "task 'mth' is in no TaskSet" in msg and "['count', 'math']" in msg, msg
        assert "did you mean 'math'?" in msg and "sess.tasks({'mth': env})" in msg, msg
        assert not sess._rewards  # nothing registered
        sess.reward("count", lambda t: 0.0)  # a known task is taken
        assert "count" in sess._rewards


def test_swapped_trainer_and_generator_name_the_order():
    sess, train, gen = _sim_parts()
    with sess:
        tasks = sess.tasks({"math": Arithmetic()}, envs_per_task=2)
        with pytest.raises(ConfigError) as ei:
            sess.pipeline(gen, train, tasks, batch_size=4, group_size=4, mode="sync")
        msg = str(ei.value)
        assert "the order is sess.pipeline(train, gen, tasks)" in msg, msg
        assert "'actor_gen'" in msg and "generator cluster" in msg and "trainer one" in msg, msg
        assert "sess.pipeline(actor_train, actor_gen, tasks, ...)" in msg, msg
        assert not sess.runtime.pipelines  # nothing was built


def test_a_bad_value_leaves_the_running_pipeline_of_that_name_open(parts):
    sess, train, gen = parts
    tasks = sess.tasks({"math": Arithmetic()}, envs_per_task=2)
    pipe = sess.pipeline(train, gen, tasks, batch_size=4, group_size=4, mode="sync", name="keep")
    for bad in ({"alpha": 0.5}, {"mode": "rolart"}, {"batch_size": 6}):
        args = {"batch_size": 4, "group_size": 4, "mode": "sync", "name": "keep", **bad}
        with pytest.raises(ConfigError):
            sess.pipeline(train, gen, tasks, **args)
        assert pipe.state != "closed" and sess.runtime.pipelines["keep"] is pipe  # checked before anything changed
    assert pipe.step().step == 0
    pipe.close()
