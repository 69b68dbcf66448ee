"""The optional async env protocol, the helpers the EnvManager calls, and a wrapper base.

An env (see :class:`rollart_nb.protocols.Env`) MAY also define ``async areset(seed)`` and
``async astep(action)``. :func:`env_reset` / :func:`env_step` use them when present, and
otherwise run the sync method in a worker thread, so an asyncio EnvManager can drive many
envs from one event loop. Both helpers turn any failure of the env into
:class:`rollart_nb.errors.EnvError` and can bound the call with a timeout.

Note: the sync fallback uses :func:`asyncio.to_thread`, whose default executor has
``min(32, cpus + 4)`` threads; many slow *sync* envs therefore queue behind each other.
Envs that wait (latency, remote calls) should define ``areset``/``astep``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, runtime_checkable

from rollart_nb.errors import EnvError

__all__ = ["AsyncEnv", "EnvWrapper", "StepResult", "env_reset", "env_step"]

StepResult = tuple[str, float, bool, bool, dict[str, Any]]


@runtime_checkable
class AsyncEnv(Protocol):
    """An env that can also be driven without threads (optional extension of ``Env``)."""

    async def areset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]: ...

    async def astep(self, action: str) -> StepResult: ...


def _name(env: Any) -> str:
    return type(env).__name__


async def _bounded(coro: Any, env: Any, what: str, timeout_s: float | None) -> Any:
    try:
        if timeout_s is None:
            return await coro
        return await asyncio.wait_for(coro, timeout_s)
    except EnvError:
        raise
    except TimeoutError as e:
        raise EnvError(
            f"env {_name(env)} did not answer {what} within {timeout_s:g}s; "
            "raise the env timeout or fix the env"
        ) from e
    except asyncio.CancelledError:
        raise
    except Exception as e:  # any env bug ends the trajectory failed, with the cause chained
        raise EnvError(f"env {_name(env)} raised in {what}: {type(e).__name__}: {e}") from e


async def env_reset(env: Any, seed: int | None = None, *, timeout_s: float | None = None) -> tuple[str, dict]:
    """Reset ``env`` from async code: its ``areset`` if defined, else ``reset`` in a thread.

    Args:
        env: any :class:`~rollart_nb.protocols.Env`.
        seed: the reset seed.
        timeout_s: give up after this many seconds (None: wait forever).

    Raises:
        EnvError: the env raised or timed out.
    """
    areset = getattr(env, "areset", None)
    coro = areset(seed) if areset is not None else asyncio.to_thread(env.reset, seed)
    return await _bounded(coro, env, "reset", timeout_s)


async def env_step(env: Any, action: str, *, timeout_s: float | None = None) -> StepResult:
    """Step ``env`` from async code: its ``astep`` if defined, else ``step`` in a thread.

    Args:
        env: any :class:`~rollart_nb.protocols.Env`.
        action: the decoded model response.
        timeout_s: give up after this many seconds (None: wait forever).

    Raises:
        EnvError: the env raised or timed out.
    """
    astep = getattr(env, "astep", None)
    coro = astep(action) if astep is not None else asyncio.to_thread(env.step, action)
    return await _bounded(coro, env, "step", timeout_s)


class EnvWrapper:
    """Base of env wrappers: forwards the env hints (``vocab``, ``max_turns``, ``shape``,
    ``validation_seeds``) explicitly, so a wrapped env looks like the env it wraps.

    Subclasses override ``reset``/``step`` and, for thread-free use, ``areset``/``astep``;
    the defaults here delegate to the wrapped env (async ones via :func:`env_reset`/
    :func:`env_step`, so an async inner env stays thread-free).
    """

    def __init__(self, env: Any) -> None:
        self.env = env

    @property
    def unwrapped(self) -> Any:
        """The innermost env."""
        return getattr(self.env, "unwrapped", self.env)

    @property
    def vocab(self) -> list[str]:
        return list(getattr(self.env, "vocab", []))

    @property
    def max_turns(self) -> int | None:
        return getattr(self.env, "max_turns", None)

    @property
    def shape(self) -> str:
        return getattr(self.env, "shape", "decode")

    def validation_seeds(self) -> list[int]:
        """The inner env's validation seeds, or ``range(16)`` when it declares none."""
        fn = getattr(self.env, "validation_seeds", None)
        return list(fn()) if callable(fn) else list(range(16))

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return self.env.reset(seed)

    def step(self, action: str) -> StepResult:
        return self.env.step(action)

    async def areset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return await env_reset(self.env, seed)

    async def astep(self, action: str) -> StepResult:
        return await env_step(self.env, action)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.env!r})"
