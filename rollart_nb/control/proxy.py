"""LLMProxy: the gateway between EnvManagers and generation workers.

A *client-side router* in the process that runs the EnvManagers: one actor hop per turn. Each
rollout process holds its own proxy; suspend/resume/abort are broadcast.

Routing (:class:`~rollart_nb.control.router.Router`): sticky per trajectory, first by task
hardware affinity, least loaded. With ``pd=True`` the prefill runs on a compute-optimized worker
and the decode on a bandwidth-optimized one (backends that implement ``prefill``/``decode``).

Dispatch: ``"direct"`` makes one actor call per turn; ``"batched"`` streams turns
(:mod:`rollart_nb.workers.streaming`). Each worker holds up to its engine's capacity
(:meth:`GeneratorWorker.capacity`) of this proxy's turns. Histories cross the wire once (see
:mod:`rollart_nb.control.env_manager`).

Failover: a call that fails because its worker died marks the worker dead; the turn goes again
to a live worker, which recomputes the KV from the history. While every
worker is dead, turns wait up to ``failover_wait_s`` for :meth:`LLMProxy.replace_target`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rollart_nb.control.router import Router
from rollart_nb.errors import GenerationError, HistoryMiss
from rollart_nb.protocols import GenerationRequest, GenerationResult

__all__ = ["GenTarget", "LLMProxy"]

log = logging.getLogger(__name__)

#: Ended trajectories forgotten on a worker in one call.
FORGET_BATCH = 64
#: Batched dispatch: turns queued while a worker's exchange call has waited this long on running
#: turns go in a separate submit call (a shorter call takes them along when it returns).
SUBMIT_AFTER_S = 0.003


@dataclass
class GenTarget:
    """A generation worker as the proxy sees it: an actor handle and where it runs."""

    handle: Any
    name: str
    hardware: str
    pool: str


class _TargetDied(GenerationError):
    """A generation worker died under a call: the turn is sent again to a live worker."""


def _is_death(e: BaseException) -> bool:
    """True if ``e`` says the worker's process is gone (not that the call itself failed)."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover - ray is a core dependency
        return False
    return isinstance(e, RayActorError)


def _plain_miss(e: HistoryMiss) -> HistoryMiss:
    """The HistoryMiss a worker raised, without Ray's wrapping (its traceback text)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, HistoryMiss):
        return cause
    return e if type(e) is HistoryMiss else HistoryMiss(str(e))


class LLMProxy:
    """Routes per-trajectory generate requests; can be suspended, resumed and aborted.

    Args:
        targets: generation workers.
        affinity: task -> preferred hardware ("H20", "compute", "bandwidth") or None.
        max_inflight: requests in flight on one worker before it counts as busy, for workers whose
            engine reports no capacity (:meth:`GeneratorWorker.capacity`); the others hold up
            to their capacity.
        pd: prefill/decode disaggregation.
        dispatch: "direct" (one actor call per turn) or "batched" (turns streamed in and out).
        max_batch: most turns in one ``submit`` call of batched dispatch.
        failover_wait_s: how long a turn waits for a replacement while every worker is dead.
        measured: tasks routed by their measured token profile (see
            :class:`~rollart_nb.control.router.Router`).
        model_spec: the served model's :class:`~rollart_nb.models.ModelSpec` (needed by ``measured``).
    """

    def __init__(
        self,
        targets: list[GenTarget],
        affinity: dict[str, str | None] | None = None,
        *,
        max_inflight: int = 256,
        pd: bool = False,
        dispatch: str = "direct",
        max_batch: int = 64,
        failover_wait_s: float = 300.0,
        measured: set[str] | frozenset[str] = frozenset(),
        model_spec: Any = None,
    ) -> None:
        if not targets:
            raise GenerationError("LLMProxy needs at least one generation worker")
        if dispatch not in ("direct", "batched"):
            raise GenerationError(f"dispatch must be 'direct' or 'batched', got {dispatch!r}")
        self.dispatch, self.max_batch = dispatch, max_batch
        self.client = uuid.uuid4().hex[:16]  # this proxy's outbox on the workers (batched dispatch)
        self._keys = itertools.count()
        self._queues: list[list[tuple[int, GenerationRequest, asyncio.Future]]] = [[] for _ in targets]
        # turns submitted to a worker and not collected yet: key -> (request, future)
        self._outstanding: list[dict[int, tuple[GenerationRequest, asyncio.Future]]] = [{} for _ in targets]
        self._pumping = [False] * len(targets)
        self._exchanging = [False] * len(targets)
        self._call_at = [0.0] * len(targets)  # when the worker's exchange call was sent
        self.batches = self.collects = 0
        # engine capacity per worker (None: unknown, max_inflight applies), learnt on first use
        self.capacity: list[int | None] = [None] * len(targets)
        self._caps: asyncio.Future | None = None
        self._forget: list[list[str]] = [[] for _ in targets]
        self._bg: set[asyncio.Task] = set()
        self.history_misses = 0
        self.targets = targets
        self.max_inflight, self.pd = max_inflight, pd
        self._inflight = [0] * len(targets)
        self._running: dict[str, int] = {}  # traj id -> worker index of its in-flight request
        self._aborted: set[str] = set()
        self._preempted: set[str] = set()  # in-flight turns stopped by suspend(preempt=True)
        self.preemptions = 0
        self._admit = asyncio.Event()
        self._admit.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.requests = 0
        self.suspended_s = 0.0
        self._holds = 0  # see hold()
        self._unheld = asyncio.Event()
        self._unheld.set()
        self.exempt: set[str] = set()  # trajectory ids that a hold lets through (validation)
        self.held_s = 0.0
        self.failover_wait_s = failover_wait_s
        self.dead: dict[int, str] = {}  # worker index -> why it is considered dead
        self._revived = asyncio.Event()  # set whenever a worker is replaced
        self.died = asyncio.Event()  # set while some worker is dead and not replaced
        self.deaths = self.rerouted = self.replaced = 0
        self.router = Router(targets, self._inflight, self.dead, affinity, measured, model_spec)

    def limits(self) -> list[int]:
        """Turns one worker holds before it counts as busy: its engine's capacity, else max_inflight."""
        return [c or self.max_inflight for c in self.capacity]

    async def _learn_capacities(self) -> None:
        """Ask every worker once for its engine's capacity (concurrently; None where it cannot say)."""
        if self._caps is None:
            self._caps = asyncio.ensure_future(self._ask_capacities(range(len(self.targets))))
        await asyncio.shield(self._caps)

    async def _ask_capacities(self, indices: Any) -> None:
        async def one(i: int) -> None:
            try:
                cap = await self.targets[i].handle.capacity.remote()
                self.capacity[i] = int(cap) if cap else None
            except Exception as e:  # a worker without the method (or dead): max_inflight applies
                log.debug("capacity of %s unknown: %s", self.targets[i].name, e)

        await asyncio.gather(*(one(i) for i in indices))

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        """Generate one turn; waits while suspended. Raises GenerationError if aborted, or if no
        worker is alive for ``failover_wait_s``."""
        while True:  # neither suspended (a weight update) nor held (a validation), both checked last
            if not self._admit.is_set():
                t0 = time.monotonic()
                await self._admit.wait()
                self.suspended_s += time.monotonic() - t0
            elif not self._unheld.is_set() and req.traj_id not in self.exempt:
                t0 = time.monotonic()
                await self._unheld.wait()
                self.held_s += time.monotonic() - t0
            else:
                break
        self.requests += 1
        if self._caps is None or not self._caps.done():
            await self._learn_capacities()
        while True:
            if req.traj_id in self._aborted:
                raise GenerationError(f"trajectory {req.traj_id} was aborted")
            await self._wait_for_live()
            try:
                if self.pd:
                    res = await self._generate_pd(req)
                else:
                    idx = self.router.route(req.traj_id, req.task, self.limits())
                    if self.dispatch == "batched":
                        res = await self._enqueue(idx, req)
                    else:
                        res = await self._call(idx, req, "generate", req, req.task)
                if req.traj_id in self._preempted:
                    self._preempted.discard(req.traj_id)
                    if res.finish_reason == "abort":  # stopped for a weight update: the sender continues it
                        res.finish_reason = "preempted"
                self.router.observe(req, res)
                return res
            except _TargetDied:
                self.rerouted += 1  # a live worker recomputes the KV (from the history, resent on a miss)
            except HistoryMiss:
                self.history_misses += 1
                raise

    async def score(self, traj_id: str, task: str, rows: list[list[int]]) -> dict[str, Any]:
        """``rows`` (trajectory ``traj_id``'s sequences) scored by a live generation worker
        (:meth:`GeneratorWorker.score <rollart_nb.workers.roles.GeneratorWorker.score>`), placed
        by ``task``'s affinity, least loaded. It waits out a weight update, not a hold, and
        counts as in flight, so an update waits for it; a worker that dies under it is replaced
        by another. Raises GenerationError if the worker fails, or none is alive."""
        await self._admit.wait()
        while True:
            await self._wait_for_live()
            idx = self.router.place(task, self.limits())
            target = self.targets[idx]
            with self._in_flight(idx):
                try:
                    return await target.handle.score.remote(rows)
                except Exception as e:
                    if not _is_death(e):
                        raise GenerationError(
                            f"{target.name} failed scoring trajectory {traj_id}: {type(e).__name__}: {str(e)[:200]}"
                        ) from e
                    self._mark_dead(idx, target, e)
                    self.rerouted += 1

    async def _wait_for_live(self) -> None:
        """Return once some worker is alive; GenerationError after ``failover_wait_s``."""
        deadline = time.monotonic() + self.failover_wait_s
        while len(self.dead) >= len(self.targets):
            self._revived.clear()
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                await asyncio.wait_for(self._revived.wait(), timeout=left)
            except TimeoutError:
                why = "; ".join(f"{self.targets[i].name}: {r}" for i, r in sorted(self.dead.items()))
                raise GenerationError(
                    f"every generation worker is dead and none was replaced within "
                    f"{self.failover_wait_s:.0f}s ({why[:400]})"
                ) from None

    def _mark_dead(self, idx: int, target: GenTarget, e: BaseException) -> None:
        """Record that ``target`` (worker ``idx``) died; its trajectories move on their next turn."""
        if self.targets[idx] is not target or idx in self.dead:
            return  # already known, or a call to a worker that has been replaced since
        self.deaths += 1
        self.died.set()
        self.dead[idx] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        self._move_off(idx, f"{target.name} died")

    def replace_target(self, idx: int, target: GenTarget) -> None:
        """Route to ``target`` in place of worker ``idx`` (dead, or replaced by hand); the
        trajectories placed on the old worker move on their next turn."""
        old = self.targets[idx]
        self.targets[idx] = target
        self.dead.pop(idx, None)
        if not self.dead:
            self.died.clear()
        self._move_off(idx, f"{old.name} was replaced")
        self._forget[idx] = []  # the replacement holds no history
        self.capacity[idx] = None
        self._spawn(self._ask_capacities([idx]))
        self.replaced += 1
        self._revived.set()

    def _move_off(self, idx: int, why: str) -> None:
        """Unpin the trajectories placed on worker ``idx`` and send its queued turns elsewhere."""
        self.router.unpin(idx)
        queued, self._queues[idx] = self._queues[idx], []
        sent, self._outstanding[idx] = self._outstanding[idx], {}
        for fut in [f for _, _, f in queued] + [f for _, f in sent.values()]:
            if not fut.done():
                fut.set_exception(_TargetDied(why))

    async def _enqueue(self, idx: int, req: GenerationRequest) -> GenerationResult:
        """Batched dispatch: queue the turn for worker ``idx``'s exchange loop; await its result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        key = next(self._keys)
        target = self.targets[idx]
        self._queues[idx].append((key, req, fut))
        with self._in_flight(idx, req.traj_id):
            self._kick(idx)
            try:
                return await fut
            except asyncio.CancelledError:
                if self._outstanding[idx].pop(key, None) is not None and self.targets[idx] is target:
                    self._spawn(self._quiet(target.handle.abort.remote(req.traj_id)))  # stop the remote work too
                raise

    def _kick(self, idx: int) -> None:
        """Make sure worker ``idx``'s queued turns get sent: by the exchange loop (its next call
        carries them), or, while its call waits on long turns, by a separate submit."""
        if not self._exchanging[idx]:
            self._exchanging[idx] = True
            self._spawn(self._exchange(idx, self.targets[idx]))
        elif not self._pumping[idx]:
            self._pumping[idx] = True
            self._spawn(self._pump(idx))

    def _take(self, idx: int) -> list[tuple[int, GenerationRequest, asyncio.Future]]:
        """Move up to ``max_batch`` queued turns of worker ``idx`` (callers still waiting) to its outstanding."""
        batch, self._queues[idx] = self._queues[idx][: self.max_batch], self._queues[idx][self.max_batch :]
        live = [(k, r, f) for k, r, f in batch if not f.done()]
        for k, r, f in live:
            self._outstanding[idx][k] = (r, f)
        return live

    async def _pump(self, idx: int) -> None:
        """Send the queued turns of a worker whose exchange call is waiting on running turns:
        after :data:`SUBMIT_AFTER_S` of that call (a short one takes them along on its return)."""
        try:
            while self._queues[idx]:
                waited = time.monotonic() - self._call_at[idx]
                if self._exchanging[idx] and waited < SUBMIT_AFTER_S:
                    await asyncio.sleep(SUBMIT_AFTER_S - waited)
                    continue
                if not self._exchanging[idx]:  # the loop ended meanwhile: it takes them
                    self._kick(idx)
                    return
                target, live = self.targets[idx], self._take(idx)
                if not live:
                    continue
                self.batches += 1
                try:
                    await target.handle.submit.remote(self.client, [(k, r) for k, r, _ in live])
                except Exception as e:  # the call failed: none of these turns runs
                    self._fail_sent(idx, target, live, e)
        finally:
            self._pumping[idx] = False

    async def _exchange(self, idx: int, target: GenTarget) -> None:
        """Worker ``idx``'s exchange loop, while it has turns queued or out: each call carries the
        queued turns and returns the results finished since the last (waiting for the first)."""
        try:
            while (self._outstanding[idx] or self._queues[idx]) and self.targets[idx] is target:
                if idx in self.dead:
                    return
                live = self._take(idx)
                if live:
                    self.batches += 1
                self._call_at[idx] = time.monotonic()
                try:
                    done = await target.handle.exchange.remote(self.client, [(k, r) for k, r, _ in live], 1.0)
                except Exception as e:
                    if _is_death(e):
                        self._mark_dead(idx, target, e)  # fails every outstanding turn (rerouted)
                        return
                    failed, self._outstanding[idx] = self._outstanding[idx], {}
                    self._fail_sent(idx, target, [(k, r, f) for k, (r, f) in failed.items()], e)
                    return
                self.collects += 1
                for key, res in done:
                    item = self._outstanding[idx].pop(key, None)
                    if item is None or item[1].done():
                        continue  # its caller is gone (cancelled, rerouted)
                    r, f = item
                    if isinstance(res, HistoryMiss):
                        f.set_exception(res)
                    elif isinstance(res, BaseException):
                        f.set_exception(self._failure(target, r, res))
                    else:
                        f.set_result(res)
        finally:
            self._exchanging[idx] = False
            if (self._outstanding[idx] or self._queues[idx]) and self.targets[idx] is not target:
                self._kick(idx)  # turns for a replacement arrived meanwhile

    def _fail_sent(
        self, idx: int, target: GenTarget, sent: list[tuple[int, GenerationRequest, asyncio.Future]], e: Exception
    ) -> None:
        """A call carrying ``sent`` failed: none of them runs (a dead worker is marked dead)."""
        if _is_death(e):
            self._mark_dead(idx, target, e)
        for k, r, f in sent:
            self._outstanding[idx].pop(k, None)
            if not f.done():
                f.set_exception(self._failure(target, r, e))

    def _failure(self, target: GenTarget, req: GenerationRequest, e: BaseException) -> BaseException:
        if _is_death(e):
            return _TargetDied(f"{target.name} died")
        if isinstance(e, HistoryMiss):
            return _plain_miss(e)
        return GenerationError(f"{target.name} failed on trajectory {req.traj_id}: {type(e).__name__}: {str(e)[:200]}")

    def _spawn(self, coro: Any) -> None:
        """Run ``coro`` in the background, keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    @staticmethod
    async def _quiet(ref: Any) -> None:
        """Await a fire-and-forget call so its error is observed (a dead worker has nothing to do)."""
        try:
            await ref
        except Exception as e:
            log.debug("background generator call failed: %s", e)

    async def _generate_pd(self, req: GenerationRequest) -> GenerationResult:
        p = self.router.route(req.traj_id, req.task, self.limits(), pref="compute")
        d = self.router.route_decode(req.traj_id, self.max_inflight)
        prefilled = await self._call(p, req, "prefill", req)
        return await self._call(d, req, "decode", req, prefilled)

    async def _call(self, idx: int, req: GenerationRequest, method: str, *args: Any) -> Any:
        target = self.targets[idx]
        with self._in_flight(idx, req.traj_id):
            try:
                return await getattr(target.handle, method).remote(*args)
            except asyncio.CancelledError:
                self._spawn(self._quiet(target.handle.abort.remote(req.traj_id)))  # stop the remote work too
                raise
            except Exception as e:
                if _is_death(e):
                    self._mark_dead(idx, target, e)
                raise self._failure(target, req, e) from (None if isinstance(e, HistoryMiss) else e)

    @contextlib.contextmanager
    def _in_flight(self, idx: int, traj_id: str | None = None) -> Iterator[None]:
        """Count one call on worker ``idx`` (of trajectory ``traj_id``, if any) while the block
        runs; :meth:`suspend` waits until none is left."""
        self._inflight[idx] += 1
        if traj_id is not None:
            self._running[traj_id] = idx
        self._idle.clear()
        try:
            yield
        finally:
            self._inflight[idx] -= 1
            if traj_id is not None:
                self._running.pop(traj_id, None)
            if not any(self._inflight):
                self._idle.set()

    # -- control ---------------------------------------------------------------------
    async def suspend(self, timeout_s: float | None = None, preempt: bool = False) -> None:
        """Stop admitting requests; return once the in-flight ones have finished.

        In-flight *trajectories* are preserved: their next turn waits for :meth:`resume`.
        ``preempt``: stop in-flight turns now (each returns its tokens with ``finish_reason``
        "preempted"); the sender continues them after :meth:`resume` from the whole history.
        """
        self._admit.clear()
        if preempt and self._running:
            running = [(tid, idx) for tid, idx in self._running.items() if idx not in self.dead]
            self._preempted.update(tid for tid, _ in running)
            self.preemptions += len(running)
            await asyncio.gather(*(self._quiet(self.targets[idx].handle.abort.remote(tid)) for tid, idx in running))
        await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)

    def resume(self) -> None:
        self._admit.set()

    def hold(self) -> None:
        """Hold back the next turn of every trajectory not in :attr:`exempt` until :meth:`release`
        (holds nest); turns in flight finish. Validation holds the rollout this way, so its
        seconds are not spent generating the next batch."""
        self._holds += 1
        self._unheld.clear()

    def release(self) -> None:
        self._holds = max(0, self._holds - 1)
        if not self._holds:
            self._unheld.set()

    @property
    def held(self) -> bool:
        return not self._unheld.is_set()

    @property
    def suspended(self) -> bool:
        return not self._admit.is_set()

    async def abort(self, traj_ids: list[str]) -> None:
        """Abort trajectories: their pending and future requests end with GenerationError."""
        for tid in traj_ids:
            self._aborted.add(tid)
            idx = self._running.get(tid)
            if idx is not None and idx not in self.dead:
                try:
                    await self.targets[idx].handle.abort.remote(tid)
                except Exception as e:  # a worker that died meanwhile has nothing left to abort
                    if not _is_death(e):
                        raise

    def forget(self, traj_id: str) -> None:
        """Drop routing state of a finished trajectory; its worker drops what it keeps for it
        (history, prefix KV) with the next :data:`FORGET_BATCH` ended trajectories."""
        self._aborted.discard(traj_id)
        self._preempted.discard(traj_id)
        for i in self.router.forget(traj_id):  # a PD decode node holds its KV too
            if i not in self.dead:
                self._queue_forget(i, traj_id)

    def _queue_forget(self, idx: int, traj_id: str) -> None:
        pending = self._forget[idx]
        pending.append(traj_id)
        if len(pending) >= FORGET_BATCH:
            self._forget[idx] = []
            try:
                self._spawn(self._quiet(self.targets[idx].handle.forget.remote(pending)))
            except (RuntimeError, AttributeError):  # no running loop, or a worker without forget
                pass

    def engines(self) -> list[dict[str, Any]]:
        """Per generation worker: ``inflight`` (this proxy's turns on it), ``queued`` (waiting to be
        submitted, batched dispatch), ``capacity`` (None: unknown) and ``occupancy`` (inflight
        over capacity, None when unknown)."""
        return [
            {
                "name": t.name,
                "inflight": n,
                "queued": len(q),
                "capacity": cap,
                "occupancy": None if not cap else min(n / cap, 1.0),
                "dead": i in self.dead,
            }
            for i, (t, n, q, cap) in enumerate(
                zip(self.targets, self._inflight, self._queues, self.capacity, strict=True)
            )
        ]

    def stats(self) -> dict[str, Any]:
        counters = ("collects", "history_misses", "requests", "suspended_s", "preemptions", "held_s", "batches")
        out: dict[str, Any] = {k: getattr(self, k) for k in counters + ("dispatch", "deaths", "rerouted", "replaced")}
        return out | {
            "engines": self.engines(),
            "fallbacks": self.router.fallbacks,
            "inflight": list(self._inflight),
            "sticky": len(self.router.sticky),
            "affinity": dict(self.router.affinity),
            "profiles": {t: dict(vars(p)) for t, p in self.router.profiles.items()},
            "dead": dict(self.dead),
        }
