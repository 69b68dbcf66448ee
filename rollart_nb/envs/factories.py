"""Env factories by name, for env servers: wrapped envs built from ``"module:Class"`` specs.

An env server builds one env per episode from a ``"module:callable"`` and JSON keyword
arguments (``rollart-nb env-server --env ... --kwargs ...``). A wrapper such as
:class:`~rollart_nb.envs.WithFailures` takes an env object, not JSON, so these factories take the
inner env's spec instead.

Example:
    >>> env = with_failures("rollart_nb.envs:Arithmetic", p_raise=1.0, seed=0)
    >>> type(env).__name__, type(env.unwrapped).__name__
    ('WithFailures', 'Arithmetic')
"""

from __future__ import annotations

import itertools
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollart_nb.envs.wrappers import WithFailures, WithLatency
    from rollart_nb.protocols import Env

__all__ = ["with_failures", "with_latency"]

# Episodes of one server process are numbered, so each env built here draws its own stream.
_built = itertools.count()


def _inner(env: str, env_kwargs: dict[str, Any] | None) -> Env:
    from rollart_nb.envs.server import load_env_factory

    return load_env_factory(env, env_kwargs)()


def _stream(seed: int | None) -> str | None:
    # Distinct per server process and per episode: replicas and episodes never replay each
    # other's failures, as instances of one WithFailures template do not.
    return None if seed is None else f"{seed}/{os.getpid()}/{next(_built)}"


def with_failures(
    env: str, env_kwargs: dict[str, Any] | None = None, *, seed: int | None = None, **failures: Any
) -> WithFailures:
    """:class:`~rollart_nb.envs.WithFailures` around the env named ``env`` (``"module:Class"``).

    Args:
        env: the inner env's spec.
        env_kwargs: its constructor arguments.
        seed: base seed; each env built gets its own stream derived from it.
        **failures: ``p_raise``, ``p_hang``, ``hang_s``, ``on`` (see ``WithFailures``).
    """
    from rollart_nb.envs.wrappers import WithFailures

    return WithFailures(_inner(env, env_kwargs), seed=_stream(seed), **failures)


def with_latency(
    env: str, env_kwargs: dict[str, Any] | None = None, *, seed: int | None = None, **latency: float
) -> WithLatency:
    """:class:`~rollart_nb.envs.WithLatency` around the env named ``env`` (``"module:Class"``).

    Args:
        env: the inner env's spec.
        env_kwargs: its constructor arguments.
        seed: base seed; each env built gets its own stream derived from it.
        **latency: ``mean_s``, ``std_s``, ``long_tail_p``, ``long_tail_scale``.
    """
    from rollart_nb.envs.wrappers import WithLatency

    return WithLatency(_inner(env, env_kwargs), seed=_stream(seed), **latency)
