"""Session: the notebook's entry point to a (local or existing) Ray cluster and its pools.

Lifecycle: ``detached -> attached -> closed``. :meth:`Session.local` and :meth:`Session.attach`
return an attached session (:meth:`Session.sim` returns a simulated one with the same API); every call on a closed
one raises a :class:`StateError` that names the fix. The API shared with the simulated session is
:class:`~rollart_nb.session_base.SessionBase`; where workers run (Ray actors, Ray Serve, weight
transports) is the session's :class:`~rollart_nb.runtime.ray.RayRuntime`.
"""

from __future__ import annotations

import contextlib
import html
import logging
import os
import socket
import tempfile
import time
import uuid
import warnings
from typing import TYPE_CHECKING, Any

import rollart_nb._ray as _ray
import rollart_nb._ray_connect as _ray_connect
from rollart_nb.errors import ConfigError, StateError
from rollart_nb.redact import redact_url
from rollart_nb.resources.manager import Holder, ResourceManager
from rollart_nb.resources.pools import Pool, canonical_name, discover_pools, pool_map_problems, pool_problems
from rollart_nb.resources.store import make_store
from rollart_nb.runtime.ray import Cluster, RayRuntime
from rollart_nb.serverless.client import Endpoint
from rollart_nb.session_base import SessionBase, SessionState

if TYPE_CHECKING:
    from rollart_nb.sim_session import SimSession

__all__ = ["DEFAULT_LOCAL_POOLS", "Session", "SessionBase"]

log = logging.getLogger(__name__)

DEFAULT_LOCAL_POOLS: dict[str, int] = {"H800": 2, "H20": 2, "cpu": 4}
"""Simulated pools of :meth:`Session.local` (pool name -> worker slots)."""

_LOCAL: Session | None = None  # the one local session of this process (re-run cells replace it)


class Session(SessionBase[RayRuntime, Cluster]):
    """A connection to a Ray cluster whose nodes form hardware pools.

    Create one with :meth:`local` (embedded Ray, simulated pools) or :meth:`attach`
    (an existing cluster). Use it as a context manager or call :meth:`close`.

    Example:
        >>> import rollart_nb as rn
        >>> with rn.Session.local() as sess:          # doctest: +SKIP
        ...     print(sess.pools["H800"].capacity)
        2.0
    """

    _reopen = "rn.Session.local() or rn.Session.attach(...)"

    def __init__(self, *, _token: object = None) -> None:
        if _token is not _PRIVATE:
            raise StateError("create a Session with rn.Session.local() or rn.Session.attach(address)")
        super().__init__()
        self.id = uuid.uuid4().hex[:8]
        self.mode = ""
        self.address = ""
        self.pools: dict[str, Pool] = {}
        self.log_dir = ""
        self.seed = 0
        self._owns_ray = False
        self.cleaned: list[dict[str, Any]] = []  # Session.local: what dead sessions left behind, now cleaned
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
        pools = DEFAULT_LOCAL_POOLS if pools is None else pools
        problems = pool_problems(pools, whole=False)
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
        resources = {f"{_ray.POOL_RESOURCE_PREFIX}{canonical_name(n)}": float(v) for n, v in pools.items()}
        info = _ray_connect.start_local(
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
            _ray_connect.shutdown()  # a failed start leaves no Ray behind: the corrected cell runs
            s.state = SessionState.CLOSED
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
        token_env: str = _ray_connect.TOKEN_ENV,
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
        problems = pool_map_problems(pool_map)
        if problems:
            raise ConfigError(problems, where="Session.attach")
        if token is None and token_env:
            token = os.environ.get(token_env) or None
        s = cls(_token=_PRIVATE)
        s.mode, s.seed = "attach", seed
        s.log_dir = log_dir or tempfile.mkdtemp(prefix=f"rollart_{s.id}_")
        s.address = _ray_connect.connect(
            address, namespace=f"rollart_{s.id}", timeout_s=timeout_s, log_to_driver=False, token=token
        )
        try:
            s._finish_attach(pool_map=pool_map, serverless=serverless, store=store)
        except BaseException:
            _ray_connect.shutdown()
            raise
        return s

    @staticmethod
    def sim(*args: Any, **kwargs: Any) -> SimSession:
        """A simulated cluster in this process, for what-if studies: same API, sim workers.

        Takes the arguments of :class:`~rollart_nb.sim_session.SimSession` (pools such as
        ``{"H800": 64, "H20": 24, "cpu": 8}``, seed, ``virtual``, ``call_latency_s``, ...) and
        returns one: workers are in-process objects on one event loop, timed by roofline models on
        a virtual clock. Build clusters of :class:`~rollart_nb.workers.SimGenerator` /
        :class:`~rollart_nb.workers.SimTrainer` and pipelines exactly as on a real session.

        Example:
            >>> with rn.Session.sim({"H800": 8, "H20": 8, "cpu": 4}) as sim:    # doctest: +SKIP
            ...     gen = sim.cluster("actor_gen", SimGenerator, pool="H20", replicas=8, model=spec("qwen3-8b"))
        """
        from rollart_nb.sim_session import SimSession

        return SimSession(*args, **kwargs)

    @property
    def token_path(self) -> str | None:
        """File holding the Ray token this session uses (None without authentication).

        Give its path to processes of your own that should join (``RAY_AUTH_TOKEN_PATH``), or
        copy it to the machines of an ``expose``\ d session; never print its contents.
        """
        return _ray_connect.token_path() if self.state == "attached" else None

    def ray_env(self) -> dict[str, str]:
        """Environment variables a child process needs to reach this session's Ray."""
        self._check()
        env = {"RAY_ADDRESS": self.address}
        if self.token_path:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self.token_path)
        return env

    def _finish_attach(self, *, pool_map: dict[str, str] | None, serverless: bool, store: str | None) -> None:
        head = _ray.current_node_id()

        def discover() -> dict[str, Pool]:
            pools = discover_pools(_ray.nodes(), pool_map=pool_map, serverless=serverless, head_node_id=head)
            if self.mode == "local" and "serverless" in pools:
                pools["serverless"].simulated = True
            return pools

        self.pools = discover()
        self.store = make_store(store, prefix=f"sessions/{self.id}/")
        # every session of the cluster reads the others' holdings here (see ResourceManager)
        holder = Holder.of_session(
            self.id, pid=os.getpid(), host=socket.gethostname(), created=time.time(), job=_ray.job_id()
        )
        resources = ResourceManager(
            self.pools,
            self.store,
            shared=make_store(store, prefix=""),
            holder=holder,
            discover=discover,
            dead_jobs=_ray.dead_jobs,
            node_lost=_ray.node_lost,
        )
        self._runtime = RayRuntime(resources, seed=self.seed, log_dir=self.log_dir, session_id=self.id)
        self.state = SessionState.ATTACHED

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

    def close(self) -> None:
        """Close every cluster, release bindings, and stop Ray if this session started it."""
        global _LOCAL
        if self.state == "closed":
            return
        if self._runtime is not None:  # the launchers after the pipelines: their rollouts used the replicas
            self._runtime.close(after_pipelines=[("stopping env launchers and log tails", self._close_own_parts)])
        else:
            self._close_own_parts()
        try:
            if self._runtime is not None:
                self._runtime.resources.close()
            if self.store is not None:
                self.store.clear()
        except Exception as e:
            log.warning("clearing the metadata store: %s", e)
        if self.mode in ("local", "attach"):
            _ray_connect.shutdown()
        self.state = SessionState.CLOSED
        if _LOCAL is self:
            _LOCAL = None

    def __repr__(self) -> str:
        pools = ", ".join(f"{n}:{p.free:g}/{p.capacity:g}{'*' if p.simulated else ''}" for n, p in self.pools.items())
        return (
            f"Session(id={self.id}, {self.mode or 'new'}, {self.state}, pools=[{pools}], "
            f"clusters={sorted(self.clusters)})"
        )

    def _repr_html_(self) -> str:
        if self._runtime is not None and self.state == "attached":
            with contextlib.suppress(Exception):  # what other sessions of the cluster hold now
                self._runtime.resources.refresh()
        rows = "".join(
            f"<tr><td><b>{html.escape(n)}</b></td><td>{p.hardware.name} ({p.hardware.optimized_for})</td>"
            f"<td>{len(p.nodes)}</td><td>{p.free:g} / {p.capacity:g}</td>"
            f"<td>{_SIM_BADGE if p.simulated else 'real'}</td></tr>"
            for n, p in self.pools.items()
        )
        binds = "".join(
            f"<tr><td>{html.escape(b.worker)}</td><td>{html.escape(b.pool)}</td><td>{b.hardware}</td>"
            f"<td>{'yes: ' + html.escape(b.reason) if b.fell_back else 'no'}</td></tr>"
            for b in (
                self.runtime.resources.bindings() if self._runtime is not None and self.state == "attached" else []
            )
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


_SIM_BADGE = '<span style="color:#b36b00">simulated</span>'


def _valid_expose(value: str) -> bool:
    import ipaddress

    if value == "auto":
        return True
    try:
        return not ipaddress.ip_address(value).is_loopback
    except ValueError:
        return False
