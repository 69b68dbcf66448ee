"""Pipeline modes as small strategy objects over one loop.

Each mode is a handful of switches read by the RolloutScheduler and the Pipeline:

========  ===============  ============  ==============  ==============  =============================
mode      env interaction  reward        launch          train overlap   staleness
========  ===============  ============  ==============  ==============  =============================
sync      batch-level      after batch   per iteration   no              none (all fresh)
sync+     trajectory       overlapped    per iteration   no              none (all fresh)
one-off   trajectory       overlapped    per iteration   yes (1 step)    all finish, stale 1
areal     trajectory       overlapped    windowed        yes             checked at start
rollart   trajectory       overlapped    windowed        yes             at start and every version, α
========  ===============  ============  ==============  ==============  =============================

"windowed": a group starts only while the groups started (less those given up) stay within
(batches taken + α + 1) batches; one opened beyond that could only go stale
(:class:`~rollart_nb.control.staleness.Staleness`). RollArt also aborts, at every version bump,
whatever began more than α versions ago; AReaL trains on it. Both preempt the turns in flight
at a weight update (``preempt``) and continue them after a KV recompute; the other modes'
updates wait for every turn in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollart_nb.errors import ConfigError

__all__ = ["MODES", "Mode", "mode"]


@dataclass(frozen=True)
class Mode:
    """Switches that define a pipeline mode.

    Attributes:
        name: "sync", "sync+", "one-off", "areal" or "rollart".
        batch_env: all envs of an iteration step together, turn by turn (a barrier per turn).
        reward_after_batch: score only after the whole iteration's rollout finished.
        continuous: keep every env busy across iterations (else launch one iteration's quota).
        overlap_train: run train_step concurrently with the next rollout.
        abort_stale: abort in-flight and buffered trajectories older than α at every version bump.
        admit_by_version: start a new group only while the groups started (less those given
            up) stay within (batches taken + α + 1) batches (the "windowed" launch above).
        preempt: a weight update stops the turns in flight (suspend) and they continue under
            the new weights, their KV recomputed, instead of the update waiting for the
            longest of them to end (RollArt's steps 2-5; AReaL's interruptible rollout).
    """

    name: str
    batch_env: bool = False
    reward_after_batch: bool = False
    continuous: bool = True
    overlap_train: bool = True
    abort_stale: bool = True
    admit_by_version: bool = False
    preempt: bool = False


MODES: dict[str, Mode] = {
    "sync": Mode(
        "sync", batch_env=True, reward_after_batch=True, continuous=False, overlap_train=False, abort_stale=False
    ),
    "sync+": Mode("sync+", continuous=False, overlap_train=False, abort_stale=False),
    "one-off": Mode("one-off", continuous=False, overlap_train=True, abort_stale=False),
    "areal": Mode("areal", continuous=True, overlap_train=True, abort_stale=False, admit_by_version=True, preempt=True),
    "rollart": Mode(
        "rollart", continuous=True, overlap_train=True, abort_stale=True, admit_by_version=True, preempt=True
    ),
}


def mode(name: str | Mode) -> Mode:
    """Look up a mode by name (a :class:`Mode` passes through)."""
    if isinstance(name, Mode):
        return name
    if name not in MODES:
        raise ConfigError(f"unknown mode {name!r}; choose one of {', '.join(MODES)}")
    return MODES[name]
