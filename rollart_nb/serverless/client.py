"""HTTP client for serverless endpoints (Ray Serve, Knative, cloud functions).

Request ``{"args": [...], "kwargs": {...}}``, 2xx response ``{"result": <json>}``; other answers
raise :class:`ServerlessError`, and timeouts, 5xx and connection errors are retried with backoff.
The bearer token is read from an environment variable at call time and never shown in reprs,
logs or exceptions.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from rollart_nb.errors import ConfigError, ServerlessError
from rollart_nb.redact import redact, redact_url, register_secret

__all__ = ["Endpoint", "call", "acall"]

_RETRYABLE = (httpx.TimeoutException, httpx.TransportError)


@dataclass(frozen=True)
class Endpoint:
    """A registered serverless endpoint.

    Attributes:
        name: endpoint name (what ``register_serverless`` refers to).
        url: full URL to POST to.
        token_env: name of an environment variable holding a bearer token.
        timeout_s: per-request timeout.
        retries: retries after the first attempt on timeout / connection error / 5xx.
        backoff_s: first backoff; doubles each retry, with jitter.
    """

    name: str
    url: str
    token_env: str | None = None
    timeout_s: float = 30.0
    retries: int = 2
    backoff_s: float = 0.1

    def __post_init__(self) -> None:
        problems = []
        if not self.url.startswith(("http://", "https://")):
            problems.append(f"url {self.url!r} must start with http:// or https://")
        if self.timeout_s <= 0:
            problems.append(f"timeout_s={self.timeout_s} must be > 0")
        if self.retries < 0:
            problems.append(f"retries={self.retries} must be >= 0")
        if problems:
            raise ConfigError(problems, where=f"endpoint {self.name!r}")
        if self.token_env:
            register_secret(os.environ.get(self.token_env, ""))

    def __repr__(self) -> str:
        return (
            f"Endpoint(name={self.name!r}, url={redact_url(self.url)!r}, token_env={self.token_env!r}, "
            f"timeout_s={self.timeout_s}, retries={self.retries}, backoff_s={self.backoff_s})"
        )

    def headers(self) -> dict[str, str]:
        h = {"content-type": "application/json"}
        if self.token_env:
            tok = os.environ.get(self.token_env)
            if not tok:
                raise ConfigError(f"endpoint {self.name!r} wants a bearer token in ${self.token_env}, which is unset")
            register_secret(tok)
            h["authorization"] = f"Bearer {tok}"
        return h


def _check(ep: Endpoint, resp: httpx.Response) -> Any:
    if resp.status_code // 100 != 2:
        body = _body(resp)[:200].replace("\n", " ")
        raise ServerlessError(
            f"endpoint {ep.name!r} ({ep.url}) answered {resp.status_code}: {body}",
            url=ep.url,
            status=resp.status_code,
        )
    try:
        data = resp.json()
    except ValueError:
        raise ServerlessError(
            f"endpoint {ep.name!r} ({ep.url}) answered non-JSON: {_body(resp)[:120]!r}",
            url=ep.url,
            status=resp.status_code,
        ) from None
    if isinstance(data, dict) and "result" in data:
        return data["result"]
    return data


def _body(resp: httpx.Response) -> str:
    # Redact before cutting: a secret cut in half would no longer match.
    return redact(resp.text[:4000])


def _retryable_status(resp: httpx.Response) -> bool:
    return resp.status_code >= 500 or resp.status_code == 429


def _delay(ep: Endpoint, attempt: int) -> float:
    return ep.backoff_s * (2**attempt) * (0.5 + random.random())


def _gave_up(ep: Endpoint, last: Exception | None) -> ServerlessError:
    return ServerlessError(
        f"endpoint {ep.name!r} ({ep.url}) failed after {ep.retries + 1} attempt(s): "
        f"{type(last).__name__}; check the service is up, or raise timeout_s/retries",
        url=ep.url,
    )


def call(ep: Endpoint, args: list[Any], kwargs: dict[str, Any], client: httpx.Client | None = None) -> Any:
    """POST ``{"args", "kwargs"}`` to ``ep`` and return ``result``, with retries."""
    own = client is None
    client = client or httpx.Client(timeout=ep.timeout_s)
    try:
        last: Exception | None = None
        for attempt in range(ep.retries + 1):
            try:
                resp = client.post(
                    ep.url, json={"args": args, "kwargs": kwargs}, headers=ep.headers(), timeout=ep.timeout_s
                )
                if _retryable_status(resp) and attempt < ep.retries:
                    time.sleep(_delay(ep, attempt))
                    continue
                return _check(ep, resp)
            except _RETRYABLE as e:
                last = e
                if attempt < ep.retries:
                    time.sleep(_delay(ep, attempt))
        raise _gave_up(ep, last)
    finally:
        if own:
            client.close()


async def acall(ep: Endpoint, args: list[Any], kwargs: dict[str, Any], client: httpx.AsyncClient | None = None) -> Any:
    """Async :func:`call` (for the asyncio EnvManager / reward paths)."""
    own = client is None
    client = client or httpx.AsyncClient(timeout=ep.timeout_s)
    try:
        last: Exception | None = None
        for attempt in range(ep.retries + 1):
            try:
                resp = await client.post(
                    ep.url, json={"args": args, "kwargs": kwargs}, headers=ep.headers(), timeout=ep.timeout_s
                )
                if _retryable_status(resp) and attempt < ep.retries:
                    await asyncio.sleep(_delay(ep, attempt))
                    continue
                return _check(ep, resp)
            except _RETRYABLE as e:
                last = e
                if attempt < ep.retries:
                    await asyncio.sleep(_delay(ep, attempt))
        raise _gave_up(ep, last)
    finally:
        if own:
            await client.aclose()
