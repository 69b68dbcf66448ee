"""SessionBase: the session API that :class:`~rollart_nb.Session` (Ray) and
:class:`~rollart_nb.sim_session.SimSession` (in-process) share: cluster checks, tasks, rewards,
pipelines, bindings.

Everything that differs between them lives in the session's :class:`~rollart_nb.runtime.Runtime`
(where workers run, weight transports, reward deployment); a subclass provides its constructors,
its ``cluster`` method (with its transport's options) and ``close``, and sets ``_runtime`` once
attached.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import inspect
import logging
import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Self, TypeAlias, TypeVar, cast

from rollart_nb import _ray
from rollart_nb.config import PipelineConfig, field_docs
from rollart_nb.control.env_manager import RolloutConfig
from rollart_nb.control.tasks import TaskSet
from rollart_nb.errors import ConfigError, StateError
from rollart_nb.resources.manager import Binding
from rollart_nb.runtime.base import ClusterSpec
from rollart_nb.serverless.client import Endpoint
from rollart_nb.session_checks import (
    check_pipeline_parts,
    pipeline_settings,
    place_on_launchers,
    reward_problems,
    staleness_algo,
    stray_reward_problem,
)
from rollart_nb.workers.worker import Worker

if TYPE_CHECKING:
    from rollart_nb.algo.grpo import GRPO
    from rollart_nb.control.curriculum import PromptCurriculum
    from rollart_nb.control.pipeline import Pipeline
    from rollart_nb.envs.base import AsyncEnv
    from rollart_nb.envs.launchers import Launcher
    from rollart_nb.logs import LogTail
    from rollart_nb.protocols import Env, RewardFn, WeightTransport
    from rollart_nb.runtime.base import Runtime
    from rollart_nb.workers.cluster import ClusterBase

    TaskEnv: TypeAlias = Env | AsyncEnv | Launcher
    """What ``sess.tasks`` takes per task: an env (copied per env instance) or a launcher serving it."""

__all__ = ["SessionBase", "SessionState"]

log = logging.getLogger(__name__)


class _Unset:
    """A keyword left out: its value comes from the config (the signature shows that default)."""

    def __repr__(self) -> str:
        return "<from config>"


UNSET: Any = _Unset()
_SETTINGS = frozenset(f.name for f in dataclasses.fields(PipelineConfig))

R = TypeVar("R", bound="Runtime")


class SessionState(enum.StrEnum):
    """A session's lifecycle: ``DETACHED -> ATTACHED -> CLOSED`` (equal to the strings)."""

    DETACHED = "detached"
    ATTACHED = "attached"
    CLOSED = "closed"


C = TypeVar("C", bound="ClusterBase")


class SessionBase(abc.ABC, Generic[R, C]):
    """What every session offers on top of its clusters: tasks, rewards, pipelines, bindings.

    :class:`~rollart_nb.Session` (Ray) and :class:`~rollart_nb.sim_session.SimSession`
    (in-process, simulated) share this code; how workers run, which weight transports and reward
    deployments exist, and what owns the clusters and pipelines by name is their
    :attr:`runtime`'s. Lifecycle: ``state`` is a :class:`SessionState` (detached, attached, closed).
    """

    _reopen: ClassVar[str]
    """How to make a new session, for the messages of a closed (or detached) one."""

    def __init__(self) -> None:
        self.state = SessionState.DETACHED
        self._runtime: R | None = None  # set once attached
        self._known_tasks: set[str] = set()  # every task of a TaskSet this session built
        self._rewards: dict[str, dict[str, Any]] = {}
        self._launchers: dict[str, Any] = {}  # task -> env launcher this session started

    @property
    def runtime(self) -> R:
        """Where this session's workers run; what its pipelines get (rollout cluster, weights, rewards)."""
        if self._runtime is None:
            self._check()
            raise StateError(f"{type(self).__name__} has no runtime; use {self._reopen}")
        return self._runtime

    @property
    def clusters(self) -> dict[str, ClusterBase]:
        """Cluster name -> cluster, pipelines' rollout clusters included."""
        return self._runtime.clusters if self._runtime is not None else {}

    @property
    def endpoints(self) -> dict[str, Endpoint]:
        """Serverless endpoints registered for ``@register_serverless`` methods, by name."""
        return self._runtime.endpoints if self._runtime is not None else {}

    def _check(self) -> None:
        name = type(self).__name__
        if self.state == SessionState.CLOSED:
            raise StateError(f"{name} is closed; create a new one with {self._reopen}")
        if self.state != SessionState.ATTACHED:
            raise StateError(f"{name} is not attached; use {self._reopen}")

    # -- clusters ----------------------------------------------------------------------
    def cluster(
        self,
        name: str,
        worker_cls: type[Worker],
        pool: str | None = None,
        replicas: int = 1,
        *,
        fallback: list[str] | None = None,
        slots: float = 1.0,
        endpoints: dict[str, str] | None = None,
        affinity: dict[str, str] | None = None,
        max_concurrency: int | None = None,
        start_timeout_s: float = 120.0,
        threaded: bool | None = None,
        **init_kwargs: Any,
    ) -> C:
        """Build (or rebuild) the cluster ``name`` of ``replicas`` ``worker_cls`` workers.

        Args:
            name: role name ("actor_train", "actor_gen", "reward", "env", ...). Building the same
                name again closes the old cluster first (re-running a cell is safe); while a pipeline
                that is not closed uses it, StateError names the pipeline and nothing changes
                (``pipe.close()`` first).
            worker_cls: a :class:`~rollart_nb.Worker` subclass.
            pool: preferred pool; default ``worker_cls.default_pool``.
            replicas: number of workers (>= 1).
            fallback: pools to try if ``pool`` is full or absent (default: compatible pools).
            slots: pool slots per worker (GPUs of one TP group; they must fit on one node).
            endpoints: serverless endpoint name -> URL for ``@register_serverless`` methods.
            affinity: tag -> hardware overrides for ``@hw_mapping`` methods.
            max_concurrency: Ray workers: concurrent calls one worker actor accepts (default: the
                worker class's ``max_concurrency``, 64; generation workers take 4096, so every
                sequence their engine can hold is in it rather than queued in front of the actor).
            start_timeout_s: Ray workers: seconds a worker may take to start.
            threaded: in-process (SimSession) workers: run sync methods on a thread of their own
                (default: only for trainers, whose sim step blocks; see :mod:`rollart_nb.runtime.local`).
            **init_kwargs: passed to ``worker_cls.__init__`` (by reference in a SimSession).
        """
        self._check()
        spec = ClusterSpec(
            name,
            worker_cls,
            pool=pool or "",
            replicas=replicas,
            fallback=fallback,
            slots=slots,
            endpoints={n: Endpoint(n, u) for n, u in (endpoints or {}).items()},
            affinity=affinity,
            max_concurrency=max_concurrency,
            start_timeout_s=start_timeout_s,
            threaded=threaded,
            init_kwargs=init_kwargs,
        )
        self.runtime.resources.check_pool_name(spec.pool)
        if name in self.clusters:
            self._check_unused(name, f"rebuilding cluster {name!r} (sess.cluster({name!r}, ...))")
            log.info("replacing cluster %s", name)
            self.close_cluster(name)
        c = cast(C, self.runtime.cluster(spec))
        for message in self.runtime.resources.absent_pool_notes(c.bindings):
            warnings.warn(message, stacklevel=2)  # a pool asked for is not in this cluster: say so in the cell
        return c

    def close_cluster(self, name: str) -> None:
        """Drop a cluster's workers and free its slots.

        Raises StateError, changing nothing, while a pipeline that is not closed uses the cluster
        (its generator, trainer or rollout): close that pipeline first.
        """
        if self._runtime is not None:
            self._check_unused(name, f"sess.close_cluster({name!r})")
            self._runtime.close_cluster(name)

    def _check_unused(self, name: str, what: str) -> None:
        """Raise StateError if a live pipeline uses cluster ``name`` (``what`` would stop its workers)."""
        c = self.clusters.get(name)
        users = [
            p.name
            for p in self.runtime.pipelines.values()
            if p.state != "closed" and any(x is c for x in (p.train, p.gen, *p.rollout.clusters))
        ]
        if c is None or not users:
            return
        names = ", ".join(repr(u) for u in users)
        raise StateError(
            f"{what} would stop workers that pipeline {names} still uses; nothing was changed. Close the pipeline "
            f"first (pipe.close(), or sess.runtime.pipelines[{users[0]!r}].close()), then run this again and build "
            "the pipeline again with sess.pipeline(...) on the new cluster"
        )

    # -- tasks, rewards, pipelines -----------------------------------------------------
    def tasks(
        self,
        envs: Mapping[str, TaskEnv],
        envs_per_task: int | dict[str, int] = 8,
        weights: dict[str, float] | None = None,
        curriculum: dict[str, PromptCurriculum] | None = None,
        *,
        launcher: dict[str, Launcher] | None = None,
        check: bool = True,
    ) -> TaskSet:
        """Declare the tasks of a run.

        Args:
            envs: task name -> env (gymnasium-style text env; copied per env instance), or a
                launcher (:class:`~rollart_nb.envs.LocalLauncher`, ...) that serves the env.
            envs_per_task: concurrent env instances per task: one int for all, or a mapping with
                a count for every task.
            weights: task -> share of each training batch (default uniform).
            curriculum: task -> :class:`~rollart_nb.PromptCurriculum`: that task's prompts (env
                seeds) are drawn by learnability instead of at random; ``pipe.stats()["curriculum"]``
                shows its state.
            launcher: task -> launcher: run that task's envs as env-server replicas. The task's
                env becomes a :class:`~rollart_nb.envs.RemoteEnv` on the launcher (each episode
                on a healthy replica; ``info["replica"]`` names it); the session starts the
                launcher if needed and stops it on :meth:`close` (or when another launcher
                replaces it for the same task). The env given in ``envs`` must be of the class
                the launcher serves.
            check: run :func:`rn.envs.check <rollart_nb.envs.check>` on each env first (a few
                short episodes here, with the task's reward if one is registered), so a broken
                env fails in this cell with its traceback; envs served by launchers or remote
                are not checked.

        Raises:
            EnvError / RewardError: ``check`` found a problem (the message has file and line).

        Example:
            >>> math = rn.envs.Arithmetic()
            >>> tasks = sess.tasks({"math": math}, curriculum={"math": rn.PromptCurriculum(math.validation_seeds())})
            ...                                                                   # doctest: +SKIP
            >>> code = rn.envs.LocalLauncher("rollart_nb.envs:CodeTask", replicas=2)
            >>> tasks = sess.tasks({"code": rn.envs.CodeTask()}, launcher={"code": code})  # doctest: +SKIP
        """
        self._check()
        envs, launchers = place_on_launchers(dict(envs), dict(launcher or {}))
        for env in envs.values():  # workers cannot import a script's or test file's env classes
            for cls in {type(env), type(getattr(env, "unwrapped", env))}:
                _ray.ship_by_value(cls)
        if check:
            from rollart_nb.envs.check import check as check_env
            from rollart_nb.envs.check import checkable

            for task, env in envs.items():
                if task not in launchers and checkable(env):
                    check_env(env, task=task, reward=self._rewards.get(task, {}).get("fn"))
        per = envs_per_task if isinstance(envs_per_task, dict) else dict.fromkeys(envs, envs_per_task)
        for task, lau in launchers.items():
            self._own_launcher(task, lau)
            envs[task].metadata()  # fetched once here, so every copy of the template carries it
        ts = TaskSet(envs, dict(per), weights, dict(curriculum or {}), launchers=launchers)
        self._known_tasks.update(ts.envs)
        return ts

    def logs(self, worker: str | None = None, last: int = 50) -> LogTail:
        """The last ``last`` lines the session's workers logged or printed (envs and rewards in
        the rollout worker included), merged by time; ``worker``: only one worker's, e.g.
        ``"pipeline.rollout"``. A str whose repr is the text, so a cell shows it as is.

        Example:
            >>> sess.logs("rollout", last=20)                                # doctest: +SKIP
        """
        from rollart_nb.logs import read_logs

        return read_logs(self.runtime.log_dir, worker, last)

    def log_tail(self, worker: str | None = None, last: int = 200) -> Any:
        """A widget that follows what :meth:`logs` shows, live: new lines as they are written
        (polled each second), a worker filter, Pause and Clear (:class:`~rollart_nb.nb.LogTailWidget`;
        needs the ``nb`` extra). ``close()`` stops it.

        Example:
            >>> sess.log_tail("rollout")                                     # doctest: +SKIP
        """
        try:
            from rollart_nb.nb.logtail import LogTailWidget
        except ImportError as e:
            raise ConfigError(
                f"the log tail widget needs the notebook extra: pip install 'rollart_nb[nb]' ({e})"
            ) from e
        tail = LogTailWidget(self.runtime.log_dir, worker=worker, last=last)
        self.__dict__.setdefault("_log_tails", []).append(tail)  # sess.close() stops its thread
        return tail

    def _own_launcher(self, task: str, lau: Any) -> None:
        """Start ``lau`` if needed and stop it on close; a different launcher for ``task`` from
        an earlier call (a re-run cell) is stopped."""
        owned = self._launchers
        old = owned.get(task)
        if old is not None and old is not lau and not any(o is old for t, o in owned.items() if t != task):
            log.info("replacing the launcher of task %s", task)
            _close_launcher(old)
        owned[task] = lau
        if not getattr(lau, "started", False):
            lau.start()
        if callable(getattr(lau, "wait_ready", None)):
            lau.wait_ready()

    def _close_own_parts(self) -> None:
        """Stop the log tails and the env launchers this session started (after its pipelines)."""
        tails, self.__dict__["_log_tails"] = self.__dict__.get("_log_tails", []), []
        for tail in tails:
            try:
                tail.close()
            except Exception:
                log.debug("closing a log tail failed", exc_info=True)
        self._close_launchers()

    def _close_launchers(self) -> None:
        owned, self._launchers = self._launchers, {}
        for lau in {id(x): x for x in owned.values()}.values():
            _close_launcher(lau)

    def reward(
        self,
        task: str,
        fn: RewardFn | None = None,
        *,
        serverless: bool = False,
        url: str | None = None,
        token_env: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 1,
        validate_with: RewardFn | None = None,
        **serve_options: Any,
    ) -> None:
        """Set ``task``'s reward for pipelines built after this call (and swap it in existing ones).

        Args:
            fn: ``fn(trajectory) -> float`` (or per-turn list), sync or async.
            serverless: deploy ``fn`` as a Ray Serve deployment that scales to zero, on 127.0.0.1
                (a real session only; a SimSession raises ConfigError).
            url: use an existing HTTP endpoint instead of ``fn`` (JSON contract in
                :mod:`rollart_nb.serverless.client`).
            token_env: environment variable holding the endpoint's bearer token (never logged).
            timeout_s / retries: per call; a reward still failing after the retries fails the
                trajectory with the reason.
            validate_with: a local ``fn(trajectory) -> float`` that scores this task's greedy
                validation instead of ``fn`` (e.g. train on a shaped reward, validate on exact
                match); it stays across later reward swaps until replaced.
            **serve_options: ``min_replicas``, ``max_replicas``, ``downscale_delay_s``, ...

        Raises:
            ConfigError: a bad argument, or ``task`` is in no TaskSet this session built and no live
                pipeline (once it knows some tasks; before, the check waits for :meth:`pipeline`).

        Example:
            >>> sess.reward("math", rn.rewards.close_answer, validate_with=rn.rewards.exact_answer)  # doctest: +SKIP
        """
        self._check()
        known = sorted(self._live_tasks())
        p = reward_problems(task, fn, url, serverless, serve_options, validate_with, timeout_s, retries, known)
        if p:
            raise ConfigError(p, where=f"sess.reward({task!r}, ...)")
        if url is not None:
            spec: dict[str, Any] = {
                "endpoint": Endpoint(f"{task}-reward", url, token_env=token_env, timeout_s=timeout_s, retries=0)
            }
        elif serverless:
            # a real session only; the dispatcher retries (``retries``), not the endpoint as well
            spec = {"endpoint": self.runtime.deploy_reward(task, fn, retries=0, **serve_options)}
        else:
            spec = {"fn": fn}
        spec.update(timeout_s=timeout_s, retries=retries)
        if validate_with is None:  # keep the task's validation scorer for pipelines built later too
            validate_with = self._rewards.get(task, {}).get("validate_with")
        if validate_with is not None:
            spec["validate_with"] = validate_with
        self._rewards[task] = spec
        for pipe in self.runtime.pipelines.values():
            if task in pipe.tasks.envs:
                pipe.rollout.set_reward(task, **spec)

    def pipeline(
        self,
        train: ClusterBase,
        gen: ClusterBase,
        tasks: TaskSet,
        *,
        config: PipelineConfig | None = None,
        algo: GRPO | None = None,
        name: str = "pipeline",
        resume_from: str | os.PathLike[str] | None = None,
        group_size: int | None = None,
        batch_size: int = UNSET,
        alpha: int = UNSET,
        staleness: str = UNSET,
        wait_s: float = UNSET,
        mode: str = UNSET,
        redundancy: int = UNSET,
        seed: int | None = UNSET,
        rollout: RolloutConfig = UNSET,
        validate_every: int = UNSET,
        validation_seeds: dict[str, list[int]] | None = UNSET,
        validate_pass_k: int = UNSET,
        pd: bool = UNSET,
        max_inflight: int = UNSET,
        dispatch: str = UNSET,
        rollout_shards: int | None = UNSET,
        step_timeout_s: float | None = UNSET,
        weights: str | WeightTransport | None = UNSET,
        hw_affinity: bool = UNSET,
        failed_trajectories: str = UNSET,
        failure_reward: float = UNSET,
        max_group_failures: int = UNSET,
        run_dir: str | os.PathLike[str] | None = UNSET,
        autosave_every: int = UNSET,
        keep_checkpoints: int = UNSET,
        max_worker_restarts: int = UNSET,
        health_every_s: float = UNSET,
        trackers: Any = UNSET,
        tracker_sample_every: int = UNSET,
        tracker_sample_size: int = UNSET,
    ) -> Pipeline:
        """Build the asynchronous RL pipeline (see :class:`~rollart_nb.control.Pipeline`).

        Its loop's settings are a :class:`~rollart_nb.config.PipelineConfig`: pass one as
        ``config``, or any of its fields as keywords of the same name (listed below with their
        defaults), or both: keywords override ``config``. ``pipe.config`` is what is in force.
        Every setting is checked before anything changes; all problems come in one ConfigError.

        Args:
            train: the ActorTrain cluster (e.g. TorchTrainer, SimTrainer); the order is
                (train, gen, tasks): swapped clusters raise ConfigError.
            gen: the ActorGen cluster (e.g. HFGenerator, SimGenerator).
            tasks: from :meth:`tasks`. A reward registered (:meth:`reward`) for a task that neither
                ``tasks`` nor an earlier pipeline of this session has raises ConfigError (a typo);
                that registration is dropped, so fixing the name and calling again works.
            config: the loop's settings (default: ``PipelineConfig()``; with ``resume_from``, the
                saved pipeline's).
            algo: e.g. ``rn.GRPO(group_size=8)``; the trainer is configured with it, and its
                ``group_size`` is the GRPO group size.
            name: re-using a name closes the previous pipeline of that name first.
            resume_from: a directory written by ``pipe.save(path)``, or a run folder (its newest
                complete autosave), in this or an earlier session: the trainer is restored from it
                (model, optimizer, version, RNG) before ``algo`` is applied, generators serve the
                saved version from the start, step numbers continue, the saved config applies
                (unless ``config`` or keywords change it), and the scheduler draws fresh env seeds
                (unless ``seed`` is given). ``tasks`` must have the saved task names; rewards are
                not saved (set them with :meth:`reward` first; a changed reward source warns).
            group_size: the GRPO group size without an ``algo`` (default 8, or the saved one with
                ``resume_from``); with one, it must match ``algo.group_size``.
            **settings: the fields of :class:`~rollart_nb.config.PipelineConfig`:

        Example:
            >>> pipe = sess.pipeline(train, gen, tasks, algo=rn.GRPO(group_size=8), batch_size=64,
            ...                      alpha=2, rollout=rn.RolloutConfig(max_turns=8))  # doctest: +SKIP
            >>> pipe.save("ckpt/run1")                          # doctest: +SKIP
            >>> # later, in a new session with the same model and tasks:
            >>> pipe = sess.pipeline(train, gen, tasks, algo=rn.GRPO(group_size=8),
            ...                      resume_from="ckpt/run1")       # doctest: +SKIP
        """
        from rollart_nb.control.checkpoint import latest_reward_sources, resolve_checkpoint
        from rollart_nb.control.pipeline import Pipeline

        self._check()
        where = f"sess.pipeline(name={name!r})"
        given = {k: v for k, v in locals().items() if k in _SETTINGS and v is not UNSET}
        check_pipeline_parts(train, gen, tasks, config, where)
        self._drop_stray_rewards(tasks, where)
        resume = resolve_checkpoint(resume_from) if resume_from is not None else None
        if resume is not None:  # check everything before anything changes
            resume.check_tasks(tasks)
        cfg, groups = pipeline_settings(config, given, algo, group_size, resume, where)
        scheduler_seed = None
        if resume is not None:
            log.warning(
                "resuming pipeline %s from %s: step %d, version %d", name, resume.path, resume.steps, resume.version
            )
            if "seed" not in given:  # fresh env seeds, not the saved run's again
                scheduler_seed = resume.resume_seed
        if name in self.runtime.pipelines:
            log.info("replacing pipeline %s", name)
            self.runtime.pipelines[name].close()
        if resume is not None:
            train.load_checkpoint(resume.trainer_dir)
        algo = staleness_algo(cfg, algo, where)
        if algo is not None:
            train.configure(algo)
        pipe = Pipeline(
            self.runtime,
            train,
            gen,
            tasks,
            config=cfg,
            group_size=groups,
            name=name,
            rewards=self._rewards,
            resume=resume,
            scheduler_seed=scheduler_seed,
        )
        pipe.algo = algo
        self.runtime.pipelines[name] = pipe
        if resume is not None:
            resume.warn_reward_changes(latest_reward_sources(pipe.reward_history()))
        return pipe

    def _live_tasks(self) -> set[str]:
        """Tasks of every TaskSet this session built and of its pipelines that are not closed."""
        live = (p.tasks.envs for p in self._runtime.pipelines.values() if p.state != "closed") if self._runtime else ()
        return self._known_tasks.union(*live)

    def _drop_stray_rewards(self, tasks: TaskSet, where: str) -> None:
        """Refuse (and drop) rewards for tasks that neither ``tasks`` nor an earlier pipeline has.

        Such a reward is a typo, or belongs to a pipeline not built yet: it would be silently
        ignored. It is dropped, else every later pipeline would refuse it too (there is no
        unregister). The tasks of ``tasks`` count as used even if this pipeline fails later.
        """
        used = self.__dict__.setdefault("_pipeline_tasks", set())  # tasks of this session's pipelines
        stray = [t for t in self._rewards if t not in tasks.envs and t not in used]
        for t in stray:
            self._rewards.pop(t)
        if stray:
            raise ConfigError([stray_reward_problem(t, sorted(tasks.envs)) for t in stray], where=where)
        used.update(tasks.envs)

    def bindings(self, role: str | None = None) -> list[Binding]:
        """Current worker bindings (optionally of one role)."""
        self._check()
        return self.runtime.resources.bindings(role)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abc.abstractmethod
    def close(self) -> None:
        """Close pipelines and clusters and stop what the session started (idempotent)."""


def _close_launcher(lau: Any) -> None:
    try:
        lau.close()
    except Exception as e:  # one launcher that fails to stop must not keep the others running
        log.warning("stopping %r: %s", lau, e)


def _document_settings(fn: Any) -> None:
    """``fn``'s signature shows each PipelineConfig keyword's real default (not the sentinel),
    and its docstring lists every setting with its field docstring, so ``help()`` and tab
    completion show them all from the one place they are defined."""
    defaults = PipelineConfig()
    sig = inspect.signature(fn)
    params = [
        p.replace(default=getattr(defaults, p.name)) if p.default is UNSET else p for p in sig.parameters.values()
    ]
    missing = _SETTINGS - set(sig.parameters)
    if missing:  # a field added to PipelineConfig needs its keyword here
        raise TypeError(f"{fn.__qualname__} lacks keywords for PipelineConfig fields {sorted(missing)}")
    fn.__signature__ = sig.replace(parameters=params)
    docs = field_docs(PipelineConfig)
    lines = []
    for f in dataclasses.fields(PipelineConfig):
        text = " ".join(docs.get(f.name, "").split())
        lines.append(f"                ``{f.name}`` ({getattr(defaults, f.name)!r}): {text}")
    marker = "            **settings: the fields of :class:`~rollart_nb.config.PipelineConfig`:\n"
    fn.__doc__ = (fn.__doc__ or "").replace(marker, marker + "\n".join(lines) + "\n")


_document_settings(SessionBase.pipeline)
