"""TaskSet: what ``sess.tasks(...)`` checks before any worker starts."""

from __future__ import annotations

import pytest

from rollart_nb.control.tasks import TaskSet
from rollart_nb.envs import Arithmetic, FrozenLake
from rollart_nb.errors import ConfigError


def envs() -> dict[str, object]:
    return {"math": Arithmetic(), "lake": FrozenLake()}


def test_envs_per_task_counts_every_task_and_only_those():
    ts = TaskSet(envs(), {"math": 4, "lake": 2})
    assert {t: len(v) for t, v in ts.expand().items()} == {"math": 4, "lake": 2}
    with pytest.raises(ConfigError, match="'lake': envs_per_task has no count for it"):
        TaskSet(envs(), {"math": 4})
    with pytest.raises(ConfigError, match="envs_per_task for unknown task 'maths'"):
        TaskSet(envs(), {"math": 4, "lake": 2, "maths": 1})
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="'math': envs_per_task must be an int >= 1"):
            TaskSet(envs(), {"math": bad, "lake": 2})


def test_an_object_without_reset_and_step_is_not_an_env():
    with pytest.raises(ConfigError, match="'math': dict is not an env"):
        TaskSet({"math": {}}, {"math": 1})
