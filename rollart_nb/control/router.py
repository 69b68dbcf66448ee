"""Router: which generation worker an LLMProxy sends each trajectory's turns to."""

from __future__ import annotations

from typing import Any

from rollart_nb.protocols import GenerationRequest, GenerationResult
from rollart_nb.workers.routing import MIN_PROFILE_TURNS, TokenProfile, assign_affinity, pick_worker

__all__ = ["Router"]


class Router:
    """Per-trajectory placement over a proxy's workers.

    Sticky per trajectory (prefix-cache locality) once placed; the first turn goes by task
    hardware affinity (decode-heavy -> bandwidth-optimized, prefill-heavy -> compute-optimized,
    via the same rule as ``@hw_mapping``), least loaded. Under prefill/decode disaggregation each
    trajectory also keeps a decode worker.

    Args:
        targets, inflight, dead: the proxy's workers, its turns in flight per worker and its dead
            workers (shared with it, read only here).
        affinity: task -> preferred hardware ("H20", "compute", "bandwidth") or None.
        measured: tasks routed by their measured token profile: every ``MIN_PROFILE_TURNS`` turns
            the roofline prices the task's mean turn on each kind of hardware in the cluster, and
            its ``affinity`` entry becomes the kind it has the comparative advantage on
            (:func:`~rollart_nb.workers.routing.assign_affinity`). Until then the given entry routes.
        model_spec: the served model's :class:`~rollart_nb.models.ModelSpec` (needed by ``measured``).
    """

    def __init__(
        self,
        targets: list[Any],
        inflight: list[int],
        dead: dict[int, str],
        affinity: dict[str, str | None] | None,
        measured: set[str] | frozenset[str],
        model_spec: Any,
    ) -> None:
        self.targets, self.inflight, self.dead = targets, inflight, dead
        self.affinity = dict(affinity or {})
        self.measured = set(measured) if model_spec is not None else set()
        self.model_spec = model_spec
        self.profiles: dict[str, TokenProfile] = {}  # task -> measured tokens per turn
        self._batch: float | None = None  # mean turns in flight per worker, as measured turns end
        self.sticky: dict[str, int] = {}
        self.sticky_d: dict[str, int] = {}  # PD: each trajectory's decode worker
        self.fallbacks = 0

    def _pick(self, pref: str | None, limits: int | list[int]) -> int:
        workers = [(t.hardware, t.pool) for t in self.targets]
        idx, fell_back = pick_worker(workers, self.inflight, pref, limits, exclude=frozenset(self.dead))
        self.fallbacks += int(fell_back)
        return idx

    def route(self, traj_id: str, task: str, limits: list[int], pref: str | None = None) -> int:
        """Worker index for this trajectory's next turn (sticky once placed)."""
        idx = self.sticky.get(traj_id)
        if idx is None or idx in self.dead:
            idx = self.sticky[traj_id] = self._pick(pref if pref is not None else self.affinity.get(task), limits)
        return idx

    def place(self, task: str, limits: list[int]) -> int:
        """A worker for one call that belongs to no running trajectory (scoring a stored one):
        by the task's hardware affinity, least loaded; nothing is pinned."""
        return self._pick(self.affinity.get(task), limits)

    def route_decode(self, traj_id: str, limit: int) -> int:
        """PD: the trajectory's decode worker, which keeps its KV between turns."""
        d = self.sticky_d.get(traj_id)
        if d is None or d in self.dead:
            d = self.sticky_d[traj_id] = self._pick("bandwidth", limit)
        return d

    def observe(self, req: GenerationRequest, res: GenerationResult) -> None:
        """Add a finished turn of a measured task to its token profile; re-decide the task's
        hardware every ``MIN_PROFILE_TURNS`` turns."""
        if req.task not in self.measured or res.finish_reason not in ("stop", "length"):
            return
        prof = self.profiles.setdefault(req.task, TokenProfile())
        # prompt tokens the worker computed: those it did not hold, or the whole history when new
        # weights made its cached KV stale
        new = max(len(req.prompt_ids), res.recomputed_tokens)
        prof.observe(new, req.full_len - new, len(res.token_ids))
        # the decode batch a turn shares: turns in flight per live worker, averaged over turns
        now = (sum(self.inflight) + 1) / max(len(self.targets) - len(self.dead), 1)
        self._batch = now if self._batch is None else 0.9 * self._batch + 0.1 * now
        if prof.turns % MIN_PROFILE_TURNS == 0:
            hardware = [t.hardware for t in self.targets]
            self.affinity.update(assign_affinity(self.model_spec, hardware, self.profiles, max(self._batch, 1.0)))

    def unpin(self, idx: int) -> None:
        """Forget every placement on worker ``idx`` (dead or replaced)."""
        for tid in [t for t, i in self.sticky.items() if i == idx]:
            del self.sticky[tid]

    def forget(self, traj_id: str) -> set[int]:
        """Drop a finished trajectory's placements; returns the workers that held it."""
        return {i for i in (self.sticky.pop(traj_id, None), self.sticky_d.pop(traj_id, None)) if i is not None}
