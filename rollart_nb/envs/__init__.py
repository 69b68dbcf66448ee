"""Text environments, wrappers and the code sandbox.

Every env follows :class:`rollart_nb.protocols.Env` (``reset(seed) -> (obs, info)``,
``step(action) -> (obs, reward, terminated, truncated, info)``) and exposes hints the
rest of rollart_nb reads: ``vocab`` (words its text uses, for word-level tokenizers),
``max_turns``, ``shape`` (``"prefill"`` or ``"decode"``: which phase dominates) and
``validation_seeds()`` (seeds that enumerate distinct starts, for evaluation).
:func:`check` drives an env (and a reward) here before a run uses it.

An env MAY also be an :class:`AsyncEnv`. :class:`EnvServer` serves any env over HTTP,
:class:`RemoteEnv` talks to it, and the launchers place and watch its replicas.
"""

from typing import Any as _Any

from rollart_nb.envs.arithmetic import Arithmetic, parse_answer, parse_int
from rollart_nb.envs.base import AsyncEnv, EnvWrapper, env_reset, env_step
from rollart_nb.envs.check import EnvCheck, check
from rollart_nb.envs.code import CodeProblem, CodeTask, extract_code
from rollart_nb.envs.frozenlake import FrozenLake
from rollart_nb.envs.gem import GEMEnv
from rollart_nb.envs.launchers import KubernetesLauncher, LocalLauncher
from rollart_nb.envs.remote import RemoteEnv
from rollart_nb.envs.wrappers import WithFailures, WithLatency
from rollart_nb.sandbox import SandboxResult, arun_sandboxed, run_sandboxed
from rollart_nb.tokens import Tokens

__all__ = [
    "Arithmetic",
    "AsyncEnv",
    "CodeProblem",
    "CodeTask",
    "EnvCheck",
    "EnvServer",
    "EnvWrapper",
    "FrozenLake",
    "GEMEnv",
    "KubernetesLauncher",
    "LocalLauncher",
    "RemoteEnv",
    "SandboxResult",
    "Tokens",
    "WithFailures",
    "WithLatency",
    "arun_sandboxed",
    "check",
    "env_reset",
    "env_step",
    "extract_code",
    "parse_answer",
    "parse_int",
    "run_sandboxed",
]


def __getattr__(name: str) -> _Any:
    if name == "EnvServer":  # aiohttp loads only when a server is built here
        from rollart_nb.envs.server import EnvServer

        return EnvServer
    raise AttributeError(f"module 'rollart_nb.envs' has no attribute {name!r}")
