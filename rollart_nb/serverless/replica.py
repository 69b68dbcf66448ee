"""What runs inside Ray Serve for a reward deployment: the replica and the counters it reports to.

Each replica answers the JSON contract of :mod:`rollart_nb.serverless.serve`; the counters live
in one actor of the manager's, so they outlive replicas that scale to zero.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import json
import logging
import os
import time
from typing import Any

import rollart_nb._ray as _ray
from rollart_nb.redact import redact
from rollart_nb.trajectory import Trajectory

__all__ = ["RewardReplica", "ServeStats"]


def _keep_replica_grpc_on_loopback() -> None:
    """On a loopback-only session, bind this replica's inter-deployment gRPC server to 127.0.0.1.

    Serve starts that server after the deployment's constructor, always on ``[::]:0`` (every
    interface, no authentication) and with no setting to change it; the proxy reaches replicas
    through Ray, so nothing here needs it on another interface.
    """
    if os.environ.get(_ray.LOOPBACK_ENV) != "0":  # an exposed or attached cluster
        return
    from ray.serve._private import replica

    add_port = replica.add_port_to_grpc_server
    if getattr(add_port, "loopback_only", False):
        return

    def loopback_port(server: Any, address: str) -> int:
        return add_port(server, "127.0.0.1:" + address[len("[::]:") :] if address.startswith("[::]:") else address)

    loopback_port.loopback_only = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = loopback_port


class RewardReplica:
    """One replica of a reward deployment (runs in a Serve replica actor).

    ``fn`` gets one :class:`Trajectory` (or, batched, a list). Its ``setup()``, if any, runs here
    once, so a judge model loads per replica rather than per request.
    """

    def __init__(
        self,
        fn: Any,
        name: str,
        version: int,
        token_digest: str | None,
        batched: bool,
        max_batch_size: int,
        batch_wait_s: float,
        stats: Any,
    ) -> None:
        t0 = time.perf_counter()
        _keep_replica_grpc_on_loopback()
        self.fn, self.name, self.version = fn, name, version
        self.token_digest, self.stats = token_digest, stats
        if callable(getattr(fn, "setup", None)):
            fn.setup()
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
        self.batch = None
        if batched:
            from ray import serve

            self.batch = serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=batch_wait_s)(self._run_batch)
        # Busy time is the union of request intervals, so utilization stays <= 1 per replica
        # even when requests overlap.
        self.ongoing, self.busy_since, self.busy_unreported = 0, 0.0, 0.0
        stats.replica_started.remote(name, version, time.perf_counter() - t0)

    async def _run(self, traj: Trajectory) -> Any:
        if self.is_async:
            return await self.fn(traj)
        return await asyncio.to_thread(self.fn, traj)  # keep the replica's loop answering

    async def _run_batch(self, trajs: list[Trajectory]) -> list[Any]:
        out = await self.fn(trajs) if self.is_async else await asyncio.to_thread(self.fn, trajs)
        if not isinstance(out, list | tuple) or len(out) != len(trajs):
            raise TypeError(
                f"batched reward returned {type(out).__name__} for {len(trajs)} trajectories; "
                "return a list with one value per trajectory"
            )
        return list(out)

    def _authorized(self, header: str | None) -> bool:
        if self.token_digest is None:
            return True
        scheme, _, token = (header or "").partition(" ")
        digest = hashlib.sha256(token.encode()).hexdigest()
        return scheme.lower() == "bearer" and hmac.compare_digest(digest, self.token_digest)

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import Response

        def answer(status: int, body: dict[str, Any]) -> Response:
            return Response(json.dumps(body, allow_nan=True), status_code=status, media_type="application/json")

        if not self._authorized(request.headers.get("authorization")):
            return answer(401, {"error": "missing or wrong bearer token"})
        try:
            body = await request.json()
            traj = Trajectory.from_dict(body["args"][0])
        except Exception as e:  # any malformed body is the caller's error, not the reward's
            return answer(
                400,
                {
                    "error": f"body must be {{'args': [trajectory dict], 'kwargs': {{}}}}: "
                    f"{type(e).__name__}: {redact(str(e))}"
                },
            )
        now = time.perf_counter()
        if self.ongoing == 0:
            self.busy_since = now
        self.ongoing += 1
        ok = True
        try:
            value = await (self.batch(traj) if self.batch is not None else self._run(traj))
            return answer(200, {"result": value, "version": self.version})
        except Exception as e:
            ok = False
            why = f"{type(e).__name__}: {redact(str(e))}"
            logging.getLogger(__name__).warning("reward %s v%d raised %s", self.name, self.version, why)
            return answer(500, {"error": why})
        finally:
            self.ongoing -= 1
            end = time.perf_counter()
            if self.ongoing == 0:
                self.busy_unreported += end - self.busy_since
            busy, self.busy_unreported = self.busy_unreported, 0.0
            self.stats.record.remote(self.name, ok, busy)  # fire and forget: off the request path


class ServeStats:
    """Counters that outlive replicas (a replica scaled to zero takes its own with it)."""

    def __init__(self) -> None:
        self.by_name: dict[str, dict[str, float]] = {}

    def _row(self, name: str) -> dict[str, float]:
        return self.by_name.setdefault(
            name, {"requests": 0, "errors": 0, "busy_s": 0.0, "replica_starts": 0, "init_s_total": 0.0}
        )

    def record(self, name: str, ok: bool, busy_s: float) -> None:
        row = self._row(name)
        row["requests"] += 1
        row["errors"] += 0 if ok else 1
        row["busy_s"] += busy_s

    def replica_started(self, name: str, version: int, init_s: float) -> None:
        row = self._row(name)
        row["replica_starts"] += 1
        row["init_s_total"] += init_s

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {k: dict(v) for k, v in self.by_name.items()}
