"""Text environments, wrappers and the code sandbox.

Every env follows :class:`rollart_nb.protocols.Env` (``reset(seed) -> (obs, info)``,
``step(action) -> (obs, reward, terminated, truncated, info)``) and exposes hints the
rest of rollart_nb reads: ``vocab`` (words its text uses, for word-level tokenizers),
``max_turns``, ``shape`` (``"prefill"`` or ``"decode"``: which phase dominates) and
``validation_seeds()`` (seeds that enumerate distinct starts, for evaluation).

An env MAY also define ``async areset(seed)`` / ``async astep(action)``
(:class:`AsyncEnv`); the EnvManager calls :func:`env_reset` / :func:`env_step`, which use
them when present and otherwise run the sync methods in a thread.
"""

from rollart_nb.envs.arithmetic import Arithmetic, parse_answer, parse_int
from rollart_nb.envs.base import AsyncEnv, EnvWrapper, env_reset, env_step
from rollart_nb.envs.code import CodeProblem, CodeTask, extract_code
from rollart_nb.envs.frozenlake import FrozenLake
from rollart_nb.envs.gem import GEMEnv
from rollart_nb.envs.sandbox import SandboxResult, arun_sandboxed, run_sandboxed
from rollart_nb.envs.wrappers import WithFailures, WithLatency

__all__ = [
    "Arithmetic",
    "AsyncEnv",
    "CodeProblem",
    "CodeTask",
    "EnvWrapper",
    "FrozenLake",
    "GEMEnv",
    "SandboxResult",
    "WithFailures",
    "WithLatency",
    "arun_sandboxed",
    "env_reset",
    "env_step",
    "extract_code",
    "parse_answer",
    "parse_int",
    "run_sandboxed",
]
