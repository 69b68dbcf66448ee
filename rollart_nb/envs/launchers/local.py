"""LocalLauncher: env-server replicas as processes on 127.0.0.1, watched and restarted.

Each replica is ``python -m rollart_nb.cli env-server --port 0 ...`` (under bubblewrap with
``sandbox=True``: read-only runtime, own PID/IPC/UTS namespaces, host network, dies with the
launcher). Its ``LISTENING <url>`` line gives the URL; a monitor thread checks every replica's
process and ``GET /v1/health`` and replaces a dead or unresponsive one, with exponential
backoff between failed attempts, up to ``max_restarts`` in a row. Nothing outlives the
launcher: :meth:`LocalLauncher.close`, garbage collection and interpreter exit all stop every
replica.

Lifecycle: ``new -> running -> closed``.
"""

from __future__ import annotations

import html
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

from rollart_nb.envs.launchers._procs import (
    Replica,
    _healthy,
    _killpg,
    _read_stdout,
    _stop_all,
    _tail,
    _terminate,
    env_spec,
)
from rollart_nb.errors import ConfigError, ConnectError, StateError

__all__ = ["LocalLauncher", "LocalReplicas"]

log = logging.getLogger(__name__)
_LIVE: weakref.WeakValueDictionary[str, LocalLauncher] = weakref.WeakValueDictionary()


class _Proc:
    """A replica's process, its stdout reader, and the monitor's bookkeeping."""

    def __init__(self, rep: Replica) -> None:
        self.rep = rep
        self.popen: subprocess.Popen[bytes] | None = None
        self.listening = threading.Event()
        self.failures = 0  # health checks failed in a row
        self.attempts = 0  # restart attempts failed in a row
        self.retry_at = 0.0


class LocalLauncher:
    """``replicas`` env servers for one env type on this machine.

    Args:
        env: ``"module:Class"`` or the class (importable by the replicas).
        kwargs: the env's constructor arguments (JSON-able).
        replicas: how many servers.
        task: task name the servers report (and replica ids start with).
        sandbox: run each server under bubblewrap (:func:`rollart_nb.sandbox.isolation.service_argv`).
        max_episodes: concurrent episodes per replica.
        health_interval_s: seconds between health checks.
        unhealthy_after: failed health checks in a row before a live process is replaced.
        max_restarts: failed restart attempts in a row before a replica is given up ("failed").
        backoff_s: pause after the first failed restart attempt; doubles with each further one.
        start_timeout_s: seconds a replica may take to listen and answer its first health check.
        ro_paths: extra paths the sandbox mounts read-only (where your env's data lives).

    Example:
        >>> lau = LocalLauncher("rollart_nb.envs:FrozenLake", {"size": 4}, replicas=2).start()  # doctest: +SKIP
        >>> lau.urls                                      # ['http://127.0.0.1:41234', ...]   # doctest: +SKIP
        >>> lau.kill(0); time.sleep(3); lau.restarts      # the monitor replaced it: 1         # doctest: +SKIP
        >>> lau.close()                                                                         # doctest: +SKIP
    """

    def __init__(
        self,
        env: Any = "rollart_nb.envs:CodeTask",
        kwargs: dict[str, Any] | None = None,
        replicas: int = 2,
        task: str | None = None,
        sandbox: bool = True,
        *,
        max_episodes: int = 256,
        health_interval_s: float = 1.0,
        unhealthy_after: int = 3,
        max_restarts: int = 5,
        backoff_s: float = 0.5,
        start_timeout_s: float = 60.0,
        ro_paths: tuple[str, ...] = (),
    ) -> None:
        self.env = env_spec(env)
        self.kwargs = dict(kwargs or {})
        problems = []
        try:
            json.dumps(self.kwargs)
        except TypeError as e:
            problems.append(f"kwargs must be JSON-able (they travel on the command line): {e}")
        if not isinstance(replicas, int) or replicas < 0:
            problems.append(f"replicas must be an int >= 0, got {replicas!r}")
        if health_interval_s <= 0 or unhealthy_after < 1 or max_restarts < 0 or backoff_s < 0:
            problems.append("need health_interval_s > 0, unhealthy_after >= 1, max_restarts >= 0, backoff_s >= 0")
        if problems:
            raise ConfigError(problems, where="LocalLauncher")
        self.replicas_wanted, self.task, self.sandbox = replicas, task, sandbox
        self.max_episodes, self.health_interval_s = max_episodes, health_interval_s
        self.unhealthy_after, self.max_restarts, self.backoff_s = unhealthy_after, max_restarts, backoff_s
        self.start_timeout_s, self.ro_paths = start_timeout_s, tuple(ro_paths)
        self.name = task or self.env.rpartition(":")[2].lower()
        self.state = "new"
        self.key = uuid.uuid4().hex[:12]
        self._procs: dict[int, _Proc] = {}
        self._popens: dict[int, subprocess.Popen[bytes]] = {}  # shared with the finalizer
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._dir = ""
        # the handle's view for other processes; known before start, so copies can be made early
        self._state_path = os.path.join(tempfile.gettempdir(), f"rollart_envs_{self.key}.json")
        _LIVE[self.key] = self
        self._finalizer: weakref.finalize | None = None
        self._monitor: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> LocalLauncher:
        """Start the replicas and the monitor; returns self. Raises ConnectError (with the
        replica's log) if one does not come up within ``start_timeout_s``."""
        if self.state == "closed":
            raise StateError("LocalLauncher is closed; create a new one")
        if self.state == "running":
            return self
        self._dir = tempfile.mkdtemp(prefix=f"rollart_envs_{self.name}_")
        self._finalizer = weakref.finalize(self, _stop_all, self._popens, self._stop, self._dir, self._state_path)
        self.state = "running"
        try:
            self._add(self.replicas_wanted)
        except BaseException:
            self.close()
            raise
        self._monitor = threading.Thread(
            target=_monitor,
            args=(weakref.ref(self), self._stop, self.health_interval_s),
            name=f"rollart-envs-{self.name}",
            daemon=True,
        )
        self._monitor.start()
        return self

    @property
    def started(self) -> bool:
        return self.state == "running"

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until every replica is up (ConnectError after ``timeout_s``)."""
        self._check()
        deadline = time.monotonic() + timeout_s
        while (reps := self.replicas) and any(r.state != "up" for r in reps):
            if time.monotonic() > deadline:
                states = ", ".join(f"{r.id}: {r.state} {r.last_error}".strip() for r in reps)
                raise ConnectError(
                    f"LocalLauncher {self.name}: not every replica is up after {timeout_s:g}s "
                    f"({states}); display the launcher for its logs' directory"
                )
            time.sleep(0.1)

    def close(self) -> None:
        """Stop the monitor and every replica (SIGTERM, then SIGKILL); idempotent."""
        if self.state == "closed":
            return
        self.state = "closed"
        self._stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(10)
        with self._lock:
            for p in self._procs.values():
                p.rep.state = "stopped"
        if self._finalizer is not None:
            self._finalizer()  # stops the processes, removes the logs and the state file
        _LIVE.pop(self.key, None)

    def __enter__(self) -> LocalLauncher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- replicas ----------------------------------------------------------------------
    @property
    def replicas(self) -> list[Replica]:
        """Every replica slot with its state (copies)."""
        with self._lock:
            return [Replica(**vars(p.rep)) for p in self._procs.values()]

    @property
    def urls(self) -> list[str]:
        """URLs of the replicas that are up."""
        return [u for _, u in self.healthy()]

    @property
    def restarts(self) -> int:
        """Replacements made by the monitor, all replicas together."""
        with self._lock:
            return sum(p.rep.restarts for p in self._procs.values())

    def healthy(self) -> list[tuple[str, str]]:
        """(replica id, url) of the replicas that are up."""
        with self._lock:
            return [(p.rep.id, p.rep.url) for p in self._procs.values() if p.rep.state == "up"]

    def handle(self) -> LocalReplicas:
        """A picklable view of the healthy replicas for RemoteEnv copies in other processes
        (empty until :meth:`start`)."""
        return LocalReplicas(self.key, self._state_path, self.name)

    def scale(self, n: int) -> None:
        """Run ``n`` replicas: start new slots, or stop the highest-numbered ones (their open
        episodes fail with EnvError)."""
        self._check()
        if not isinstance(n, int) or n < 0:
            raise ConfigError(f"scale(n): n must be an int >= 0, got {n!r}")
        self.replicas_wanted = n
        with self._lock:
            extra = sorted(self._procs)[n:]
            for i in extra:
                p = self._procs.pop(i)
                p.rep.state = "stopped"
                _terminate(p.popen)
                self._popens.pop(i, None)
            self._write_state()
        self._add(n - len(self._procs))

    def kill(self, i: int) -> None:
        """SIGKILL replica ``i`` (to try failure handling); the monitor will replace it."""
        self._check()
        with self._lock:
            p = self._procs[i]
            if p.popen is not None and p.popen.poll() is None:
                _killpg(p.popen.pid, signal.SIGKILL)

    def _check(self) -> None:
        if self.state != "running":
            raise StateError(
                f"LocalLauncher is {self.state}; call .start() first"
                if self.state == "new"
                else "LocalLauncher is closed; create a new one"
            )

    def _add(self, k: int) -> None:
        with self._lock:
            first = max(self._procs, default=-1) + 1
            new = [_Proc(Replica(i, f"{self.name}-{i}")) for i in range(first, first + max(k, 0))]
            for p in new:
                self._procs[p.rep.index] = p
                self._launch(p)
        errors = [e for p in new if (e := self._await_up(p))]
        if errors:
            raise ConnectError("env-server replica did not start:\n" + "\n".join(errors))

    def _launch(self, p: _Proc) -> None:
        p.listening.clear()
        p.rep.state, p.rep.url = "starting", ""
        log_path = os.path.join(self._dir, f"{p.rep.id}.log")
        logf = open(log_path, "ab")  # noqa: SIM115  (the child and the reader thread keep it)
        try:
            popen = subprocess.Popen(
                self._argv(p.rep),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=logf,
                env=self._child_env(),
                start_new_session=True,
            )
        finally:
            logf.close()
        p.popen, p.rep.pid = popen, popen.pid
        self._popens[p.rep.index] = popen
        threading.Thread(
            target=_read_stdout, args=(popen, p, log_path), daemon=True, name=f"rollart-envs-{p.rep.id}-out"
        ).start()

    def _await_up(self, p: _Proc) -> str:
        """'' once ``p`` listens and answers its health check, else why not (and it is killed)."""
        deadline = time.monotonic() + self.start_timeout_s
        while not p.listening.wait(0.05):
            if p.popen is None or p.popen.poll() is not None or time.monotonic() > deadline:
                break
        why = ""
        if not p.listening.is_set():
            code = p.popen.poll() if p.popen is not None else None
            why = f"exited with code {code}" if code is not None else f"no LISTENING line in {self.start_timeout_s:g}s"
        elif not _healthy(p.rep.url, timeout_s=max(1.0, deadline - time.monotonic())):
            why = "does not answer GET /v1/health"
        with self._lock:
            if not why:
                p.rep.state, p.failures = "up", 0
            else:
                _terminate(p.popen)
                p.rep.state, p.rep.last_error = "dead", why
            self._write_state()
        if not why:
            return ""
        return f"  {p.rep.id}: {why}; its log ({self._dir}/{p.rep.id}.log) ends:\n{_tail(self._dir, p.rep.id)}"

    def _argv(self, rep: Replica) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "rollart_nb.cli",
            "env-server",
            "--env",
            self.env,
            "--kwargs",
            json.dumps(self.kwargs),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--replica-id",
            rep.id,
            "--max-episodes",
            str(self.max_episodes),
            "--exit-with-parent",
        ]
        if self.task:
            cmd += ["--task", self.task]
        if not self.sandbox:
            return cmd
        from rollart_nb.sandbox.isolation import service_argv

        return service_argv(cmd, ro_paths=self._code_paths(), env=self._child_env())

    def _import_roots(self) -> list[str]:
        """Where rollart_nb and the env's top-level module are imported from (their parent dirs)."""
        roots = [str(Path(__file__).resolve().parents[3])]
        top = self.env.partition(":")[0].split(".")[0]
        spec = importlib.util.find_spec(top)  # finds without running the module
        if spec is None:
            raise ConfigError(
                f"env module {top!r} is not importable here, so the replicas could not import it "
                "either; put it on sys.path / PYTHONPATH or install it"
            )
        for loc in spec.submodule_search_locations or [spec.origin or ""]:
            if loc:
                roots.append(str(Path(loc).resolve().parent))
        return list(dict.fromkeys(roots))

    def _code_paths(self) -> list[str]:
        """What the sandbox mounts read-only: the import roots, the Python prefixes, site-packages."""
        site = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
        return list(dict.fromkeys([*self._import_roots(), sys.prefix, sys.base_prefix, *site, *self.ro_paths]))

    def _child_env(self) -> dict[str, str]:
        # a small explicit environment: the sandbox clears everything else, and secrets of the
        # notebook's environment have no business in an env server
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "ROLLART_LOG")}
        roots = [*self._import_roots(), *([] if self.sandbox else [os.getcwd()])]
        return {
            **keep,
            "HOME": "/tmp" if self.sandbox else os.environ.get("HOME", "/tmp"),
            "PYTHONPATH": os.pathsep.join(roots),
            "PYTHONUNBUFFERED": "1",
        }

    # -- the monitor -------------------------------------------------------------------
    def _check_replicas(self) -> None:
        with self._lock:
            procs = [p for p in self._procs.values() if p.rep.state in ("up", "dead", "unhealthy")]
        for p in procs:
            if self._stop.is_set():
                return
            if p.rep.state == "up":
                self._probe(p)
            elif time.monotonic() >= p.retry_at:
                self._restart(p)

    def _probe(self, p: _Proc) -> None:
        code = p.popen.poll() if p.popen is not None else -1
        if code is None and _healthy(p.rep.url, timeout_s=2.0):
            p.failures = 0
            return
        p.failures += 1
        if code is None and p.failures < self.unhealthy_after:
            return
        why = (
            f"exited with code {code}"
            if code is not None and code >= 0
            else f"killed by {signal.Signals(-code).name}"
            if code is not None
            else f"failed {p.failures} health checks in a row"
        )
        log.warning("env-server replica %s (%s) %s; restarting it", p.rep.id, p.rep.url, why)
        with self._lock:
            _terminate(p.popen)
            p.rep.state, p.rep.last_error = ("dead" if code is not None else "unhealthy"), why
            p.attempts, p.retry_at = 0, time.monotonic()
            self._write_state()

    def _restart(self, p: _Proc) -> None:
        with self._lock:
            if self._stop.is_set() or p.rep.index not in self._procs:
                return
            self._launch(p)
        if not self._await_up(p):
            with self._lock:
                p.rep.restarts += 1
                p.attempts = 0
            return
        p.attempts += 1
        if p.attempts > self.max_restarts:
            p.rep.state = "failed"
            log.error(
                "env-server replica %s failed %d restarts in a row; giving up (see %s)", p.rep.id, p.attempts, self._dir
            )
        else:
            p.retry_at = time.monotonic() + self.backoff_s * 2 ** (p.attempts - 1)
        with self._lock:
            self._write_state()

    def _write_state(self) -> None:
        """The handle's view for other processes; replaced atomically."""
        if self.state != "running":
            return
        path = self._state_path
        data = {"replicas": [vars(p.rep) for p in self._procs.values()]}
        with open(path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(path + ".tmp", path)

    # -- display -----------------------------------------------------------------------
    def __repr__(self) -> str:
        reps = ", ".join(f"{r.id}@{r.url or '-'} pid={r.pid} {r.state} restarts={r.restarts}" for r in self.replicas)
        return f"LocalLauncher({self.env}, {self.state}, sandbox={self.sandbox}, [{reps}])"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{r.index}</td><td>{html.escape(r.id)}</td><td><code>{html.escape(r.url or '-')}</code></td>"
            f"<td>{r.pid or '-'}</td><td>{r.state}</td><td>{r.restarts}</td><td>{html.escape(r.last_error)}</td></tr>"
            for r in self.replicas
        )
        return (
            f"<div><b>LocalLauncher</b> <code>{html.escape(self.env)}</code> &middot; {self.state} &middot; "
            f"sandbox {'on' if self.sandbox else 'off'}<table><tr><th>#</th><th>replica</th><th>url</th>"
            f"<th>pid</th><th>state</th><th>restarts</th><th>last error</th></tr>{rows}</table></div>"
        )


class LocalReplicas:
    """Picklable view of a :class:`LocalLauncher`'s healthy replicas: the live launcher in its
    own process, its state file (rewritten on every change) anywhere else on this machine."""

    def __init__(self, key: str, path: str, name: str = "") -> None:
        self.key, self.path, self.name = key, path, name
        self._cache: tuple[int, list[tuple[str, str]]] | None = None

    def replicas(self) -> list[tuple[str, str]]:
        live = _LIVE.get(self.key)
        if live is not None:
            return live.healthy()
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return []  # the launcher closed
        if self._cache is None or self._cache[0] != mtime:
            with open(self.path) as f:
                reps = json.load(f)["replicas"]
            self._cache = (mtime, [(r["id"], r["url"]) for r in reps if r["state"] == "up"])
        return list(self._cache[1])

    def __getstate__(self) -> dict[str, Any]:
        return {"key": self.key, "path": self.path, "name": self.name, "_cache": None}

    def __repr__(self) -> str:
        return f"LocalLauncher {self.name!r} replicas"


def _monitor(ref: weakref.ref[LocalLauncher], stop: threading.Event, interval: float) -> None:
    # holds the launcher only weakly, so an unreferenced launcher is collected and its
    # finalizer stops the replicas
    while not stop.wait(interval):
        launcher = ref()
        if launcher is None:
            return
        try:
            launcher._check_replicas()
        except Exception:  # the monitor must survive a bad round; the next one retries
            log.exception("env-server monitor of %s", launcher.name)
        del launcher
