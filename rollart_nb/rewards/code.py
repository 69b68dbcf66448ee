"""Code reward: run the last action's program against hidden tests in the sandbox."""

from __future__ import annotations

from rollart_nb.envs.code import PROBLEMS, extract_code
from rollart_nb.errors import RewardError
from rollart_nb.sandbox.run import arun_sandboxed, run_sandboxed
from rollart_nb.trajectory import Trajectory

__all__ = ["acode_tests", "code_tests"]

_BY_NAME = {p.name: p for p in PROBLEMS}


def _tests_for(trajectory: Trajectory) -> str:
    tests = trajectory.info.get("tests")
    if tests is None and trajectory.info.get("problem") in _BY_NAME:
        tests = _BY_NAME[trajectory.info["problem"]].tests
    if not tests:
        raise RewardError(
            f"trajectory {trajectory.id} (task {trajectory.task!r}) has no info['tests']; "
            "code_tests needs an env such as CodeTask whose reset() info carries them"
        )
    return tests


def code_tests(trajectory: Trajectory, timeout_s: float = 5.0, memory_mb: int = 256) -> float:
    """Fraction of ``trajectory.info["tests"]`` passed by the code in the last action.

    The code is taken with :func:`~rollart_nb.envs.extract_code` and run by
    :func:`~rollart_nb.envs.run_sandboxed`. Tests come from ``info["tests"]``, or from the
    built-in problem named ``info["problem"]``.

    Raises:
        RewardError: the trajectory carries no tests.
    """
    tests = _tests_for(trajectory)
    action = trajectory.turns[-1].action if trajectory.turns else ""
    return run_sandboxed(extract_code(action), tests, timeout_s, memory_mb).score


async def acode_tests(trajectory: Trajectory, timeout_s: float = 5.0, memory_mb: int = 256) -> float:
    """:func:`code_tests` for event loops (awaits the sandbox without a thread)."""
    tests = _tests_for(trajectory)
    action = trajectory.turns[-1].action if trajectory.turns else ""
    return (await arun_sandboxed(extract_code(action), tests, timeout_s, memory_mb)).score
