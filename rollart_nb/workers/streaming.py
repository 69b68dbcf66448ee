"""Streamed turns: the generator side of batched dispatch.

A rollout process hands a generation worker many turns in one call and gets back every result
finished since its last call (:meth:`TurnStream.exchange`: it waits only while none is), or
only hands turns over (:meth:`TurnStream.submit`, which returns once they run). Each turn runs on its own as soon as it
arrives, and its result leaves as soon as it is done: one slow sequence never holds back the
others submitted with it, which is what continuous batching needs. One actor call in flight
per (rollout process, worker) carries any number of turns both ways.

Several rollout processes (rollout shards) share one worker: each has its own ``client`` id
and its own outbox.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rollart_nb.errors import GenerationError, HistoryMiss

__all__ = ["StreamedGeneration", "TurnStream"]

#: An outbox nobody collected from for this long is dropped (its rollout process is gone).
IDLE_CLIENT_S = 600.0


class _Outbox:
    def __init__(self) -> None:
        self.done: list[tuple[int, Any]] = []
        self.ready = asyncio.Event()
        self.running: dict[int, asyncio.Task] = {}
        self.seen = time.monotonic()


class TurnStream:
    """Runs submitted turns concurrently and hands their results out as they finish.

    Args:
        run: generates one turn (``await run(request) -> GenerationResult``).
        name: the worker's name, for messages.
    """

    def __init__(self, run: Callable[[Any], Awaitable[Any]], name: str = "") -> None:
        self._run, self.name = run, name
        self._boxes: dict[str, _Outbox] = {}
        self.submitted = 0

    def _box(self, client: str) -> _Outbox:
        box = self._boxes.get(client)
        if box is None:
            self._drop_idle()
            box = self._boxes[client] = _Outbox()
        box.seen = time.monotonic()
        return box

    def _drop_idle(self) -> None:
        now = time.monotonic()
        for client, box in list(self._boxes.items()):
            if not box.running and now - box.seen > IDLE_CLIENT_S:
                del self._boxes[client]

    async def submit(self, client: str, items: list[tuple[int, Any]]) -> int:
        """Start every ``(key, request)`` now; returns the number of turns running for ``client``."""
        box = self._box(client)
        for key, request in items:
            task = asyncio.ensure_future(self._one(box, key, request))
            box.running[key] = task
        self.submitted += len(items)
        return len(box.running)

    async def _one(self, box: _Outbox, key: int, request: Any) -> None:
        try:
            out: Any = await self._run(request)
        except asyncio.CancelledError:
            box.running.pop(key, None)
            raise
        except HistoryMiss as e:  # the sender resends the whole history
            out = e
        except Exception as e:  # one turn's failure is that turn's result; it must cross processes
            out = GenerationError(f"{type(e).__name__}: {str(e)[:300]}")
        box.running.pop(key, None)
        box.done.append((key, out))
        box.ready.set()

    async def exchange(self, client: str, items: list[tuple[int, Any]], wait_s: float = 1.0) -> list[tuple[int, Any]]:
        """:meth:`submit` ``items``, then hand back the results finished since the last call, as
        ``(key, result or exception)``: waits up to ``wait_s`` for the first one (an empty list
        after that); results that finish within the same pass of the event loop go along."""
        if items:
            await self.submit(client, items)
        box = self._box(client)
        if not box.done:
            box.ready.clear()
            try:
                await asyncio.wait_for(box.ready.wait(), timeout=wait_s)
            except TimeoutError:
                pass
        await asyncio.sleep(0)  # turns finishing right now join this answer
        out, box.done = box.done, []
        box.ready.clear()
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "clients": len(self._boxes),
            "running": sum(len(b.running) for b in self._boxes.values()),
            "undelivered": sum(len(b.done) for b in self._boxes.values()),
            "submitted": self.submitted,
        }


class StreamedGeneration:
    """The calls the LLMProxy makes on a generation worker besides ``generate`` (batched
    dispatch, and forgetting ended trajectories), served by ``self._stream`` and
    ``self.backend``. Mixed into :class:`~rollart_nb.workers.roles.GeneratorWorker` and the
    in-process :class:`~rollart_nb.control.local.LocalGenerator`; not called by users."""

    _stream: TurnStream
    backend: Any

    async def submit(self, client: str, items: list[tuple[int, Any]]) -> int:
        return await self._stream.submit(client, items)

    async def exchange(self, client: str, items: list[tuple[int, Any]], wait_s: float = 1.0) -> list[tuple[int, Any]]:
        return await self._stream.exchange(client, items, wait_s)

    def forget(self, traj_ids: list[str]) -> None:
        """Drop what the backend keeps for these ended trajectories (token history, prefix KV)."""
        drop = getattr(self.backend, "forget", None)
        if drop is not None:
            for tid in traj_ids:
                drop(tid)
