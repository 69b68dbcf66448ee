"""In-process stand-ins for actor handles, so the control plane runs inside one event loop.

:class:`LocalHandle` gives any object the ``handle.method.remote(...)`` calling convention of a
Ray actor handle, returning an awaitable. The LLMProxy and RolloutScheduler then run
unchanged against in-process backends: large what-if studies (hundreds of simulated GPUs,
thousands of envs) on one core, and fast tests of the scheduling logic itself.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from rollart_nb.workers.roles import engine_capacity
from rollart_nb.workers.streaming import StreamedGeneration, TurnStream

__all__ = ["LocalGenerator", "LocalHandle"]


class _Method:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future:
        """Start the call; returns an awaitable future (like an ObjectRef in an async actor)."""
        loop = asyncio.get_running_loop()
        res = self._fn(*args, **kwargs)
        if inspect.isawaitable(res):
            return asyncio.ensure_future(res)
        fut = loop.create_future()
        fut.set_result(res)
        return fut


class LocalHandle:
    """Wrap ``obj`` so ``handle.m.remote(*a)`` calls ``obj.m(*a)`` on the running loop.

    Example:
        >>> from rollart_nb.sim import SimBackend                               # doctest: +SKIP
        >>> h = LocalHandle(SimBackend(spec("qwen3-8b"), PROFILES["H20"]))       # doctest: +SKIP
        >>> res = await h.generate.remote(request)                               # doctest: +SKIP
    """

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._obj, name))

    def __repr__(self) -> str:
        return f"LocalHandle({self._obj!r})"


class LocalGenerator(StreamedGeneration):
    """A generation backend with a generation worker's calling convention (in-process).

    Wrap it in :class:`LocalHandle` to give it to an LLMProxy without Ray.
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._stream = TurnStream(self.backend.generate, "local")

    async def generate(self, request: Any, tag_name: str | None = None) -> Any:
        return await self.backend.generate(request)

    def capacity(self) -> int | None:
        return engine_capacity(self.backend)

    async def prefill(self, request: Any) -> Any:
        return await self.backend.prefill(request)

    async def decode(self, request: Any, prefilled: Any) -> Any:
        return await self.backend.decode(request, prefilled)

    async def abort(self, traj_id: str) -> None:
        await self.backend.abort(traj_id)

    def load_weights(self, state: Any, version: int) -> int:
        self.backend.load_weights(state, version)
        return self.backend.version
