"""Reward functions: plain ``fn(trajectory) -> float`` callables (sync or async).

Rule based: :func:`exact_answer`, :func:`close_answer` (shaped), :func:`env_return`, :func:`format_reward`.
Code: :func:`code_tests` / :func:`acode_tests` (hidden tests in the sandbox).
"""

from rollart_nb.rewards.code import acode_tests, code_tests
from rollart_nb.rewards.rules import close_answer, env_return, exact_answer, format_reward

__all__ = ["acode_tests", "close_answer", "code_tests", "env_return", "exact_answer", "format_reward"]
