"""Ledger: how every trajectory of a rollout ended (one terminal status each), counted for stats,
reports and stall checks. ``counts`` are by current status (an evicted buffered sample moves from
completed to aborted_stale); ``events`` only grow, so a step's share is a difference. A task whose
recent trajectories all fail stalls; one user-code error on a task that never succeeded stops early.
"""

from __future__ import annotations

import collections
import re
from array import array
from collections.abc import Iterable, Iterator
from typing import Any

from rollart_nb.control.staleness import DISCARDED
from rollart_nb.logs import TRACEBACK_HEAD
from rollart_nb.trajectory import Status, Trajectory

__all__ = ["EndedLog", "Ledger", "TrainRecords"]

# Failure reasons name the env manager and trajectory; the stall message groups reasons without them.
_ENV_INDEX = re.compile(r"env #\d+")
_TRAJ_ID = re.compile(r"trajectory [0-9a-f]+")


def _reason_key(reason: str) -> str:
    """A failure reason without the ids that differ between trajectories of one error."""
    return _TRAJ_ID.sub("trajectory …", _ENV_INDEX.sub("env #…", reason))


def _env_number(name: str) -> int:
    return int(name.rsplit("#", 1)[1])


def _generated(traj: Trajectory) -> int:
    """Response tokens generated for ``traj`` so far (every turn, trained on or not, and the
    turns in flight the ``cancel`` staleness policy discarded)."""
    return sum(len(t.response_ids) for t in traj.turns) + int(traj.info.get(DISCARDED, 0))


class EndedLog:
    """The most recently ended trajectories, whole (for the viewer and ``pipe.trajectories``),
    bounded by count and by tokens: the oldest leave first, so a long run's memory stays flat
    whatever its trajectories' lengths.

    Args:
        max_trajectories: most trajectories kept.
        max_tokens: most tokens kept (each trajectory's conversation plus its generated tokens,
            whose log-probabilities and masks are stored per token).
    """

    def __init__(self, max_trajectories: int = 4096, max_tokens: int = 1 << 21) -> None:
        self.max_trajectories, self.max_tokens = max_trajectories, max_tokens
        self._items: collections.deque[tuple[Trajectory, int]] = collections.deque()
        self.tokens = 0

    def append(self, traj: Trajectory) -> None:
        last = traj.turns[-1] if traj.turns else None
        size = (len(last.prompt_ids) + len(last.response_ids) if last is not None else 0) + _generated(traj)
        self._items.append((traj, size))
        self.tokens += size
        while self._items and (len(self._items) > self.max_trajectories or self.tokens > self.max_tokens):
            self.tokens -= self._items.popleft()[1]

    def __iter__(self) -> Iterator[Trajectory]:
        return (t for t, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)


class TrainRecords:
    """What the train steps computed per token (``token_records`` of their metrics), by
    trajectory id, for the newest trajectories within ``max_tokens`` positions (stored as
    float32 arrays); :meth:`attach` sets ``Trajectory.train`` on the ones it knows."""

    def __init__(self, max_tokens: int = 1 << 21) -> None:
        self.max_tokens, self.tokens = max_tokens, 0
        self._items: collections.OrderedDict[str, tuple[dict[str, Any], int]] = collections.OrderedDict()

    def add(self, records: dict[str, dict[str, Any]] | None, step: int) -> None:
        for tid, rec in (records or {}).items():
            rows = [None if r is None else {k: array("f", v) for k, v in r.items()} for r in rec["rows"]]
            size = sum(len(r["logprob"]) for r in rows if r is not None)
            if tid in self._items:
                self.tokens -= self._items.pop(tid)[1]
            self._items[tid] = ({**rec, "step": step, "rows": rows}, size)
            self.tokens += size
        while self._items and self.tokens > self.max_tokens:
            self.tokens -= self._items.popitem(last=False)[1][1]

    def attach(self, trajectories: Iterable[Trajectory]) -> None:
        for t in trajectories:
            if t.id in self._items:
                rec = self._items[t.id][0]
                rows = [None if r is None else {k: list(v) for k, v in r.items()} for r in rec["rows"]]
                t.train = {**rec, "rows": rows}


class Ledger:
    """The counts of one rollout scheduler (it calls one method per ending).

    Args:
        group_size: GRPO group size (a task's early stop waits for that many same failures).

    Example:
        >>> led = Ledger(group_size=2)
        >>> led.launched += 1
        >>> led.ended_out(Trajectory("t", status=Status.FAILED, reason="env step: boom"))
        >>> led.counts["failed"], led.accounting({"running": 0})["unaccounted"]
        (1, 0)
    """

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.launched = 0
        self.counts: collections.Counter[str] = collections.Counter()
        self.events: collections.Counter[str] = collections.Counter()
        # generated (response) tokens of ended trajectories, by how they ended: wasted work shows here
        self.generated: collections.Counter[str] = collections.Counter()
        # "ended" (each trajectory once) and, by kind, tokens that became waste (at the ending or eviction)
        self.token_events: collections.Counter[str] = collections.Counter()
        self.task_events: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.ended = EndedLog()
        self.buffered_ids: set[str] = set()  # counted completed and still in the buffer
        self.failure_reasons: collections.deque[tuple[str, str]] = collections.deque(maxlen=64)
        self.consecutive_failures: collections.Counter[str] = collections.Counter()  # per task
        # per task: (reason without env/trajectory ids, failures in a row with it, the first one's reason)
        self.same_failure: dict[str, tuple[str, int, str]] = {}
        self.completed_by_task: collections.Counter[str] = collections.Counter()
        self.waited_s = 0.0  # the "wait" staleness policy's holds of wait_ready, and when its budget began
        self.hold_began: tuple[int, float] | None = None  # (version, loop time)

    def count(self, task: str, kind: str) -> None:
        """One more ``kind`` ending (a status, "penalized" or "redundant_cancelled"), overall and for ``task``."""
        self.events[kind] += 1
        self.task_events[task][kind] += 1

    def redundant(self, task: str) -> None:
        """A member cancelled because its group completed without it."""
        self.counts["redundant_cancelled"] += 1
        self.count(task, "redundant_cancelled")

    def note_failure(self, task: str, reason: str) -> None:
        self.failure_reasons.append((task, reason))
        self.consecutive_failures[task] += 1
        key = _reason_key(reason)
        prev = self.same_failure.get(task)
        if prev is not None and prev[0] == key:
            self.same_failure[task] = (key, prev[1] + 1, prev[2])
        else:
            self.same_failure[task] = (key, 1, reason)

    def ended_out(self, traj: Trajectory) -> None:
        """``traj`` ended without entering the buffer."""
        n = _generated(traj)
        self.counts[traj.status.value] += 1
        self.generated[traj.status.value] += n
        self.token_events["ended"] += n
        if traj.status in (Status.ABORTED_STALE, Status.CANCELLED):
            self.token_events[traj.status.value] += n
        else:
            self._discarded(traj)
        self.count(traj.task, traj.status.value)
        self.ended.append(traj)
        if traj.status is Status.FAILED:
            self.note_failure(traj.task, traj.reason)

    def renewed(self, traj: Trajectory, masked: int) -> None:
        """The ``cancel`` staleness policy renewed in-flight ``traj``; ``masked``: finished tokens
        it took out of the loss (waste, counted as ``renewed`` tokens at once)."""
        self.count(traj.task, "renewed")
        self.token_events["renewed"] += masked

    def _discarded(self, traj: Trajectory) -> None:
        """Tokens of turns the ``cancel`` policy discarded, waste once ``traj`` ends."""
        self.token_events["renewed"] += int(traj.info.get(DISCARDED, 0))

    def buffered(self, traj: Trajectory, penalized: bool) -> None:
        """``traj`` entered the buffer (counted completed; a penalized one is a failure too)."""
        self.buffered_ids.add(traj.id)
        self.counts["completed"] += 1
        self.generated["completed"] += _generated(traj)
        self.token_events["ended"] += _generated(traj)
        self._discarded(traj)
        self.count(traj.task, "completed")
        if penalized:  # counted only once it is in: a stale or surplus one ends as such instead
            self.count(traj.task, "penalized")
            self.note_failure(traj.task, traj.reason)
        self.ended.append(traj)

    def succeeded(self, task: str) -> None:
        self.consecutive_failures[task] = 0
        self.completed_by_task[task] += 1
        self.same_failure.pop(task, None)

    def evicted(self, t: Trajectory) -> bool:
        """A sample left the buffer with ``t.status``; returns whether it had been counted completed."""
        if t.id not in self.buffered_ids:
            return False
        self.buffered_ids.discard(t.id)
        self.counts["completed"] -= 1
        self.counts[t.status.value] += 1
        n = _generated(t)
        self.generated["completed"] -= n
        self.generated[t.status.value] += n
        self.token_events[t.status.value] += n  # trained on by nobody after all
        self.count(t.task, t.status.value)  # events only grow: a step reports its own endings
        return True

    def accounting(self, in_flight: dict[str, int]) -> dict[str, int]:
        """Every trajectory started, by where it is now: ended (by status) or ``in_flight``
        (name -> count). ``unaccounted`` is 0 unless a trajectory was lost (a bug)."""
        ended = {k: self.counts.get(k, 0) for k in ("completed", "aborted_stale", "cancelled", "failed")}
        lost = self.launched - sum(ended.values()) - sum(in_flight.values())
        return {"started": self.launched, **ended, **in_flight, "unaccounted": lost}

    def select(
        self, task: str | None, status: str | None, last: int | None, running: list[Trajectory]
    ) -> list[Trajectory]:
        """The kept ended trajectories (then ``running``) of ``task`` with ``status``, the ``last`` ones."""
        pool = [*self.ended, *running]
        out = [t for t in pool if (task is None or t.task == task) and (status is None or t.status.value == status)]
        return out[-last:] if last else out

    def stats(self) -> dict[str, Any]:
        """``counts`` (by current status), ``generated_tokens`` (response tokens of ended
        trajectories, by the same statuses), ``token_events`` (``ended``, and ``aborted_stale`` /
        ``cancelled`` once they became waste, ``renewed``: what the ``cancel`` staleness policy
        discarded or took out of the loss), ``events`` and ``task_events`` (endings, growing),
        ``waited_s`` (the ``wait`` policy's holds, growing)."""
        return {
            "counts": dict(self.counts),
            "generated_tokens": dict(self.generated),
            "token_events": dict(self.token_events),
            "events": dict(self.events),
            "task_events": {t: dict(c) for t, c in self.task_events.items()},
            "waited_s": self.waited_s,
        }

    # -- stalls ----------------------------------------------------------------------
    def is_broken(self, task: str) -> bool:
        """``task`` never completed a trajectory and its last ``group_size`` (at least 2)
        trajectories failed with one error of user code (an env or reward bug, with traceback)."""
        same = self.same_failure.get(task)
        if same is None or self.completed_by_task[task]:
            return False
        return same[1] >= max(self.group_size, 2) and TRACEBACK_HEAD in same[2]

    def broken_message(self, task: str) -> str:
        _, n, first = self.same_failure[task]
        return (
            f"the last {n} trajectories of task {task!r} all failed with the same error, and none of the task's "
            f"trajectories succeeded: stopping early. The first of them:\n{first}\n"
            "Fix the env or reward (rn.envs.check(env, reward=fn) reproduces it in this process), "
            "or give the task weight 0 in sess.tasks(..., weights=...)."
        )

    def is_stalled(self, task: str, envs: int) -> bool:
        """The recent trajectories of ``task`` (on ``envs`` envs) all failed: a batch cannot form."""
        return self.consecutive_failures[task] >= max(4 * envs, 4 * self.group_size, 16)

    def stall_message(self, task: str, env: dict[str, Any], pool: str) -> str:
        """Why ``task`` cannot fill its share: its commonest failure reasons, each with the envs
        it hit (the reasons name the failing component: env call, reward, generator), and the
        env thread pool's state (hung calls at the cap make healthy envs wait)."""
        reasons: collections.Counter[str] = collections.Counter()
        envs: dict[str, set[str]] = collections.defaultdict(set)
        for t, r in self.failure_reasons:
            if t == task:
                reasons[_reason_key(r)] += 1
                envs[_reason_key(r)].update(_ENV_INDEX.findall(r))
        lines = [
            f"  {c} x {r[:400]}" + (f" (on {', '.join(sorted(envs[r], key=_env_number))})" if envs[r] else "")
            for r, c in reasons.most_common(3)
        ]
        return (
            f"the last {self.consecutive_failures[task]} trajectories of task {task!r} all failed, and each batch "
            "needs its share of that task. Most common reasons:\n"
            + "\n".join(lines)
            + f"\nEnv faults so far: {env['restarts']} env restart(s), {env['timeouts']} env timeout(s); "
            + pool
            + ".\nFix the env/reward/generator, or give the task weight 0 in sess.tasks(..., weights=...)."
        )
