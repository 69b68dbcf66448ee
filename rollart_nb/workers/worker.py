"""The :class:`Worker` base class: a user-subclassable unit of computation run as a Ray actor."""

from __future__ import annotations

import logging
import os
from typing import Any

from rollart_nb.redact import RedactingFilter
from rollart_nb.resources.manager import Binding

__all__ = ["Worker"]


class Worker:
    """Base class of every role worker (train, generation, reward, environment).

    Subclass it, decorate methods with :func:`~rollart_nb.register`,
    :func:`~rollart_nb.hw_mapping` or :func:`~rollart_nb.register_serverless`, and build a
    Cluster with ``sess.cluster(name, MyWorker, pool=..., replicas=...)``. Inside the actor,
    ``self.binding`` (pool, node, hardware, fell_back), ``self.rank``, ``self.world_size``,
    ``self.hardware`` and ``self.pool`` are set before your ``__init__`` runs. Use
    ``self.log`` (a logger that writes to the session's log dir), never ``print``.

    Example:
        >>> class Doubler(rn.Worker):
        ...     @rn.register()
        ...     def double(self, x):
        ...         return 2 * x
        >>> c = sess.cluster("doublers", Doubler, pool="cpu", replicas=2)   # doctest: +SKIP
        >>> c.double(21)                                                     # doctest: +SKIP
        [42, 42]
    """

    default_pool: str = "cpu"
    """Pool used when ``sess.cluster(...)`` is given none."""
    max_concurrency: int = 64
    """Concurrent calls one worker actor accepts when ``sess.cluster(...)`` is given none
    (generation workers accept many more: a turn waits in the engine, not in front of the actor)."""
    binding: Binding | None = None
    world_size: int = 1
    role: str = ""

    @property
    def rank(self) -> int:
        return self.binding.index if self.binding else 0

    @property
    def hardware(self) -> str:
        return self.binding.hardware if self.binding else "CPU"

    @property
    def pool(self) -> str:
        return self.binding.pool if self.binding else ""

    @property
    def log(self) -> logging.Logger:
        return logging.getLogger(f"rollart_nb.worker.{self.role}.{self.rank}")

    # Called by the Cluster on every worker; not for users.
    def _rn_info(self) -> dict[str, Any]:
        import rollart_nb._ray as _ray

        return {
            "node_id": _ray.current_node_id(),
            "pid": os.getpid(),
            "hardware": self.hardware,
            "pool": self.pool,
            "rank": self.rank,
        }

    def _rn_call(self, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self, method)(*args, **kwargs)

    async def _rn_acall(self, method: str, args: tuple, kwargs: dict) -> Any:
        res = getattr(self, method)(*args, **kwargs)
        if hasattr(res, "__await__"):
            res = await res
        return res


def _setup_logging(log_dir: str | None, name: str) -> None:
    """Send this actor's logs to a file in the session's log dir (not into the notebook), with
    secrets masked (:class:`~rollart_nb.redact.RedactingFilter`)."""
    if not log_dir:
        return
    os.makedirs(log_dir, exist_ok=True)
    root = logging.getLogger("rollart_nb")
    if any(isinstance(h, logging.FileHandler) for h in root.handlers):
        return
    h = logging.FileHandler(os.path.join(log_dir, f"{name.replace('/', '_')}.log"))
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    h.addFilter(RedactingFilter())
    root.addHandler(h)
    root.setLevel(logging.INFO)
    import rollart_nb._ray as _ray
    from rollart_nb.logs import capture_user_output

    if _ray.in_worker_process():  # a worker actor's own process: its print and logging go to that file too
        capture_user_output(h.baseFilename)


def actor_class_for(worker_cls: type[Worker]) -> type:
    """A subclass that sets the binding before the user's ``__init__`` runs."""

    class _Actor(worker_cls):  # type: ignore[valid-type, misc]
        def __init__(
            self, _rn_binding: Binding, _rn_world: int, _rn_log_dir: str | None, *args: Any, **kwargs: Any
        ) -> None:
            self.binding = _rn_binding
            self.world_size = _rn_world
            self.role = _rn_binding.role
            _setup_logging(_rn_log_dir, _rn_binding.worker)
            super().__init__(*args, **kwargs)

    _Actor.__name__ = worker_cls.__name__
    _Actor.__qualname__ = worker_cls.__qualname__
    _Actor.__doc__ = worker_cls.__doc__
    return _Actor
