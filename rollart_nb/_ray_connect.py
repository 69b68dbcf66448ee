"""Starting, joining and leaving Ray: where it listens, who may talk to it, what it prints.

Measured pitfalls handled here:
- A plain local ``ray.init()`` listens on every interface and runs anyone's code without token
  auth: a local session binds Ray to 127.0.0.1 and turns token authentication on with a token
  of its own (a 0600 file its workers find through ``RAY_AUTH_TOKEN_PATH``). Ray's process-wide
  auth caches are refreshed when a session changes them and restored when it ends.
- A killed cluster leaves ``ray_current_cluster`` behind: local sessions pass ``address="local"``.
- A client pointed at no cluster, a non-Ray port or another Ray version retries for minutes:
  every connect first asks over gRPC with a deadline and stops with a ConnectError.
- Ray's Serve chatter and retried-task notices stay out of notebook cells unless a session
  forwards worker output (:func:`quiet_serve_logs`, :data:`RETRY_NOTICES_ENV`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from rollart_nb._ray import LOOPBACK_ENV, _short, is_initialized, ray
from rollart_nb.errors import ConnectError, StateError

log = logging.getLogger(__name__)

RETRY_NOTICES_ENV = "RAY_enable_output_error_log_if_still_retry"
"""Ray's switch for printing "Task X failed. There are N retries remaining, so the task will be
retried" on the driver; a quiet session sets it to "0" unless it is set already."""
_ENV_KEYS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", LOOPBACK_ENV, RETRY_NOTICES_ENV)
_saved_env: dict[str, str | None] | None = None
_auth_dir: str | None = None
TOKEN_ENV = "RAY_AUTH_TOKEN"
"""Where :meth:`Session.attach` looks for a cluster's token by default (Ray's own variable)."""


def _apply_env(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _set_env(values: dict[str, str | None]) -> None:
    """Set Ray's auth/bind variables for this process and its children (restored by shutdown)."""
    global _saved_env
    if _saved_env is None:
        _saved_env = {k: os.environ.get(k) for k in _ENV_KEYS}
    _apply_env(values)
    _refresh_ray_config()


def _use_token(token: str, log_to_driver: bool, extra: dict[str, str | None] | None = None) -> None:
    """Authenticate this process and its workers with ``token`` (kept in a private file); keep
    Ray's chatter quiet unless ``log_to_driver``."""
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": _write_token(token), "RAY_AUTH_TOKEN": None}
    _set_env({**auth, **(extra or {}), **_retry_notices_env(quiet=not log_to_driver)})
    quiet_serve_logs(not log_to_driver)


def _retry_notices_env(quiet: bool) -> dict[str, str | None]:
    """:data:`RETRY_NOTICES_ENV` for a session: off when ``quiet``, unless the user chose already."""
    current = os.environ.get(RETRY_NOTICES_ENV)
    return {RETRY_NOTICES_ENV: "0" if quiet and current is None else current}


SERVE_LOGGER = "ray.serve"


class _BelowWarning(logging.Filter):
    """Passes WARNING and above only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


_SERVE_INFO_FILTER = _BelowWarning("")


def quiet_serve_logs(quiet: bool = True) -> None:
    """Keep Ray Serve's INFO lines out of this process's output (``quiet=False``: let them back).

    ``import ray.serve`` gives the ``ray.serve`` logger a stderr handler and sets its level to
    INFO, so a level set beforehand does not last; a filter on the logger does. Warnings and
    errors still pass. Replicas and the controller log to their own files (and reach the driver
    only with ``log_to_driver``).
    """
    logger = logging.getLogger(SERVE_LOGGER)
    if quiet:
        logger.addFilter(_SERVE_INFO_FILTER)  # added once however often this is called
    else:
        logger.removeFilter(_SERVE_INFO_FILTER)


def _refresh_ray_config() -> None:
    # Ray reads these once (a module constant, a C++ config, a cached token): re-read them.
    from ray._private import ray_constants
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # not in _raylet.pyi

    ray_constants.ENABLE_RAY_CLUSTER = os.environ.get(LOOPBACK_ENV, "1").lower() not in ("0", "false")
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def restore_env() -> None:
    """Undo :func:`_set_env` and delete the session's token file."""
    global _saved_env, _auth_dir
    if _saved_env is not None:
        saved, _saved_env = _saved_env, None
        _apply_env(saved)
        with contextlib.suppress(Exception):
            _refresh_ray_config()
    if _auth_dir is not None:
        shutil.rmtree(_auth_dir, ignore_errors=True)
        _auth_dir = None


_OWNER = "owner.json"
"""In a session's auth directory: the pid and start time of the process that started its Ray, so
a later session can tell that it died without closing (see :func:`clean_stale`)."""


def _proc_start(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks since boot), or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _write_token(token: str) -> str:
    """Keep ``token`` in a file only this user can read; returns its path."""
    global _auth_dir
    if _auth_dir is None:
        _auth_dir = tempfile.mkdtemp(prefix="rollart_auth_")  # mode 0700
        with open(os.path.join(_auth_dir, _OWNER), "w") as f:
            json.dump({"pid": os.getpid(), "start": _proc_start(os.getpid())}, f)
    path = os.path.join(_auth_dir, "token")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return path


def clean_stale() -> list[dict[str, Any]]:
    """Clean up after local sessions whose process died without closing (a killed kernel, a
    SIGKILLed script): stop the Ray processes they left running (Ray's dashboard and runtime-env
    agents outlive a killed driver) and delete their auth token. Returns what was cleaned, one
    dict per dead session: ``driver_pid``, ``processes`` (names of those stopped), ``token_dir``.

    A session is recognised by its auth directory's owner record; its processes by the token
    path in their environment. Sessions of live processes, and directories without a record,
    are left alone.
    """
    if not os.path.isdir("/proc"):
        return []
    out = []
    for d in sorted(Path(tempfile.gettempdir()).glob("rollart_auth_*")):
        if str(d) == _auth_dir:
            continue
        try:
            owner = json.loads((d / _OWNER).read_text())
            pid, start = int(owner["pid"]), owner["start"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if start is not None and _proc_start(pid) == start:
            continue  # its session is alive
        entry = f"RAY_AUTH_TOKEN_PATH={d / 'token'}".encode()
        stopped = []
        for p in os.listdir("/proc"):
            if not p.isdigit() or int(p) == os.getpid():
                continue
            try:
                with open(f"/proc/{p}/environ", "rb") as f:
                    if entry not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{p}/comm") as f:
                    name = f.read().strip()
                os.kill(int(p), 9)
                stopped.append(name)
            except (OSError, ProcessLookupError):
                continue
        shutil.rmtree(d, ignore_errors=True)
        out.append({"driver_pid": pid, "processes": stopped, "token_dir": str(d)})
        log.warning(
            "cleaned up after a local Ray session whose process (pid %d) died without closing: stopped %d "
            "leftover process(es)%s and deleted its auth token",
            pid,
            len(stopped),
            f" ({', '.join(sorted(set(stopped)))})" if stopped else "",
        )
    return out


def token_path() -> str | None:
    """The file that holds the current session's Ray token (None when auth is off)."""
    return os.environ.get("RAY_AUTH_TOKEN_PATH") if os.environ.get("RAY_AUTH_MODE") == "token" else None


def _existing_token() -> str | None:
    """A token the user already gave Ray (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    for p in (os.environ.get("RAY_AUTH_TOKEN_PATH"), str(Path.home() / ".ray" / "auth_token")):
        if p and os.path.isfile(p):
            with contextlib.suppress(OSError):
                return Path(p).read_text().strip() or None
    return None


def start_local(
    *,
    num_cpus: int | None,
    resources: dict[str, float],
    namespace: str,
    log_to_driver: bool,
    object_store_memory: int | None = None,
    expose: str | None = None,
) -> dict[str, Any]:
    """Start a fresh single-node Ray here (never joins a stale or foreign cluster).

    It listens on 127.0.0.1 only, unless ``expose`` names this node's address (or "auto");
    token authentication is on either way, with a fresh token (see :func:`token_path`).
    Without ``log_to_driver``, Ray Serve's INFO lines and Ray's retry notices stay quiet here
    (see the module docstring).
    """
    if is_initialized():
        raise StateError(
            "Ray is already initialized in this process (not by a rollart_nb Session); "
            "call ray.shutdown() first, or use rn.Session.attach(...) to use that cluster."
        )
    restore_env()  # a session that died without closing left its settings behind
    cleaned = clean_stale()  # ... or, in another process, its Ray agents and token
    _use_token(secrets.token_hex(32), log_to_driver, {LOOPBACK_ENV: "0" if expose is None else "1"})
    extra: dict[str, Any] = {}
    if expose not in (None, "auto"):
        extra["_node_ip_address"] = expose
    for attempt in range(3):
        try:
            ctx = ray().init(
                address="local",
                num_cpus=num_cpus,
                resources=resources,
                namespace=namespace,
                include_dashboard=False,
                log_to_driver=log_to_driver,
                object_store_memory=object_store_memory,
                configure_logging=False,
                **extra,
            )
            return {**ctx.address_info, "rollart_cleaned": cleaned}
        except Exception as e:
            # Ray waits a fixed 30 s for its raylet; on an overloaded machine that can lapse.
            if "timed out during startup" not in str(e) or attempt == 2:
                shutdown()
                raise ConnectError(f"could not start a local Ray instance: {_short(e)}") from e
            log.warning("Ray start timed out (machine busy?); retrying (%d/2)", attempt + 1)
            with contextlib.suppress(Exception):
                ray().shutdown()
            time.sleep(2.0)
    raise AssertionError("unreachable")


def _host_port(address: str) -> tuple[str, int] | None:
    addr = address.removeprefix("ray://")
    if ":" not in addr:
        return None
    host, _, port = addr.rpartition(":")
    try:
        return host or "127.0.0.1", int(port)
    except ValueError:
        return None


def _current_cluster_address() -> str | None:
    """Address of the cluster `ray start` left in the temp dir (may be stale)."""
    env = os.environ.get("RAY_ADDRESS")
    if env and env != "auto":
        return env
    for base in {tempfile.gettempdir(), "/tmp"}:
        f = Path(base) / "ray" / "ray_current_cluster"
        if f.exists():
            txt = f.read_text().strip()
            if txt:
                return txt
    return None


def probe(address: str, timeout_s: float) -> None:
    """Raise ConnectError unless ``address``'s TCP port answers within ``timeout_s``; at once
    when the connection is refused (the host is up, nothing listens there)."""
    hp = _host_port(address)
    if hp is None:
        raise ConnectError(f"cannot parse Ray address {address!r}; use 'auto', 'host:6379' or 'ray://host:10001'")
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(hp, timeout=min(1.0, timeout_s)):
                return
        except ConnectionRefusedError:
            # the host answered: nothing listens on that port, and waiting will not change it
            raise ConnectError(
                f"connection refused at {address}: the host is up but nothing listens on port {hp[1]}. "
                "Check that the head node runs (`ray status` there), that the port is the GCS port "
                "`ray start --head` printed (default 6379; 10001 for ray://), and that no firewall rejects it"
            ) from None
        except OSError as e:
            last = e
            time.sleep(0.2)
    raise ConnectError(
        f"no Ray cluster answers at {address} within {timeout_s:.0f}s ({last}); start one with "
        "`ray start --head` or check the address, or use rn.Session.local() for an embedded one"
    )


def _refusal(code_name: str, address: str, token: str | None) -> str:
    if token:
        return (
            f"the Ray cluster at {address} refused the token ({code_name}); pass the cluster's own "
            "token: Session.attach(..., token=...) or the variable named by token_env (on the head "
            "node, `ray get-auth-token` prints it)"
        )
    return (
        f"the Ray cluster at {address} requires a token ({code_name}); pass Session.attach(..., "
        f"token=...) or set {TOKEN_ENV} (on the head node, `ray get-auth-token` prints it)"
    )


def preflight(address: str, *, token: str | None, timeout_s: float) -> None:
    """Ask the cluster one question over gRPC with a deadline before Ray's own connect.

    Raises ConnectError within about ``timeout_s`` if nothing answers, if what answers is not a
    Ray GCS (or Ray Client server), if it refuses the token, or if its Ray version differs.
    """
    import grpc

    deadline = time.monotonic() + timeout_s
    probe(address, timeout_s)
    hp = _host_port(address)
    assert hp is not None  # probe checked
    client = address.startswith("ray://")
    what = "Ray Client server" if client else "Ray GCS"
    channel = grpc.insecure_channel(f"[{hp[0]}]:{hp[1]}" if ":" in hp[0] else f"{hp[0]}:{hp[1]}")
    try:
        try:
            grpc.channel_ready_future(channel).result(timeout=max(0.1, deadline - time.monotonic()))
        except grpc.FutureTimeoutError:
            raise ConnectError(
                f"{address} accepts TCP connections but no gRPC answer came within {timeout_s:g}s: it is not "
                f"a {what} port (check the address: `ray start --head` prints it)"
            ) from None
        try:
            theirs = _ask_version(channel, client, token, max(0.1, deadline - time.monotonic()))
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            name = getattr(code, "name", "error")
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise ConnectError(_refusal(name, address, token)) from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise ConnectError(f"the {what} at {address} did not answer within {timeout_s:g}s") from None
            raise ConnectError(
                f"{address} answered gRPC but not as a {what} of this Ray version ({name}); check the address "
                f"and that the cluster runs Ray {ray().__version__}"
            ) from None
        if theirs and theirs != ray().__version__:
            raise ConnectError(
                f"the cluster at {address} runs Ray {theirs}, this process Ray {ray().__version__}; "
                f"install ray=={theirs} here (drivers and clusters must match)"
            )
    finally:
        channel.close()


def _ask_version(channel: Any, client: bool, token: str | None, timeout: float) -> str | None:
    """One RPC on ``channel``: a Ray Client server's ping (None: it tells no version), or the
    GCS's cluster metadata, whose ``ray_version`` this returns. Raises ``grpc.RpcError``."""
    meta = [("authorization", f"Bearer {token}")] if token else []
    if client:
        from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc

        ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(
            ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING),  # type: ignore[attr-defined]
            timeout=timeout,
            metadata=meta,
        )
        return None
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    reply = gcs_service_pb2_grpc.InternalKVGcsServiceStub(channel).InternalKVGet(
        gcs_service_pb2.InternalKVGetRequest(key=b"CLUSTER_METADATA", namespace=b"cluster"),  # type: ignore[attr-defined]  # generated protobuf
        timeout=timeout,
        metadata=meta,
    )
    try:
        return json.loads(reply.value.decode()).get("ray_version") if reply.value else None
    except (ValueError, UnicodeDecodeError):
        return None


def _token_if_required(address: str, timeout_s: float) -> str | None:
    """A token the user already gave Ray (:func:`_existing_token`), if the cluster asks for one;
    ``""`` when one was found but the cluster runs without authentication, None when none was.

    A token left in ``~/.ray/auth_token`` (Ray writes one there when a plain ``ray.init()`` turns
    authentication on) would put this driver in token mode against a cluster without
    authentication, where Ray cancels every actor it creates.
    """
    found = _existing_token()
    if found is None:
        return None
    try:
        preflight(address, token=None, timeout_s=timeout_s)
    except ConnectError as e:
        if "requires a token" in str(e):
            return found
        raise
    log.info("the cluster at %s runs without authentication; the token found here is not used", address)
    return ""


def connect(address: str, *, namespace: str, timeout_s: float, log_to_driver: bool, token: str | None = None) -> str:
    """Join an existing cluster; returns the resolved address.

    ``token``: the cluster's Ray token (else the one in ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``
    or ``~/.ray/auth_token`` when the cluster asks for one, else none). It goes to a private
    file, never to a log.
    Without ``log_to_driver``, Ray Serve's INFO lines and Ray's retry notices stay quiet here.
    """
    if is_initialized():
        raise StateError(
            "Ray is already initialized in this process; close the other Session "
            "(or call ray.shutdown()) before attaching."
        )
    resolved = address
    if address == "auto":
        found = _current_cluster_address()
        if found is None:
            raise ConnectError(
                "address='auto' found no running Ray cluster on this machine; start one with "
                "`ray start --head` or pass its address"
            )
        resolved = found
    restore_env()
    deadline = time.monotonic() + timeout_s
    try:
        if token:
            _use_token(token.strip(), log_to_driver)
        else:
            token = _token_if_required(resolved, timeout_s)
            mode = "token" if token else "disabled" if token == "" else os.environ.get("RAY_AUTH_MODE", "disabled")
            token = token or None
            _set_env({"RAY_AUTH_MODE": mode, **_retry_notices_env(quiet=not log_to_driver)})
            quiet_serve_logs(not log_to_driver)
        preflight(resolved, token=token, timeout_s=max(0.1, deadline - time.monotonic()))
        while True:
            try:
                ray().init(
                    address=resolved,
                    namespace=namespace,
                    log_to_driver=log_to_driver,
                    configure_logging=False,
                )
                break
            except Exception as e:
                # A head that has just started answers the GCS before its raylet has registered.
                why = f"{e} {e.__cause__}"
                if "node info" not in why or time.monotonic() + 2.0 > deadline:
                    raise
                with contextlib.suppress(Exception):
                    ray().shutdown()
                time.sleep(1.0)
    except ConnectError:
        shutdown()
        raise
    except Exception as e:  # Ray raises ConnectionError, RuntimeError, ... depending on mode
        shutdown()
        if type(e).__name__ == "AuthenticationError":
            raise ConnectError(_refusal("AuthenticationError", resolved, token)) from None
        raise ConnectError(f"could not attach to the Ray cluster at {resolved}: {_short(e)}") from e
    return resolved


def shutdown() -> None:
    """Stop (or leave) Ray and restore the auth/bind and logging settings a session made."""
    if is_initialized():
        ray().shutdown()
    restore_env()
    quiet_serve_logs(False)
