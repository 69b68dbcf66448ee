"""Failover of one pipeline. A generator that died is restarted on a compatible slot, loads the
served weights and takes over its routing (its trajectories move to live workers at their next
turn); a trainer that died is restored from the newest autosave, the served version rolled back
to it. A worker restarted by hand is taken over the same way. Each is an event in the StepReport;
``max_worker_restarts`` bounds the automatic restarts per worker slot.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from rollart_nb.control.checkpoint import read_checkpoint
from rollart_nb.errors import StateError, WorkerDiedError

__all__ = ["Failover", "RestartsExhausted", "worker_of"]

log = logging.getLogger(__name__)


class RestartsExhausted(WorkerDiedError):
    """A worker died once more than ``max_worker_restarts`` allows: no further recovery."""


def worker_of(e: WorkerDiedError, cluster: Any) -> int | None:
    """Index in ``cluster`` of the worker ``e`` names, or None."""
    for i, h in enumerate(cluster.workers):
        if h.binding.worker == e.worker:
            return i
    return None


class Failover:
    """Notices dead or restarted workers of pipeline ``name``'s clusters and brings them back;
    ``transport`` is None for direct weight loads, ``log_dir`` is named in the final error and
    ``step()`` gives the step number stamped on events."""

    def __init__(
        self,
        name: str,
        train: Any,
        gen: Any,
        rollout: Any,
        *,
        transport: Any,
        max_restarts: int,
        log_dir: str | os.PathLike[str] | None,
        step: Callable[[], int],
    ) -> None:
        self.name, self.train, self.gen, self.rollout, self.transport = name, train, gen, rollout, transport
        self.max_restarts, self.log_dir, self._step = max_restarts, log_dir, step
        # workers in separate processes can die (Ray actors); in-process ones (a SimSession) cannot
        self.enabled = hasattr(gen, "restart_worker") and hasattr(train, "restart_worker")
        self.events: list[dict[str, Any]] = []  # replacements and restores, oldest first
        self._new_events: list[dict[str, Any]] = []  # since the last StepReport
        self._restarts: collections.Counter[str] = collections.Counter()  # worker -> automatic restarts
        self._routed = [h.actor for h in gen.workers]  # to notice a restart by hand
        self._trainer_actors = [h.actor for h in train.workers]

    def take_events(self) -> list[dict[str, Any]]:
        """The events since the last call, oldest first."""
        out, self._new_events = self._new_events, []
        return out

    def lost_trainers(self, cause: WorkerDiedError | None = None) -> tuple[dict[int, str], list[int]]:
        """Trainer workers that died (index -> reason) and those restarted by hand."""
        dead = self.train.dead_workers()
        if cause is not None and (i := worker_of(cause, self.train)) is not None:
            dead.setdefault(i, str(cause))
        return dead, [i for i, h in enumerate(self.train.workers) if h.actor is not self._trainer_actors[i]]

    def wait_for_batch(
        self, n: int, timeout_s: float | None, every_s: float, clock: Callable[[], float], heal: Callable[[], Any]
    ) -> None:
        """Wait for the rollout to hold a batch of ``n``, calling ``heal()`` meanwhile: every
        ``every_s`` on ``clock``, and at once when the rollout sees a generator die."""
        if not self.enabled:  # in-process workers (a SimSession) never die: no probes, no polling
            self.rollout.wait_ready(n, timeout_s)
            return
        deadline = None if timeout_s is None else clock() + timeout_s
        while True:
            poll = every_s if deadline is None else min(every_s, max(0.0, deadline - clock()))
            if self.rollout.wait_for_batch(n, poll)["ready"]:
                return
            heal()
            if deadline is not None and clock() >= deadline:
                self.rollout.wait_ready(n, 0)  # raises TimeoutError with the rollout's counts
                return

    def lost_state(self, version: int, served: int, folder: Any) -> StateError:
        """The error for a trainer at ``version``, older than the ``served`` one: it lost its
        state (a restarted worker starts from its initial weights); ``folder``: the run folder."""
        where = (
            f"resume_from={str(folder.path)!r} (its newest autosave, {folder.last})"
            if folder is not None and folder.last
            else "resume_from=<a checkpoint saved with pipe.save(path)>"
        )
        return StateError(
            f"trainer {self.train.name} reports version {version}, older than the version {served} the "
            f"generators serve: it lost its state (was a worker restarted?); nothing was changed. Rebuild the "
            f"pipeline with sess.pipeline(..., {where}) to continue from a saved version"
        )

    def serve(self, version: int, served: Any) -> dict[str, float]:
        """Every generator loads ``version`` (``served``: its weights' object ref, direct path;
        else from the transport, pulled in the background since the trainer published). One
        that dies meanwhile is replaced and all load again. Returns pull metrics, summed."""
        while True:  # ends: a generator dies only so often before _count_restart raises
            try:
                if self.transport is None:
                    self.gen.load_weights(served, version)
                    return {}
                out: dict[str, float] = {}
                for m in self.gen.apply_weights(version):
                    for k in ("pull_s", "exposed_pull_s", "bytes"):
                        out[k] = out.get(k, 0.0) + float(m.get(k) or 0.0)
                if out.get("pull_s"):
                    out["hidden_fraction"] = 1.0 - out["exposed_pull_s"] / out["pull_s"]
                return out
            except WorkerDiedError as e:  # a generator died: its replacement loads this version, then all again
                if worker_of(e, self.train) is not None or not self.heal_generators(version, served, cause=e):
                    raise

    def heal_generators(self, version: int, served: Any, cause: WorkerDiedError | None = None) -> bool:
        """Replace dead or hand-restarted generators, serving them ``version`` (``served``: the
        object ref of its weights on the direct path); True if it replaced any."""
        dead = self.gen.dead_workers()
        dead.update({i: r for i, r in self.rollout.dead_targets().items() if i not in dead})
        if cause is not None and (i := worker_of(cause, self.gen)) is not None:
            dead.setdefault(i, str(cause))
        acted = False
        for i, h in enumerate(self.gen.workers):
            by_hand = h.actor is not self._routed[i]  # restart_worker was called: the new worker is up
            if i in dead or by_hand:
                self._replace_generator(i, dead.get(i, "restarted with restart_worker"), version, served, by_hand)
                acted = True
        return acted

    def _count_restart(self, cluster: Any, i: int, reason: str) -> None:
        b = cluster.workers[i].binding
        self._restarts[b.worker] += 1
        if self._restarts[b.worker] > self.max_restarts:
            raise RestartsExhausted(
                f"{b.worker} (pool {b.pool}) died ({reason}); pipeline {self.name!r} restarted it "
                f"{self._restarts[b.worker] - 1} time(s) already, the most max_worker_restarts="
                f"{self.max_restarts} allows. Look at {self.log_dir} for its log, then call "
                f"{cluster.name}.restart_worker({i}) by hand, or raise max_worker_restarts",
                worker=b.worker,
                pool=b.pool,
                fix=f"{cluster.name}.restart_worker({i})",
            )

    def _replace_generator(self, i: int, reason: str, version: int, served: Any, by_hand: bool) -> None:
        """Restart generator ``i`` (unless it was restarted by hand), load ``version``, route to it."""
        t = time.monotonic()
        if not by_hand:
            self._count_restart(self.gen, i, reason)
            log.warning(
                "pipeline %s: generator %s died (%s); replacing it",
                self.name,
                self.gen.workers[i].binding.worker,
                reason,
            )
            self.gen.restart_worker(i)
        h = self.gen.workers[i]
        b = h.binding
        if self.transport is not None:
            self.gen.call_worker(i, "set_transport", self.transport)
            if version:
                self.gen.call_worker(i, "apply_weights", version)
        elif version:
            self.gen.call_worker(i, "load_weights", served, version)
        self.rollout.replace_target(i, (h.actor, b.worker, b.hardware, b.pool))
        self._routed[i] = h.actor
        self.event(
            "generator_replaced",
            worker=b.worker,
            pool=b.pool,
            node=b.node,
            reason=reason,
            by_hand=by_hand,
            fell_back=b.fell_back,
            binding=b.reason,
            version=version,
            seconds=round(time.monotonic() - t, 3),
        )

    def restore_trainer(
        self,
        dead: dict[int, str],
        restarted: list[int],
        *,
        autosave: str | None,
        version: int,
        algo: Any,
        roll_back: Callable[[int], Any],
    ) -> None:
        """Restore every trainer worker from ``autosave`` (the newest), reconfigure it with
        ``algo`` and ``roll_back(restored_version)``; ``version`` is the one served now."""
        names = ", ".join(self.train.workers[i].binding.worker for i in sorted({*dead, *restarted}))
        reason = (
            "; ".join(f"{self.train.workers[i].binding.worker}: {r}" for i, r in sorted(dead.items()))
            or "restarted with restart_worker"
        )
        b0 = self.train.workers[min({*dead, *restarted})].binding
        if autosave is None:
            raise RestartsExhausted(
                f"trainer {names} lost its state ({reason[:300]}), and pipeline {self.name!r} has no autosave to "
                f"restore it from: the training up to version {version} ({self._step()} step(s)) is lost. Build the "
                "trainer cluster and the pipeline again, with autosave_every=N so that a dead trainer is restored "
                "by itself, or with resume_from=<a directory saved with pipe.save(path)>",
                worker=b0.worker,
                pool=b0.pool,
                fix="sess.pipeline(..., autosave_every=N)",
            )
        if self.transport is not None:
            raise StateError(
                f"trainer {names} lost its state ({reason[:300]}); pipeline {self.name!r} restores a trainer only "
                f"with weights='direct' (its transport still holds the lost versions). Resume with "
                f"sess.pipeline(..., resume_from={os.path.dirname(os.path.dirname(autosave))!r})"
            )
        t = time.monotonic()
        for i in sorted(dead):
            self._count_restart(self.train, i, dead[i])
            worker = self.train.workers[i].binding.worker
            log.warning("pipeline %s: trainer %s died (%s); restoring it from %s", self.name, worker, dead[i], autosave)
            self.train.restart_worker(i)
        ckpt = read_checkpoint(autosave)
        restored = int(self.train.load_checkpoint(ckpt.trainer_dir))
        if algo is not None:
            self.train.configure(algo)
        self._trainer_actors = [h.actor for h in self.train.workers]
        roll_back(restored)
        self.event(
            "trainer_restored",
            worker=names,
            pool=b0.pool,
            reason=reason,
            checkpoint=ckpt.path,
            version=restored,
            versions_lost=max(0, version - restored),  # overlapped modes autosave the trainer one version ahead
            seconds=round(time.monotonic() - t, 3),
        )

    def event(self, kind: str, **fields: Any) -> None:
        """Record a failover event (it goes into the next StepReport and :attr:`events`)."""
        ev = {"kind": kind, "at": time.time(), "step": self._step(), **fields}
        self.events.append(ev)
        self._new_events.append(ev)
        log.warning("pipeline %s: %s %s", self.name, kind, {k: v for k, v in fields.items() if k != "node"})
