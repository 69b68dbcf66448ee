"""The optional async env protocol, the helpers the EnvManager calls, and a wrapper base.

An env (see :class:`rollart_nb.protocols.Env`) MAY also define ``async areset(seed)`` and
``async astep(action)``. :func:`env_reset` / :func:`env_step` use them when present, and
otherwise run the sync method on a :class:`BlockingPool` thread; both turn any failure into
:class:`rollart_nb.errors.EnvError` and can bound the call with a timeout.

Blocking user code never runs on the loop's default executor (the control plane's, with few
threads that hung envs would exhaust); a :class:`BlockingPool` replaces abandoned threads.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from rollart_nb.errors import EnvError, StateError

__all__ = ["AsyncEnv", "BlockingPool", "EnvWrapper", "StepResult", "default_pool", "env_name", "env_reset", "env_step"]

log = logging.getLogger(__name__)

StepResult = tuple[str, float, bool, bool, dict[str, Any]]

DEFAULT_MAX_REPLACEMENTS = 1024
"""Default cap on hung calls whose threads a :class:`BlockingPool` replaces. Each hung thread
keeps a little memory (its stack's touched pages) until its call returns."""


@runtime_checkable
class AsyncEnv(Protocol):
    """An env that can also be driven without threads (optional extension of ``Env``)."""

    async def areset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]: ...

    async def astep(self, action: str) -> StepResult: ...


# -- blocking calls ------------------------------------------------------------------------
class _Call:
    """One blocking call: runs ``fn(*args)`` on a pool thread, with the state its caller needs
    to tell "never started" (simply dropped) from "running" (abandoned) when it gives up."""

    __slots__ = ("abandoned", "args", "cancelled", "finished", "fn", "pool", "started")

    def __init__(self, pool: BlockingPool, fn: Callable[..., Any], args: tuple) -> None:
        self.pool, self.fn, self.args = pool, fn, args
        self.started = self.finished = self.cancelled = self.abandoned = False

    def __call__(self) -> Any:
        with self.pool._cv:
            if self.cancelled:  # its caller gave up while it waited for a thread
                return None
            self.started = True
        try:
            return self.fn(*self.args)
        finally:
            self.pool._returned(self)


class BlockingPool(concurrent.futures.Executor):
    """Daemon threads for blocking user code, apart from the event loop's default executor.

    Threads start on demand and leave after ``idle_exit_s`` idle. The limit is ``size`` plus one
    replacement per hung (abandoned, still running) call, at most ``max_replacements``; at that
    cap the pool warns once and :meth:`stats` reports ``at_cap``. Call it via :meth:`call`.

    Args:
        name: names the threads (``rollart-<name>-<n>``) and the pool in logs.
        size: threads for normal work: how many calls may run at once (e.g. one per env).
        max_replacements: how many hung calls get a replacement thread.
        idle_exit_s: an idle thread exits after this many seconds.

    Example:
        >>> import asyncio, time
        >>> pool = BlockingPool("demo", size=2)
        >>> async def main():
        ...     try:
        ...         await asyncio.wait_for(pool.call(time.sleep, 5), 0.05)   # abandoned
        ...     except TimeoutError:
        ...         pass
        ...     return await pool.call(sum, [1, 2])                          # still served
        >>> asyncio.run(main())
        3
        >>> pool.stats()["abandoned"], pool.stats()["hung"]
        (1, 1)
    """

    def __init__(
        self, name: str, size: int, *, max_replacements: int = DEFAULT_MAX_REPLACEMENTS, idle_exit_s: float = 30.0
    ) -> None:
        if size < 1 or max_replacements < 0:
            raise ValueError(
                f"BlockingPool {name!r}: size must be >= 1 and max_replacements >= 0, got {size}, {max_replacements}"
            )
        self.name, self.size, self.max_replacements, self.idle_exit_s = name, size, max_replacements, idle_exit_s
        self._cv = threading.Condition()
        self._jobs: collections.deque[tuple[concurrent.futures.Future, Callable[[], Any]]] = collections.deque()
        self._threads = self._idle = self._hung = 0
        self._spawned = 0
        self._closed = False
        self._warned = False
        self.abandoned = 0  # calls given up while running (timeouts, cancellations)
        self.returned_late = 0  # abandoned calls that did return in the end
        self.cap_hits = 0  # times a call had to wait because the pool was at its cap

    # -- sizing ----------------------------------------------------------------------------
    @property
    def cap(self) -> int:
        """The most threads this pool will ever run at once."""
        return self.size + self.max_replacements

    def _limit(self) -> int:
        return self.size + min(self._hung, self.max_replacements)

    def ensure_size(self, size: int) -> None:
        """Allow at least ``size`` calls at once (e.g. once the number of envs is known)."""
        with self._cv:
            self.size = max(self.size, int(size))

    # -- Executor --------------------------------------------------------------------------
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Queue ``fn(*args, **kwargs)``; a thread starts if none is idle and the limit allows."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._closed:
                raise StateError(f"BlockingPool {self.name!r} is shut down; create a new one")
            self._jobs.append((fut, lambda: fn(*args, **kwargs)))
            self._grow()
            self._cv.notify()
        return fut

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = False) -> None:
        """Stop taking work; idle threads leave. Hung threads are never waited for."""
        with self._cv:
            self._closed = True
            if cancel_futures:
                while self._jobs:
                    self._jobs.popleft()[0].cancel()
            self._cv.notify_all()

    def _grow(self) -> None:  # holds self._cv
        while len(self._jobs) > self._idle:
            if self._threads >= self._limit():
                if self._hung >= self.max_replacements:
                    self.cap_hits += 1
                    if not self._warned:
                        self._warned = True
                        log.warning(
                            "blocking pool %r is at its cap of %d threads (%d calls hung and abandoned, "
                            "%d replaced); further calls wait for a thread. Fix the code that hangs, or "
                            "give it a timeout of its own.",
                            self.name,
                            self.cap,
                            self._hung,
                            self.max_replacements,
                        )
                return
            self._threads += 1
            self._spawned += 1
            self._idle += 1  # counted idle from now, so one waiting call starts one thread
            threading.Thread(target=self._work, name=f"rollart-{self.name}-{self._spawned}", daemon=True).start()

    def _work(self) -> None:
        with self._cv:
            while True:
                # self._idle already counts this thread (set by _grow, or at the end of the loop)
                if (
                    not self._cv.wait_for(lambda: self._jobs or self._closed, timeout=self.idle_exit_s)
                    or not self._jobs
                ):
                    self._idle -= 1
                    self._threads -= 1
                    return
                fut, job = self._jobs.popleft()
                self._idle -= 1
                if fut.set_running_or_notify_cancel():
                    self._cv.release()
                    try:
                        _run(fut, job)
                    finally:
                        self._cv.acquire()
                if self._threads > self._limit() and not self._jobs:  # a hung call came back: surplus
                    self._threads -= 1
                    return
                self._idle += 1

    # -- async use -------------------------------------------------------------------------
    async def call(self, fn: Callable[..., Any], *args: Any, on_abandon: Callable[[], None] | None = None) -> Any:
        """``await`` ``fn(*args)`` on a pool thread. If the awaiting task is cancelled (e.g. by
        a timeout) while the call runs, the call is abandoned: counted, its thread replaced,
        and ``on_abandon()`` called; a call still waiting for a thread is simply dropped."""
        c = _Call(self, fn, args)
        fut = asyncio.get_running_loop().run_in_executor(self, c)
        try:
            # shielded: a running call's future must complete when its thread does, not at the
            # cancel, so a SimSession's virtual clock counts the thread's hold on time correctly
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if self._abandon(c):
                fut.add_done_callback(_consume)
                if on_abandon is not None:
                    on_abandon()
            else:
                fut.cancel()  # not started: the thread that picks it up skips it
            raise

    def _abandon(self, c: _Call) -> bool:
        with self._cv:
            if not c.started:
                c.cancelled = True
                return False
            if c.finished:
                return False
            c.abandoned = True
            self._hung += 1
            self.abandoned += 1
            self._grow()  # its thread is lost for now: let a new one serve the calls waiting
            return True

    def _returned(self, c: _Call) -> None:
        with self._cv:
            c.finished = True
            if c.abandoned:
                self._hung -= 1
                self.returned_late += 1
                if self._hung < self.max_replacements:
                    self._warned = False

    # -- views -----------------------------------------------------------------------------
    @property
    def at_cap(self) -> bool:
        """True while hung calls have used up every replacement thread."""
        return 0 < self._hung >= self.max_replacements

    def stats(self) -> dict[str, Any]:
        """threads (alive), busy, queued, size, cap, abandoned, hung (abandoned, still running),
        returned_late, cap_hits, at_cap."""
        with self._cv:
            return {
                "threads": self._threads,
                "busy": self._threads - self._idle,
                "queued": len(self._jobs),
                "size": self.size,
                "cap": self.cap,
                "abandoned": self.abandoned,
                "hung": self._hung,
                "returned_late": self.returned_late,
                "cap_hits": self.cap_hits,
                "at_cap": self.at_cap,
            }

    def describe(self) -> str:
        """One line for error messages: the pool's name, threads, hung calls and cap."""
        s = self.stats()
        at_cap = " AT ITS CAP (calls wait for a thread)" if s["at_cap"] else ""
        return (
            f"{self.name} thread pool: {s['threads']} threads, {s['hung']} hung call(s) abandoned, "
            f"cap {s['cap']}{at_cap}"
        )

    def __repr__(self) -> str:
        return f"BlockingPool({self.name!r}, size={self.size}, cap={self.cap})"


def _consume(fut: asyncio.Future) -> None:
    """Retrieve an abandoned call's late outcome (nobody awaits it; asyncio would warn)."""
    if not fut.cancelled():
        fut.exception()


def _run(fut: concurrent.futures.Future, job: Callable[[], Any]) -> None:
    try:
        result = job()
    except BaseException as e:  # handed to the awaiting caller (if it still waits)
        fut.set_exception(e)
    else:
        fut.set_result(result)


_default_lock = threading.Lock()
_default: BlockingPool | None = None


def default_pool() -> BlockingPool:
    """The process-wide pool for sync env calls made outside an EnvManager (tests, notebooks),
    sized like the loop's default executor but separate from it."""
    global _default
    with _default_lock:
        if _default is None:
            _default = BlockingPool("env", size=min(32, (os.cpu_count() or 1) + 4))
        return _default


# The pool (and abandon callback) of the env call in progress: wrappers reach their inner env
# through env_reset/env_step without passing them, and must use the same pool.
_THREADS: contextvars.ContextVar[tuple[BlockingPool, Callable[[], None] | None] | None] = contextvars.ContextVar(
    "rollart_env_threads", default=None
)


async def _blocking(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a sync env method on the current env call's pool (else the default one)."""
    threads = _THREADS.get()
    pool, on_abandon = threads if threads is not None else (default_pool(), None)
    return await pool.call(fn, *args, on_abandon=on_abandon)


# -- env calls -----------------------------------------------------------------------------
def env_name(env: Any) -> str:
    """``Arithmetic``, or ``WithFailures(Arithmetic)`` for a wrapped env: for error messages."""
    name = type(env).__name__
    inner = getattr(env, "unwrapped", env)
    return name if inner is env else f"{name}({type(inner).__name__})"


async def _bounded(
    make: Callable[[], Any],
    env: Any,
    what: str,
    timeout_s: float | None,
    pool: BlockingPool | None,
    on_abandon: Callable[[], None] | None,
) -> Any:
    token = _THREADS.set((pool, on_abandon)) if pool is not None else None
    try:
        coro = make()  # inside the context: a wrapper's inner calls see the pool
        if timeout_s is None:
            return await coro
        return await asyncio.wait_for(coro, timeout_s)
    except EnvError:
        raise
    except TimeoutError as e:
        threads = _THREADS.get()
        where = threads[0] if threads is not None else None
        note = f" ({where.describe()})" if where is not None and where.at_cap else ""
        raise EnvError(
            f"env {env_name(env)} did not answer {what} within {timeout_s:g}s; the call was abandoned{note}. "
            "Raise the env timeout (RolloutConfig.env_timeout_s) if the env is just slow, or fix the env"
        ) from e
    except asyncio.CancelledError:
        raise
    except Exception as e:  # any env bug ends the trajectory failed, with the cause chained
        raise EnvError(f"env {env_name(env)} raised in {what}: {type(e).__name__}: {e}") from e
    finally:
        if token is not None:
            _THREADS.reset(token)


async def env_reset(
    env: Any,
    seed: int | None = None,
    *,
    timeout_s: float | None = None,
    pool: BlockingPool | None = None,
    on_abandon: Callable[[], None] | None = None,
) -> tuple[str, dict]:
    """Reset ``env`` from async code: its ``areset`` if defined, else ``reset`` on a pool thread.

    Args:
        env: any :class:`~rollart_nb.protocols.Env`.
        seed: the reset seed.
        timeout_s: give up after this many seconds (None: wait forever), abandoning a sync call.
        pool: where sync calls run, nested ones included (default: the enclosing call's pool,
            else :func:`default_pool`).
        on_abandon: called when a sync call of this reset is abandoned.

    Raises:
        EnvError: the env raised or timed out.
    """
    areset = getattr(env, "areset", None)
    make = (lambda: areset(seed)) if areset is not None else (lambda: _blocking(env.reset, seed))
    return _checked(await _bounded(make, env, "reset", timeout_s, pool, on_abandon), env, "reset", 2)


async def env_step(
    env: Any,
    action: str,
    *,
    timeout_s: float | None = None,
    pool: BlockingPool | None = None,
    on_abandon: Callable[[], None] | None = None,
) -> StepResult:
    """Step ``env`` from async code: its ``astep`` if defined, else ``step`` on a pool thread.

    Args:
        env: any :class:`~rollart_nb.protocols.Env`.
        action: the decoded model response.
        timeout_s / pool / on_abandon: as in :func:`env_reset`.

    Raises:
        EnvError: the env raised or timed out.
    """
    astep = getattr(env, "astep", None)
    make = (lambda: astep(action)) if astep is not None else (lambda: _blocking(env.step, action))
    return _checked(await _bounded(make, env, "step", timeout_s, pool, on_abandon), env, "step", 5)


def _checked(result: Any, env: Any, what: str, n: int) -> Any:
    """An env that returns the wrong shape fails here, as an env error, not later as a crash."""
    if not isinstance(result, tuple | list) or len(result) != n:
        shape = "(obs, info)" if n == 2 else "(obs, reward, terminated, truncated, info)"
        raise EnvError(f"env {env_name(env)} {what} returned {type(result).__name__} {result!r:.80}, expected {shape}")
    return tuple(result)


class EnvWrapper:
    """Base of env wrappers: forwards the env hints (``vocab``, ``max_turns``, ``shape``,
    ``validation_seeds``) explicitly, so a wrapped env looks like the env it wraps.

    Subclasses override ``reset``/``step`` and, for thread-free use, ``areset``/``astep``;
    the defaults here delegate to the wrapped env (async ones via :func:`env_reset`/
    :func:`env_step`, so an async inner env stays thread-free).
    """

    def __init__(self, env: Any) -> None:
        self.env = env

    @property
    def unwrapped(self) -> Any:
        """The innermost env."""
        return getattr(self.env, "unwrapped", self.env)

    @property
    def vocab(self) -> list[str]:
        return list(getattr(self.env, "vocab", []))

    @property
    def max_turns(self) -> int | None:
        return getattr(self.env, "max_turns", None)

    @property
    def shape(self) -> str:
        return getattr(self.env, "shape", "decode")

    def validation_seeds(self) -> list[int]:
        """The inner env's validation seeds, or ``range(16)`` when it declares none."""
        fn = getattr(self.env, "validation_seeds", None)
        return list(fn()) if callable(fn) else list(range(16))

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return self.env.reset(seed)

    def step(self, action: str) -> StepResult:
        return self.env.step(action)

    async def areset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        return await env_reset(self.env, seed)

    async def astep(self, action: str) -> StepResult:
        return await env_step(self.env, action)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.env!r})"
