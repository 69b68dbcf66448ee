"""ClusterBase: what every cluster shares, whichever transport starts its Workers.

A cluster spawns a role's Workers from bindings and binds their decorated methods onto itself:
``cluster.compute_gradients(...)`` has the Worker method's own signature and docstring (so
``help()`` and tab completion work) plus a keyword-only ``blocking`` flag. The transports sit
beside their runtimes: :class:`~rollart_nb.runtime.ray.Cluster` (Ray actors) and
:class:`~rollart_nb.runtime.local.LocalCluster` (in-process objects).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import html
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from rollart_nb.errors import ConfigError, StateError
from rollart_nb.resources.manager import Binding, ResourceManager
from rollart_nb.serverless.client import Endpoint, acall, call
from rollart_nb.workers.decorators import Dispatch, dispatch_of
from rollart_nb.workers.routing import pick_worker

if TYPE_CHECKING:
    from rollart_nb.runtime.base import ClusterSpec

__all__ = ["ClusterBase"]


class ClusterBase(abc.ABC):
    """What the Ray ``Cluster`` and the simulator's in-process ``LocalCluster`` share (same rules,
    different transports): the ``@register`` / ``@hw_mapping`` / ``@register_serverless``
    dispatch, the methods bound from the Worker class, and the views.

    A transport implements the abstract methods (start a worker, send calls, collect results,
    restart, close) and sets ``_lock`` before calling :meth:`__init__`. Workers are bound
    through the :class:`~rollart_nb.resources.manager.ResourceManager` given, never through the
    session. Each ``workers`` item has ``actor``, ``binding``, ``inflight`` and ``calls``.
    """

    _lock: contextlib.AbstractContextManager[Any]
    """Guards ``workers``' in-flight counts (set by the transport before ``__init__``)."""
    _register_hint: ClassVar[bool] = False
    """Whether error messages may suggest ``sess.register_endpoint`` (a Ray session has it)."""
    closed: bool
    closed_fix: str = ""
    """What to do instead of calling this cluster once it is closed (default: build it again with
    ``sess.cluster``); set on internal clusters, e.g. a pipeline's rollout, that users do not build."""

    if TYPE_CHECKING:
        # The Worker class's ``@register`` / ``@hw_mapping`` / ``@register_serverless`` methods,
        # bound onto each instance by ``_bind_methods``: any name here is such a method. Code that
        # needs a checked surface types a cluster by the Protocol of its role instead (e.g.
        # ``rollart_nb.control.parts.TrainerCluster``).
        def __getattr__(self, name: str) -> Any: ...

    @abc.abstractmethod
    def _spawn(self, index: int, world: int, binding: Binding | None = None) -> Any:
        """Bind (unless ``binding`` is given) and start worker ``index`` of ``world``; returns its handle."""

    @abc.abstractmethod
    def _start(self, h: Any, attr: str, args: tuple, kwargs: dict) -> Any:
        """Start ``attr`` on the worker of handle ``h``; returns its ref (called under ``_lock``)."""

    @abc.abstractmethod
    def _stop(self, h: Any) -> None:
        """Stop the worker of handle ``h`` (on close)."""

    @abc.abstractmethod
    def _finish(
        self, idx: list[int], refs: list[Any], combine: Callable[[list[Any]], Any], blocking: bool, what: str
    ) -> Any:
        """The combined result of ``refs`` (blocking) or a future of it."""

    @abc.abstractmethod
    def restart_worker(self, index: int) -> Binding:
        """Failover: replace worker ``index`` on a rebound slot; returns its new binding."""

    @abc.abstractmethod
    def info(self) -> list[dict[str, Any]]:
        """Per worker: node, pid, hardware, pool, rank."""

    def _submit(self, idx: list[int], attr: str, per_worker_args: list[tuple[tuple, dict]]) -> list[Any]:
        """Start ``attr`` on the workers at ``idx`` (one (args, kwargs) each); returns one ref per call."""
        with self._lock:
            for i in idx:
                self.workers[i].inflight += 1
                self.workers[i].calls += 1
            return [self._start(self.workers[i], attr, a, k) for i, (a, k) in zip(idx, per_worker_args, strict=True)]

    def close(self) -> None:
        """Stop the workers and release their pool slots (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for h in self.workers:
            self._stop(h)
        self._resources.release(self.name)

    def _call_register(self, attr: str, d: Dispatch, args: tuple, kwargs: dict, blocking: bool) -> Any:
        n = len(self.workers)
        if d.mode == "one":
            idx = [0]
            per = [(args, kwargs)]
            combine: Callable[[list[Any]], Any] = lambda r: r[0]  # noqa: E731
        elif d.mode == "scatter":
            for v in (*args, *kwargs.values()):
                if isinstance(v, list | tuple) and len(v) != n:
                    raise ConfigError(f"{self.name}.{attr}: scatter argument has {len(v)} items for {n} workers")
            idx = list(range(n))
            per = [(tuple(_pick(a, i) for a in args), {k: _pick(v, i) for k, v in kwargs.items()}) for i in idx]
            combine = list
        else:
            idx = list(range(n))
            per = [(args, kwargs)] * n
            combine = list
        refs = self._submit(idx, attr, per)
        return self._finish(idx, refs, combine, blocking, f"{self.name}.{attr}")

    def affinity(self, attr: str, tag: str | None) -> str | None:
        """Preferred hardware for ``tag`` when calling ``attr`` (cluster override, then decorator)."""
        fn = getattr(self.worker_cls, attr)
        d = dispatch_of(fn)
        if tag is not None and tag in self._affinity_override:
            return self._affinity_override[tag]
        if d is not None and tag is not None and tag in d.affinity:
            return d.affinity[tag]
        return d.default if d is not None else None

    def set_affinity(self, tag: str, hardware: str) -> None:
        """Route calls tagged ``tag`` to ``hardware`` ("H20", "compute", "bandwidth", ...)."""
        self._affinity_override[tag] = hardware

    def choose_worker(self, attr: str, tag: str | None, max_inflight: int) -> tuple[int, bool]:
        """Pick a worker index for a tagged call; returns (index, fell_back)."""
        pref = self.affinity(attr, tag)
        with self._lock:
            return pick_worker(
                [(h.binding.hardware, h.binding.pool) for h in self.workers],
                [h.inflight for h in self.workers],
                pref,
                max_inflight,
            )

    def _call_hw(self, attr: str, d: Dispatch, args: tuple, kwargs: dict, blocking: bool) -> Any:
        tag = kwargs.get("tag_name")
        if tag is None:
            params = [p for p in inspect.signature(getattr(self.worker_cls, attr)).parameters if p != "self"]
            pos = params.index("tag_name")
            tag = args[pos] if len(args) > pos else None
        i, fell_back = self.choose_worker(attr, tag, d.max_inflight)
        if fell_back:
            self.fallbacks[attr] = self.fallbacks.get(attr, 0) + 1
        refs = self._submit([i], attr, [(args, kwargs)])
        return self._finish([i], refs, lambda r: r[0], blocking, f"{self.name}.{attr}")

    # -- what both transports share: bound methods, serverless calls, views ------------------
    _node_chars: int | None = None
    """Characters of a node id shown in the HTML view (None: all)."""

    def __init__(self, resources: ResourceManager, spec: ClusterSpec, registry: Mapping[str, Endpoint]) -> None:
        """Bind the Worker's decorated methods, then start ``spec.replicas`` workers (closing them
        all if one fails). Subclasses set what their ``_spawn`` needs before calling this.

        ``spec.endpoints`` are this cluster's own serverless endpoints; ``registry`` is the
        session's (read at call time, so endpoints registered later are found).
        """
        self.spec, self.name, self.worker_cls, self.pool = spec, spec.name, spec.worker_cls, spec.pool
        self._resources, self._registry = resources, registry
        self._affinity_override = dict(spec.affinity or {})
        self.fallbacks: dict[str, int] = {}
        self.closed = False
        self.workers: list[Any] = []
        self._bind_methods()  # validates the Worker class before any worker starts
        try:
            for i in range(spec.replicas):
                self.workers.append(self._spawn(i, spec.replicas))
            self._wait_ready(range(spec.replicas))
        except BaseException:
            self.close()
            raise

    def _bind(self, index: int) -> Binding:
        """A slot for worker ``index`` by the spec's pool, fallback and slots."""
        s = self.spec
        return self._resources.bind(self.name, index, prefer=s.pool, fallback=s.fallback, slots=s.slots)

    def call_worker(self, index: int, attr: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``attr`` on worker ``index`` only and wait for its result (e.g. load weights into
        a replacement)."""
        self._check_open()
        refs = self._submit([index], attr, [(args, kwargs)])
        return self._finish([index], refs, lambda r: r[0], True, f"{self.name}.{attr}")

    def dead_workers(self, timeout_s: float = 0.0) -> dict[int, str]:
        """Index -> reason for every worker whose process is gone (in-process workers never die)."""
        return {}

    def _wait_ready(self, indices: range | list[int]) -> None:
        """Block until the workers at ``indices`` are up (nothing to wait for by default)."""
        return None

    _html_note = ""
    """Extra text in the HTML view's header."""

    def _bind_methods(self) -> None:
        for attr, fn in inspect.getmembers(self.worker_cls, predicate=inspect.isfunction):
            d = dispatch_of(fn)
            if d is None:
                continue
            if hasattr(type(self), attr):
                raise ConfigError(f"{self.worker_cls.__name__}.{attr} clashes with a Cluster attribute; rename it")
            setattr(self, attr, self._make_proxy(attr, fn, d))

    def _make_proxy(self, attr: str, fn: Callable[..., Any], d: Dispatch) -> Callable[..., Any]:
        if d.kind == "register":
            impl = functools.partial(self._call_register, attr, d)
        elif d.kind == "hw_mapping":
            impl = functools.partial(self._call_hw, attr, d)
        else:
            impl = functools.partial(self._call_serverless, attr, d)

        @functools.wraps(fn)
        def proxy(*args: Any, blocking: bool = True, **kwargs: Any) -> Any:
            self._check_open()
            return impl(args, kwargs, blocking)

        sig = inspect.signature(fn)
        # Ray's tracing hook adds `_ray_trace_ctx` to actor methods: not part of the user's API.
        params = [p for n, p in sig.parameters.items() if n not in ("self", "_ray_trace_ctx")]
        params.append(inspect.Parameter("blocking", inspect.Parameter.KEYWORD_ONLY, default=True))
        proxy.__signature__ = sig.replace(parameters=_ordered(params))  # type: ignore[attr-defined]
        return proxy

    def _endpoint(self, d: Dispatch) -> Endpoint:
        name = d.endpoint or ""
        ep = self.spec.endpoints.get(name) or self._registry.get(name)
        if ep is None:
            how = f"call sess.register_endpoint({name!r}, url) or " if self._register_hint else ""
            raise ConfigError(
                f"{self.name}: no serverless endpoint {name!r} is registered; "
                f"{how}pass endpoints={{{name!r}: url}} to sess.cluster"
            )
        return Endpoint(ep.name, ep.url, ep.token_env, timeout_s=d.timeout_s, retries=d.retries, backoff_s=ep.backoff_s)

    def _call_serverless(self, attr: str, d: Dispatch, args: tuple, kwargs: dict, blocking: bool) -> Any:
        ep = self._endpoint(d)
        if blocking:
            return call(ep, list(args), kwargs)
        return acall(ep, list(args), kwargs)  # a coroutine: await it

    def _check_open(self) -> None:
        if self.closed:
            fix = self.closed_fix or f"build it again with sess.cluster({self.name!r}, ...)"
            raise StateError(f"Cluster {self.name!r} is closed; {fix}")

    @property
    def model(self) -> Any:
        """The ``model`` the workers were built with (None if not given)."""
        return self.spec.init_kwargs.get("model")

    @property
    def bindings(self) -> list[Binding]:
        return [h.binding for h in self.workers]

    def __len__(self) -> int:
        return len(self.workers)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.workers)} worker(s)"
        pools = ",".join(sorted({h.binding.pool for h in self.workers}))
        return f"{type(self).__name__}({self.name!r}, {self.worker_cls.__name__}, {state}, pools={pools or '-'})"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{h.binding.index}</td><td>{html.escape(h.binding.pool)}</td><td>{h.binding.hardware}</td>"
            f"<td><code>{html.escape(h.binding.node[: self._node_chars])}</code></td>"
            f"<td>{'yes: ' + html.escape(h.binding.reason) if h.binding.fell_back else 'no'}</td>"
            f"<td>{h.inflight}</td><td>{h.calls}</td></tr>"
            for h in self.workers
        )
        return (
            f"<div><b>Cluster</b> <code>{html.escape(self.name)}</code> &middot; {self.worker_cls.__name__} &middot; "
            f"{'closed' if self.closed else 'open'}{self._html_note}<table><tr><th>rank</th><th>pool</th><th>hardware</th><th>node</th>"
            f"<th>fell back</th><th>in flight</th><th>calls</th></tr>{rows}</table></div>"
        )


def _pick(v: Any, i: int) -> Any:
    return v[i] if isinstance(v, list | tuple) else v


def _ordered(params: list[inspect.Parameter]) -> list[inspect.Parameter]:
    """Keep a valid parameter order after appending keyword-only ``blocking``."""
    var_kw = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    rest = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return sorted(rest, key=lambda p: p.kind) + var_kw
