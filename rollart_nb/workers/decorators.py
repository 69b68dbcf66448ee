"""The three method decorators of a :class:`~rollart_nb.Worker`.

- :func:`register` — collective: ``cluster.m(...)`` runs on workers and aggregates with ``ray.get``.
- :func:`hw_mapping` — affinity: the call's ``tag_name`` picks workers whose hardware matches.
- :func:`register_serverless` — the Cluster calls a registered HTTP endpoint instead.

Each decorator only attaches a :class:`Dispatch` record to the function; the Cluster reads
it when it binds the method onto itself, so a decorated method still runs normally when
called directly on a worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rollart_nb.errors import ConfigError

__all__ = ["DISPATCH_ATTR", "Dispatch", "dispatch_of", "hw_mapping", "register", "register_serverless"]

F = TypeVar("F", bound=Callable[..., Any])
DISPATCH_ATTR = "_rollart_dispatch"
MODES = ("all", "one", "scatter")


@dataclass(frozen=True)
class Dispatch:
    """How a Cluster invokes a decorated Worker method.

    Attributes:
        kind: "register", "hw_mapping" or "serverless".
        mode: for register: "all" (every worker, list of results), "one" (rank 0 only) or
            "scatter" (each list argument is split by rank: worker i gets element i).
        affinity: for hw_mapping: tag -> preferred hardware name, or "compute"/"bandwidth".
        default: for hw_mapping: hardware for tags not in ``affinity`` (None: any worker).
        max_inflight: for hw_mapping: calls in flight after which a worker counts as busy.
        endpoint: for serverless: name of the endpoint registered with the session
            (defaults to the method name).
        timeout_s / retries: for serverless: per-request timeout and retry count.
    """

    kind: str
    mode: str = "all"
    affinity: dict[str, str] = field(default_factory=dict)
    default: str | None = None
    max_inflight: int = 8
    endpoint: str | None = None
    timeout_s: float = 30.0
    retries: int = 2


def dispatch_of(fn: Any) -> Dispatch | None:
    return getattr(fn, DISPATCH_ATTR, None)


def register(mode: str = "all") -> Callable[[F], F]:
    """Mark a Worker method as collective.

    Args:
        mode: "all" — run on every worker, return the list of results (rank order);
            "one" — run on rank 0, return its result;
            "scatter" — every list/tuple argument must have one element per worker; worker i
            receives element i; returns the list of results.

    Example:
        >>> class Trainer(rn.Worker):
        ...     @rn.register()
        ...     def compute_gradients(self, batch): ...
    """
    if callable(mode):  # used bare: @register
        return register()(mode)  # type: ignore[return-value]
    if mode not in MODES:
        raise ConfigError(f"register(mode={mode!r}): mode must be one of {MODES}")

    def deco(fn: F) -> F:
        setattr(fn, DISPATCH_ATTR, Dispatch("register", mode=mode))
        return fn

    return deco


def hw_mapping(
    affinity: dict[str, str] | None = None,
    *,
    default: str | None = None,
    max_inflight: int = 8,
) -> Callable[[F], F]:
    """Route a call by its ``tag_name`` to workers whose hardware matches.

    The decorated method must accept a ``tag_name`` argument (usually the task). For a call
    with ``tag_name=t``, the Cluster prefers workers whose hardware is ``affinity[t]`` (a
    hardware name like "H20", or "compute"/"bandwidth" for any compute- or
    bandwidth-optimized device), least loaded first; if none match, or all matching workers
    have ``max_inflight`` calls in flight, it falls back to the least-loaded compatible
    worker and counts the fallback.

    Example:
        >>> class Gen(rn.Worker):
        ...     @rn.hw_mapping({"math": "bandwidth", "frozenlake": "compute"})
        ...     def generate(self, prompt, tag_name): ...
    """
    if max_inflight < 1:
        raise ConfigError(f"hw_mapping(max_inflight={max_inflight}): must be >= 1")

    def deco(fn: F) -> F:
        import inspect

        if "tag_name" not in inspect.signature(fn).parameters:
            raise ConfigError(f"@hw_mapping method {fn.__qualname__} must take a 'tag_name' argument")
        setattr(
            fn,
            DISPATCH_ATTR,
            Dispatch("hw_mapping", affinity=dict(affinity or {}), default=default, max_inflight=max_inflight),
        )
        return fn

    return deco


def register_serverless(endpoint: str | None = None, *, timeout_s: float = 30.0, retries: int = 2) -> Callable[[F], F]:
    """Serve this method from a registered serverless endpoint instead of the workers.

    The Cluster replaces the method with an HTTP call (httpx) to the URL registered under
    ``endpoint`` (default: the method's name) with ``sess.register_endpoint(name, url)`` or
    ``sess.cluster(..., endpoints={name: url})``. Request body: ``{"args": [...], "kwargs": {...}}``;
    response: ``{"result": ...}``. Timeouts are retried with backoff; a non-2xx answer raises
    :class:`~rollart_nb.errors.ServerlessError`.

    Example:
        >>> class Reward(rn.Worker):
        ...     @rn.register_serverless("score")
        ...     def score(self, trajectory): ...   # local fallback body
    """
    if callable(endpoint):  # used bare
        return register_serverless()(endpoint)  # type: ignore[return-value]

    def deco(fn: F) -> F:
        setattr(
            fn,
            DISPATCH_ATTR,
            Dispatch("serverless", endpoint=endpoint or fn.__name__, timeout_s=timeout_s, retries=retries),
        )
        return fn

    return deco
