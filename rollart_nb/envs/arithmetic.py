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

from rollart_nb.errors import ConfigError, StateError

__all__ = ["HELDOUT_SEED_BASE", "Arithmetic", "parse_answer", "parse_digits", "parse_int"]

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_AFTER_WORD_RE = re.compile(r"\banswer\b(?!.*\banswer\b)(.*)", re.IGNORECASE | re.DOTALL)
# An integer: digits that may be separated by single spaces, with a minus sign unless the
# minus follows a digit ("7 - 3" is a subtraction, "= - 3" a negative number).
_INT_RE = re.compile(r"(?:(?<!\d)(?<!\d )-\s?)?\d(?: ?\d)*")
# A fixed shuffle of problem indices so consecutive seeds are not "0 + 0", "0 + 1", ...
_SHUFFLE_SEED = 1234
HELDOUT_SEED_BASE = 2**31
"""Envs with a held-out split (``Arithmetic(holdout=...)``, ``FrozenLake(random_maps=True, holdout=...)``)
pick a held-out problem only for a seed at or above this; the scheduler draws training seeds from
``[0, 2**31)`` and a :class:`~rollart_nb.control.curriculum.PromptCurriculum` draws from the env's
``training_seeds()``, so no training stage ever meets a validation problem."""


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


def parse_digits(text: str) -> str | None:
    """The last integer in the answer part of ``text`` as written, spaces removed: ``"0 5 2"`` is
    ``"052"`` (leading zeros kept, unlike :func:`parse_int`), ``"- 3"`` is ``"-3"``."""
    found = [m.group(0) for m in _INT_RE.finditer(parse_answer(text))]
    return found[-1].replace(" ", "") if found else None


def format_number(n: int, spaced: bool = True) -> str:
    """``12 -> "1 2"`` (or ``"12"`` when not spaced); negatives start with ``"- "``."""
    digits = " ".join(str(abs(n))) if spaced else str(abs(n))
    return ("- " if spaced else "-") + digits if n < 0 else digits


class Arithmetic:
    """Answer ``a op b`` for operands in ``[0, max_operand]``.

    A seed below the problem count ``n`` picks that problem of a fixed shuffle, so
    ``validation_seeds()`` is every problem once; larger seeds pick problem ``seed % n``, or with
    ``balance_answers`` first an answer uniformly, then a problem with it. ``info["answer"]`` is the
    expected answer as written ("12"; reversed digits with ``reverse_answer``), ``info["value"]``
    its int. With ``holdout > 0`` the first ``holdout`` problems are reached only by
    ``validation_seeds()`` (``HELDOUT_SEED_BASE + i``), never by training seeds. A correct answer
    gives 1.0 and ends the episode; a wrong one 0.0 and, if turns remain, "wrong . try again ."
    and the question again.

    Args:
        max_operand: largest operand.
        ops: operators among ``"+"``, ``"-"``, ``"*"``.
        max_turns: attempts before truncation (1: single-turn).
        spaced_digits: write numbers digit by digit (word-level tokenizers).
        balance_answers: training seeds give every answer the same frequency (else a small
            policy collapses onto the most common sum; docs/learning.md).
        holdout: problems kept out of training for validation (0: validation is every problem).
        fixed_width: zero-pad operands and answers to a fixed width, so digits line up.
        reverse_answer: write the answer least significant digit first, which makes addition
            learnable (Lee et al. 2023, arXiv:2307.03381). ``+`` only.

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
        holdout: int = 0,
        fixed_width: bool = False,
        reverse_answer: bool = False,
    ) -> None:
        problems = []
        if max_operand < 1:
            problems.append(f"max_operand must be >= 1, got {max_operand}")
        if not ops or set(ops) - set(_OPS):
            problems.append(f"ops must be a non-empty subset of {sorted(_OPS)}, got {ops!r}")
        if max_turns < 1:
            problems.append(f"max_turns must be >= 1, got {max_turns}")
        n_all = (max(max_operand, 0) + 1) ** 2 * len(ops or ())
        if not isinstance(holdout, int) or not 0 <= holdout < max(n_all, 1):
            problems.append(f"holdout must be a whole number in [0, {n_all}) (the number of problems), got {holdout!r}")
        if reverse_answer and set(ops) - {"+"}:
            problems.append(f"reverse_answer needs ops=('+',) (no negative results), got {ops!r}")
        if problems:
            raise ConfigError(problems, where="Arithmetic")
        self.holdout = holdout
        self.fixed_width = fixed_width
        self.reverse_answer = reverse_answer
        self._width = len(str(max_operand))
        self._answer_width = max(
            len(str(abs(_OPS[op](a, b)))) for op in ops for a in (0, max_operand) for b in (0, max_operand)
        )
        self.max_operand = max_operand
        self.ops = tuple(ops)
        self.max_turns = max_turns
        self.spaced_digits = spaced_digits
        values = range(max_operand + 1)
        self._problems = [(a, op, b) for op, a, b in product(self.ops, values, values)]
        random.Random(_SHUFFLE_SEED).shuffle(self._problems)
        self.balance_answers = balance_answers
        self._heldout = self._problems[:holdout]
        self._training = self._problems[holdout:]
        self._by_answer: dict[int, list[tuple[int, str, int]]] = {}
        for a, op, b in self._training:
            self._by_answer.setdefault(_OPS[op](a, b), []).append((a, op, b))
        self._answers = sorted(self._by_answer)
        self._answer: int | None = None
        self._expected = ""
        self._question = ""
        self._turn = 0

    @property
    def vocab(self) -> list[str]:
        """Words used by observations and answers."""
        words = {str(d) for d in range(10)} | set(self.ops) | {"=", "-", "wrong", ".", "try", "again"}
        return sorted(words | {"answer", "<answer>", "</answer>"})

    def validation_seeds(self) -> list[int]:
        """One seed per validation problem: every problem, or with ``holdout`` the held-out ones."""
        if self.holdout:
            return [HELDOUT_SEED_BASE + i for i in range(self.holdout)]
        return list(range(len(self._problems)))

    def training_seeds(self) -> list[int]:
        """One seed per training problem (every problem when there is no ``holdout``)."""
        return list(range(len(self._training)))

    def validation_problems(self) -> list[tuple[int, str, int]]:
        """The ``(a, op, b)`` of every validation problem."""
        return [self.problem(s) for s in self.validation_seeds()]

    def problem(self, seed: int | None) -> tuple[int, str, int]:
        """The ``(a, op, b)`` that ``reset(seed)`` asks (see the class docstring)."""
        s = 0 if seed is None else int(seed)
        if self.holdout and s >= HELDOUT_SEED_BASE:
            return self._heldout[(s - HELDOUT_SEED_BASE) % self.holdout]
        n = len(self._training)
        if 0 <= s < n or not self.balance_answers:
            return self._training[s % n]
        k = len(self._answers)
        same = self._by_answer[self._answers[s % k]]
        return same[(s // k) % len(same)]

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        a, op, b = self.problem(seed)
        value = _OPS[op](a, b)
        self._answer = value
        self._expected = self.answer_text(value).replace(" ", "")
        self._question = self.question(a, op, b)
        self._turn = 0
        return self._question, {"answer": self._expected, "value": value, "question": f"{a} {op} {b}"}

    def demonstrate(self, seed: int | None = None) -> list[tuple[str, str]]:
        """A worked solution of ``reset(seed)``'s problem: ``[(question, right answer as written)]``."""
        a, op, b = self.problem(seed)
        return [(self.question(a, op, b), self.answer_text(_OPS[op](a, b)))]

    def question(self, a: int, op: str, b: int) -> str:
        """The observation that asks ``a op b``."""
        return f"{self._operand(a)} {op} {self._operand(b)} ="

    def answer_text(self, value: int) -> str:
        """``value`` written as a right answer is written ("5 2"; "2 5 0" reversed at width 3)."""
        if not (self.fixed_width or self.reverse_answer):
            return format_number(value, self.spaced_digits)
        digits = str(abs(value)).zfill(self._answer_width if self.fixed_width else 0)
        if self.reverse_answer:
            digits = digits[::-1]
        text = " ".join(digits) if self.spaced_digits else digits
        return ("- " if self.spaced_digits else "-") + text if value < 0 else text

    def _operand(self, n: int) -> str:
        if self.fixed_width:
            digits = str(n).zfill(self._width)
            return " ".join(digits) if self.spaced_digits else digits
        return format_number(n, self.spaced_digits)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._answer is None:
            raise StateError("Arithmetic has no open episode (not reset yet, or it ended); call reset() first")
        self._turn += 1
        given = parse_int(action)
        # Fixed-width and reversed answers are read as the digits written ("2 5" is not "2 5 0");
        # parse_int would drop the zeros, so compare the digit string.
        if self.reverse_answer or self.fixed_width:
            correct = parse_digits(action) == self._expected
        else:
            correct = given == self._answer
        truncated = not correct and self._turn >= self.max_turns
        info = {"parsed": given, "correct": correct}
        if correct or truncated:
            self._answer = None
            return "", 1.0 if correct else 0.0, correct, truncated, info
        return f"wrong . try again .\n{self._question}", 0.0, False, False, info

    def __deepcopy__(self, memo: dict[int, Any]) -> Arithmetic:
        # Every EnvManager and validation run copies its template; the problem tables (10,000
        # problems at max_operand=99) are never changed after __init__, so copies share them.
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __repr__(self) -> str:
        return (
            f"Arithmetic(max_operand={self.max_operand}, ops={self.ops}, max_turns={self.max_turns}, "
            f"balance_answers={self.balance_answers}"
            + (f", holdout={self.holdout}" if self.holdout else "")
            + (", fixed_width=True" if self.fixed_width else "")
            + (", reverse_answer=True" if self.reverse_answer else "")
            + ")"
        )
