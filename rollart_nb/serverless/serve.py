"""Reward functions as Ray Serve deployments that scale to zero.

:class:`ServeManager` turns a plain callable into a deployment on the current Ray connection
and hands back an :class:`~rollart_nb.serverless.client.Endpoint` that speaks the JSON contract::

    POST /<name>  {"args": [trajectory.to_dict()], "kwargs": {}}
    200           {"result": <float | [per-turn floats]>, "version": <deploy number>}
    500           {"error": "<ExceptionType>: <message>"}   (the function raised)
    400 / 401     bad body / missing or wrong bearer token

Non-finite results are sent as JSON ``NaN`` / ``Infinity`` so the caller's validation decides.
Deploying a name again updates the application in place: Serve starts the new replicas before
draining the old, so no request fails. See ``benchmarks/serverless_reward.py`` for timings.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import re
import socket
import sys
import threading
import time
import types
from collections import deque
from dataclasses import dataclass
from typing import Any

import rollart_nb._ray as _ray
from rollart_nb.errors import ConfigError, ServerlessError, StateError
from rollart_nb.redact import redact_url, register_secret
from rollart_nb.serverless.client import Endpoint
from rollart_nb.serverless.replica import RewardReplica, ServeStats

__all__ = ["ServeManager"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_TIMELINE_POINTS = 20_000  # per deployment; ~3 h at the default sampling interval


@dataclass(frozen=True)
class _Scaling:
    """A deployment's replica and autoscaling options (documented at ServeManager.deploy)."""

    min_replicas: int
    max_replicas: int
    downscale_delay_s: float
    upscale_delay_s: float
    target_ongoing_requests: float
    max_ongoing_requests: int
    batched: bool
    max_batch_size: int
    batch_wait_s: float
    num_cpus: float
    num_gpus: float

    def problems(self) -> list[str]:
        """Every bad option, one sentence each."""
        lo, hi = self.min_replicas, self.max_replicas
        problems = [] if isinstance(lo, int) and lo >= 0 else [f"min_replicas={lo!r} must be an int >= 0"]
        if not isinstance(hi, int) or hi < max(1, lo if isinstance(lo, int) else 1):
            problems.append(f"max_replicas={hi!r} must be an int >= max(1, min_replicas)")
        for key in ("downscale_delay_s", "upscale_delay_s", "batch_wait_s", "num_cpus", "num_gpus"):
            if getattr(self, key) < 0:
                problems.append(f"{key}={getattr(self, key)} must be >= 0")
        if self.target_ongoing_requests <= 0:
            problems.append(f"target_ongoing_requests={self.target_ongoing_requests} must be > 0")
        if self.max_ongoing_requests < 1 or self.max_batch_size < 1:
            problems.append("max_ongoing_requests and max_batch_size must be >= 1")
        return problems

    def autoscaling(self) -> dict[str, Any]:
        """Serve's ``autoscaling_config``."""
        return {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "target_ongoing_requests": self.target_ongoing_requests,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            # Serve's defaults (10 s pushes, 30 s window) would keep an idle reward replica up
            # for ~40 s past downscale_delay_s; between-step idleness is what we reclaim.
            "metrics_interval_s": 0.5,
            "look_back_period_s": max(1.0, min(5.0, self.downscale_delay_s)),
        }


@dataclass
class _Deployed:
    endpoint: Endpoint
    version: int
    scaling: _Scaling
    deployed_at: float


def _token_digest(token_env: str | None, problems: list[str]) -> str | None:
    """The SHA-256 of the bearer token in ``$token_env`` (None without one); a missing one is a problem."""
    token = os.environ.get(token_env) if token_env is not None else None
    if token_env is not None and not token:
        problems.append(f"token_env ${token_env} is unset or empty; export the token first")
    if not token:
        return None
    register_secret(token)
    return hashlib.sha256(token.encode()).hexdigest()


# Ray Serve's RequestRouterConfig() registers and then unregisters a module in cloudpickle's
# global pickle-by-value set, so two threads building one at once (deploy() here, serve.status()
# in the replica sampler) can make the second unregister raise ValueError. Serialise them.
_SERVE_CONFIG_LOCK = threading.Lock()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ship(fn: Any) -> bytes:
    """Register by value every non-importable module ``fn`` reaches; return ``fn`` pickled.

    Serve replicas cannot import notebook, test or script modules, and ``fn`` may hold such
    functions (an ``LLMJudge`` with a notebook ``parse``): pickle until no new module turns up.
    """
    from ray import cloudpickle

    shipped: set[str] = set()

    class _Recorder(cloudpickle.CloudPickler):
        met: list[Any]  # every class and function pickled, in order

        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, type | types.FunctionType):
                self.met.append(obj)
            return super().reducer_override(obj)

    for _ in range(8):
        buf = io.BytesIO()
        rec = _Recorder(buf)
        rec.met = []
        rec.dump(fn)
        new = [
            o
            for o in rec.met
            if isinstance(getattr(o, "__module__", None), str)
            and o.__module__ not in shipped
            and o.__module__.partition(".")[0] not in sys.stdlib_module_names
        ]  # stdlib: importable
        if not new:
            return buf.getvalue()
        for o in new:
            shipped.add(o.__module__)
            _ray.ship_by_value(o)  # reads only __module__; skips installed / rollart_nb modules
    return cloudpickle.dumps(fn)


def _loads(blob: bytes) -> str:
    from ray import cloudpickle

    return type(cloudpickle.loads(blob)).__name__


class ServeManager:
    """Ray Serve on the current Ray connection, serving reward functions that scale to zero.

    Start a Session first; Serve (one per cluster) runs its HTTP proxy on the head node.

    Args:
        host: address the HTTP proxy binds (keep 127.0.0.1 unless others must reach it).
        port: HTTP port; None picks a free one.

    Example:
        >>> sess = rn.Session.local({"cpu": 2})                           # doctest: +SKIP
        >>> mgr = ServeManager()                                          # doctest: +SKIP
        >>> ep = mgr.deploy("math", rn.rewards.exact_answer, downscale_delay_s=5)  # doctest: +SKIP
        >>> call(ep, [traj.to_dict()], {})                                 # doctest: +SKIP
        1.0
        >>> mgr.utilization("math")["cold_starts"]                        # doctest: +SKIP
        1
    """

    def __init__(self, host: str = "127.0.0.1", port: int | None = None) -> None:
        if not _ray.is_initialized():
            raise StateError(
                "ServeManager needs a Ray connection; create rn.Session.local() or rn.Session.attach(...) first"
            )
        from ray import serve

        self.host = host
        want = port or _free_port(host)
        serve.start(http_options={"host": host, "port": want}, proxy_location="HeadOnly")
        self.port = self._bound_port(want)
        ray = _ray.ray()
        self._stats = ray.remote(ServeStats).options(num_cpus=0, max_concurrency=1).remote()
        self.deployments: dict[str, _Deployed] = {}
        self.state = "running"
        self._lock = threading.Lock()
        self._timeline: dict[str, deque[tuple[float, int]]] = {}
        self._last_replicas: dict[str, int] = {}
        self._cold_starts: dict[str, int] = {}
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()

    def _bound_port(self, want: int) -> int:
        # Serve is one per cluster: if it already ran, its proxy keeps its own port.
        try:
            from ray.serve.context import _get_global_client

            client = _get_global_client()
            if client is None:  # no Serve running yet: it takes the port we ask for
                return want
            port = int(client.http_config.port)
        except Exception as e:  # private API; the port we asked for is the best guess
            log.debug("could not read Serve's HTTP port: %s", e)
            return want
        if port != want:
            log.warning("Ray Serve was already running on port %d; using it (asked for %d)", port, want)
        return port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- deployments -------------------------------------------------------------------
    def deploy(
        self,
        name: str,
        fn: Any,
        *,
        min_replicas: int = 0,
        max_replicas: int = 4,
        downscale_delay_s: float = 30.0,
        upscale_delay_s: float = 0.0,
        target_ongoing_requests: float = 2.0,
        max_ongoing_requests: int = 16,
        batched: bool = False,
        max_batch_size: int = 16,
        batch_wait_s: float = 0.01,
        num_cpus: float = 0.1,
        num_gpus: float = 0.0,
        token_env: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 2,
    ) -> Endpoint:
        """Deploy ``fn`` as ``/<name>`` (or hot-swap it if ``name`` is deployed) and wait until ready.

        Args:
            name: deployment, application and route name (letters, digits, ``_``, ``-``).
            fn: ``fn(trajectory) -> float | list[float]``, sync or async; with ``batched``,
                ``fn(list[trajectory]) -> list``. Notebook / test functions ship by value.
            min_replicas: 0 scales to zero when idle (the first call then pays a cold start).
            max_replicas: most replicas under load.
            downscale_delay_s: idle time before removing a replica (and going to zero).
            upscale_delay_s: sustained load before adding a replica (0 from zero replicas).
            target_ongoing_requests: requests per replica the autoscaler aims for.
            max_ongoing_requests: requests one replica accepts at once; more wait in the proxy.
            batched: group concurrent requests into one ``fn`` call (``serve.batch``).
            max_batch_size: largest batch when ``batched``.
            batch_wait_s: how long a batch waits to fill.
            num_cpus: CPUs per replica (small: reward functions are light).
            num_gpus: GPUs per replica (an LLM judge on a GPU pool).
            token_env: environment variable holding a bearer token the deployment demands.
                Only its SHA-256 reaches Serve; the returned Endpoint reads it at call time.
            timeout_s: per-request timeout of the returned endpoint (covers a cold start).
            retries: endpoint retries on 5xx / connection errors.

        Returns:
            An Endpoint for :func:`~rollart_nb.serverless.client.call`, ``acall`` and
            ``RewardDispatcher.set(task, endpoint=...)``; the same URL across hot swaps.

        Raises:
            ConfigError: bad name / options, ``fn`` not callable, or ``token_env`` unset.
            ServerlessError: Serve could not deploy it.
        """
        self._check()
        scaling = _Scaling(
            min_replicas,
            max_replicas,
            downscale_delay_s,
            upscale_delay_s,
            target_ongoing_requests,
            max_ongoing_requests,
            batched,
            max_batch_size,
            batch_wait_s,
            num_cpus,
            num_gpus,
        )
        problems = (
            []
            if isinstance(name, str) and _NAME.match(name)
            else [f"name {name!r} must be 1-64 letters, digits, '_' or '-' (it becomes the URL route)"]
        )
        if not callable(fn):
            problems.append(f"fn must be callable, got {type(fn).__name__}")
        problems += scaling.problems()
        digest = _token_digest(token_env, problems)
        if problems:
            raise ConfigError(problems, where=f"ServeManager.deploy({name!r}, ...)")

        self._check_ships(name, fn)
        old = self.deployments.get(name)
        version = 0 if old is None else old.version + 1
        t0 = time.perf_counter()
        self._run_app(name, version, scaling, fn, digest)
        ep = Endpoint(name, f"{self.url}/{name}", token_env=token_env, timeout_s=timeout_s, retries=retries)
        with self._lock:
            self.deployments[name] = _Deployed(ep, version, scaling, time.time())
            self._timeline.setdefault(name, deque(maxlen=_TIMELINE_POINTS))
            self._cold_starts.setdefault(name, 0)
        log.info("deployed reward %s v%d at %s in %.2fs", name, version, redact_url(ep.url), time.perf_counter() - t0)
        return ep

    def _run_app(self, name: str, version: int, scaling: _Scaling, fn: Any, digest: str | None) -> None:
        """Deploy ``fn`` as the Serve application ``name``, or update it in place."""
        from ray import serve

        with _SERVE_CONFIG_LOCK:
            app = (
                # Ray annotates deployment() as returning the decorator form, even given a class
                serve.deployment(RewardReplica)  # type: ignore[attr-defined]
                .options(
                    name=name,
                    ray_actor_options={"num_cpus": scaling.num_cpus, "num_gpus": scaling.num_gpus},
                    max_ongoing_requests=scaling.max_ongoing_requests,
                    autoscaling_config=scaling.autoscaling(),
                )
                .bind(
                    fn,
                    name,
                    version,
                    digest,
                    scaling.batched,
                    scaling.max_batch_size,
                    scaling.batch_wait_s,
                    self._stats,
                )
            )
        try:
            serve.run(app, name=name, route_prefix=f"/{name}")
        except Exception as e:
            raise ServerlessError(
                f"Ray Serve could not deploy {name!r} v{version}: {type(e).__name__}: "
                f"{str(e)[:300]}; check that fn pickles and its setup() works",
                url=f"{self.url}/{name}",
            ) from e

    def _check_ships(self, name: str, fn: Any) -> None:
        # A replica that cannot unpickle fn never starts, and with min_replicas=0 nobody
        # would know until a request timed out: try it in a plain worker first.
        try:
            blob = _ship(fn)
        except Exception as e:
            raise ConfigError(f"fn does not pickle: {type(e).__name__}: {e}", where=f"reward {name!r}") from e
        task = _ray.ray().remote(num_cpus=0, max_retries=0)(_loads)
        try:
            _ray.get(task.remote(blob), timeout_s=120, what=f"unpickling reward {name!r} in a worker")
        except Exception as e:
            raise ConfigError(
                f"fn does not unpickle in a Ray worker ({type(e).__name__}: {str(e)[:200]}); define it in a "
                "notebook, a script or an installed module, not in a module only this process can import",
                where=f"reward {name!r}",
            ) from e

    def endpoint(self, name: str) -> Endpoint:
        """The Endpoint of a deployed name."""
        return self._get(name).endpoint

    def version(self, name: str) -> int:
        """How many times ``name`` was redeployed (0 for the first deploy); responses carry it."""
        return self._get(name).version

    def delete(self, name: str) -> None:
        """Remove a deployment (its replicas stop; its URL answers 404)."""
        self._check()
        from ray import serve

        self._get(name)
        serve.delete(name)
        with self._lock:
            self.deployments.pop(name)
            self._last_replicas.pop(name, None)

    # -- observation -------------------------------------------------------------------
    def replicas(self, name: str | None = None) -> dict[str, dict[str, int]]:
        """Replica counts by state per deployment, e.g. ``{"math": {"RUNNING": 1}}``."""
        self._check()
        from ray import serve

        out: dict[str, dict[str, int]] = {}
        with _SERVE_CONFIG_LOCK:
            apps = serve.status().applications
        for n in [name] if name else list(self.deployments):
            dep = apps[n].deployments.get(n) if n in apps else None
            out[n] = {str(getattr(k, "value", k)): int(v) for k, v in (dep.replica_states if dep else {}).items()}
        self._observe({n: s.get("RUNNING", 0) for n, s in out.items()})
        return out

    def _observe(self, running: dict[str, int]) -> None:
        now = time.time()
        with self._lock:
            for n, r in running.items():
                if n not in self.deployments:
                    continue
                if self._last_replicas.get(n, 0) == 0 and r > 0:
                    self._cold_starts[n] = self._cold_starts.get(n, 0) + 1
                self._last_replicas[n] = r
                self._timeline.setdefault(n, deque(maxlen=_TIMELINE_POINTS)).append((now, r))

    def sample_replicas(self, interval_s: float = 0.25) -> None:
        """Start (once) a background thread recording ``(time, running replicas)`` per deployment.

        The samples feed :meth:`timeline` and :meth:`utilization`'s ``cold_starts``.
        """
        self._check()
        if interval_s <= 0:
            raise ConfigError(f"interval_s={interval_s} must be > 0")
        if self._sampler is not None and self._sampler.is_alive():
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                if not _ray.is_initialized():  # the session closed under us: nothing left to watch
                    return
                try:
                    self.replicas()
                except Exception as e:  # Serve restarting or Ray going away: try again next tick
                    log.debug("replica sampling: %s", e)

        self._sampler = threading.Thread(target=loop, name="rollart-serve-sampler", daemon=True)
        self._sampler.start()

    def timeline(self, name: str) -> list[tuple[float, int]]:
        """``(unix time, running replicas)`` samples of ``name`` (see :meth:`sample_replicas`)."""
        with self._lock:
            return list(self._timeline.get(name, ()))

    def utilization(self, name: str) -> dict[str, Any]:
        """What ``name`` is doing and has done.

        Returns:
            Serve's ``status`` and ``message``; ``replicas`` / ``starting`` now; ``requests``,
            ``errors``, ``busy_s``, ``replica_starts``, ``init_s_mean`` and ``cold_starts`` so far;
            ``replica_s`` and ``utilization`` = busy_s / replica_s (None without samples).
        """
        self._check()
        from ray import serve

        d = self._get(name)
        states = self.replicas(name)[name]
        app = serve.status().applications.get(name)
        dep = app.deployments.get(name) if app else None
        row = _ray.get(self._stats.snapshot.remote(), timeout_s=30, what="ServeManager.utilization").get(name, {})
        replica_s = _integrate(self.timeline(name))
        starts = int(row.get("replica_starts", 0))
        busy = float(row.get("busy_s", 0.0))
        return {
            "name": name,
            "version": d.version,
            "status": str(getattr(dep.status, "value", dep.status)) if dep else "MISSING",
            "message": dep.message if dep else "",
            "replicas": states.get("RUNNING", 0),
            "starting": states.get("STARTING", 0) + states.get("UPDATING", 0),
            "requests": int(row.get("requests", 0)),
            "errors": int(row.get("errors", 0)),
            "busy_s": busy,
            "replica_starts": starts,
            "init_s_mean": row.get("init_s_total", 0.0) / starts if starts else None,
            "cold_starts": self._cold_starts.get(name, 0),
            "replica_s": replica_s,
            "utilization": min(1.0, busy / replica_s) if replica_s > 0 else None,
        }

    # -- lifecycle ---------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop sampling, delete every deployment and shut Ray Serve down (idempotent)."""
        if self.state == "closed":
            return
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(timeout=5)
        self.state = "closed"
        if not _ray.is_initialized():
            return
        from ray import serve

        with contextlib.suppress(Exception):  # Serve half gone must not keep the session open
            serve.shutdown()
        _ray.kill(self._stats)

    def _check(self) -> None:
        if self.state == "closed":
            raise StateError("ServeManager is shut down; create a new one with ServeManager()")

    def _get(self, name: str) -> _Deployed:
        if name not in self.deployments:
            raise ConfigError(f"no reward deployment {name!r}; deployed: {sorted(self.deployments)}")
        return self.deployments[name]

    def __enter__(self) -> ServeManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        deps = ", ".join(f"{n} v{d.version}" for n, d in self.deployments.items())
        return f"ServeManager({self.url}, {self.state}, deployments=[{deps}])"


def _integrate(samples: list[tuple[float, int]]) -> float:
    """Replica-seconds under a step function of ``(time, replicas)`` samples."""
    return sum((t1 - t0) * r0 for (t0, r0), (t1, _) in zip(samples, samples[1:], strict=False))
