"""Rule-based reward functions: plain ``fn(trajectory) -> float``.

They read the last turn's action and ground truth that the env put in
``trajectory.info`` at reset (e.g. :class:`~rollart_nb.envs.Arithmetic`'s ``"answer"``).
"""

from __future__ import annotations

import math
import re

from rollart_nb.envs.arithmetic import parse_answer, parse_digits, parse_int
from rollart_nb.errors import RewardError
from rollart_nb.trajectory import Trajectory

__all__ = ["close_answer", "env_return", "exact_answer", "format_reward"]

_INT_TEXT_RE = re.compile(r"-?\d+")


def _last_action(trajectory: Trajectory) -> str:
    return trajectory.turns[-1].action if trajectory.turns else ""


def _normalize(text: str) -> str:
    return " ".join(text.lower().split())


def exact_answer(trajectory: Trajectory) -> float:
    """1.0 if the last action's answer equals ``trajectory.info["answer"]``, else 0.0.

    An integer answer ("12", "-3") is compared as a number, parsed leniently with
    :func:`~rollart_nb.envs.parse_int` ("<answer> 1 2 </answer>", "answer 12", "... = 1 2");
    any other answer is compared as text (case and spacing ignored) with the answer part
    given by :func:`~rollart_nb.envs.parse_answer`.

    Raises:
        RewardError: the trajectory has no ``info["answer"]`` to compare with.

    Example:
        >>> from rollart_nb.trajectory import Trajectory, Turn
        >>> t = Trajectory(task="math", info={"answer": "12"}, turns=[Turn("7 + 5 =", "<answer> 1 2 </answer>")])
        >>> exact_answer(t)
        1.0
    """
    if "answer" not in trajectory.info:
        raise RewardError(
            f"trajectory {trajectory.id} (task {trajectory.task!r}) has no info['answer']; "
            "exact_answer needs an env whose reset() info carries the answer"
        )
    expected = str(trajectory.info["answer"]).strip()
    action = _last_action(trajectory)
    if _INT_TEXT_RE.fullmatch(expected):
        if expected.lstrip("-").startswith("0") and len(expected.lstrip("-")) > 1:
            # fixed-width digits ("060"): every digit written counts, leading zeros included
            return 1.0 if parse_digits(action) == expected else 0.0
        return 1.0 if parse_int(action) == int(expected) else 0.0
    return 1.0 if _normalize(parse_answer(action)) == _normalize(expected) else 0.0


def close_answer(trajectory: Trajectory, partial: float = 0.5, scale: float = 18.0) -> float:
    """A shaped integer reward: 1.0 for the exact answer, ``partial * max(0, 1 - |d| / scale)``
    for an integer ``d`` away from it (the answer's integer as :func:`exact_answer` reads it:
    the last one in the answer part), 0.0 for no integer.

    Partial credit puts a spread into nearly every GRPO group where exact match is sparse
    (docs/learning.md: "Shaped math reward"). ``scale`` is the answer range (18 for sums of two
    digits). Train on it, validate on :func:`exact_answer`.

    Example:
        >>> from rollart_nb.trajectory import Trajectory, Turn
        >>> t = Trajectory(task="math", info={"answer": "12"}, turns=[Turn("7 + 5 =", "<answer> 9 </answer>")])
        >>> close_answer(t)
        0.4166666666666667
    """
    if not (0.0 <= partial <= 1.0 and math.isfinite(scale) and scale > 0):
        raise RewardError(f"close_answer needs 0 <= partial <= 1 and a finite scale > 0, got {partial!r}, {scale!r}")
    if exact_answer(trajectory) == 1.0:
        return 1.0
    expected = str(trajectory.info["answer"]).strip()
    got = parse_int(_last_action(trajectory)) if _INT_TEXT_RE.fullmatch(expected) else None
    if got is None:
        return 0.0
    return partial * max(0.0, 1.0 - abs(got - int(expected)) / scale)


def env_return(trajectory: Trajectory) -> float:
    """The sum of the env's own step rewards (``trajectory.env_return``)."""
    return trajectory.env_return


def format_reward(trajectory: Trajectory, tag: str = "answer") -> float:
    """Fraction of turns whose action holds exactly one well-formed ``<tag> ... </tag>``.

    Use it as a shaping term next to a correctness reward, e.g.
    ``lambda t: exact_answer(t) + 0.1 * format_reward(t)``.
    """
    if not trajectory.turns:
        return 0.0
    block = re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)
    ok = 0
    for turn in trajectory.turns:
        blocks = block.findall(turn.action)
        # Stray tags outside the one block mean the format is broken.
        stray = turn.action.count(f"<{tag}>") + turn.action.count(f"</{tag}>") - 2 * len(blocks)
        ok += len(blocks) == 1 and blocks[0].strip() != "" and stray == 0
    return ok / len(trajectory.turns)
