import asyncio

import pytest

from rollart_nb.envs import CodeTask
from rollart_nb.errors import RewardError
from rollart_nb.rewards import acode_tests, code_tests
from rollart_nb.trajectory import Trajectory, Turn


def scored(action, info):
    return Trajectory(task="code", info=info, turns=[Turn(observation="p", action=action)])


def test_code_tests_scores_with_hidden_tests_from_reset_info():
    env = CodeTask()
    _, info = env.reset(seed=4)  # factorial
    good = "```python\ndef factorial(n):\n    return 1 if n < 2 else n * factorial(n - 1)\n```"
    bad = "```python\ndef factorial(n):\n    return n\n```"
    assert code_tests(scored(good, info)) == 1.0
    assert code_tests(scored(bad, info)) == pytest.approx(1 / 3)  # only factorial(1) == 1 holds
    assert asyncio.run(acode_tests(scored(good, info))) == 1.0


def test_code_tests_falls_back_to_builtin_problem_name():
    assert code_tests(scored("def add(a, b):\n    return a + b", {"problem": "add"})) == 1.0


def test_code_tests_without_tests_raises():
    with pytest.raises(RewardError, match="no info\\['tests'\\]"):
        code_tests(scored("x = 1", {}))
