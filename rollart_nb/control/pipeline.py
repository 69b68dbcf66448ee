"""Pipeline: the six-step asynchronous protocol, one readable iteration.

Each :meth:`Pipeline.step`::

    (1) get_batch   wait until the SampleBuffer holds a batch of whole groups, take it (then,
                    when training overlaps, wait for the previous step's train_step)
    (2) suspend     the LLMProxy stops admitting requests (in-flight trajectories are kept);
                    modes with ``preempt`` stop the turns in flight instead of waiting for them
    (3) update      generation workers load the trainer's newest weights; the version bumps
                    and the staleness bound aborts / evicts what it now excludes
    (4) resume      the proxy admits requests again
    (5) recompute   in-flight trajectories re-prefill their history under the new weights
                    (inside the generation backend, on their next turn) and continue
    (6) train_step  on the batch from (1), overlapped with the resumed rollout

Failover, at every step and while a step waits for its batch: a generation worker that died
is replaced on a compatible slot, loads the served weights, and takes over its routing (its
trajectories moved to live workers at their next turn); a trainer that died is restored from
the newest autosave and the pipeline continues from that version. Each shows up as an event
in the StepReport. ``max_worker_restarts`` bounds the replacements per worker slot.

Modes change a few switches (:mod:`rollart_nb.control.modes`), not the loop. Lifecycle:
``idle -> running -> paused -> closed``; a background run that raises leaves ``failed`` (its
error in ``pipe.error``) until the next step or run. :meth:`Pipeline.save` checkpoints the trainer and the
pipeline's counters; ``sess.pipeline(..., resume_from=path)`` continues from them in a new
session (:mod:`rollart_nb.control.checkpoint`).

A pipeline gets what it needs from its session's :class:`~rollart_nb.runtime.Runtime`: the
rollout clusters (one per rollout shard, :mod:`rollart_nb.control.shards`), the weight transport,
reward deployment, the clock, and its own registration by name (it removes itself on
:meth:`Pipeline.close`); it never calls into the session.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from rollart_nb.config import PipelineConfig, portable
from rollart_nb.control.checkpoint import PipelineCheckpoint, latest_reward_sources, write_checkpoint
from rollart_nb.control.modes import mode as get_mode
from rollart_nb.control.report import (
    ENGINE_REPORTS,
    StepReport,
    count_deltas,
    env_fault_deltas,
    mean_occupancy,
    waste,
)
from rollart_nb.control.shards import ShardedRollout, auto_shards, plan_rollout, plan_shards
from rollart_nb.errors import ConfigError, StateError, WorkerDiedError
from rollart_nb.trackers import resolve_trackers, sample_rows
from rollart_nb.trajectory import Trajectory, TrajectoryList
from rollart_nb.views import view
from rollart_nb.workers.routing import shape_affinity

if TYPE_CHECKING:
    from rollart_nb.control.tasks import TaskSet
    from rollart_nb.runtime.base import Runtime
    from rollart_nb.workers.cluster import ClusterBase

__all__ = ["Pipeline"]

log = logging.getLogger(__name__)


class Pipeline:
    """Asynchronous RL pipeline over a train cluster, a generation cluster and tasks.

    Built by :meth:`rollart_nb.Session.pipeline`.

    Example:
        >>> pipe = sess.pipeline(train, gen, tasks, batch_size=32, alpha=1, mode="rollart")  # doctest: +SKIP
        >>> report = pipe.step()                                                            # doctest: +SKIP
        >>> pipe.run(20)                                                                     # doctest: +SKIP
        >>> pipe.save("ckpt/run1")                   # later, in a new session:              # doctest: +SKIP
        >>> pipe = sess.pipeline(train, gen, tasks, resume_from="ckpt/run1")                # doctest: +SKIP
    """

    def __init__(
        self,
        runtime: Runtime,
        train: ClusterBase,
        gen: ClusterBase,
        tasks: TaskSet,
        *,
        config: PipelineConfig | None = None,
        group_size: int = 8,
        name: str = "pipeline",
        rewards: dict[str, dict[str, Any]] | None = None,
        resume: PipelineCheckpoint | None = None,
        scheduler_seed: int | None = None,
    ) -> None:
        c = self.config = config if config is not None else PipelineConfig()
        run_dir: str | os.PathLike[str] | None = c.run_dir
        if c.autosave_every and run_dir is None:
            run_dir = Path("runs") / name
        self.run_dir = Path(run_dir).absolute() if run_dir is not None else None
        self.autosave_every, self.keep_checkpoints = c.autosave_every, c.keep_checkpoints
        self.last_autosave: str | None = None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            log.info(
                "pipeline %s writes steps.jsonl%s to %s",
                name,
                f" and a checkpoint every {c.autosave_every} steps" if c.autosave_every else "",
                self.run_dir,
            )
        self.mode = get_mode(c.mode)
        # step timing: the runtime's clock (a SimSession's virtual time, else wall time)
        self._clock = runtime.clock
        self.runtime, self.train, self.gen, self.tasks, self.name = runtime, train, gen, tasks, name
        seed = scheduler_seed if scheduler_seed is not None else runtime.seed if c.seed is None else c.seed
        self.cfg = plan_rollout(tasks.expand(), c, group_size, seed, tasks.weights, tasks.curricula or None)
        shards = c.rollout_shards
        if shards is None:  # one per ENVS_PER_SHARD envs, within the CPU pool's free slots
            free = runtime.resources.free("cpu") if "cpu" in runtime.resources.pools else None
            shards = auto_shards(self.cfg, free)
        plans = plan_shards(self.cfg, shards)  # raises ConfigError before anything starts
        self.validate_every, self.validate_pass_k = c.validate_every, c.validate_pass_k
        self.state = "idle"
        self.validation_seeds = c.validation_seeds or tasks.validation_seeds()
        self.last_validation: dict[str, dict[str, Any]] = {}
        self.step_timeout_s = c.step_timeout_s
        # failover: what the rollout routes to and which trainer holds the state, to notice restarts
        self.max_worker_restarts, self.health_every_s = c.max_worker_restarts, float(c.health_every_s)
        self.algo: Any = None  # set by sess.pipeline: a restored trainer is configured with it again
        self.events: list[dict[str, Any]] = []  # replacements and restores, oldest first
        self._new_events: list[dict[str, Any]] = []  # since the last StepReport
        self._restarts: collections.Counter[str] = collections.Counter()  # worker -> automatic restarts
        self._routed = [h.actor for h in gen.workers]
        self._trainer_actors = [h.actor for h in train.workers]
        # workers in separate processes can die (Ray actors); in-process ones (a SimSession) cannot
        self._failover = hasattr(gen, "restart_worker") and hasattr(train, "restart_worker")

        # experiment trackers (TensorBoard, W&B, MLflow, ...): each StepReport goes to each of them
        self.trackers = resolve_trackers(list(c.trackers) or None, run_dir=self.run_dir, name=name)
        self._tracking_started = False  # trackers get the run's config before its first step
        # task -> preferred hardware: the generator's @hw_mapping, else the env's shape hint until
        # the task's measured token profile decides (in the rollout's proxy)
        tagged = {t: gen.affinity("generate", t) for t in tasks.envs} if c.hw_affinity else {}
        self.affinity = (
            {t: tagged[t] or shape_affinity(getattr(env, "shape", None)) for t, env in tasks.envs.items()}
            if c.hw_affinity
            else {}
        )
        measured = sorted(t for t, tag in tagged.items() if not tag)
        targets = [(h.actor, h.binding.worker, h.binding.hardware, h.binding.pool) for h in gen.workers]
        self.rollout = ShardedRollout(
            runtime,
            f"{name}.rollout",
            plans,
            model=gen.model,
            targets=targets,
            task_affinity=self.affinity,
            measured=measured,
            pd=c.pd,
            max_inflight=c.max_inflight,
            dispatch=c.dispatch,
        )
        # closed with this pipeline: a call on it afterwards points to the pipeline, not to sess.cluster
        self.rollout.closed_fix = (
            f"it was the rollout of pipeline {name!r}, closed with it: create a new pipeline with "
            f"sess.pipeline(..., name={name!r})"
        )
        for task, spec in (rewards or {}).items():
            self.rollout.set_reward(task, **spec)
        # Everything starts at the trainer's version (a reused or restored trainer's too): the
        # rollout's first trajectories wait until the generators serve it, so none claims an older
        # version than the one that generates it, and none is aborted as stale by the first update.
        trained = int(train.version())
        served = gen.version() if callable(getattr(gen, "version", None)) else []  # e.g. a previous pipeline's
        served = served if isinstance(served, list) else [served]
        serve = bool(trained) or resume is not None or any(int(v) != trained for v in served)
        self.E = self.rollout.start(trained, not serve)
        self.version = 0
        self._served_state: Any = None  # object ref of the served weights (the direct path): replacements load it
        self.transport = runtime.weight_transport(c.weights, name)
        if self.transport is not None:  # trainer publishes, generators pull in the background
            train.set_transport(self.transport)
            gen.set_transport(self.transport)
        if serve:  # serve the trainer's weights, then launch the first trajectories
            self._update_weights(trained)
        self.first_step = resume.steps if resume is not None else 0  # step numbers go on after a resume
        self.resumed_from = resume
        self.state = "idle"
        self.reports: list[StepReport] = []
        self._train_fut: Any = None
        self._counts: dict[str, int] = {}  # cumulative endings by kind, at the last step
        self._token_events: dict[str, int] = {}  # cumulative generated / wasted tokens, at the last step
        self._task_counts: dict[str, dict[str, int]] = {}  # task -> kind -> endings, at the last step
        self._env_faults: dict[str, int] = {}  # cumulative env fault counters at the last step
        self._thread: threading.Thread | None = None
        self._pause = threading.Event()
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> StepReport:
        """Run one iteration of the six-step protocol; returns its :class:`StepReport`."""
        self._check_open()
        with self._lock:
            prev, self.state = ("idle" if self.state == "failed" else self.state), "running"
            try:
                try:
                    return self._step()
                except WorkerDiedError as e:  # a worker died mid-step: replace or restore it, step again
                    if isinstance(e, _Final) or not self._heal(cause=e):
                        raise
                    self.rollout.resume()
                    return self._step()
            finally:
                if self.state == "running":
                    self.state = prev if prev != "running" else "idle"

    def _step(self) -> StepReport:
        n, m = self.cfg.batch_size, self.mode
        rep = StepReport(
            step=self.first_step + len(self.reports), version=self.version, mode=m.name, started_at=time.time()
        )
        t0 = self._clock()
        self._heal()  # failover, if needed
        self._wait_batch(n)  # (1) get_batch
        batch: list[Trajectory] = self.rollout.take_batch(n)
        t1 = self._clock()
        rep.phases["rollout_wait"] = t1 - t0
        metrics: dict[str, float] = {}
        if not m.overlap_train:  # sync, sync+
            metrics = self.train.train_step(batch)
            rep.phases["train"] = rep.train_s = self._clock() - t1
        if m.overlap_train and self._train_fut is not None:  # previous step's training, rollout still running
            t2 = self._clock()
            metrics = self._train_fut.result()
            rep.phases["train"] = self._clock() - t2
            rep.train_s = metrics.get("step_s", metrics.get("modelled_s", 0.0))
        t3 = self._clock()
        self.rollout.suspend(preempt=m.preempt)  # (2) suspend
        t4 = self._clock()
        rep.phases["suspend"] = t4 - t3
        if metrics:  # (3) update
            rep.weights = self._update_weights(int(metrics["version"]))
            rep.weights.update({k: metrics[k] for k in ("push_s", "push_bytes") if k in metrics})
        rep.phases["update"] = self._clock() - t4
        t5 = self._clock()
        self.rollout.resume()  # (4) resume, (5) recompute
        if not m.continuous:  # in the backends' next turn
            self.rollout.start_iteration()
        rep.phases["resume"] = self._clock() - t5
        if m.overlap_train:  # (6) train_step, overlapped
            self._train_fut = self.train.train_step(batch, blocking=False)
        return self._finish_report(rep, batch, metrics, t0)

    def _wait_batch(self, n: int) -> None:
        """Wait for a batch of ``n``, replacing dead workers meanwhile (a probe every
        ``health_every_s``, at once when the rollout sees a generator die)."""
        if not self._failover:  # in-process workers (a SimSession) never die: no probes, no polling
            self.rollout.wait_ready(n, self.step_timeout_s)
            return
        deadline = None if self.step_timeout_s is None else self._clock() + self.step_timeout_s
        while True:
            poll = (
                self.health_every_s
                if deadline is None
                else min(self.health_every_s, max(0.0, deadline - self._clock()))
            )
            if self.rollout.wait_for_batch(n, poll)["ready"]:
                return
            self._heal()
            if deadline is not None and self._clock() >= deadline:
                self.rollout.wait_ready(n, 0)  # raises TimeoutError with the rollout's counts
                return

    def _update_weights(self, version: int, rollback: bool = False) -> dict[str, float]:
        """Generators switch to ``version``; returns weight-sync metrics (summed over generators).

        Raises StateError, changing nothing, if ``version`` is older than the one served: the
        trainer lost its state (a restarted worker starts from its initial weights), and
        serving or training on older weights would go on silently. ``rollback=True`` (a trainer
        restored from an autosave) allows it, and the rollout drops what newer weights generated.
        """
        if version < self.version and not rollback:
            where = (
                f"resume_from={str(self.run_dir)!r} (its newest autosave, {self.last_autosave})"
                if self.last_autosave
                else "resume_from=<a checkpoint saved with pipe.save(path)>"
            )
            raise StateError(
                f"trainer {self.train.name} reports version {version}, older than the version {self.version} the "
                f"generators serve: it lost its state (was a worker restarted?); nothing was changed. Rebuild the "
                f"pipeline with sess.pipeline(..., {where}) to continue from a saved version"
            )
        out: dict[str, float] = {}
        if self.transport is None:
            state = self.train.state_dict(blocking=False)  # an object ref: weights go trainer -> generators
            self._served_state = state.refs[0]
        while True:  # ends: a generator dies only so often before _count_restart raises
            try:
                if self.transport is None:
                    self.gen.load_weights(self._served_state, version)
                else:  # pulled in the background since the trainer published; wait only for the rest
                    out = {}
                    for m in self.gen.apply_weights(version):
                        for k in ("pull_s", "exposed_pull_s", "bytes"):
                            out[k] = out.get(k, 0.0) + float(m.get(k) or 0.0)
                    if out.get("pull_s"):
                        out["hidden_fraction"] = 1.0 - out["exposed_pull_s"] / out["pull_s"]
                break
            except WorkerDiedError as e:  # a generator died: its replacement loads this version, then all again
                if _worker_of(e, self.train) is not None or not self._heal_generators(version, cause=e):
                    raise
        self.version = version
        self.rollout.set_version(version, rollback=rollback)
        return out

    # -- failover ----------------------------------------------------------------------
    def _heal(self, cause: WorkerDiedError | None = None) -> bool:
        """Replace dead generators and restore a dead or restarted trainer; True if it did
        either. A generator restarted by hand (``gen.restart_worker(i)``) is taken over the
        same way: it loads the served weights before it gets requests."""
        if not self._failover:
            return False
        acted = False
        dead_t = self.train.dead_workers()
        if cause is not None and (i := _worker_of(cause, self.train)) is not None:
            dead_t.setdefault(i, str(cause))
        restarted_t = [i for i, h in enumerate(self.train.workers) if h.actor is not self._trainer_actors[i]]
        if dead_t or restarted_t:
            self._restore_trainer(dead_t, restarted_t)
            acted = True
        return self._heal_generators(self.version, cause=cause) or acted

    def _heal_generators(self, version: int, cause: WorkerDiedError | None = None) -> bool:
        dead = self.gen.dead_workers()
        dead.update({i: r for i, r in self.rollout.dead_targets().items() if i not in dead})
        if cause is not None and (i := _worker_of(cause, self.gen)) is not None:
            dead.setdefault(i, str(cause))
        acted = False
        for i, h in enumerate(self.gen.workers):
            by_hand = h.actor is not self._routed[i]  # restart_worker was called: the new worker is up
            if i in dead or by_hand:
                self._replace_generator(i, dead.get(i, "restarted with restart_worker"), version, by_hand)
                acted = True
        return acted

    def _count_restart(self, cluster: Any, i: int, reason: str) -> None:
        b = cluster.workers[i].binding
        self._restarts[b.worker] += 1
        if self._restarts[b.worker] > self.max_worker_restarts:
            raise _Final(
                f"{b.worker} (pool {b.pool}) died ({reason}); pipeline {self.name!r} restarted it "
                f"{self._restarts[b.worker] - 1} time(s) already, the most max_worker_restarts="
                f"{self.max_worker_restarts} allows. Look at {self.runtime.log_dir} for its log, then call "
                f"{cluster.name}.restart_worker({i}) by hand, or raise max_worker_restarts",
                worker=b.worker,
                pool=b.pool,
                fix=f"{cluster.name}.restart_worker({i})",
            )

    def _replace_generator(self, i: int, reason: str, version: int, by_hand: bool) -> None:
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
            self.gen.call_worker(i, "load_weights", self._served_state, version)
        self.rollout.replace_target(i, (h.actor, b.worker, b.hardware, b.pool))
        self._routed[i] = h.actor
        self._event(
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

    def _restore_trainer(self, dead: dict[int, str], restarted: list[int]) -> None:
        """A trainer worker died or was restarted: restore every trainer worker from the newest
        autosave and roll the served version back to it."""
        names = ", ".join(self.train.workers[i].binding.worker for i in sorted({*dead, *restarted}))
        reason = (
            "; ".join(f"{self.train.workers[i].binding.worker}: {r}" for i, r in sorted(dead.items()))
            or "restarted with restart_worker"
        )
        b0 = self.train.workers[min({*dead, *restarted})].binding
        steps = self.first_step + len(self.reports)
        if self.last_autosave is None:
            raise _Final(
                f"trainer {names} lost its state ({reason[:300]}), and pipeline {self.name!r} has no autosave to "
                f"restore it from: the training up to version {self.version} ({steps} step(s)) is lost. Build the "
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
                f"sess.pipeline(..., resume_from={str(self.run_dir)!r})"
            )
        from rollart_nb.control.checkpoint import read_checkpoint

        t = time.monotonic()
        for i in sorted(dead):
            self._count_restart(self.train, i, dead[i])
            log.warning(
                "pipeline %s: trainer %s died (%s); restoring it from %s",
                self.name,
                self.train.workers[i].binding.worker,
                dead[i],
                self.last_autosave,
            )
            self.train.restart_worker(i)
        ckpt = read_checkpoint(self.last_autosave)
        restored = int(self.train.load_checkpoint(ckpt.trainer_dir))
        if self.algo is not None:
            self.train.configure(self.algo)
        self._trainer_actors = [h.actor for h in self.train.workers]
        self._train_fut = None  # the batch it was training on is lost with it
        lost = max(0, self.version - restored)  # overlapped modes autosave the trainer one version ahead
        self._update_weights(restored, rollback=True)
        self._event(
            "trainer_restored",
            worker=names,
            pool=b0.pool,
            reason=reason,
            checkpoint=ckpt.path,
            version=restored,
            versions_lost=lost,
            seconds=round(time.monotonic() - t, 3),
        )

    def _event(self, kind: str, **fields: Any) -> None:
        ev = {"kind": kind, "at": time.time(), "step": self.first_step + len(self.reports), **fields}
        self.events.append(ev)
        self._new_events.append(ev)
        log.warning("pipeline %s: %s %s", self.name, kind, {k: v for k, v in fields.items() if k != "node"})

    def _finish_report(
        self, rep: StepReport, batch: list[Trajectory], metrics: dict[str, float], t0: float
    ) -> StepReport:
        rep.version = self.version
        rep.step_s = self._clock() - t0
        rep.batch_size = len(batch)
        rep.tokens = sum(t.num_tokens for t in batch)
        # a validation holds the rollout (see validate), so its seconds, outside step_s, made
        # none of these tokens
        rep.throughput = rep.tokens / rep.step_s if rep.step_s > 0 else 0.0
        by_task: dict[str, list[float]] = collections.defaultdict(list)
        for t in batch:
            by_task[t.task].append(t.reward)
            gap = self.version - t.min_version
            rep.staleness[gap] = rep.staleness.get(gap, 0) + 1
        rep.reward = {k: sum(v) / len(v) for k, v in sorted(by_task.items())}
        rep.train = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        stats = self.rollout.stats()
        rep.engines = list(stats.get("proxy", {}).get("engines", []))
        rep.engine_occupancy = mean_occupancy(rep.engines)
        # endings during this step (events only grow; "counts" moves evicted samples between statuses)
        rep.counts, self._counts = count_deltas(stats["events"], self._counts), stats["events"]
        tokens = stats.get("token_events", {})
        rep.waste = waste(count_deltas(tokens, self._token_events), rep.counts.get("aborted_stale", 0))
        self._token_events = tokens
        per_task = stats.get("task_events", {})
        for task, kinds in per_task.items():
            delta = count_deltas(kinds, self._task_counts.get(task, {}))
            if delta:
                rep.task_counts[task] = delta
        self._task_counts = per_task
        rep.env, self._env_faults = env_fault_deltas(stats.get("env", {}), self._env_faults), stats.get("env", {})
        # the rollout keeps its last few failure reasons: this step's are the newest of them
        new_failed = rep.counts.get("failed", 0) + rep.counts.get("penalized", 0)
        for task, reason in stats.get("failures", [])[-new_failed:] if new_failed else []:
            rep.failures.setdefault(task, []).append(reason)
        if self.validate_every and (rep.step + 1) % self.validate_every == 0:
            tv = self._clock()
            with self._held():  # greedy and sampled: one hold, no training turn in between
                rep.validation = self._greedy(None)
                if self.validate_pass_k > 1:
                    rep.pass_k = self._sampled(self.validate_pass_k, None, self.cfg.rollout.temperature)
            rep.phases["validation"] = self._clock() - tv  # after step_s: not part of the step's time
        rep.events, self._new_events = self._new_events, []
        self.reports.append(rep)
        if len(self.reports) > ENGINE_REPORTS:  # older steps keep their occupancy, not every engine's dict
            self.reports[-ENGINE_REPORTS - 1].engines = []
        self._record(rep)
        self._track(rep, batch)
        return rep

    def _track(self, rep: StepReport, batch: list[Trajectory]) -> None:
        """Send the step (and, every ``tracker_sample_every`` steps, a sample of its batch) to
        every tracker; a tracker that fails is reported once, never fatal."""
        if not self.trackers:
            return
        every = self.config.tracker_sample_every
        rows = sample_rows(batch, self.config.tracker_sample_size) if every and (rep.step + 1) % every == 0 else []
        if not self._tracking_started:
            self._tracking_started = True
            config = self.run_config()
            for t in self.trackers:
                try:
                    t.start(config)
                except Exception as e:
                    log.warning("tracker %r could not start (%s); it gets no steps from pipeline %s", t, e, self.name)
                    t.failed = True
        for t in self.trackers:
            if getattr(t, "failed", False):
                continue
            try:
                t.log_step(rep)
                if rows and hasattr(t, "log_samples"):
                    t.log_samples(rep.step, rows)
            except Exception as e:  # a tracker's outage must not stop training
                log.warning("tracker %r failed at step %d (%s); it gets no more steps", t, rep.step, e)
                t.failed = True

    def run_config(self) -> dict[str, Any]:
        """What a tracker records as the run's parameters: mode, alpha, sizes, tasks, algorithm."""
        algo = self.algo
        return {
            "pipeline": self.name,
            **portable(self.config),
            "rollout_shards": self.rollout.shards,
            "group_size": self.cfg.group_size,
            "seed": self.cfg.seed,
            "tasks": sorted(self.tasks.envs),
            "generators": len(self.gen.workers),
            "trainers": len(self.train.workers),
            "algo": type(algo).__name__ if algo is not None else None,
            **(
                {f"algo.{k}": v for k, v in vars(algo).items() if isinstance(v, int | float | str | bool)}
                if algo is not None and hasattr(algo, "__dict__")
                else {}
            ),
        }

    # -- the run folder: steps.jsonl and autosaves ----------------------------------------
    def _record(self, rep: StepReport) -> None:
        """Append the step to ``steps.jsonl`` and autosave when one is due (step lock held)."""
        if self.run_dir is None:
            return
        with (self.run_dir / "steps.jsonl").open("a") as f:
            f.write(json.dumps(rep.to_dict(), default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.autosave_every and (rep.step + 1) % self.autosave_every == 0:
            self._autosave()

    def _autosave(self) -> str | None:
        """Checkpoint into ``run_dir/checkpoints/step-NNNNNN`` and keep the newest ``keep_checkpoints``."""
        from rollart_nb.control.checkpoint import run_checkpoints

        steps = self.first_step + len(self.reports)
        if self.run_dir is None or not self.autosave_every or not self.reports:
            return None
        path = self.run_dir / "checkpoints" / f"step-{steps:06d}"
        if self.last_autosave == str(path):
            return self.last_autosave
        if self._train_fut is not None:
            self._train_fut.result()  # the checkpoint holds every batch taken; the result stays for the next step
        trained = int(self.train.version())
        if trained < self.version:  # a restarted trainer: saving it would make a lost state the latest
            log.warning(
                "not autosaving pipeline %s: its trainer is at version %d, behind the %d served (it lost its "
                "state); the newest good autosave stays %s",
                self.name,
                trained,
                self.version,
                self.last_autosave,
            )
            return None
        t = time.monotonic()
        self._write_checkpoint(path)
        self.last_autosave = str(path)
        for old in run_checkpoints(self.run_dir)[: -self.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("autosaved pipeline %s at step %d to %s (%.1fs)", self.name, steps, path, time.monotonic() - t)
        return self.last_autosave

    async def astep(self) -> StepReport:
        """``await pipe.astep()``: :meth:`step` without blocking a running event loop (Jupyter)."""
        return await asyncio.to_thread(self.step)

    @overload
    def run(
        self, steps: int, *, background: Literal[False] = False, progress: bool = True, on_step: Any = None
    ) -> list[StepReport]: ...

    @overload
    def run(
        self, steps: int, *, background: Literal[True], progress: bool = True, on_step: Any = None
    ) -> threading.Thread: ...

    def run(
        self, steps: int, *, background: bool = False, progress: bool = True, on_step: Any = None
    ) -> list[StepReport] | threading.Thread:
        """Run ``steps`` iterations.

        With ``background=True`` it returns at once (a thread runs the steps; the kernel stays
        responsive); :meth:`pause` stops it after the current step, :meth:`wait` joins it.
        ``on_step(report)`` is called after every step (dashboards use it).
        """
        self._check_open()
        if self._thread is not None and self._thread.is_alive():
            raise StateError("the pipeline is already running in the background; call pipe.pause() or pipe.wait()")
        self._pause.clear()
        if background:
            self._thread = threading.Thread(
                target=self._run_loop, args=(steps, progress, on_step), name=f"rollart-{self.name}", daemon=True
            )
            self._thread.start()
            return self._thread
        return self._run_loop(steps, progress, on_step)

    def _run_loop(self, steps: int, progress: bool, on_step: Any) -> list[StepReport]:
        out: list[StepReport] = []
        bar = _progress(steps, f"{self.name} ({self.mode.name})") if progress else None
        try:
            for _ in range(steps):
                if self._pause.is_set():
                    self.state = "paused"
                    with self._lock:
                        self._autosave()
                    break
                rep = self.step()
                out.append(rep)
                if on_step is not None:
                    on_step(rep)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(v=rep.version, reward=f"{rep.mean_reward:.3f}", s=f"{rep.step_s:.2f}")
        except KeyboardInterrupt:
            self.state = "paused"  # the stop button: steps are whole; a later step() continues
            log.warning("interrupted: paused after %d step(s)", len(out))
        except BaseException as e:
            self.error = e
            if self._thread is None or threading.current_thread() is not self._thread:
                raise
            self.state = "failed"  # until the next step or run; pipe.error says why, pipe.wait() raises it
            log.exception("background run failed")
        finally:
            if bar is not None:
                bar.close()
        return out

    @property
    def running(self) -> bool:
        """True while a background run (``pipe.run(..., background=True)``) is in progress."""
        return self._thread is not None and self._thread.is_alive()

    def pause(self) -> None:
        """Stop a background :meth:`run` after the step in progress."""
        self._pause.set()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for a background :meth:`run` to end; re-raises its error, if any."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    # -- checkpoints ---------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> str:
        """Checkpoint the trainer (model, optimizer, version, RNG) and what a resume needs.

        Saves at a step boundary: it waits for a step in progress, and in overlapped modes for
        the training of the batch already taken, so the checkpoint holds every batch trained
        on. The pipeline keeps running afterwards. Resume in this or a new session with
        ``sess.pipeline(train, gen, tasks, ..., resume_from=path)``: the trainer is restored,
        generators serve the saved version from the start, step numbers continue.

        Args:
            path: a directory (created; an existing checkpoint there is replaced). It must be on
                a filesystem the trainer worker shares with this process.

        Returns:
            The checkpoint directory (absolute).
        """
        self._check_open()
        with self._lock:
            if self._train_fut is not None:
                self._train_fut.result()  # the result stays available to the next step
            ckpt = self._write_checkpoint(path)
        log.info("saved pipeline %s at step %d, version %d to %s", self.name, ckpt.steps, ckpt.version, ckpt.path)
        return ckpt.path

    def _write_checkpoint(self, path: str | os.PathLike[str]) -> PipelineCheckpoint:
        """The trainer's checkpoint and what a resume needs, at ``path`` (the step lock held)."""
        return write_checkpoint(
            path,
            self.train,
            steps=self.first_step + len(self.reports),
            seed=int(self.cfg.seed),
            tasks={t: type(e).__name__ for t, e in self.tasks.envs.items()},
            rewards=latest_reward_sources(self.reward_history()),
            config={
                "name": self.name,
                "mode": self.mode.name,
                "alpha": self.cfg.alpha,
                "batch_size": self.cfg.batch_size,
                "group_size": self.cfg.group_size,
                "served_version": self.version,
                "pipeline": portable(self.config),
            },
        )

    # -- rewards, validation, views ------------------------------------------------------
    def swap_reward(self, task: str, fn: Any = None, **kwargs: Any) -> int:
        """Hot-swap ``task``'s reward; trajectories scored after this use it. Returns the new version.

        ``kwargs``: ``timeout_s``, ``retries``, ``serverless``, and ``validate_with`` (a scorer for
        validation rollouts, as in :meth:`Session.reward`; left out, the task keeps the one it has).
        """
        self._check_open()
        self.tasks.check(task)
        if fn is not None and kwargs.pop("serverless", False):
            # the options of the dispatcher stay here; the rest are Ray Serve's
            opts = {k: kwargs.pop(k) for k in ("timeout_s", "retries", "validate_with") if k in kwargs}
            endpoint = self.runtime.deploy_reward(task, fn, retries=0, **kwargs)  # the dispatcher does the retrying
            return int(self.rollout.set_reward(task, endpoint=endpoint, **opts))
        kwargs.pop("serverless", None)
        return int(self.rollout.set_reward(task, fn, **kwargs))

    def reward_history(self) -> list[dict[str, Any]]:
        """Every reward version per task, with source and time."""
        return self.rollout.reward_history()

    def validate(self, tasks: list[str] | None = None) -> dict[str, float]:
        """Greedy validation score per task over its validation seeds. Each task's full result
        (``score``, ``n``, ``failed``, ``distinct_actions``, ``top_actions``) is kept in
        :attr:`last_validation`. The rollout is held while it runs: no new training trajectory
        starts and no training turn is generated (turns, env steps and scoring already under way
        finish), so its seconds produce no batch tokens and bend no tokens/s."""
        self._check_open()
        with self._held():  # once for every task: no training turn between two tasks' validations
            return self._greedy(tasks)

    def _greedy(self, tasks: list[str] | None) -> dict[str, float]:
        out = {}
        for task in tasks or list(self.tasks.envs):
            res = self.rollout.evaluate(task, self.validation_seeds[task])
            self.last_validation[task] = res
            out[task] = res["score"]
        return out

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """The rollout held for the block: no new training trajectory starts and no training
        turn is generated (a step's greedy and sampled validations share one hold)."""
        self.rollout.hold()
        try:
            yield
        finally:
            try:
                self.rollout.release()
            except Exception:  # the rollout is gone: whatever failed says so, not this
                log.exception("pipeline %s: could not release the rollout after a validation", self.name)

    def pass_at(
        self, k: int = 8, tasks: list[str] | None = None, temperature: float | None = None
    ) -> dict[str, dict[str, float]]:
        """Sampled validation: each validation seed ``k`` times at ``temperature`` (default: the
        rollout's). Returns per task ``{"pass@1": ..., "pass@k": ...}``: the share of all samples
        that succeed (reward >= 1) and the share of seeds with at least one success out of ``k``
        (the estimator of Chen et al. 2021 with n = k). pass@k well above pass@1 is what RL can
        sharpen. The rollout is held while it runs, as in :meth:`validate`.

        Example:
            >>> pipe.pass_at(8)  # doctest: +SKIP
            {'math': {'pass@1': 0.21, 'pass@8': 0.64}}
        """
        self._check_open()
        if not isinstance(k, int) or k < 1:
            raise ConfigError(f"pass_at needs a whole number k >= 1, got {k!r}")
        temp = self.cfg.rollout.temperature if temperature is None else float(temperature)
        if k > 1 and temp <= 0:
            raise ConfigError(f"pass@{k} needs sampling: temperature must be > 0, got {temp}")
        with self._held():
            return self._sampled(k, tasks, temp)

    def _sampled(self, k: int, tasks: list[str] | None, temperature: float) -> dict[str, dict[str, float]]:
        out = {}
        for task in tasks or list(self.tasks.envs):
            res = self.rollout.evaluate(task, self.validation_seeds[task], temperature=temperature, samples=k)
            out[task] = {"pass@1": res["pass@1"], f"pass@{k}": res[f"pass@{k}"]}
        return out

    def trajectories(
        self, task: str | None = None, status: str | None = None, last: int | None = 200, include_running: bool = False
    ) -> TrajectoryList:
        """Recent trajectories (all statuses), newest last; in a notebook, a TrajectoryViewer."""
        items = self.rollout.trajectories(task, status, last, include_running)
        return TrajectoryList(
            items,
            source=self,
            filters={"task": task, "status": status, "last": last, "include_running": include_running},
        )

    def viewer(self, **filters: Any) -> Any:
        """The TrajectoryViewer widget (filters as in :meth:`trajectories`), live-updating."""
        return view("trajectories", self.trajectories(**filters))

    def dashboard(self, **kwargs: Any) -> Any:
        """A live dashboard widget (reward, step-time phases, staleness, pool use, throughput)."""
        return view("dashboard", self, **kwargs)

    def stats(self) -> dict[str, Any]:
        """Live rollout stats: counts by status, running, buffered, proxy, ``accounting``
        (started, each ending, in flight, ``unaccounted``: 0 unless a trajectory was lost),
        ``env`` (restarts, timeouts, abandoned/hung threads), ``rewards`` and ``shards`` (each
        rollout shard's envs, batch share, accounting and proxy; the other keys sum the shards,
        see :class:`~rollart_nb.control.shards.ShardedRollout`)."""
        return self.rollout.stats()

    # -- lifecycle -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.state == "closed":
            raise StateError("Pipeline is closed; create a new one with session.pipeline(...)")

    def close(self) -> None:
        """Stop rollout (in-flight trajectories end cancelled), wait for training, free the actor."""
        if self.state == "closed":
            return
        self.pause()
        if self._thread is not None:
            self._thread.join(timeout=300)
        try:
            with self._lock:
                try:
                    self._autosave()
                except Exception as e:  # closing must not fail on a full disk
                    log.warning("autosave at close of pipeline %s failed: %s", self.name, e)
            self.rollout.shutdown()
            if self._train_fut is not None:
                self._train_fut.result(timeout=300)
        finally:
            for t in self.trackers:
                try:
                    t.close()
                except Exception as e:
                    log.warning("tracker %r failed to close: %s", t, e)
            self.rollout.close()
            self.state = "closed"
            if self.runtime.pipelines.get(self.name) is self:
                del self.runtime.pipelines[self.name]

    def __repr__(self) -> str:
        last = self.reports[-1] if self.reports else None
        tail = f", last step {last.step_s:.2f}s reward {last.mean_reward:.3f}" if last else ""
        return (
            f"Pipeline({self.name!r}, mode={self.mode.name}, alpha={self.cfg.alpha}, version={self.version}, "
            f"{self.state}, steps={len(self.reports)}{tail})"
        )

    def _repr_html_(self) -> str:
        from rollart_nb.control.report import render_pipeline_html

        return render_pipeline_html(self)


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a core dependency
        return None
    return tqdm(total=total, desc=desc, leave=False)


class _Final(WorkerDiedError):
    """A worker died once more than ``max_worker_restarts`` allows: no further recovery."""


def _worker_of(e: WorkerDiedError, cluster: Any) -> int | None:
    """Index in ``cluster`` of the worker ``e`` names, or None."""
    for i, h in enumerate(cluster.workers):
        if h.binding.worker == e.worker:
            return i
    return None
