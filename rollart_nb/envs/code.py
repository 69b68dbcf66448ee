"""CodeTask: write a small Python function; hidden tests run in the sandbox.

Action format (see :func:`extract_code`): the code inside the last fenced block
(```` ```python ... ``` ```` or ```` ``` ... ``` ````), else inside the last
``<answer> ... </answer>`` block, else the whole action.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rollart_nb.errors import ConfigError, StateError
from rollart_nb.sandbox.run import (
    ISOLATION_MODES,
    MAX_MEMORY_MB,
    MAX_TIMEOUT_S,
    MIN_MEMORY_MB,
    SandboxResult,
    arun_sandboxed,
    run_sandboxed,
)

__all__ = ["PROBLEMS", "CodeProblem", "CodeTask", "extract_code"]

_PROBLEM_FIELDS = ("name", "prompt", "tests")

_FENCE_RE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n?(.*?)```", re.DOTALL | re.IGNORECASE)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def extract_code(action: str) -> str:
    """The program in a model response; see the module docstring."""
    for pattern in (_FENCE_RE, _ANSWER_RE):
        blocks = pattern.findall(action)
        if blocks:
            return blocks[-1].strip("\n")
    return action


@dataclass(frozen=True)
class CodeProblem:
    """One problem: the prompt shown, the hidden tests, and a reference solution."""

    name: str
    prompt: str
    tests: str
    solution: str


PROBLEMS: tuple[CodeProblem, ...] = (
    CodeProblem(
        "add",
        "write a python function add ( a , b ) that returns a + b .",
        "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(10, 5) == 15",
        "def add(a, b):\n    return a + b",
    ),
    CodeProblem(
        "maximum",
        "write a python function maximum ( xs ) that returns the largest number in the list xs .",
        "assert maximum([1, 3, 2]) == 3\nassert maximum([-5, -2]) == -2\nassert maximum([7]) == 7",
        "def maximum(xs):\n    return max(xs)",
    ),
    CodeProblem(
        "reverse",
        "write a python function reverse ( s ) that returns the string s reversed .",
        "assert reverse('abc') == 'cba'\nassert reverse('') == ''\nassert reverse('ab ') == ' ba'",
        "def reverse(s):\n    return s[::-1]",
    ),
    CodeProblem(
        "is_even",
        "write a python function is_even ( n ) that returns True if n is even .",
        "assert is_even(2) is True\nassert is_even(7) is False\nassert is_even(0) is True",
        "def is_even(n):\n    return n % 2 == 0",
    ),
    CodeProblem(
        "factorial",
        "write a python function factorial ( n ) that returns n factorial .",
        "assert factorial(0) == 1\nassert factorial(1) == 1\nassert factorial(5) == 120",
        "def factorial(n):\n    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r",
    ),
    CodeProblem(
        "count_vowels",
        "write a python function count_vowels ( s ) that returns how many of a e i o u are in s .",
        "assert count_vowels('hello') == 2\nassert count_vowels('xyz') == 0\nassert count_vowels('aeiou') == 5",
        "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)",
    ),
    CodeProblem(
        "fib",
        "write a python function fib ( n ) that returns the n th fibonacci number , fib ( 0 ) = 0 .",
        "assert fib(0) == 0\nassert fib(1) == 1\nassert fib(10) == 55",
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
    ),
    CodeProblem(
        "total",
        "write a python function total ( xs ) that returns the sum of the list xs .",
        "assert total([]) == 0\nassert total([1, 2, 3]) == 6\nassert total([-1, 1]) == 0",
        "def total(xs):\n    return sum(xs)",
    ),
    CodeProblem(
        "is_palindrome",
        "write a python function is_palindrome ( s ) that returns True if s reads the same backwards .",
        "assert is_palindrome('aba') is True\nassert is_palindrome('ab') is False\nassert is_palindrome('') is True",
        "def is_palindrome(s):\n    return s == s[::-1]",
    ),
    CodeProblem(
        "square_all",
        "write a python function square_all ( xs ) that returns a list of the squares of xs .",
        "assert square_all([1, 2, 3]) == [1, 4, 9]\nassert square_all([]) == []\nassert square_all([-2]) == [4]",
        "def square_all(xs):\n    return [x * x for x in xs]",
    ),
)


class CodeTask:
    """Single-turn code writing; reward is the fraction of hidden tests passed.

    ``seed % len(problems)`` picks the problem. The tests never appear in the observation;
    they travel in ``info["tests"]`` for :func:`rollart_nb.rewards.code_tests`. The env's
    own step reward is the same score, computed in the sandbox.

    Args:
        problems: the problem set (default :data:`PROBLEMS`).
        timeout_s: wall-clock limit per sandboxed run, in (0, 86400] seconds.
        memory_mb: address-space limit per sandboxed run, a whole number of MiB in [32, 1048576].
        isolation: ``"bwrap"`` (OS isolation, the default) or ``"none"`` (warns on every run);
            see :func:`~rollart_nb.envs.run_sandboxed`.

    Example:
        >>> env = CodeTask()
        >>> obs, info = env.reset(seed=0)
        >>> env.step("```python\\ndef add(a, b):\\n    return a + b\\n```")[1]
        1.0
    """

    shape = "decode"
    max_turns = 1

    def __init__(
        self,
        problems: tuple[CodeProblem, ...] = PROBLEMS,
        timeout_s: float = 5.0,
        memory_mb: int = 256,
        isolation: str = "bwrap",
    ) -> None:
        if isinstance(problems, Iterable) and not isinstance(problems, str):
            problems = tuple(problems)
        bad = []
        if not isinstance(problems, tuple) or not problems:
            bad.append(f"problems={problems!r} must be a non-empty sequence of CodeProblem (default: PROBLEMS)")
        else:
            wrong = [q for q in problems if not all(isinstance(getattr(q, a, None), str) for a in _PROBLEM_FIELDS)]
            if wrong:
                bad.append(f"problems holds {wrong[0]!r}, not a CodeProblem(name, prompt, tests, solution) of strings")
        # the sandbox's own limits (run_sandboxed refuses anything else), checked here so a bad
        # value fails when the task is built, not in every rollout
        number = isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool)
        if not (number and 0 < timeout_s <= MAX_TIMEOUT_S):
            bad.append(
                f"timeout_s={timeout_s!r} must be a number of seconds in (0, {MAX_TIMEOUT_S}] "
                "(the wall-clock limit of one sandboxed run)"
            )
        whole = isinstance(memory_mb, int) and not isinstance(memory_mb, bool)
        if not (whole and MIN_MEMORY_MB <= memory_mb <= MAX_MEMORY_MB):
            bad.append(
                f"memory_mb={memory_mb!r} must be a whole number of MiB in "
                f"[{MIN_MEMORY_MB}, {MAX_MEMORY_MB}] (the address-space limit of one sandboxed run)"
            )
        if isolation not in ISOLATION_MODES:
            bad.append(f"isolation={isolation!r} must be one of {', '.join(map(repr, ISOLATION_MODES))}")
        if bad:
            raise ConfigError(bad, where="CodeTask")
        self.problems: tuple[CodeProblem, ...] = problems
        self.timeout_s, self.memory_mb, self.isolation = timeout_s, memory_mb, isolation
        self._problem: CodeProblem | None = None

    @property
    def vocab(self) -> list[str]:
        """Words of the prompts (code itself needs a real tokenizer)."""
        return sorted({w for p in self.problems for w in p.prompt.split()} | {"```", "python"})

    def validation_seeds(self) -> list[int]:
        """One seed per problem."""
        return list(range(len(self.problems)))

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._problem = self.problems[(0 if seed is None else int(seed)) % len(self.problems)]
        p = self._problem
        return p.prompt, {"problem": p.name, "tests": p.tests}

    def _finish(self, result: SandboxResult) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self._problem = None
        msg = f"passed {result.passed} of {result.total} tests ."
        info = {"passed": result.passed, "total": result.total, "error": result.error}
        return msg, result.score, True, False, info

    def _current(self) -> CodeProblem:
        if self._problem is None:
            raise StateError("CodeTask has no open episode (not reset yet, or it ended); call reset() first")
        return self._problem

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        p = self._current()
        return self._finish(
            run_sandboxed(extract_code(action), p.tests, self.timeout_s, self.memory_mb, isolation=self.isolation)
        )

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        p = self._current()
        return self._finish(
            await arun_sandboxed(
                extract_code(action), p.tests, self.timeout_s, self.memory_mb, isolation=self.isolation
            )
        )

    async def areset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return self.reset(seed)

    def __repr__(self) -> str:
        return f"CodeTask(problems={len(self.problems)}, timeout_s={self.timeout_s})"
