"""Env server: any env class as an HTTP/JSON service with many concurrent episodes.

Protocol version 1 (JSON bodies, UTF-8). Every episode is one env instance made by the
server's factory; ``replica`` in each answer names the server that answered.

==========================================  ===========================================================
``GET /v1/health``                          200 ``{status: "ok", protocol, replica, episodes, capacity}``
``GET /v1/metadata``                        200 ``{protocol: 1, env, task, max_turns, shape, vocab,
                                            validation_seeds, replica}``
``POST /v1/episodes {seed}``                201 ``{episode_id, obs, info, replica}``
``POST /v1/episodes/{id}/step {action}``    200 ``{obs, reward, terminated, truncated, info, replica}``;
                                            an episode that terminated or truncated is closed
``DELETE /v1/episodes/{id}``                204 (404 when unknown)
==========================================  ===========================================================

Errors are ``{"error": {"type", "message", ...}}``: 400 bad request, 404 unknown episode or
path, 405 wrong method, 409 a step while the episode is stepping, 413 body too large, 503 at
the episode cap (``Retry-After``), 500 ``EnvException`` (with ``env_type`` and ``where``) when
the env raised. Idle episodes close after ``idle_timeout_s``; sync env methods run in a
bounded pool of daemon threads.

Example:
    >>> from rollart_nb.envs import FrozenLake
    >>> srv = EnvServer(lambda: FrozenLake(size=4), task="lake")
    >>> url = srv.start_in_thread()          # http://127.0.0.1:<free port>  # doctest: +SKIP
    >>> srv.stop()                                                            # doctest: +SKIP

From a shell: ``rollart-nb env-server --env rollart_nb.envs:FrozenLake --kwargs '{"size": 4}'
--port 0`` prints ``LISTENING http://127.0.0.1:<port>`` once it accepts requests.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import math
import os
import queue
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rollart_nb.errors import ConfigError

__all__ = ["PROTOCOL_VERSION", "EnvServer", "load_env_factory", "serve", "to_json"]

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1


def load_env_factory(spec: Any, kwargs: dict[str, Any] | None = None) -> Callable[[], Any]:
    """A zero-argument factory for ``spec``: ``"module:Class"`` (imported by name) or a class.

    Raises:
        ConfigError: the spec is malformed, the module cannot be imported or has no such name.
    """
    kwargs = dict(kwargs or {})
    if isinstance(spec, str):
        mod_name, sep, attr = spec.partition(":")
        if not sep or not mod_name or not attr:
            raise ConfigError(f"env {spec!r} is not 'module:Class' (e.g. rollart_nb.envs:FrozenLake)")
        try:
            obj: Any = importlib.import_module(mod_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ConfigError(
                f"cannot load env {spec!r}: {type(e).__name__}: {e}; make sure its module "
                "is importable here (on PYTHONPATH or installed)"
            ) from e
    elif callable(spec):
        obj = spec
    else:
        raise ConfigError(f"env must be 'module:Class' or a class, got {type(spec).__name__}")
    return lambda: obj(**kwargs)


def to_json(value: Any) -> Any:
    """``value`` with numpy scalars/arrays, tuples and sets made JSON-able; other objects as str."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [to_json(v) for v in value]
    if hasattr(value, "tolist"):  # numpy scalars and arrays, without importing numpy
        return to_json(value.tolist())
    return str(value)


class _DaemonPool:
    """A fixed pool of daemon threads for sync env calls (the stdlib executor's threads are
    joined at exit, so one hung env would hang interpreter shutdown)."""

    def __init__(self, threads: int) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._work, name=f"rollart-env-{i}", daemon=True).start()

    def _work(self) -> None:
        while (job := self._q.get()) is not None:
            loop, fut, fn, args = job
            try:
                result, exc = fn(*args), None
            except BaseException as e:  # handed to the awaiting request, never lost
                result, exc = None, e
            loop.call_soon_threadsafe(_settle, fut, result, exc)

    def run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._q.put((loop, fut, fn, args))
        return fut

    def shutdown(self, threads: int) -> None:
        for _ in range(threads):
            self._q.put(None)


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if not fut.done():
        fut.set_exception(exc) if exc is not None else fut.set_result(result)


@dataclass
class _Episode:
    env: Any
    last_used: float = field(default_factory=time.monotonic)
    busy: bool = False


class _HTTPFail(Exception):
    def __init__(self, status: int, type_: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.body = status, {"type": type_, "message": message, **extra}


class EnvServer:
    """Serves episodes of one env type over the protocol in the module docstring.

    Args:
        factory: makes one env instance (called per episode; finished envs are reused).
        task: task name reported by ``/v1/metadata``.
        replica_id: this server's name in answers (default ``host:port``).
        max_episodes: concurrent episodes; more get 503.
        idle_timeout_s: an episode untouched this long is closed.
        threads: threads for sync env methods.
        max_body_bytes: larger request bodies get 413.
    """

    def __init__(
        self,
        factory: Callable[[], Any],
        *,
        task: str | None = None,
        replica_id: str | None = None,
        max_episodes: int = 256,
        idle_timeout_s: float = 600.0,
        threads: int = 8,
        max_body_bytes: int = 1 << 20,
    ) -> None:
        if max_episodes < 1 or threads < 1 or idle_timeout_s <= 0 or max_body_bytes < 1024:
            raise ConfigError(
                "need max_episodes >= 1, threads >= 1, idle_timeout_s > 0, max_body_bytes >= 1024", where="EnvServer"
            )
        self.factory, self.task, self.replica_id = factory, task, replica_id
        self.max_episodes, self.idle_timeout_s = max_episodes, idle_timeout_s
        self.threads, self.max_body_bytes = threads, max_body_bytes
        self.episodes: dict[str, _Episode] = {}
        self._pool: _DaemonPool | None = None
        template = factory()  # fail at start, not at the first episode
        self._meta = self._metadata(template)
        self._spare: list[Any] = [template]  # finished envs, reset before reuse
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.url = ""

    # -- lifecycle ---------------------------------------------------------------------
    def app(self) -> web.Application:
        """The aiohttp application (routes, JSON errors, body limit, idle sweeper)."""
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._errors])
        app.router.add_get("/v1/health", self._health)
        app.router.add_get("/v1/metadata", self._metadata_route)
        app.router.add_post("/v1/episodes", self._reset)
        app.router.add_post("/v1/episodes/{id}/step", self._step)
        app.router.add_delete("/v1/episodes/{id}", self._delete)
        app.cleanup_ctx.append(self._background)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host:port`` (0: a free port) in the running loop; returns the URL."""
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # the port 0 resolved to
        self.url = f"http://{host}:{bound}"
        if self.replica_id is None:
            self.replica_id = f"{socket.gethostname()}:{bound}"
        self._meta["replica"] = self.replica_id
        return self.url

    async def stop_async(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0) -> str:
        """Serve from a background thread with its own event loop (notebooks, tests); returns the URL."""
        ready: queue.SimpleQueue[Any] = queue.SimpleQueue()

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                ready.put(loop.run_until_complete(self.start(host, port)))
            except BaseException as e:
                ready.put(e)
                return
            loop.run_forever()
            loop.run_until_complete(self.stop_async())
            loop.close()

        self._thread = threading.Thread(target=main, name="rollart-env-server", daemon=True)
        self._thread.start()
        out = ready.get(timeout=timeout_s)
        if isinstance(out, BaseException):
            raise out
        return out

    def stop(self) -> None:
        """Stop a server started with :meth:`start_in_thread`."""
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._thread = self._loop = None

    async def _background(self, app: web.Application) -> Any:
        self._pool = _DaemonPool(self.threads)
        sweeper = asyncio.create_task(self._sweep())
        yield
        sweeper.cancel()
        for ep in list(self.episodes.values()):
            _close_env(ep.env)
        self.episodes.clear()
        self._pool.shutdown(self.threads)

    async def _sweep(self) -> None:
        period = min(5.0, self.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            cutoff = time.monotonic() - self.idle_timeout_s
            for eid, ep in list(self.episodes.items()):
                if not ep.busy and ep.last_used < cutoff:
                    del self.episodes[eid]
                    _close_env(ep.env)

    # -- routes ------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except _HTTPFail as e:
            headers = {"Retry-After": "1"} if e.status == 503 else None
            return web.json_response({"error": e.body}, status=e.status, headers=headers)
        except web.HTTPRequestEntityTooLarge:
            return _fail(413, "BodyTooLarge", f"request body over {self.max_body_bytes} bytes")
        except web.HTTPException as e:  # aiohttp's own 404/405 as JSON too
            if e.status < 400:
                raise
            return _fail(e.status, e.reason.replace(" ", ""), f"{request.method} {request.path}: {e.reason}")

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "protocol": PROTOCOL_VERSION,
                "replica": self.replica_id,
                "episodes": len(self.episodes),
                "capacity": self.max_episodes,
            }
        )

    async def _metadata_route(self, request: web.Request) -> web.Response:
        return web.json_response(self._meta)

    async def _reset(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise _HTTPFail(400, "BadRequest", f"seed must be an integer or null, got {seed!r}")
        if len(self.episodes) >= self.max_episodes:
            raise _HTTPFail(
                503,
                "AtCapacity",
                f"replica {self.replica_id} is at its cap of {self.max_episodes} "
                "episodes; retry later, add replicas or raise --max-episodes",
            )
        env = self._spare.pop() if self._spare else self.factory()
        eid = uuid.uuid4().hex
        ep = self.episodes[eid] = _Episode(env, busy=True)  # counts against the cap while resetting
        try:
            obs, info = await self._call(env, "reset", seed)
        except BaseException:
            self.episodes.pop(eid, None)
            raise
        ep.busy, ep.last_used = False, time.monotonic()
        return web.json_response(
            {"episode_id": eid, "obs": str(obs), "info": to_json(info or {}), "replica": self.replica_id}, status=201
        )

    async def _step(self, request: web.Request) -> web.Response:
        eid = request.match_info["id"]
        ep = self._episode(eid)
        body = await self._body(request)
        action = body.get("action")
        if not isinstance(action, str):
            raise _HTTPFail(400, "BadRequest", f"action must be a string, got {type(action).__name__}")
        if ep.busy:
            raise _HTTPFail(409, "EpisodeBusy", f"episode {eid} is still stepping; wait for its answer")
        ep.busy = True
        try:
            obs, reward, terminated, truncated, info = await self._call(ep.env, "step", action)
        except BaseException:
            self._finish(eid)  # an env that raised is in an unknown state: end its episode
            raise
        ep.busy, ep.last_used = False, time.monotonic()
        if terminated or truncated:
            self._finish(eid, reuse=True)
        return web.json_response(
            {
                "obs": str(obs),
                "reward": to_json(float(reward)),
                "terminated": bool(terminated),
                "truncated": bool(truncated),
                "info": to_json(info or {}),
                "replica": self.replica_id,
            }
        )

    async def _delete(self, request: web.Request) -> web.Response:
        eid = request.match_info["id"]
        self._episode(eid)
        self._finish(eid)
        return web.Response(status=204)

    # -- helpers -----------------------------------------------------------------------
    def _episode(self, eid: str) -> _Episode:
        ep = self.episodes.get(eid)
        if ep is None:
            raise _HTTPFail(
                404,
                "UnknownEpisode",
                f"episode {eid} is unknown on replica {self.replica_id} "
                "(finished, deleted, expired or never created); start one with POST /v1/episodes",
            )
        return ep

    def _finish(self, eid: str, reuse: bool = False) -> None:
        ep = self.episodes.pop(eid, None)
        if ep is None:
            return
        if reuse and len(self._spare) < 64:
            self._spare.append(ep.env)
        else:
            _close_env(ep.env)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise _HTTPFail(
                413,
                "BodyTooLarge",
                f"request body of {request.content_length} bytes is over the limit of {self.max_body_bytes}",
            )
        raw = await request.read()
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise _HTTPFail(400, "BadJSON", f"request body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise _HTTPFail(400, "BadRequest", f"request body must be a JSON object, got {type(body).__name__}")
        return body

    async def _call(self, env: Any, method: str, arg: Any) -> Any:
        try:
            fn = getattr(env, "a" + method, None)
            if fn is not None:
                return await fn(arg)
            assert self._pool is not None
            return await self._pool.run(getattr(env, method), arg)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            tb = traceback.extract_tb(e.__traceback__)
            where = f"{tb[-1].filename}:{tb[-1].lineno}" if tb else ""
            raise _HTTPFail(
                500,
                "EnvException",
                f"{type(e).__name__}: {e}",
                env_type=type(e).__name__,
                env_message=str(e),
                where=where,
                call=method,
            ) from e

    def _metadata(self, env: Any) -> dict[str, Any]:
        seeds = getattr(env, "validation_seeds", None)
        return to_json(
            {
                "protocol": PROTOCOL_VERSION,
                "env": type(env).__name__,
                "task": self.task,
                "max_turns": getattr(env, "max_turns", None),
                "shape": getattr(env, "shape", "decode"),
                "vocab": list(getattr(env, "vocab", []) or []),
                "validation_seeds": list(seeds()) if callable(seeds) else None,
                "replica": self.replica_id,
            }
        )


def _fail(status: int, type_: str, message: str) -> web.Response:
    return web.json_response({"error": {"type": type_, "message": message}}, status=status)


def _close_env(env: Any) -> None:
    close = getattr(env, "close", None)
    if callable(close):
        try:
            close()
        except Exception as e:  # closing is best effort; the episode is gone either way
            log.debug("closing %s: %s", type(env).__name__, e)


async def serve(server: EnvServer, host: str = "127.0.0.1", port: int = 0, *, exit_with_parent: bool = False) -> None:
    """Run ``server`` until SIGTERM/SIGINT (or, with ``exit_with_parent``, until the process that
    started this one dies); prints ``LISTENING <url>`` on stdout once it accepts requests."""
    import signal

    url = await server.start(host, port)
    print(f"LISTENING {url}", flush=True)  # launchers read this line; keep its format
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.getppid()
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                # without a sandbox nothing else kills a replica whose launcher was SIGKILLed
                if exit_with_parent and os.getppid() != parent:
                    log.warning("parent process %d is gone; stopping", parent)
                    break
    finally:
        await server.stop_async()
