"""Pipeline: the six-step asynchronous protocol, one readable iteration.

Each :meth:`Pipeline.step`::

    ① get_batch   wait until the SampleBuffer holds a batch of whole groups, take it (then,
                  when training overlaps, wait for the previous step's train_step)
    ② suspend     the LLMProxy stops admitting requests (in-flight trajectories are kept);
                  modes with ``preempt`` stop the turns in flight instead of waiting for them
    ③ update      generation workers load the trainer's newest weights; the version bumps
                  and the staleness bound aborts / evicts what it now excludes
    ④ resume      the proxy admits requests again
    ⑤ recompute   in-flight trajectories re-prefill their history under the new weights
                  (inside the generation backend, on their next turn) and continue
    ⑥ train_step  on the batch from ①, overlapped with the resumed rollout

Dead workers are replaced or restored at every step and while a step waits for its batch
(:mod:`~rollart_nb.control.failover`); modes change a few switches (:mod:`~rollart_nb.control.modes`),
not the loop. :meth:`Pipeline.save` checkpoints what ``sess.pipeline(..., resume_from=path)``
continues from (:mod:`~rollart_nb.control.checkpoint`). A pipeline gets what it needs from its
session's :class:`~rollart_nb.runtime.Runtime` (rollout clusters, weight transport, reward
deployment, clock, its registration by name); it never calls into the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, overload

from rollart_nb._checks import is_whole
from rollart_nb.config import PipelineConfig, portable
from rollart_nb.control.checkpoint import PipelineCheckpoint, RunFolder, latest_reward_sources, write_checkpoint
from rollart_nb.control.failover import Failover, RestartsExhausted
from rollart_nb.control.ledger import TrainRecords
from rollart_nb.control.modes import mode as get_mode
from rollart_nb.control.pipeline_setup import build_rollout
from rollart_nb.control.replay import check_from_turn, find, replay
from rollart_nb.control.report import ENGINE_REPORTS, StepReport, StepTally, TrackerFanout, progress_bar, run_config
from rollart_nb.control.shards import auto_shards, plan_rollout, plan_shards
from rollart_nb.control.validation import Validation
from rollart_nb.errors import ConfigError, StateError, WorkerDiedError
from rollart_nb.trackers import resolve_trackers
from rollart_nb.trajectory import Trajectory, TrajectoryList
from rollart_nb.views import view

if TYPE_CHECKING:
    from rollart_nb.control.tasks import TaskSet
    from rollart_nb.runtime.base import Runtime
    from rollart_nb.workers.cluster import ClusterBase

__all__ = ["Pipeline", "PipelineState"]

log = logging.getLogger(__name__)


class PipelineState(enum.StrEnum):
    """Where a pipeline is in its life: ``idle -> running -> paused -> closed``.

    A background run that raises leaves ``failed`` (its error in ``pipe.error``) until the
    next step or run. Members are strings: ``pipe.state == "idle"`` holds.
    """

    IDLE = "idle"
    RUNNING = "running"
    PAUSED = "paused"
    CLOSED = "closed"
    FAILED = "failed"


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
        self.mode = get_mode(c.mode)
        self._clock = runtime.clock  # step timing: a SimSession's virtual time, else wall time
        self.runtime, self.train, self.gen, self.tasks, self.name = runtime, train, gen, tasks, name
        self.state = PipelineState.IDLE
        self.folder = RunFolder.of(c, name)
        plans = self._plan_rollout(runtime, c, tasks, group_size, scheduler_seed)
        self.step_timeout_s, self.health_every_s = c.step_timeout_s, float(c.health_every_s)
        self.algo: Any = None  # set by sess.pipeline: a restored trainer is configured with it again
        self.first_step = resume.steps if resume is not None else 0  # step numbers go on after a resume
        self.resumed_from = resume
        self.reports: list[StepReport] = []
        self.error: BaseException | None = None
        self._tally = StepTally()
        self.train_records = TrainRecords()  # what each train step computed per token
        self._train_fut: Any = None
        self._in_training: list[Trajectory] = []  # the batch behind _train_fut
        self._thread: threading.Thread | None = None
        self._pause = threading.Event()
        self._lock = threading.Lock()
        self.trackers = TrackerFanout(  # TensorBoard, W&B, MLflow, ...: each StepReport goes to each
            resolve_trackers(list(c.trackers) or None, run_dir=self.folder.path if self.folder else None, name=name),
            name,
            sample_every=c.tracker_sample_every,
            sample_size=c.tracker_sample_size,
            run_config=self.run_config,
        )
        self.rollout, self.affinity = build_rollout(runtime, name, gen, tasks, plans, c, rewards)
        self.validation = Validation(
            name,
            self.rollout,
            c.validation_seeds or tasks.validation_seeds(),
            every=c.validate_every,
            pass_k=c.validate_pass_k,
            temperature=self.cfg.rollout.temperature,
        )
        self.last_validation = self.validation.last  # task -> its newest greedy result
        self._start_serving(c, resume)

    # -- setup ---------------------------------------------------------------------------
    def _plan_rollout(
        self, runtime: Runtime, c: PipelineConfig, tasks: TaskSet, group_size: int, scheduler_seed: int | None
    ) -> Any:
        """The scheduler config (``self.cfg``) and the rollout shards' plans (ConfigError before
        anything starts)."""
        seed = scheduler_seed if scheduler_seed is not None else runtime.seed if c.seed is None else c.seed
        self.cfg = plan_rollout(tasks.expand(), c, group_size, seed, tasks.weights, tasks.curricula or None)
        shards = c.rollout_shards
        if shards is None:  # one per ENVS_PER_SHARD envs, within the CPU pool's free slots
            free = runtime.resources.free("cpu") if "cpu" in runtime.resources.pools else None
            shards = auto_shards(self.cfg, free)
        return plan_shards(self.cfg, shards)  # raises ConfigError before anything starts

    def _start_serving(self, c: PipelineConfig, resume: PipelineCheckpoint | None) -> None:
        """Launch the first trajectories at the trainer's version (a reused or restored
        trainer's too), serving its weights first when the generators do not have them: no
        trajectory claims an older version than generates it, none is aborted as stale by
        the first update."""
        trained = int(self.train.version())
        served = self.gen.version() if callable(getattr(self.gen, "version", None)) else []  # a previous pipeline's
        served = served if isinstance(served, list) else [served]
        serve = bool(trained) or resume is not None or any(int(v) != trained for v in served)
        self.E = self.rollout.start(trained, not serve)
        self.version = 0
        self._served_state: Any = None  # object ref of the served weights (the direct path): replacements load it
        self.transport = self.runtime.weight_transport(c.weights, self.name)
        if self.transport is not None:  # trainer publishes, generators pull in the background
            self.train.set_transport(self.transport)
            self.gen.set_transport(self.transport)
        self.failover = Failover(
            self.name,
            self.train,
            self.gen,
            self.rollout,
            transport=self.transport,
            max_restarts=c.max_worker_restarts,
            log_dir=self.runtime.log_dir,
            step=self._steps_done,
        )
        if serve:
            self._update_weights(trained)

    # -- the loop ----------------------------------------------------------------------
    def step(self) -> StepReport:
        """Run one iteration of the six-step protocol; returns its :class:`StepReport`."""
        self._check_open()
        with self._lock:
            prev = PipelineState.IDLE if self.state == PipelineState.FAILED else self.state
            self.state = PipelineState.RUNNING
            try:
                try:
                    return self._step()
                except WorkerDiedError as e:  # a worker died mid-step: replace or restore it, step again
                    if isinstance(e, RestartsExhausted) or not self._heal(cause=e):
                        raise
                    self.rollout.resume()
                    return self._step()
            finally:
                if self.state == PipelineState.RUNNING:
                    self.state = prev if prev != PipelineState.RUNNING else PipelineState.IDLE

    def _step(self) -> StepReport:
        n, m = self.cfg.batch_size, self.mode
        rep = StepReport(step=self._steps_done(), version=self.version, mode=m.name, started_at=time.time())
        t0, metrics = self._clock(), {}
        with self._phase(rep, "rollout_wait"):  # ① get_batch, dead workers replaced first
            self._heal()
            self.failover.wait_for_batch(n, self.step_timeout_s, self.health_every_s, self._clock, self._heal)
            batch: list[Trajectory] = self.rollout.take_batch(n)
        if not m.overlap_train:  # sync, sync+: train on it now
            with self._phase(rep, "train"):
                metrics = self.train.train_step(batch)
            rep.train_s = rep.phases["train"]
        elif self._train_fut is not None:  # the previous step's training, behind the rollout
            with self._phase(rep, "train"):
                metrics = self._train_fut.result()
            rep.train_s = metrics.get("step_s", metrics.get("modelled_s", 0.0))
        with self._phase(rep, "suspend"):  # ② suspend
            self.rollout.suspend(preempt=m.preempt)
        with self._phase(rep, "update"):  # ③ update
            if metrics:
                rep.weights = self._update_weights(int(metrics["version"]))
                rep.weights.update({k: metrics[k] for k in ("push_s", "push_bytes") if k in metrics})
        with self._phase(rep, "resume"):  # ④ resume; ⑤ recompute, in the backends' next turn
            self.rollout.resume()
            if not m.continuous:
                self.rollout.start_iteration()
        trained = self._in_training if m.overlap_train else batch  # what ``metrics`` are of
        if m.overlap_train:  # ⑥ train_step, overlapped with the resumed rollout
            self._train_fut, self._in_training = self.train.train_step(batch, blocking=False), batch
        return self._finish_report(rep, batch, metrics, t0, trained)

    @contextlib.contextmanager
    def _phase(self, rep: StepReport, phase: str) -> Iterator[None]:
        """Time the block on the pipeline's clock into ``rep.phases[phase]``."""
        t = self._clock()
        yield
        rep.phases[phase] = self._clock() - t

    def _steps_done(self) -> int:
        """Steps taken, counting those of the run this one resumed."""
        return self.first_step + len(self.reports)

    def _update_weights(self, version: int, rollback: bool = False) -> dict[str, float]:
        """Generators switch to ``version``; returns weight-sync metrics (summed over generators).

        Raises StateError, changing nothing, if ``version`` is older than the one served: the
        trainer lost its state (a restarted worker starts from its initial weights), and
        serving or training on older weights would go on silently. ``rollback=True`` (a trainer
        restored from an autosave) allows it, and the rollout drops what newer weights generated.
        """
        if version < self.version and not rollback:
            raise self.failover.lost_state(version, self.version, self.folder)
        if self.transport is None:  # an object ref: weights go trainer -> generators
            self._served_state = self.train.state_dict(blocking=False).refs[0]
        out = self.failover.serve(version, self._served_state)
        self.version = version
        self.rollout.set_version(version, rollback=rollback)
        return out

    def _heal(self, cause: WorkerDiedError | None = None) -> bool:
        """Restore a dead or restarted trainer and replace dead (or hand-restarted)
        generators; True if it did either."""
        f = self.failover
        if not f.enabled:
            return False
        dead, restarted = f.lost_trainers(cause)
        if dead or restarted:
            last = self.folder.last if self.folder is not None else None
            f.restore_trainer(
                dead, restarted, autosave=last, version=self.version, algo=self.algo, roll_back=self._roll_back
            )
        return f.heal_generators(self.version, self._served_state, cause) or bool(dead or restarted)

    def _roll_back(self, version: int) -> None:
        """Serve ``version`` of a restored trainer; the batch it was training on is lost with it."""
        self._train_fut, self._in_training = None, []
        self._update_weights(version, rollback=True)

    @property
    def events(self) -> list[dict[str, Any]]:
        """Failover events (generators replaced, trainers restored), oldest first."""
        return self.failover.events

    def _finish_report(
        self, rep: StepReport, batch: list[Trajectory], metrics: dict[str, Any], t0: float, trained: list[Trajectory]
    ) -> StepReport:
        """Fill and keep ``rep`` for ``batch``; ``trained``: the batch ``metrics`` are of (the
        previous one when training overlaps), which trackers sample with its per-token records."""
        rep.version = self.version
        rep.step_s = self._clock() - t0
        rep.train = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        self.train_records.add(metrics.get("token_records"), rep.step)
        self.train_records.attach(trained)
        self._tally.fill(rep, batch, self.rollout.stats())
        self.validation.after_step(rep, self._clock)
        rep.events = self.failover.take_events()
        self.reports.append(rep)
        if len(self.reports) > ENGINE_REPORTS:  # older steps keep their occupancy, not every engine's dict
            self.reports[-ENGINE_REPORTS - 1].engines = []
        if self.folder is not None:  # the step lock is held
            self.folder.record(rep.to_dict())
            if self.folder.due(rep.step):
                self._autosave()
        self.trackers.send(rep, trained if metrics else batch)
        return rep

    def run_config(self) -> dict[str, Any]:
        """What a tracker records as the run's parameters: mode, alpha, sizes, tasks, algorithm."""
        return run_config(self)

    def _autosave(self) -> str | None:
        """Autosave into the run folder, when it has one (the step lock held)."""
        if self.folder is None or not self.reports:
            return None
        return self.folder.autosave(self._steps_done(), self._trained_version, self.version, self._write_checkpoint)

    def _trained_version(self) -> int:
        """The trainer's version once every batch taken is trained on (the result stays for the next step)."""
        if self._train_fut is not None:
            self._train_fut.result()
        return int(self.train.version())

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
        """Run ``steps`` iterations (0: none).

        With ``background=True`` it returns at once (a thread runs the steps; the kernel stays
        responsive); :meth:`pause` stops it after the current step, :meth:`wait` joins it.
        ``on_step(report)`` is called after every step (dashboards use it).

        Raises:
            ConfigError: ``steps`` is a number but not a whole one >= 0.
        """
        self._check_open()
        if steps is not None and not (is_whole(steps) and steps >= 0):  # None: range's TypeError, as ever
            raise ConfigError(f"steps must be a whole number >= 1 (0 runs none), got {steps!r}", where="pipe.run")
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
        bar = progress_bar(steps, f"{self.name} ({self.mode.name})") if progress else None
        try:
            for _ in range(steps):
                if self._pause.is_set():
                    self.state = PipelineState.PAUSED
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
            self.state = PipelineState.PAUSED  # the stop button: steps are whole; a later step() continues
            log.warning("interrupted: paused after %d step(s)", len(out))
        except BaseException as e:
            self.error = e
            if self._thread is None or threading.current_thread() is not self._thread:
                raise
            self.state = PipelineState.FAILED  # until the next step or run; pipe.wait() raises pipe.error
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

        Raises:
            ConfigError: ``path`` cannot be written (nothing is left behind there).
        """
        self._check_open()
        with self._lock:
            self._trained_version()
            ckpt = self._write_checkpoint(path)
        log.info("saved pipeline %s at step %d, version %d to %s", self.name, ckpt.steps, ckpt.version, ckpt.path)
        return ckpt.path

    def _write_checkpoint(self, path: str | os.PathLike[str]) -> PipelineCheckpoint:
        """The trainer's checkpoint and what a resume needs, at ``path`` (the step lock held)."""
        return write_checkpoint(
            path,
            self.train,
            steps=self._steps_done(),
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
        with self.validation.held():  # once for every task: no training turn between two tasks' validations
            return self.validation.greedy(tasks)

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
        return self.validation.pass_at(k, tasks, temperature)

    def trajectories(
        self, task: str | None = None, status: str | None = None, last: int | None = 200, include_running: bool = False
    ) -> TrajectoryList:
        """Recent trajectories (all statuses), newest last; in a notebook, a TrajectoryViewer.

        Raises:
            ConfigError: ``task`` is not one of the pipeline's tasks.
        """
        if task is not None:
            self.tasks.check(task)
        items = self.rollout.trajectories(task, status, last, include_running)
        self.train_records.attach(items)
        filters = {"task": task, "status": status, "last": last, "include_running": include_running}
        return TrajectoryList(items, source=self, filters=filters)

    def replay(self, traj: Trajectory | str) -> Trajectory:
        """``traj`` (or its id) re-scored by a generator under the policy served now, training
        untouched: a copy whose token frame has ``replay_logprob`` beside ``sampler_logprob``."""
        self._check_open()
        return replay(self.rollout, find(traj, self.trajectories))

    def regenerate(self, traj: Trajectory | str, from_turn: int = 0) -> Trajectory:
        """A new trajectory: ``traj``'s turns before ``from_turn`` replayed in a fresh env from its
        seed, the rest generated by the policy served now and scored; never trained on.

        Raises:
            ConfigError: ``from_turn`` outside ``0..len(traj.turns)``.
            StateError: the env answered a replayed action otherwise (not deterministic).
        """
        self._check_open()
        check_from_turn(t := find(traj, self.trajectories), from_turn)
        return TrajectoryList([self.rollout.regenerate(t, from_turn)], source=self)[0]

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
        if self.state == PipelineState.CLOSED:
            raise StateError("Pipeline is closed; create a new one with session.pipeline(...)")

    def close(self) -> None:
        """Stop rollout (in-flight trajectories end cancelled), wait for training, free the actor."""
        if self.state == PipelineState.CLOSED:
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
            self.trackers.close()
            self.rollout.close()
            self.state = PipelineState.CLOSED
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
