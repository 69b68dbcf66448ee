"""PromptCurriculum: learnability-weighted prompt sampling, alone and inside the scheduler."""

import collections
import math
import random

import pytest

from rollart_nb import PromptCurriculum
from rollart_nb.config import PipelineConfig
from rollart_nb.control.shards import plan_rollout
from rollart_nb.control.tasks import TaskSet
from rollart_nb.envs import Arithmetic
from rollart_nb.errors import ConfigError


def test_bad_settings_are_config_errors():
    for kw, match in [
        ({"seeds": []}, "empty"),
        ({"seeds": [1, 1]}, "distinct"),
        ({"seeds": [1], "uniform": 1.5}, "uniform"),
        ({"seeds": [1], "decay": 1.0}, "decay"),
        ({"seeds": [1], "success": math.nan}, "success"),
    ]:
        with pytest.raises(ConfigError, match=match):
            PromptCurriculum(**kw)


def test_draws_favour_prompts_solved_about_half_the_time():
    cur = PromptCurriculum(range(3), uniform=0.1)
    assert [cur.p(s) for s in range(3)] == [0.5, 0.5, 0.5]  # unseen: maximally learnable
    for k in range(40):  # seed 0 always solved, 1 never, 2 every other time
        cur.update(0, 1.0)
        cur.update(1, 0.3)  # below success=1.0: a miss, however much partial credit
        cur.update(2, 1.0 if k % 2 else 0.0)
    cur.update(2, math.nan)  # ignored, as is a seed outside the set
    cur.update(99, 1.0)
    assert cur.p(0) > 0.9 and cur.p(1) < 0.1 and 0.4 < cur.p(2) < 0.6
    w = cur.weights()
    assert sum(w) == pytest.approx(1.0) and w[2] > 0.6 and w[2] > 4 * max(w[0], w[1])
    rng = random.Random(0)
    drawn = collections.Counter(cur.next_seed(rng) for _ in range(3000))
    assert drawn[2] / 3000 == pytest.approx(w[2], abs=0.04)
    assert drawn[0] > 0 and drawn[1] > 0  # the uniform share keeps every prompt in play
    flat = PromptCurriculum(range(3), uniform=1.0)
    flat._hits, flat._trials = list(cur._hits), list(cur._trials)
    assert flat.weights() == pytest.approx([1 / 3] * 3)
    s = cur.summary()
    assert s["seeds"] == 3 and s["seen"] == 3 and s["solved"] == 1 and s["updates"] == 120 and s["draws"] == 3000


def test_config_checks_the_curriculum():
    with pytest.raises(ConfigError, match="unknown task 'code'"):
        TaskSet({"math": Arithmetic()}, {"math": 2}, curricula={"code": PromptCurriculum([1])})
    with pytest.raises(ConfigError, match="next_seed"):
        TaskSet({"math": Arithmetic()}, {"math": 2}, curricula={"math": [1, 2, 3]})
    with pytest.raises(ConfigError, match="next_seed"):
        plan_rollout({"math": [Arithmetic()]}, PipelineConfig(batch_size=4), 4, curricula={"math": object()})
    with pytest.raises(ConfigError, match="unknown task 'code'"):
        plan_rollout(
            {"math": [Arithmetic()]}, PipelineConfig(batch_size=4), 4, curricula={"code": PromptCurriculum([1])}
        )
