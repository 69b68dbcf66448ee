"""Arithmetic: "3 + 4 =" -> "7". Few turns, short answers: a decode-heavy task.

Numbers in observations are written digit by digit ("1 2 + 3 =" is 12 + 3) so a
word-level vocabulary with the ten digits covers every number; pass
``spaced_digits=False`` for plain "12 + 3 =".

Answer format (see :func:`parse_answer`): the answer is read from the last
``<answer> ... </answer>`` block if there is one, else from the text after the last word
``answer``, else from the whole action; within that, the last integer counts. An integer
may have its digits separated by single spaces ("1 2" is 12) and a leading minus
("- 3" or "-3"). So "<answer> 1 2 </answer>", "answer 12", "3 + 9 = 1 2" and "12" all
answer 12.
"""

from __future__ import annotations

import random
import re
from itertools import product
from typing import Any

from rollart_nb.errors import ConfigError

__all__ = ["Arithmetic", "parse_answer", "parse_int"]

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_AFTER_WORD_RE = re.compile(r"\banswer\b(?!.*\banswer\b)(.*)", re.IGNORECASE | re.DOTALL)
# An integer: digits that may be separated by single spaces, with a minus sign unless the
# minus follows a digit ("7 - 3" is a subtraction, "= - 3" a negative number).
_INT_RE = re.compile(r"(?:(?<!\d)(?<!\d )-\s?)?\d(?: ?\d)*")
# A fixed shuffle of problem indices so consecutive seeds are not "0 + 0", "0 + 1", ...
_SHUFFLE_SEED = 1234


def parse_answer(text: str) -> str:
    """The answer part of ``text``: the last ``<answer>`` block's content, else the text
    after the last word ``answer``, else all of ``text``; stripped."""
    tags = _TAG_RE.findall(text)
    if tags:
        return tags[-1].strip()
    after = _AFTER_WORD_RE.search(text)
    if after:
        return after.group(1).strip(" :=\n\t")
    return text.strip()


def parse_int(text: str) -> int | None:
    """The last integer in the answer part of ``text`` (digits may be space-separated)."""
    found = [m.group(0) for m in _INT_RE.finditer(parse_answer(text))]
    if not found:
        return None
    return int(found[-1].replace(" ", ""))


def format_number(n: int, spaced: bool = True) -> str:
    """``12 -> "1 2"`` (or ``"12"`` when not spaced); negatives start with ``"- "``."""
    digits = " ".join(str(abs(n))) if spaced else str(abs(n))
    return ("- " if spaced else "-") + digits if n < 0 else digits


class Arithmetic:
    """Answer ``a op b`` for operands in ``[0, max_operand]``.

    There are ``n = (max_operand + 1)**2 * len(ops)`` problems in a fixed shuffle. A seed below
    ``n`` picks problem ``seed``, so ``validation_seeds()`` (``range(n)``) is every problem once.
    Larger seeds (the scheduler draws training seeds from ``[0, 2**31)``) pick the *answer*
    uniformly first and then a problem with that answer, when ``balance_answers`` is on; else
    problem ``seed % n``.
    ``info["answer"]`` carries the result as a plain string ("12", "-3") for rewards.
    A correct answer gives reward 1.0 and ends the episode; a wrong one gives 0.0 and, if
    turns remain, the observation "wrong . try again ." followed by the question.

    Args:
        max_operand: largest operand.
        ops: operators among ``"+"``, ``"-"``, ``"*"``.
        max_turns: attempts before truncation (1: single-turn).
        spaced_digits: write numbers digit by digit (word-level tokenizers).
        balance_answers: training seeds give every answer the same frequency. Without it
            single-digit sums are 9 ten times as often as 0 or 18, and a small policy that cannot
            read the operands yet maximises its reward by always answering 9: RL collapses onto
            that answer before it learns the sums (docs/learning.md: "Why math collapses").

    Example:
        >>> env = Arithmetic()
        >>> obs, info = env.reset(seed=3)
        >>> _, reward, terminated, _, _ = env.step(f"<answer> {info['answer']} </answer>")
        >>> reward, terminated
        (1.0, True)
    """

    shape = "decode"

    def __init__(
        self,
        max_operand: int = 9,
        ops: tuple[str, ...] = ("+",),
        max_turns: int = 1,
        spaced_digits: bool = True,
        balance_answers: bool = True,
    ) -> None:
        problems = []
        if max_operand < 1:
            problems.append(f"max_operand must be >= 1, got {max_operand}")
        if not ops or set(ops) - set(_OPS):
            problems.append(f"ops must be a non-empty subset of {sorted(_OPS)}, got {ops!r}")
        if max_turns < 1:
            problems.append(f"max_turns must be >= 1, got {max_turns}")
        if problems:
            raise ConfigError(problems, where="Arithmetic")
        self.max_operand = max_operand
        self.ops = tuple(ops)
        self.max_turns = max_turns
        self.spaced_digits = spaced_digits
        values = range(max_operand + 1)
        self._problems = [(a, op, b) for op, a, b in product(self.ops, values, values)]
        random.Random(_SHUFFLE_SEED).shuffle(self._problems)
        self.balance_answers = balance_answers
        self._by_answer: dict[int, list[tuple[int, str, int]]] = {}
        for a, op, b in self._problems:
            self._by_answer.setdefault(_OPS[op](a, b), []).append((a, op, b))
        self._answers = sorted(self._by_answer)
        self._answer: int | None = None
        self._question = ""
        self._turn = 0

    @property
    def vocab(self) -> list[str]:
        """Words used by observations and answers."""
        words = {str(d) for d in range(10)} | set(self.ops) | {"=", "-", "wrong", ".", "try", "again"}
        return sorted(words | {"answer", "<answer>", "</answer>"})

    def validation_seeds(self) -> list[int]:
        """One seed per distinct problem."""
        return list(range(len(self._problems)))

    def problem(self, seed: int | None) -> tuple[int, str, int]:
        """The ``(a, op, b)`` that ``reset(seed)`` asks (see the class docstring)."""
        s = 0 if seed is None else int(seed)
        n = len(self._problems)
        if 0 <= s < n or not self.balance_answers:
            return self._problems[s % n]
        k = len(self._answers)
        same = self._by_answer[self._answers[s % k]]
        return same[(s // k) % len(same)]

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        a, op, b = self.problem(seed)
        self._answer = _OPS[op](a, b)
        fmt = self.spaced_digits
        self._question = f"{format_number(a, fmt)} {op} {format_number(b, fmt)} ="
        self._turn = 0
        return self._question, {"answer": str(self._answer), "question": f"{a} {op} {b}"}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._answer is None:
            raise RuntimeError("Arithmetic episode is over; call reset() first")
        self._turn += 1
        given = parse_int(action)
        correct = given == self._answer
        truncated = not correct and self._turn >= self.max_turns
        info = {"parsed": given, "correct": correct}
        if correct or truncated:
            self._answer = None
            return "", 1.0 if correct else 0.0, correct, truncated, info
        return f"wrong . try again .\n{self._question}", 0.0, False, False, info

    def __repr__(self) -> str:
        return (
            f"Arithmetic(max_operand={self.max_operand}, ops={self.ops}, max_turns={self.max_turns}, "
            f"balance_answers={self.balance_answers})"
        )
