"""RemoteEnv: an env served by ``rollart-nb env-server`` (protocol in :mod:`rollart_nb.envs.server`).

Sync and async, like any env. Only failures to *connect* are retried (a step is never sent
twice); every failure is an :class:`~rollart_nb.errors.EnvError` naming the URL and call.
Bound to a launcher it puts each episode on the healthy replica with the fewest open episodes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from typing import Any

from rollart_nb.errors import EnvError

__all__ = ["RemoteEnv"]

log = logging.getLogger(__name__)

_OPEN: Counter[str] = Counter()  # url -> episodes this process has open there (least-loaded pick)
_TURN = itertools.count()  # round-robin tie-break, shared by all RemoteEnvs of this process


_IS_IT_UP = "is the env server up? (GET <url>/v1/health; rollart-nb env-server --help)"


class _Retryable(Exception):
    """The request never reached the env (connection refused, replica at capacity): safe to resend."""


class RemoteEnv:
    """A text env behind an env server.

    Args:
        url: base URL of one env server (``http://127.0.0.1:8000``); or give ``launcher``.
        launcher: a launcher (:class:`~rollart_nb.envs.LocalLauncher`,
            :class:`~rollart_nb.envs.KubernetesLauncher`) or its ``handle()``: each episode goes
            to one of its healthy replicas.
        timeout_s: seconds to wait for an answer (a slow env step fails the trajectory after it).
        connect_timeout_s: seconds to wait for a connection.
        connect_retries: extra attempts when the connection fails (never for a sent request).
        retry_backoff_s: first pause between attempts (doubles each time).

    Example:
        >>> env = RemoteEnv("http://127.0.0.1:8000")                          # doctest: +SKIP
        >>> obs, info = env.reset(seed=0)                                     # doctest: +SKIP
        >>> obs, reward, terminated, truncated, info = env.step("right")      # doctest: +SKIP
        >>> info["replica"]                                                    # doctest: +SKIP
        'vm:8000'
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        launcher: Any = None,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        connect_retries: int = 3,
        retry_backoff_s: float = 0.2,
    ) -> None:
        from rollart_nb.errors import ConfigError

        if (url is None) == (launcher is None):
            raise ConfigError("give a url or a launcher (not both)", where="RemoteEnv")
        if timeout_s <= 0 or connect_timeout_s <= 0 or connect_retries < 0:
            raise ConfigError("timeouts must be > 0 and connect_retries >= 0", where="RemoteEnv")
        self.url = url.rstrip("/") if url else None
        self.launcher = launcher
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.connect_retries, self.retry_backoff_s = connect_retries, retry_backoff_s
        self._meta: dict[str, Any] | None = None
        self._reset_live()

    def _reset_live(self) -> None:
        """Drop per-instance live state: clients and the open episode."""
        self._client: Any = None
        self._aclient: Any = None
        self._aloop: Any = None
        self._episode: tuple[str, str, str] | None = None  # (base url, episode id, replica)

    # -- pickling / copying: a copy never shares a client or an episode -----------------------
    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_client", "_aclient", "_aloop", "_episode")}
        handle = getattr(self.launcher, "handle", None)
        if callable(handle):  # a launcher owns processes/threads: copies get its small handle
            state["launcher"] = handle()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_live()

    # -- env hints from /v1/metadata ---------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        """The server's ``/v1/metadata`` (fetched once, then cached)."""
        if self._meta is None:
            base = self._candidates()[0][1]
            try:
                self._meta = self._sync("GET", base, "/v1/metadata", "metadata", retry=True)
            except _Retryable as e:
                raise self._error("metadata", base, f"{e}; {_IS_IT_UP}") from e
        return self._meta

    @property
    def vocab(self) -> list[str]:
        return list(self.metadata().get("vocab") or [])

    @property
    def max_turns(self) -> int | None:
        return self.metadata().get("max_turns")

    @property
    def shape(self) -> str:
        return self.metadata().get("shape") or "decode"

    def validation_seeds(self) -> list[int]:
        """The served env's validation seeds, or ``range(16)`` when it declares none."""
        seeds = self.metadata().get("validation_seeds")
        return list(seeds) if seeds is not None else list(range(16))

    # -- sync env protocol -------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._drop_episode()
        last: Exception | None = None
        cands = self._candidates()
        for i, (replica, base) in enumerate(cands):
            try:  # other replicas first; the last one gets the connect retries
                out = self._sync("POST", base, "/v1/episodes", "reset", {"seed": seed}, retry=i == len(cands) - 1)
            except _Retryable as e:  # this replica is down or full: try the next one
                last = e
                continue
            return self._opened(base, replica, out)
        raise self._error("reset", self._where(), f"{last}; {_IS_IT_UP}")

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        base, eid, replica = self._current()
        try:
            out = self._sync("POST", base, f"/v1/episodes/{eid}/step", "step", {"action": action}, retry=True)
        except _Retryable as e:
            self._close_local()  # see _close_local: the episode's state is unknown now
            raise self._error("step", base, str(e)) from e
        except BaseException:  # EnvError, or cancelled by a timeout
            self._close_local()
            raise
        return self._stepped(out, replica)

    # -- async env protocol ------------------------------------------------------------------
    async def areset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        await self._adrop_episode()
        last: Exception | None = None
        cands = self._candidates()
        for i, (replica, base) in enumerate(cands):
            try:  # as in reset
                out = await self._async(
                    "POST", base, "/v1/episodes", "reset", {"seed": seed}, retry=i == len(cands) - 1
                )
            except _Retryable as e:
                last = e
                continue
            return self._opened(base, replica, out)
        raise self._error("reset", self._where(), f"{last}; {_IS_IT_UP}")

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        base, eid, replica = self._current()
        try:
            out = await self._async("POST", base, f"/v1/episodes/{eid}/step", "step", {"action": action}, retry=True)
        except _Retryable as e:
            self._close_local()  # see _close_local: the episode's state is unknown now
            raise self._error("step", base, str(e)) from e
        except BaseException:  # EnvError, or cancelled by a timeout
            self._close_local()
            raise
        return self._stepped(out, replica)

    def close(self) -> None:
        """End the open episode (best effort) and close the HTTP clients."""
        self._drop_episode()
        if self._client is not None:
            self._client.close()
        self._client = None

    async def aclose(self) -> None:
        await self._adrop_episode()
        if self._aclient is not None:
            await self._aclient.aclose()
        self._aclient = self._aloop = None

    # -- episodes ----------------------------------------------------------------------------
    def _candidates(self) -> list[tuple[str, str]]:
        """(replica id, url) to try for a new episode, best first."""
        if self.url is not None:
            return [("", self.url)]
        source = self.launcher.handle() if callable(getattr(self.launcher, "handle", None)) else self.launcher
        try:
            reps = list(source.replicas())
        except Exception as e:  # e.g. the Kubernetes API: the trajectory fails, the rollout goes on
            raise EnvError(f"remote env: cannot list the replicas of {source!r}: {type(e).__name__}: {e}") from e
        if not reps:
            raise EnvError(
                f"remote env: no healthy replica of {source!r}; start the launcher "
                "(launcher.start()) or check its replicas (display the launcher)"
            )
        turn = next(_TURN)
        order = sorted(range(len(reps)), key=lambda i: (_OPEN[reps[i][1]], (i - turn) % len(reps)))
        return [reps[i] for i in order]

    def _where(self) -> str:
        return self.url or repr(self.launcher)

    def _opened(self, base: str, replica: str, out: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        replica = out.get("replica") or replica or base
        self._episode = (base, out["episode_id"], replica)
        _OPEN[base] += 1
        info = dict(out.get("info") or {})
        info["replica"] = replica
        return out["obs"], info

    def _stepped(self, out: dict[str, Any], replica: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        info = dict(out.get("info") or {})
        info["replica"] = out.get("replica") or replica
        if out["terminated"] or out["truncated"]:
            self._close_local()  # the server closes finished episodes itself
        return out["obs"], float(out["reward"]), bool(out["terminated"]), bool(out["truncated"]), info

    def _current(self) -> tuple[str, str, str]:
        if self._episode is None:
            raise EnvError(f"remote env {self._where()}: step without an open episode; call reset() first")
        return self._episode

    def _close_local(self) -> tuple[str, str, str] | None:
        """Forget the open episode here. After a failed or cancelled step its state is unknown;
        the server closes it itself (an env that raised) or expires it."""
        ep, self._episode = self._episode, None
        if ep is not None:
            _OPEN[ep[0]] -= 1
            if _OPEN[ep[0]] <= 0:
                del _OPEN[ep[0]]
        return ep

    def _drop_episode(self) -> None:
        ep = self._close_local()
        if ep is not None:  # an unfinished episode: free its slot on the server now, not at expiry
            try:
                self._sync("DELETE", ep[0], f"/v1/episodes/{ep[1]}", "close", retry=False)
            except (EnvError, _Retryable) as e:  # the server expires it; this must not fail the next reset
                log.debug("closing episode %s on %s: %s", ep[1], ep[0], e)

    async def _adrop_episode(self) -> None:
        ep = self._close_local()
        if ep is not None:
            try:
                await self._async("DELETE", ep[0], f"/v1/episodes/{ep[1]}", "close", retry=False)
            except (EnvError, _Retryable) as e:  # as in _drop_episode
                log.debug("closing episode %s on %s: %s", ep[1], ep[0], e)

    # -- HTTP --------------------------------------------------------------------------------
    def _timeout(self) -> Any:
        import httpx

        return httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s)

    def _sync(self, method: str, base: str, path: str, call: str, body: Any = None, *, retry: bool) -> Any:
        import httpx

        if self._client is None:
            self._client = httpx.Client(timeout=self._timeout())
        for attempt in range(self.connect_retries + 1 if retry else 1):
            try:
                return self._answer(self._client.request(method, base + path, json=body), base, call)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, _Retryable) as e:
                if attempt == self.connect_retries or not retry:
                    raise _Retryable(f"{base}: {_reason(e)}") from e
                time.sleep(self.retry_backoff_s * 2**attempt)
            except httpx.HTTPError as e:
                raise self._error(call, base, _reason(e)) from e
        raise AssertionError("unreachable")

    async def _async(self, method: str, base: str, path: str, call: str, body: Any = None, *, retry: bool) -> Any:
        import httpx

        loop = asyncio.get_running_loop()
        if self._aclient is None or self._aloop is not loop:  # a client is bound to the loop it ran on
            self._aclient, self._aloop = httpx.AsyncClient(timeout=self._timeout()), loop
        for attempt in range(self.connect_retries + 1 if retry else 1):
            try:
                return self._answer(await self._aclient.request(method, base + path, json=body), base, call)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, _Retryable) as e:
                if attempt == self.connect_retries or not retry:
                    raise _Retryable(f"{base}: {_reason(e)}") from e
                await asyncio.sleep(self.retry_backoff_s * 2**attempt)
            except httpx.HTTPError as e:
                raise self._error(call, base, _reason(e)) from e
        raise AssertionError("unreachable")

    def _answer(self, r: Any, base: str, call: str) -> Any:
        if r.status_code == 503 and call == "reset":
            raise _Retryable(f"{base}: at capacity ({_message(r)})")  # no episode was created
        if r.status_code >= 400:
            raise self._error(call, base, f"HTTP {r.status_code}: {_message(r)}")
        if r.status_code == 204:
            return None
        try:
            return r.json()
        except ValueError as e:
            raise self._error(call, base, f"answer is not JSON: {r.text[:200]!r}") from e

    def _error(self, call: str, where: str, reason: str) -> EnvError:
        return EnvError(f"remote env {where} failed in {call}: {reason}")

    def __repr__(self) -> str:
        return f"RemoteEnv({self._where()})"


def _reason(e: Exception) -> str:
    import httpx

    if isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout | httpx.PoolTimeout):
        return f"no answer in time ({type(e).__name__}); raise timeout_s or fix the env"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _message(r: Any) -> str:
    try:
        err = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return r.text[:300]
    msg = f"{err.get('type', '?')}: {err.get('message', '')}"
    if err.get("where"):
        msg += f" (at {err['where']})"
    return msg
