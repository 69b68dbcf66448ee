"""Session: the notebook's entry point to a (local or existing) Ray cluster and its pools.

Lifecycle: ``detached -> attached -> closed``. :meth:`Session.local` and :meth:`Session.attach`
return an attached session (:meth:`Session.sim` returns a simulated one with the same API); every call on a closed one raises a :class:`StateError` that
names the fix.
"""

from __future__ import annotations

import html
import inspect
import logging
import os
import tempfile
import uuid
import warnings
from typing import TYPE_CHECKING, Any, Self

from rollart_nb import _ray
from rollart_nb.control.tasks import TaskSet
from rollart_nb.errors import ConfigError, StateError
from rollart_nb.redact import redact_url
from rollart_nb.resources.manager import Binding, ResourceManager
from rollart_nb.resources.pools import Pool, discover_pools
from rollart_nb.resources.profiles import PROFILES
from rollart_nb.resources.store import make_store
from rollart_nb.serverless.client import Endpoint
from rollart_nb.workers.cluster import Cluster
from rollart_nb.workers.worker import Worker

if TYPE_CHECKING:
    from rollart_nb.sim.session import SimSession

__all__ = ["DEFAULT_LOCAL_POOLS", "Session", "SessionBase"]

log = logging.getLogger(__name__)

DEFAULT_LOCAL_POOLS: dict[str, int] = {"H800": 2, "H20": 2, "cpu": 4}
"""Simulated pools of :meth:`Session.local` (pool name -> worker slots)."""

_LOCAL: Session | None = None  # the one local session of this process (re-run cells replace it)


class SessionBase:
    """What every session offers on top of its clusters: tasks, rewards, pipelines, bindings.

    :class:`Session` (Ray) and :class:`~rollart_nb.sim.session.SimSession` (in-process,
    simulated) share this code; they differ in how workers run (:meth:`cluster`), which weight
    transports and reward deployments they offer (:meth:`_weight_transport`,
    :meth:`_deploy_version`) and their lifecycle.
    """

    state: str
    clusters: dict[str, Any]
    _rewards: dict[str, dict[str, Any]]
    _pipelines: dict[str, Any]
    _resources: ResourceManager

    def _check(self) -> None:
        raise NotImplementedError

    def _deploy_version(self, task: str, fn: Any, **serve_options: Any) -> Endpoint:
        raise NotImplementedError

    def _deploy_reward(self, pipe: Any, task: str, fn: Any, **kwargs: Any) -> int:
        kwargs.pop("serverless", None)
        timeout_s, retries = kwargs.pop("timeout_s", 30.0), kwargs.pop("retries", 1)
        validate_with = kwargs.pop("validate_with", None)
        ep = self._deploy_version(task, fn, retries=0, **kwargs)  # the dispatcher does the retrying
        return pipe.rollout.set_reward(
            task, endpoint=ep, timeout_s=timeout_s, retries=retries, validate_with=validate_with
        )

    # -- clusters ----------------------------------------------------------------------
    def _before_cluster(
        self,
        name: str,
        worker_cls: Any,
        pool: str | None,
        replicas: Any,
        slots: float,
        endpoints: dict[str, str] | None,
    ) -> tuple[str, dict[str, Endpoint]]:
        """Check :meth:`cluster`'s arguments, close a cluster of the same name; returns the pool
        (default ``worker_cls.default_pool``) and the serverless endpoints."""
        self._check()
        problems = []
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            problems.append(f"worker_cls must be a rollart_nb.Worker subclass, got {worker_cls!r}")
        if not isinstance(replicas, int) or replicas < 1:
            problems.append(f"replicas must be an int >= 1, got {replicas!r}")
        if slots <= 0:
            problems.append(f"slots must be > 0, got {slots!r}")
        if not name or not isinstance(name, str):
            problems.append("name must be a non-empty string")
        if problems:
            raise ConfigError(problems, where=f"sess.cluster({name!r}, ...)")
        pool = pool or getattr(worker_cls, "default_pool", "cpu")
        self._resources.check_pool_name(pool)
        if name in self.clusters:
            log.info("replacing cluster %s", name)
            self.close_cluster(name)
        return pool, {n: Endpoint(n, u) for n, u in (endpoints or {}).items()}

    def close_cluster(self, name: str) -> None:
        """Drop a cluster's workers and free its slots."""
        c = self.clusters.pop(name, None)
        if c is not None:
            c.close()

    # -- tasks, rewards, pipelines -----------------------------------------------------
    def tasks(
        self,
        envs: dict[str, Any],
        envs_per_task: int | dict[str, int] = 8,
        weights: dict[str, float] | None = None,
        curriculum: dict[str, Any] | None = None,
        *,
        launcher: dict[str, Any] | None = None,
    ) -> TaskSet:
        """Declare the tasks of a run.

        Args:
            envs: task name -> env (gymnasium-style text env; copied per env instance), or a
                launcher (:class:`~rollart_nb.envs.LocalLauncher`, ...) that serves the env.
            envs_per_task: concurrent env instances per task (an int, or per task).
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

        Example:
            >>> math = rn.envs.Arithmetic()
            >>> tasks = sess.tasks({"math": math}, curriculum={"math": rn.PromptCurriculum(math.validation_seeds())})
            ...                                                                   # doctest: +SKIP
            >>> code = rn.envs.LocalLauncher("rollart_nb.envs:CodeTask", replicas=2)
            >>> tasks = sess.tasks({"code": rn.envs.CodeTask()}, launcher={"code": code})  # doctest: +SKIP
        """
        self._check()
        envs, launchers = _place_on_launchers(dict(envs), dict(launcher or {}))
        per = envs_per_task if isinstance(envs_per_task, dict) else dict.fromkeys(envs, envs_per_task)
        for task, lau in launchers.items():
            self._own_launcher(task, lau)
            envs[task].metadata()  # fetched once here, so every copy of the template carries it
        return TaskSet(envs, dict(per), weights, dict(curriculum or {}), launchers=launchers)

    def _own_launcher(self, task: str, lau: Any) -> None:
        """Start ``lau`` if needed and stop it on close; a different launcher for ``task`` from
        an earlier call (a re-run cell) is stopped."""
        owned = self.__dict__.setdefault("_launchers", {})
        old = owned.get(task)
        if old is not None and old is not lau and not any(o is old for t, o in owned.items() if t != task):
            log.info("replacing the launcher of task %s", task)
            _close_launcher(old)
        owned[task] = lau
        if not getattr(lau, "started", False):
            lau.start()
        if callable(getattr(lau, "wait_ready", None)):
            lau.wait_ready()

    def _close_launchers(self) -> None:
        for lau in {id(x): x for x in self.__dict__.pop("_launchers", {}).values()}.values():
            _close_launcher(lau)

    def reward(
        self,
        task: str,
        fn: Any = None,
        *,
        serverless: bool = False,
        url: str | None = None,
        token_env: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 1,
        validate_with: Any = None,
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

        Example:
            >>> sess.reward("math", rn.rewards.close_answer, validate_with=rn.rewards.exact_answer)  # doctest: +SKIP
        """
        from rollart_nb.control.reward import option_problems

        self._check()
        p = []
        if not isinstance(task, str) or not task:
            p.append(f"task={task!r} must be a task name (a non-empty string, as in sess.tasks({{name: env}}))")
        if (fn is None) == (url is None):
            p.append(
                "give a reward function fn(trajectory) -> float, or url=... of an HTTP endpoint (not both, not neither)"
            )
        elif fn is not None and not callable(fn):
            if isinstance(fn, Endpoint) or isinstance(fn, str) and fn.startswith(("http://", "https://")):
                hint = "; for an HTTP endpoint pass its address as url=..."
            else:
                hint = ", e.g. rn.rewards.exact_answer or lambda t: ..."
            p.append(
                f"fn={fn!r:.80} ({type(fn).__name__}) is not callable; pass a function fn(trajectory) -> float{hint}"
            )
        if url is not None and not isinstance(url, str):
            p.append(f"url={url!r:.80} must be a string http(s)://...")
        if url is not None and serverless:
            p.append("serverless=True deploys fn on Ray Serve; url=... is an endpoint already running: drop one")
        if serve_options and not serverless:
            p.append(f"{', '.join(sorted(serve_options))}: options of serverless=True only (add it, or drop them)")
        p += option_problems(validate_with, timeout_s, retries)
        if p:
            raise ConfigError(p, where=f"sess.reward({task!r}, ...)")
        if url is not None:
            spec: dict[str, Any] = {
                "endpoint": Endpoint(f"{task}-reward", url, token_env=token_env, timeout_s=timeout_s, retries=0)
            }
        elif serverless:
            # a real session only; the dispatcher retries (``retries``), not the endpoint as well
            spec = {"endpoint": self._deploy_version(task, fn, retries=0, **serve_options)}
        else:
            spec = {"fn": fn}
        spec.update(timeout_s=timeout_s, retries=retries)
        if validate_with is None:  # keep the task's validation scorer for pipelines built later too
            validate_with = self._rewards.get(task, {}).get("validate_with")
        if validate_with is not None:
            spec["validate_with"] = validate_with
        self._rewards[task] = spec
        for pipe in self._pipelines.values():
            if task in pipe.tasks.envs:
                pipe.rollout.set_reward(task, **spec)

    def pipeline(
        self,
        train: Any,
        gen: Any,
        tasks: TaskSet,
        *,
        algo: Any = None,
        batch_size: int = 32,
        alpha: int = 1,
        mode: str = "rollart",
        name: str = "pipeline",
        resume_from: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Build the asynchronous RL pipeline (see :class:`~rollart_nb.control.Pipeline`).

        Args:
            train: the ActorTrain cluster (e.g. TorchTrainer, SimTrainer).
            gen: the ActorGen cluster (e.g. HFGenerator, SimGenerator).
            tasks: from :meth:`tasks`. A reward registered (:meth:`reward`) for a task that neither
                ``tasks`` nor an earlier pipeline of this session has raises ConfigError (a typo);
                that registration is dropped, so fixing the name and calling again works.
            algo: e.g. ``rn.GRPO(group_size=8)``; its ``group_size`` sets the GRPO group size and
                the trainer is configured with it.
            batch_size: trajectories per training step (a multiple of the group size).
            alpha: per-trajectory staleness bound.
            mode: "sync", "sync+", "one-off", "areal" or "rollart".
            name: re-using a name closes the previous pipeline of that name first.
            resume_from: a directory written by ``pipe.save(path)``, or a run folder (its newest
                complete autosave), in this or an earlier session: the trainer is restored from it (model, optimizer, version, RNG) before
                ``algo`` is applied, generators serve the saved version from the start, step
                numbers continue, and the scheduler draws fresh env seeds (unless ``seed`` is
                given). ``tasks`` must have the saved task names; rewards are not saved (set them
                with :meth:`reward` first; a changed reward source warns).
            **kwargs: ``redundancy``, ``rollout`` (RolloutConfig), ``validate_every``, ``pd``,
                ``run_dir`` (``steps.jsonl`` appended per step), ``autosave_every=N`` (a checkpoint
                in ``run_dir/checkpoints/`` every N steps and when paused or closed; ``run_dir``
                defaults to ``runs/<name>``), ``keep_checkpoints`` (3), ``max_worker_restarts``
                (3: automatic replacements of a dead generator or restores of a dead trainer per
                worker slot; a trainer is restored only from an autosave), ``health_every_s`` (5.0:
                how often a step waiting for its batch probes the workers), ``trackers`` (names
                "tensorboard", "wandb", "mlflow", or tracker objects; see :mod:`rollart_nb.trackers`), ...

        Example:
            >>> pipe.save("ckpt/run1")                          # doctest: +SKIP
            >>> # later, in a new session with the same model and tasks:
            >>> pipe = sess.pipeline(train, gen, tasks, algo=rn.GRPO(group_size=8),
            ...                      resume_from="ckpt/run1")       # doctest: +SKIP
        """
        import difflib

        from rollart_nb.control.checkpoint import latest_reward_sources, resolve_checkpoint
        from rollart_nb.control.env_manager import RolloutConfig
        from rollart_nb.control.modes import mode as get_mode
        from rollart_nb.control.pipeline import Pipeline
        from rollart_nb.control.scheduler import SchedulerConfig

        self._check()
        if not isinstance(tasks, TaskSet):
            raise ConfigError(
                f"tasks={tasks!r:.80} must be a TaskSet; build it with sess.tasks({{name: env}})",
                where=f"sess.pipeline(name={name!r})",
            )
        # A reward for a task that neither this TaskSet nor an earlier pipeline of this session has
        # is a typo, or belongs to a pipeline not built yet: it would be silently ignored, so refuse
        # it and drop it (else every later pipeline would refuse it too; there is no unregister).
        used = self.__dict__.setdefault("_pipeline_tasks", set())  # tasks of this session's pipelines
        stray = [t for t in self._rewards if t not in tasks.envs and t not in used]
        if stray:
            known = sorted(tasks.envs)
            p = []
            for t in stray:
                self._rewards.pop(t)
                close = difflib.get_close_matches(t, known, n=1)
                fix = f"did you mean {close[0]!r}? " if close else ""
                p.append(
                    f"a reward is registered for task {t!r}, which this pipeline's tasks {known} do not "
                    f"have; {fix}the registration for {t!r} was dropped: register the reward again under "
                    f"one of these names, e.g. sess.reward({(close or known)[0]!r}, fn), then call "
                    "sess.pipeline(...) again"
                )
            raise ConfigError(p, where=f"sess.pipeline(name={name!r})")
        # The loop's own settings, checked before anything changes (a same-named pipeline is
        # closed below): the values Pipeline would use, its defaults read from its signature.
        defaults = {k: v.default for k, v in inspect.signature(Pipeline.__init__).parameters.items()}
        SchedulerConfig(
            batch_size=batch_size,
            alpha=alpha,
            mode=get_mode(mode),
            group_size=kwargs.get("group_size", algo.group_size if algo is not None else defaults["group_size"]),
            redundancy=kwargs.get("redundancy", defaults["redundancy"]),
            rollout=kwargs.get("rollout") or RolloutConfig(),
        )
        used.update(tasks.envs)
        resume = None
        if resume_from is not None:  # check everything before anything changes
            resume = resolve_checkpoint(resume_from)
            resume.check_tasks(tasks)
            log.warning(
                "resuming pipeline %s from %s: step %d, version %d", name, resume.path, resume.steps, resume.version
            )
        if name in self._pipelines:
            log.info("replacing pipeline %s", name)
            self._pipelines[name].close()
        if resume is not None:
            train.load_checkpoint(resume.trainer_dir)
            if kwargs.get("seed") is None:
                kwargs["seed"] = resume.resume_seed
        if algo is not None:
            kwargs.setdefault("group_size", algo.group_size)
            train.configure(algo)
        pipe = Pipeline(
            self,
            train,
            gen,
            tasks,
            batch_size=batch_size,
            alpha=alpha,
            mode=mode,
            name=name,
            rewards=self._rewards,
            resume=resume,
            **kwargs,
        )
        pipe.algo = algo
        self._pipelines[name] = pipe
        if resume is not None:
            resume.warn_reward_changes(latest_reward_sources(pipe.reward_history()))
        return pipe

    def bindings(self, role: str | None = None) -> list[Binding]:
        """Current worker bindings (optionally of one role)."""
        self._check()
        return self._resources.bindings(role)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


class Session(SessionBase):
    """A connection to a Ray cluster whose nodes form hardware pools.

    Create one with :meth:`local` (embedded Ray, simulated pools) or :meth:`attach`
    (an existing cluster). Use it as a context manager or call :meth:`close`.

    Example:
        >>> import rollart_nb as rn
        >>> with rn.Session.local() as sess:          # doctest: +SKIP
        ...     print(sess.pools["H800"].capacity)
        2.0
    """

    def __init__(self, *, _token: object = None) -> None:
        if _token is not _PRIVATE:
            raise StateError("create a Session with rn.Session.local() or rn.Session.attach(address)")
        self.id = uuid.uuid4().hex[:8]
        self.state = "detached"
        self.mode = ""
        self.address = ""
        self.pools: dict[str, Pool] = {}
        self.endpoints: dict[str, Endpoint] = {}
        self.clusters: dict[str, Cluster] = {}
        self._pipelines: dict[str, Any] = {}
        self._rewards: dict[str, dict[str, Any]] = {}
        self._serve: Any = None
        self._mooncake: Any = None
        self.log_dir = ""
        self.seed = 0
        self._owns_ray = False
        self.cleaned: list[dict[str, Any]] = []  # Session.local: what dead sessions left behind, now cleaned
        self._resources: ResourceManager | None = None  # type: ignore[assignment]
        self.store: Any = None

    # -- constructors ----------------------------------------------------------------
    @classmethod
    def local(
        cls,
        pools: dict[str, int] | None = None,
        serverless: bool = True,
        *,
        num_cpus: int | None = None,
        store: str | None = None,
        log_dir: str | None = None,
        seed: int = 0,
        object_store_gb: float = 2.0,
        log_to_driver: bool = False,
        expose: str | None = None,
    ) -> Session:
        """Start Ray on this machine with simulated pools.

        Only this machine can reach it: every Ray process binds to 127.0.0.1, and Ray's token
        authentication is on with a token the session makes, keeps in a file only you can read
        (:attr:`token_path`) and hands to its own workers. See ``SECURITY.md``.

        Args:
            pools: pool name -> worker slots; names are hardware types ("H800", "H20", "H100",
                "A100") or "cpu". Default :data:`DEFAULT_LOCAL_POOLS`.
            serverless: add the elastic ``serverless`` pool (Ray Serve on 127.0.0.1).
            num_cpus: CPUs Ray may use (default: all). Workers reserve pool slots, not CPUs.
            store: metadata store: None (Ray GCS KV) or ``redis://host:port``.
            log_dir: where worker logs go (default: a temp dir); they never flood the cell.
            seed: the session's base seed (clusters and pipelines derive theirs from it).
            object_store_gb: Ray object store size.
            log_to_driver: forward worker prints into this process (off: keeps notebooks usable).
            expose: listen beyond this machine: this node's IP address, or "auto" for the one
                Ray detects. Ray then binds its ports on all interfaces; authentication stays on,
                so other machines need the token (:attr:`token_path`) to join or attach.

        Calling it again in the same process closes the previous local session first.
        """
        global _LOCAL
        pools = dict(DEFAULT_LOCAL_POOLS if pools is None else pools)
        problems = []
        for name, n in pools.items():
            if name.lower() not in ("cpu", "serverless") and name.upper() not in PROFILES:
                problems.append(f"pool {name!r} is not a known hardware type ({sorted(PROFILES)}) or 'cpu'")
            if not isinstance(n, int | float) or n <= 0:
                problems.append(f"pool {name!r} needs a positive slot count, got {n!r}")
        if object_store_gb <= 0:
            problems.append(f"object_store_gb={object_store_gb} must be > 0")
        if expose is not None and not _valid_expose(expose):
            problems.append(f"expose={expose!r} must be this node's IP address (e.g. '10.0.0.5') or 'auto'")
        if problems:
            raise ConfigError(problems, where="Session.local")
        if _LOCAL is not None and _LOCAL.state == "attached":
            warnings.warn("closing the previous Session.local() of this process", stacklevel=2)
            _LOCAL.close()
        s = cls(_token=_PRIVATE)
        s.mode, s.seed = "local", seed
        s.log_dir = log_dir or tempfile.mkdtemp(prefix=f"rollart_{s.id}_")
        resources = {f"{_ray.POOL_RESOURCE_PREFIX}{_canon(n)}": float(v) for n, v in pools.items()}
        info = _ray.start_local(
            num_cpus=num_cpus,
            resources=resources,
            namespace=f"rollart_{s.id}",
            log_to_driver=log_to_driver,
            object_store_memory=int(object_store_gb * 2**30),
            expose=expose,
        )
        s._owns_ray = True
        s.cleaned = info.get("rollart_cleaned", [])  # what sessions that died without closing left behind
        s.address = info.get("gcs_address", info.get("address", ""))
        try:
            s._finish_attach(pool_map=None, serverless=serverless, store=store)
        except BaseException:
            _ray.shutdown()  # a failed start leaves no Ray behind: the corrected cell runs
            s.state = "closed"
            raise
        _LOCAL = s
        return s

    @classmethod
    def attach(
        cls,
        address: str = "auto",
        *,
        pool_map: dict[str, str] | None = None,
        serverless: bool = False,
        store: str | None = None,
        timeout_s: float = 30.0,
        log_dir: str | None = None,
        seed: int = 0,
        token: str | None = None,
        token_env: str = _ray.TOKEN_ENV,
    ) -> Session:
        """Join an existing Ray cluster and discover its pools.

        Args:
            address: "auto" (the cluster ``ray start`` runs on this machine), "host:port" (GCS),
                or "ray://host:10001" (Ray Client).
            pool_map: custom resource -> hardware name, e.g. ``{"my_h20": "H20"}``, for nodes
                that label GPUs their own way. ``accelerator_type:<NAME>`` needs no mapping.
            serverless: add the elastic serverless pool.
            store: metadata store (None: Ray GCS KV; or ``redis://...``).
            timeout_s: give up (ConnectError) if the cluster does not answer as Ray within this,
                end to end (a port that is not Ray's, another Ray version, a silent proxy).
            token: the cluster's Ray token (``ray get-auth-token`` on its head node). Never
                echoed; kept in a private file for this process and its workers.
            token_env: environment variable to read the token from when ``token`` is None
                (default ``RAY_AUTH_TOKEN``; ``RAY_AUTH_TOKEN_PATH`` and ``~/.ray/auth_token``
                are tried next). A cluster that refuses the token raises ConnectError.
        """
        if token is None and token_env:
            token = os.environ.get(token_env) or None
        s = cls(_token=_PRIVATE)
        s.mode, s.seed = "attach", seed
        s.log_dir = log_dir or tempfile.mkdtemp(prefix=f"rollart_{s.id}_")
        s.address = _ray.connect(
            address, namespace=f"rollart_{s.id}", timeout_s=timeout_s, log_to_driver=False, token=token
        )
        try:
            s._finish_attach(pool_map=pool_map, serverless=serverless, store=store)
        except BaseException:
            _ray.shutdown()
            raise
        return s

    @staticmethod
    def sim(
        pools: dict[str, int] | None = None, seed: int = 0, *, gpus_per_node: int = 8, virtual: bool = True
    ) -> SimSession:
        """A simulated cluster in this process, for what-if studies: same API, sim workers.

        Returns a :class:`~rollart_nb.sim.session.SimSession` (pools such as
        ``{"H800": 64, "H20": 24, "cpu": 8}``; workers are in-process objects on one event loop,
        timed by roofline models on a virtual clock). Build clusters of
        :class:`~rollart_nb.workers.SimGenerator` / :class:`~rollart_nb.workers.SimTrainer` and
        pipelines exactly as on a real session.

        Example:
            >>> with rn.Session.sim({"H800": 8, "H20": 8, "cpu": 4}) as sim:    # doctest: +SKIP
            ...     gen = sim.cluster("actor_gen", SimGenerator, pool="H20", replicas=8, model=spec("qwen3-8b"))
        """
        from rollart_nb.sim.session import SimSession

        return SimSession(pools, seed, gpus_per_node=gpus_per_node, virtual=virtual)

    @property
    def token_path(self) -> str | None:
        """File holding the Ray token this session uses (None without authentication).

        Give its path to processes of your own that should join (``RAY_AUTH_TOKEN_PATH``), or
        copy it to the machines of an ``expose``\ d session; never print its contents.
        """
        return _ray.token_path() if self.state == "attached" else None

    def ray_env(self) -> dict[str, str]:
        """Environment variables a child process needs to reach this session's Ray."""
        self._check()
        env = {"RAY_ADDRESS": self.address}
        if self.token_path:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self.token_path)
        return env

    def _finish_attach(self, *, pool_map: dict[str, str] | None, serverless: bool, store: str | None) -> None:
        self.pools = discover_pools(
            _ray.nodes(), pool_map=pool_map, serverless=serverless, head_node_id=_ray.current_node_id()
        )
        if self.mode == "local" and "serverless" in self.pools:
            self.pools["serverless"].simulated = True
        self.store = make_store(store, prefix=f"sessions/{self.id}/")
        self._resources = ResourceManager(self.pools, self.store)
        self.state = "attached"

    # -- clusters --------------------------------------------------------------------
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
        max_concurrency: int = 64,
        start_timeout_s: float = 120.0,
        **init_kwargs: Any,
    ) -> Cluster:
        """Build (or rebuild) the Cluster ``name`` of ``replicas`` ``worker_cls`` workers.

        Args:
            name: role name ("actor_train", "actor_gen", "reward", "env", ...). Building the same
                name again closes the old cluster first (re-running a cell is safe).
            worker_cls: a :class:`~rollart_nb.Worker` subclass.
            pool: preferred pool; default ``worker_cls.default_pool``.
            replicas: number of workers (>= 1).
            fallback: pools to try if ``pool`` is full or absent (default: compatible pools).
            slots: pool slots per worker (GPUs per worker on a GPU pool).
            endpoints: serverless endpoint name -> URL for ``@register_serverless`` methods.
            affinity: tag -> hardware overrides for ``@hw_mapping`` methods.
            max_concurrency: concurrent calls one worker actor accepts.
            **init_kwargs: passed to ``worker_cls.__init__``.
        """
        pool, eps = self._before_cluster(name, worker_cls, pool, replicas, slots, endpoints)
        c = Cluster(
            self,
            name,
            worker_cls,
            replicas=replicas,
            pool=pool,
            fallback=fallback,
            slots=slots,
            init_kwargs=init_kwargs,
            endpoints=eps,
            affinity=affinity,
            max_concurrency=max_concurrency,
            start_timeout_s=start_timeout_s,
        )
        self.clusters[name] = c
        return c

    def register_endpoint(
        self, name: str, url: str, *, token_env: str | None = None, timeout_s: float = 30.0, retries: int = 2
    ) -> Endpoint:
        """Register a serverless endpoint for ``@register_serverless`` methods.

        ``token_env`` names an environment variable with a bearer token; the token is read at
        call time and never stored or shown.
        """
        self._check()
        ep = Endpoint(name, url, token_env=token_env, timeout_s=timeout_s, retries=retries)
        self.endpoints[name] = ep
        self.store.put(f"endpoints/{name}", {"url": redact_url(url), "token_env": token_env})
        return ep

    # -- tasks, rewards, pipelines -------------------------------------------------------
    def _serve_manager(self) -> Any:
        if self._serve is None:
            from rollart_nb.serverless.serve import ServeManager

            self._serve = ServeManager()
        return self._serve

    def _weight_transport(self, weights: Any, name: str) -> Any:
        """``"direct"`` (None), ``"object_store"``, ``"mooncake"`` (a master on 127.0.0.1), or a transport."""
        if weights in (None, "direct"):
            return None
        if weights == "object_store":
            from rollart_nb.weights.object_store import ObjectStoreTransport

            return ObjectStoreTransport(name=f"rollart_nb/{self.id}/{name}/weights")
        if weights == "mooncake":
            from rollart_nb.weights.mooncake import MooncakeMaster, MooncakeTransport

            if self._mooncake is None:
                self._mooncake = MooncakeMaster().start()
            return MooncakeTransport(self._mooncake.address, prefix=f"{self.id}/{name}", segment_bytes=256 * 2**20)
        if hasattr(weights, "publish") and hasattr(weights, "pull"):
            return weights
        raise ConfigError(f"weights={weights!r}: use 'direct', 'object_store', 'mooncake' or a WeightTransport")

    def _deploy_version(self, task: str, fn: Any, **serve_options: Any) -> Endpoint:
        """Deploy ``fn`` under a new route per version, so the dispatcher's switch is atomic:
        a trajectory is scored by exactly the version it records (old routes scale to zero)."""
        mgr = self._serve_manager()
        n = sum(1 for name in mgr.deployments if name.startswith(f"reward-{task}-v"))
        return mgr.deploy(f"reward-{task}-v{n}", fn, **serve_options)

    def _check(self) -> None:
        if self.state == "closed":
            raise StateError("Session is closed; create a new one with rn.Session.local() or rn.Session.attach(...)")
        if self.state != "attached":
            raise StateError("Session is not attached; use rn.Session.local() or rn.Session.attach(...)")

    def close(self) -> None:
        """Close every cluster, release bindings, and stop Ray if this session started it."""
        global _LOCAL
        if self.state == "closed":
            return
        for pipe in list(self._pipelines.values()):
            try:
                pipe.close()
            except Exception as e:
                log.warning("closing pipeline %s: %s", pipe.name, e)
        if self._serve is not None:
            try:
                self._serve.shutdown()
            except Exception as e:
                log.warning("stopping Ray Serve: %s", e)
        if self._mooncake is not None:
            try:
                self._mooncake.stop()
            except Exception as e:
                log.warning("stopping mooncake_master: %s", e)
        self._close_launchers()  # after the pipelines: their rollouts used the replicas
        for name in list(self.clusters):
            try:
                self.close_cluster(name)
            except Exception as e:  # a dead cluster must not keep the session open
                log.warning("closing cluster %s: %s", name, e)
        try:
            if self.store is not None:
                self.store.clear()
        except Exception as e:
            log.warning("clearing the metadata store: %s", e)
        if self.mode in ("local", "attach"):
            _ray.shutdown()
        self.state = "closed"
        if _LOCAL is self:
            _LOCAL = None

    def __repr__(self) -> str:
        pools = ", ".join(f"{n}:{p.free:g}/{p.capacity:g}{'*' if p.simulated else ''}" for n, p in self.pools.items())
        return (
            f"Session(id={self.id}, {self.mode or 'new'}, {self.state}, pools=[{pools}], "
            f"clusters={sorted(self.clusters)})"
        )

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td><b>{html.escape(n)}</b></td><td>{p.hardware.name} ({p.hardware.optimized_for})</td>"
            f"<td>{len(p.nodes)}</td><td>{p.free:g} / {p.capacity:g}</td>"
            f"<td>{_SIM_BADGE if p.simulated else 'real'}</td></tr>"
            for n, p in self.pools.items()
        )
        binds = "".join(
            f"<tr><td>{html.escape(b.worker)}</td><td>{html.escape(b.pool)}</td><td>{b.hardware}</td>"
            f"<td>{'yes: ' + html.escape(b.reason) if b.fell_back else 'no'}</td></tr>"
            for b in (self._resources.bindings() if self._resources and self.state == "attached" else [])
        )
        return (
            f"<div><b>rollart_nb Session</b> <code>{self.id}</code> &middot; {self.mode} &middot; {self.state}"
            f" &middot; <code>{html.escape(self.address)}</code>"
            f"<table><tr><th>pool</th><th>hardware</th><th>nodes</th><th>free / capacity</th><th></th></tr>{rows}</table>"
            + (
                f"<table><tr><th>worker</th><th>pool</th><th>hardware</th><th>fell back</th></tr>{binds}</table>"
                if binds
                else "<p>no workers bound yet</p>"
            )
            + "</div>"
        )


_PRIVATE = object()


def _is_launcher(obj: Any) -> bool:
    return callable(getattr(obj, "handle", None)) and callable(getattr(obj, "start", None))


def _place_on_launchers(envs: dict[str, Any], launchers: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``envs`` with each launched task's env replaced by a RemoteEnv on its launcher."""
    from rollart_nb.envs.remote import RemoteEnv

    launchers.update({t: e for t, e in envs.items() if _is_launcher(e)})
    problems = []
    for task, lau in launchers.items():
        if task not in envs:
            problems.append(f"launcher for unknown task {task!r}; tasks are {sorted(envs)}")
        elif not _is_launcher(lau):
            problems.append(f"task {task!r}: {type(lau).__name__} is not a launcher (e.g. rn.envs.LocalLauncher)")
        elif envs[task] is not lau:
            served = str(getattr(lau, "env", "")).rpartition(":")[2]
            given = type(envs[task]).__name__
            if served and served != given:
                problems.append(
                    f"task {task!r}: the launcher serves {served} but the env given is {given}; "
                    "pass the matching env, or the launcher itself as the task's env"
                )
    if problems:
        raise ConfigError(problems, where="sess.tasks(...)")
    for task, lau in launchers.items():
        envs[task] = RemoteEnv(launcher=lau)
    return envs, launchers


def _close_launcher(lau: Any) -> None:
    try:
        lau.close()
    except Exception as e:  # one launcher that fails to stop must not keep the others running
        log.warning("stopping %r: %s", lau, e)


_SIM_BADGE = '<span style="color:#b36b00">simulated</span>'


def _valid_expose(value: str) -> bool:
    import ipaddress

    if value == "auto":
        return True
    try:
        return not ipaddress.ip_address(value).is_loopback
    except ValueError:
        return False


def _canon(name: str) -> str:
    low = name.lower()
    if low in ("cpu", "serverless"):
        return low
    return PROFILES[name.upper()].name
