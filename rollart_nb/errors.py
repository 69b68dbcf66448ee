"""Errors raised by rollart_nb.

Every error is a :class:`RollartError`; each message says what happened, to which
worker / env / trajectory, and what to do next. The tree::

    RollartError
    ├── ConfigError            bad argument or config value (reports every problem at once)
    ├── StateError             call in the wrong lifecycle state (Session / Pipeline closed, ...)
    │   └── CheckpointError    a checkpoint file is missing, truncated or corrupt (names it)
    ├── ResourceError          pool/binding problems
    │   ├── UnknownPoolError   a pool name that does not exist in the session
    │   └── NoCapacityError    nothing compatible is free, even after fallback
    │       └── PoolHeldError  another session on the cluster holds the slots (names it)
    ├── ClusterError           Worker/Cluster construction or invocation
    │   └── WorkerDiedError    a worker actor died (carries worker, pool, fix)
    ├── ConnectError           cannot reach a Ray cluster / store / service in time
    ├── ServerlessError        an HTTP endpoint answered non-2xx or timed out
    ├── RewardError            a reward function raised, timed out or returned NaN/inf
    ├── EnvError               an env raised or hung (the trajectory ends failed)
    │   └── SandboxError       the OS sandbox cannot start (bubblewrap missing, user namespaces off)
    ├── GenerationError        a generation backend failed or the request was aborted
    │   └── HistoryMiss        the generator does not hold the trajectory's history: resend it whole
    ├── RolloutStalledError    every recent trajectory failed: a batch cannot form
    ├── WeightSyncError        a weight version is missing, partial or corrupt
    └── StoreError             metadata store (GCS KV / Redis) failure

Messages (and ``ServerlessError.url``) pass through :func:`rollart_nb.redact.redact` when the
error is built, so credentials in URLs, bearer tokens and registered secrets never show in
``str``, ``repr``, tracebacks or pickled copies.
"""

from __future__ import annotations

from typing import Any

from rollart_nb.redact import redact, redact_url

__all__ = [
    "CheckpointError",
    "ClusterError",
    "ConfigError",
    "ConnectError",
    "EnvError",
    "GenerationError",
    "HistoryMiss",
    "NoCapacityError",
    "PoolHeldError",
    "ResourceError",
    "RewardError",
    "RollartError",
    "RolloutStalledError",
    "SandboxError",
    "ServerlessError",
    "StateError",
    "StoreError",
    "UnknownPoolError",
    "WeightSyncError",
    "WorkerDiedError",
]


class RollartError(Exception):
    """Base class of every error raised by rollart_nb. String arguments are redacted."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class ConfigError(RollartError, ValueError):
    """A config value or argument is invalid. The message lists every problem found."""

    def __init__(self, problems: str | list[str], *, where: str = "") -> None:
        if isinstance(problems, str):
            problems = [problems]
        self.problems = [redact(p) for p in problems]
        head = f"invalid {where}: " if where else ""
        if len(self.problems) == 1:
            msg = head + self.problems[0]
        else:
            msg = head + f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(msg)


class StateError(RollartError, RuntimeError):
    """A call was made in the wrong lifecycle state (e.g. on a closed Session)."""


class CheckpointError(StateError):
    """A checkpoint is damaged: the message names the file and the last good checkpoint."""

    def __init__(self, message: str, *, path: str = "") -> None:
        self.path = path
        super().__init__(message)


class ResourceError(RollartError):
    """A resource pool or binding problem."""


class UnknownPoolError(ResourceError, KeyError):
    """A pool name does not exist in this session."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class NoCapacityError(ResourceError):
    """No pool with free, compatible capacity exists for a worker."""


class PoolHeldError(NoCapacityError):
    """The slots a request needs are held by other sessions of the same Ray cluster.

    ``holders`` names them ("session 3fa2b1c0 (pid 1234 on host-a, since 12:40:01 UTC)"); the
    message says what to do: close that session, lower replicas, or add nodes to the pool.
    """

    def __init__(self, message: str, *, holders: list[str] | None = None) -> None:
        self.holders = list(holders or [])
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return _pool_held, (self.args[0] if self.args else "", self.holders)


def _pool_held(message: str, holders: list[str]) -> PoolHeldError:
    return PoolHeldError(message, holders=holders)


class ClusterError(RollartError):
    """Building a Cluster or calling one of its methods failed."""


class WorkerDiedError(ClusterError):
    """A worker actor died. ``worker``, ``pool`` and ``fix`` say which and what to do."""

    def __init__(self, message: str, *, worker: str = "", pool: str = "", fix: str = "") -> None:
        self.worker, self.pool, self.fix = worker, pool, fix
        super().__init__(message)


class ConnectError(RollartError, ConnectionError):
    """A Ray cluster, store or service could not be reached in time."""


class ServerlessError(RollartError):
    """A serverless endpoint answered with an error or did not answer in time."""

    def __init__(self, message: str, *, url: str = "", status: int | None = None) -> None:
        self.url, self.status = redact_url(url), status
        super().__init__(message)


class RewardError(RollartError):
    """A reward function raised, timed out, or returned a non-finite / non-number value."""


class EnvError(RollartError):
    """An environment raised or hung; the trajectory ends failed with this reason."""


class SandboxError(EnvError):
    """The OS sandbox for model-written code cannot start here; the message says how to fix it."""


class GenerationError(RollartError):
    """A generation backend failed, or the request was aborted."""


class HistoryMiss(GenerationError):
    """The generator does not hold this trajectory's history (a replaced worker, an eviction);
    the sender resends the whole history (``prefix_len=0``). ``traj_id``, ``expected`` (the
    request's ``prefix_len``) and ``held`` (tokens held, None: nothing) say which and why."""

    def __init__(self, message: str, *, traj_id: str = "", expected: int = 0, held: int | None = None) -> None:
        self.traj_id, self.expected, self.held = traj_id, expected, held
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return _history_miss, (self.args[0] if self.args else "", self.traj_id, self.expected, self.held)


def _history_miss(message: str, traj_id: str, expected: int, held: int | None) -> HistoryMiss:
    return HistoryMiss(message, traj_id=traj_id, expected=expected, held=held)


class RolloutStalledError(RollartError):
    """Every recent trajectory failed, so no batch can form; the message lists the reasons."""


class WeightSyncError(RollartError):
    """A weight version is missing, partial, or failed its checksum."""


class StoreError(RollartError):
    """The metadata store (Ray GCS KV or Redis) failed."""


def brief(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, with an ellipsis when cut (for messages)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
