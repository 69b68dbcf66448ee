import asyncio

import pytest

from rollart_nb.envs import CodeTask, env_step, extract_code
from rollart_nb.envs.code import PROBLEMS
from rollart_nb.errors import StateError


def test_extract_code_formats():
    assert extract_code("text\n```python\nx = 1\n```\nmore") == "x = 1"
    assert extract_code("```\na = 1\n```\n```py\nb = 2\n```") == "b = 2"
    assert extract_code("<answer>y = 2</answer>") == "y = 2"
    assert extract_code("z = 3") == "z = 3"


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.name)
def test_reference_solutions_pass_and_tests_are_hidden(problem):
    env = CodeTask(problems=(problem,))
    obs, info = env.reset(seed=0)
    assert obs == problem.prompt and "assert" not in obs
    assert info["tests"] == problem.tests
    _, reward, terminated, truncated, step_info = env.step(f"```python\n{problem.solution}\n```")
    assert (reward, terminated, truncated) == (1.0, True, False), step_info


def test_wrong_solution_gets_partial_or_zero_reward():
    env = CodeTask()
    env.reset(seed=0)  # add
    obs, reward, *_ = env.step("def add(a, b):\n    return 3")
    assert reward == pytest.approx(1 / 3) and obs == "passed 1 of 3 tests ."
    env.reset(seed=0)
    assert env.step("print('no function')")[1] == 0.0


def test_async_step_and_validation_seeds():
    env = CodeTask(timeout_s=1)
    assert len(env.validation_seeds()) == len(PROBLEMS) >= 10
    names = {env.reset(seed=s)[1]["problem"] for s in env.validation_seeds()}
    assert len(names) == len(PROBLEMS)

    async def main():
        env.reset(seed=1)  # maximum
        return await env_step(env, "def maximum(xs):\n    while True:\n        pass")

    _, reward, terminated, _, info = asyncio.run(main())
    assert reward == 0.0 and terminated and "timed out" in info["error"]


def test_bad_settings_are_reported_together():
    from rollart_nb.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        CodeTask(problems=(), timeout_s=-1, memory_mb=0, isolation="chroot")
    assert len(e.value.problems) == 4


def test_a_grader_forgery_scores_nothing():
    env = CodeTask()
    env.reset(seed=0)  # add
    forged = "class Yes(int):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Yes(0)\n"
    _, reward, _, _, info = env.step(forged)
    assert reward == 0.0 and info["passed"] == 0


def test_step_before_reset_is_a_state_error():
    with pytest.raises(StateError, match=r"call reset\(\) first"):
        CodeTask().step("def f(): pass")
