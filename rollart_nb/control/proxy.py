"""LLMProxy: the gateway between EnvManagers and generation workers.

The proxy is a *client-side router*: it lives in the process that runs the EnvManagers and
sends each request straight to a generation worker actor (one actor hop per turn), instead of
being one actor that every request must pass through. Several rollout processes each hold
their own proxy, so routing scales out with them; suspend/resume/abort are broadcast.

Routing per request: sticky per trajectory (prefix-cache locality) once placed; the first
turn goes by task hardware affinity (decode-heavy -> bandwidth-optimized, prefill-heavy ->
compute-optimized, via the same rule as ``@hw_mapping``), least loaded. With
``pd=True`` the prefill runs on a compute-optimized worker and the decode on a
bandwidth-optimized one (backends that implement ``prefill``/``decode``).

Failover: a call that fails because its worker died (a Ray actor error) marks the worker dead;
the turn goes again to a live worker, which recomputes the KV from the history the request
carries (every request holds the whole trajectory so far, the same path a resumed trajectory
takes after a weight update). While every worker is dead, turns wait up to
``failover_wait_s`` for :meth:`LLMProxy.replace_target`, which the pipeline calls once a
replacement has loaded the served weights.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from rollart_nb.errors import GenerationError
from rollart_nb.protocols import GenerationRequest, GenerationResult
from rollart_nb.workers.routing import pick_worker

__all__ = ["GenTarget", "LLMProxy"]


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


class LLMProxy:
    """Routes per-trajectory generate requests; can be suspended, resumed and aborted.

    Args:
        targets: generation workers.
        affinity: task -> preferred hardware ("H20", "compute", "bandwidth") or None.
        max_inflight: requests in flight on one worker before it counts as busy.
        pd: prefill/decode disaggregation.
        failover_wait_s: how long a turn waits for a replacement while every worker is dead.
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
    ) -> None:
        if not targets:
            raise GenerationError("LLMProxy needs at least one generation worker")
        if dispatch not in ("direct", "batched"):
            raise GenerationError(f"dispatch must be 'direct' or 'batched', got {dispatch!r}")
        # "batched": requests for one worker that arrive while its previous call is in flight go
        # together in one actor call (one hop for many turns), like an engine consuming a batch.
        self.dispatch, self.max_batch = dispatch, max_batch
        self._queues: list[list[tuple[GenerationRequest, asyncio.Future]]] = [[] for _ in targets]
        self._pumping = [False] * len(targets)
        self.batches = 0
        self.targets = targets
        self.affinity = dict(affinity or {})
        self.max_inflight, self.pd = max_inflight, pd
        self._inflight = [0] * len(targets)
        self._sticky: dict[str, int] = {}
        self._running: dict[str, int] = {}  # traj id -> worker index of its in-flight request
        self._aborted: set[str] = set()
        self._admit = asyncio.Event()
        self._admit.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.fallbacks = 0
        self.requests = 0
        self.suspended_s = 0.0
        # a validation holds training turns back (its own go ahead), so its seconds are not
        # spent generating the next batch: see hold()
        self._holds = 0
        self._unheld = asyncio.Event()
        self._unheld.set()
        self.exempt: set[str] = set()  # trajectory ids that a hold lets through (validation)
        self.held_s = 0.0
        self.failover_wait_s = failover_wait_s
        self.dead: dict[int, str] = {}  # worker index -> why it is considered dead
        self._revived = asyncio.Event()  # set whenever a worker is replaced
        self.died = asyncio.Event()  # set while some worker is dead and not replaced
        self.deaths = self.rerouted = self.replaced = 0

    # -- routing ---------------------------------------------------------------------
    def route(self, traj_id: str, task: str, pref: str | None = None) -> int:
        """Worker index for this trajectory's next turn (sticky once placed)."""
        idx = self._sticky.get(traj_id)
        if idx is not None and idx not in self.dead:
            return idx
        pref = pref if pref is not None else self.affinity.get(task)
        idx, fell_back = pick_worker(
            [(t.hardware, t.pool) for t in self.targets],
            self._inflight,
            pref,
            self.max_inflight,
            exclude=frozenset(self.dead),
        )
        self.fallbacks += int(fell_back)
        self._sticky[traj_id] = idx
        return idx

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
        while True:
            if req.traj_id in self._aborted:
                raise GenerationError(f"trajectory {req.traj_id} was aborted")
            await self._wait_for_live()
            try:
                if self.pd:
                    return await self._generate_pd(req)
                idx = self.route(req.traj_id, req.task)
                if self.dispatch == "batched":
                    return await self._enqueue(idx, req)
                return await self._call(idx, req, "generate", req, req.task)
            except _TargetDied:
                self.rerouted += 1  # the history travels with the request: a live worker recomputes its KV

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
        self.replaced += 1
        self._revived.set()

    def _move_off(self, idx: int, why: str) -> None:
        """Unpin the trajectories placed on worker ``idx`` and send its queued turns elsewhere."""
        for tid in [t for t, i in self._sticky.items() if i == idx]:
            del self._sticky[tid]
        queued, self._queues[idx] = self._queues[idx], []
        for _, fut in queued:
            if not fut.done():
                fut.set_exception(_TargetDied(why))

    async def _enqueue(self, idx: int, req: GenerationRequest) -> GenerationResult:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queues[idx].append((req, fut))
        self._inflight[idx] += 1
        self._running[req.traj_id] = idx
        self._idle.clear()
        if not self._pumping[idx]:
            self._pumping[idx] = True
            asyncio.get_running_loop().create_task(self._pump(idx))
        try:
            return await fut
        finally:
            self._inflight[idx] -= 1
            self._running.pop(req.traj_id, None)
            if not any(self._inflight):
                self._idle.set()

    async def _pump(self, idx: int) -> None:
        """Send whatever is queued for worker ``idx`` as one call, until the queue is empty."""
        try:
            while self._queues[idx]:
                batch, self._queues[idx] = self._queues[idx][: self.max_batch], self._queues[idx][self.max_batch :]
                live = [(r, f) for r, f in batch if not f.done()]
                if not live:
                    continue
                self.batches += 1
                target = self.targets[idx]
                try:
                    results = await target.handle.generate_many.remote([r for r, _ in live])
                except Exception as e:  # the whole call failed (worker died, ...)
                    if _is_death(e):
                        self._mark_dead(idx, target, e)
                        results = [_TargetDied(f"{target.name} died")] * len(live)
                    else:
                        results = [e] * len(live)
                for (r, f), res in zip(live, results, strict=True):
                    if f.done():
                        continue
                    if isinstance(res, _TargetDied):
                        f.set_exception(res)
                    elif isinstance(res, BaseException):
                        f.set_exception(
                            GenerationError(
                                f"{self.targets[idx].name} failed on trajectory "
                                f"{r.traj_id}: {type(res).__name__}: {str(res)[:200]}"
                            )
                        )
                    else:
                        f.set_result(res)
        finally:
            self._pumping[idx] = False

    async def _generate_pd(self, req: GenerationRequest) -> GenerationResult:
        p = self.route(req.traj_id, req.task, pref="compute")
        d, fell_back = pick_worker(
            [(t.hardware, t.pool) for t in self.targets],
            self._inflight,
            "bandwidth",
            self.max_inflight,
            exclude=frozenset(self.dead),
        )
        self.fallbacks += int(fell_back)
        prefilled = await self._call(p, req, "prefill", req)
        return await self._call(d, req, "decode", req, prefilled)

    async def _call(self, idx: int, req: GenerationRequest, method: str, *args: Any) -> Any:
        target = self.targets[idx]
        self._inflight[idx] += 1
        self._running[req.traj_id] = idx
        self._idle.clear()
        try:
            return await getattr(target.handle, method).remote(*args)
        except asyncio.CancelledError:
            target.handle.abort.remote(req.traj_id)  # stop the remote work too
            raise
        except Exception as e:
            if _is_death(e):
                self._mark_dead(idx, target, e)
                raise _TargetDied(f"{target.name} died") from e
            raise GenerationError(
                f"{target.name} failed on trajectory {req.traj_id}: {type(e).__name__}: {str(e)[:200]}"
            ) from e
        finally:
            self._inflight[idx] -= 1
            self._running.pop(req.traj_id, None)
            if not any(self._inflight):
                self._idle.set()

    # -- control ---------------------------------------------------------------------
    async def suspend(self, timeout_s: float | None = None) -> None:
        """Stop admitting requests; return once the in-flight ones have finished.

        In-flight *trajectories* are preserved: their next turn waits for :meth:`resume`.
        """
        self._admit.clear()
        await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)

    def resume(self) -> None:
        self._admit.set()

    def hold(self) -> None:
        """Hold back the next turn of every trajectory not in :attr:`exempt` until :meth:`release`
        (holds nest). Turns in flight finish; nothing is aborted; the scheduler starts no new
        trajectory meanwhile. Validation holds the rollout this way, so a step's tokens/s does
        not count work done while it ran."""
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
        """Drop routing state of a finished trajectory."""
        self._sticky.pop(traj_id, None)
        self._aborted.discard(traj_id)

    def stats(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "fallbacks": self.fallbacks,
            "inflight": list(self._inflight),
            "sticky": len(self._sticky),
            "suspended_s": self.suspended_s,
            "held_s": self.held_s,
            "batches": self.batches,
            "dispatch": self.dispatch,
            "dead": dict(self.dead),
            "deaths": self.deaths,
            "rerouted": self.rerouted,
            "replaced": self.replaced,
        }
