"""SampleBuffer: scored trajectories wait here, grouped, under the staleness rule.

:meth:`SampleBuffer.set_version` evicts what :class:`~rollart_nb.control.staleness.Staleness`
excludes (and returns it so the scheduler can account for it and relaunch group members);
:meth:`SampleBuffer.take_batch` evicts again and returns whole GRPO groups only. The scheduler's
admission rule keeps the buffer at O(alpha * E) trajectories; :attr:`capacity` enforces that hard.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from rollart_nb.control.staleness import Staleness
from rollart_nb.errors import ConfigError
from rollart_nb.trajectory import Status, Trajectory

__all__ = ["SampleBuffer", "split_quota"]


def split_quota(need: int, weights: dict[str, float]) -> dict[str, int]:
    """Split ``need`` groups across tasks in proportion to ``weights`` (largest remainder)."""
    total = sum(w for w in weights.values() if w > 0)
    if total <= 0:
        raise ConfigError("task weights must have a positive sum")
    exact = {t: need * max(w, 0.0) / total for t, w in weights.items()}
    out = {t: int(x) for t, x in exact.items()}
    for t in sorted(exact, key=lambda t: out[t] - exact[t])[: need - sum(out.values())]:
        out[t] += 1
    return out


class SampleBuffer:
    """Holds scored trajectories by GRPO group until a batch takes them.

    Args:
        group_size: members a group needs to be complete.
        staleness: the α rule (one that does not ``abort_stale`` keeps everything).
        capacity: hard cap on buffered trajectories (the O(α·E) bound); ``put`` beyond it
            evicts the oldest incomplete groups first.

    Example:
        >>> buf = SampleBuffer(group_size=2, staleness=Staleness(alpha=1), capacity=64)
        >>> for i in range(2):
        ...     buf.put(Trajectory("math", group_id="g0", status=Status.COMPLETED, reward=1.0, reward_version=0))
        >>> [t.group_id for t in buf.take_batch(2)]
        ['g0', 'g0']
    """

    def __init__(self, group_size: int, staleness: Staleness, capacity: int) -> None:
        problems = []
        if group_size < 1:
            problems.append(f"group_size={group_size} must be >= 1")
        if capacity < group_size:
            problems.append(f"capacity={capacity} must be >= group_size={group_size}")
        if problems:
            raise ConfigError(problems, where="SampleBuffer")
        self.group_size, self.staleness, self.capacity = group_size, staleness, capacity
        self.version = 0
        self._groups: OrderedDict[str, list[Trajectory]] = OrderedDict()
        self._changed: asyncio.Event | None = None
        self.peak = 0

    # -- state -----------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(g) for g in self._groups.values())

    def groups(self) -> dict[str, int]:
        """group id -> members buffered."""
        return {g: len(m) for g, m in self._groups.items()}

    def complete_groups(self) -> list[str]:
        return [g for g, m in self._groups.items() if len(m) >= self.group_size]

    def ready(self, n: int, task_weights: dict[str, float] | None = None) -> bool:
        """True if ``n`` trajectories' worth of complete groups are buffered (each task's share,
        when ``task_weights`` is given)."""
        done = self.complete_groups()
        if not task_weights:
            return len(done) * self.group_size >= n
        have: dict[str, int] = {}
        for g in done:
            task = self._groups[g][0].task
            have[task] = have.get(task, 0) + 1
        return all(have.get(t, 0) >= q for t, q in split_quota(n // self.group_size, task_weights).items())

    def is_stale(self, traj: Trajectory) -> bool:
        return self.staleness.is_stale(traj, self.version)

    # -- mutation --------------------------------------------------------------------
    def put(self, traj: Trajectory) -> list[Trajectory]:
        """Add a scored, completed trajectory. Returns the trajectories evicted to make room
        (and ``traj`` itself, marked aborted_stale, if it is already stale)."""
        if traj.status is not Status.COMPLETED:
            raise ValueError(f"only completed trajectories go in the buffer, got {traj.status.value}")
        if self.is_stale(traj):
            traj.status, traj.reason = Status.ABORTED_STALE, self.staleness.reason(traj, self.version)
            return [traj]
        members = self._groups.setdefault(traj.group_id, [])
        if len(members) >= self.group_size:  # a surplus member (redundant rollout): keep the first finishers
            traj.status, traj.reason = Status.CANCELLED, "group already complete"
            return [traj]
        members.append(traj)
        evicted = self._enforce_capacity()
        self.peak = max(self.peak, len(self))
        self._notify()
        return evicted

    def set_version(self, version: int) -> list[Trajectory]:
        """Advance the policy version and evict what became stale (returned, marked aborted_stale)."""
        self.version = version
        return self.evict_stale()

    def evict_stale(self) -> list[Trajectory]:
        return self.evict(self.is_stale)

    def evict(self, pred: Any, reason: str | None = None) -> list[Trajectory]:
        """Remove the buffered trajectories for which ``pred(t)`` holds (returned, marked
        aborted_stale with ``reason``, or the staleness reason)."""
        out: list[Trajectory] = []
        for gid in list(self._groups):
            keep = []
            for t in self._groups[gid]:
                if pred(t):
                    t.status, t.reason = Status.ABORTED_STALE, reason or self.staleness.reason(t, self.version)
                    out.append(t)
                else:
                    keep.append(t)
            if keep:
                self._groups[gid] = keep
            else:
                del self._groups[gid]
        if out:
            self._notify()
        return out

    def take_batch(self, n: int, task_weights: dict[str, float] | None = None) -> list[Trajectory]:
        """Remove and return ``n`` trajectories as whole complete groups (oldest first).

        ``n`` must be a multiple of ``group_size``. With ``task_weights``, each task gets
        exactly its share of the groups (see :func:`split_quota`).
        """
        if n % self.group_size:
            raise ConfigError(f"batch size {n} is not a multiple of group_size {self.group_size}")
        self.evict_stale()
        need = n // self.group_size
        if not self.ready(n, task_weights):
            raise ValueError(f"{n} samples are not ready; await wait_ready first")
        done = self.complete_groups()
        if task_weights:
            chosen: list[str] = []
            for task, quota in split_quota(need, task_weights).items():
                chosen += [g for g in done if self._groups[g][0].task == task][:quota]
        else:
            chosen = done[:need]
        batch: list[Trajectory] = []
        for g in chosen:
            batch += self._groups.pop(g)[: self.group_size]
        return batch

    async def wait_ready(
        self, n: int, timeout_s: float | None = None, task_weights: dict[str, float] | None = None
    ) -> None:
        """Block (async) until :meth:`ready` (``n``, ``task_weights``)."""
        loop = asyncio.get_running_loop()  # loop time: a SimSession's virtual clock, else monotonic
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not self.ready(n, task_weights):
            ev = self._event()
            ev.clear()
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"SampleBuffer: {n} samples not ready within {timeout_s}s")
            try:
                await asyncio.wait_for(ev.wait(), timeout=remaining)
            except TimeoutError:
                continue

    # -- internals -------------------------------------------------------------------
    def _enforce_capacity(self) -> list[Trajectory]:
        out: list[Trajectory] = []
        while len(self) > self.capacity:
            # drop the oldest incomplete group first (complete ones are about to be trained on)
            victim = next((g for g, m in self._groups.items() if len(m) < self.group_size), None)
            victim = victim or next(iter(self._groups))
            for t in self._groups.pop(victim):
                t.status, t.reason = Status.CANCELLED, f"buffer over capacity {self.capacity}"
                out.append(t)
        return out

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
