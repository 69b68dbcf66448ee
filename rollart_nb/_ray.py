"""Every Ray specific of rollart_nb lives here (and in the object-store weight transport).

The rest of the package calls these helpers, so a Ray API change or a Ray failure mode is
handled in one place, and Ray errors come out as :mod:`rollart_nb.errors` types.

Measured pitfalls handled here:
- Ray 2.60 turns on token authentication; clusters a session starts set
  ``RAY_AUTH_MODE=disabled`` so a second process can attach.
- A killed cluster leaves ``ray_current_cluster`` behind, and a bare ``ray.init()`` then
  tries to join the dead cluster: local sessions always pass ``address="local"``.
- A client pointed at a missing cluster hangs: every connect first probes the TCP port
  with a timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from rollart_nb.errors import ClusterError, ConnectError, StateError, WorkerDiedError

log = logging.getLogger(__name__)

POOL_RESOURCE_PREFIX = "rollart_pool_"
"""Custom Ray resource that stands for one slot of a simulated pool (``rollart_pool_H800``)."""

KV_NAMESPACE = "rollart_nb"


def ray():  # noqa: ANN201 - lazy import: nothing happens at `import rollart_nb`
    import ray as _ray

    return _ray


def is_initialized() -> bool:
    return ray().is_initialized()


def _auth_env() -> None:
    # Clusters we start (and clients we make) agree on "no token" unless the user chose.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def start_local(
    *,
    num_cpus: int | None,
    resources: dict[str, float],
    namespace: str,
    log_to_driver: bool,
    object_store_memory: int | None = None,
) -> dict[str, Any]:
    """Start a fresh single-node Ray here (never joins a stale or foreign cluster)."""
    _auth_env()
    if is_initialized():
        raise StateError(
            "Ray is already initialized in this process (not by a rollart_nb Session); "
            "call ray.shutdown() first, or use rn.Session.attach(...) to use that cluster."
        )
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
            )
            return dict(ctx.address_info)
        except Exception as e:
            # Ray waits a fixed 30 s for its raylet; on an overloaded machine that can lapse.
            if "timed out during startup" not in str(e) or attempt == 2:
                raise ConnectError(f"could not start a local Ray instance: {_short(e)}") from e
            log.warning("Ray start timed out (machine busy?); retrying (%d/2)", attempt + 1)
            shutdown()
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
    """Raise ConnectError unless ``address``'s TCP port answers within ``timeout_s``."""
    hp = _host_port(address)
    if hp is None:
        raise ConnectError(
            f"cannot parse Ray address {address!r}; use 'auto', 'host:6379' or 'ray://host:10001'"
        )
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(hp, timeout=min(1.0, timeout_s)):
                return
        except OSError as e:
            last = e
            time.sleep(0.2)
    raise ConnectError(
        f"no Ray cluster answers at {address} within {timeout_s:.0f}s ({last}); start one with "
        "`ray start --head` or check the address, or use rn.Session.local() for an embedded one"
    )


def connect(address: str, *, namespace: str, timeout_s: float, log_to_driver: bool) -> str:
    """Join an existing cluster; returns the resolved address."""
    _auth_env()
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
    probe(resolved, timeout_s)
    try:
        ray().init(
            address=resolved,
            namespace=namespace,
            log_to_driver=log_to_driver,
            configure_logging=False,
        )
    except Exception as e:  # Ray raises ConnectionError, RuntimeError, ... depending on mode
        raise ConnectError(f"could not attach to the Ray cluster at {resolved}: {e}") from e
    return resolved


def shutdown() -> None:
    if is_initialized():
        ray().shutdown()


def nodes() -> list[dict[str, Any]]:
    """Alive nodes as {"node_id", "ip", "resources"}."""
    out = []
    for n in ray().nodes():
        if n.get("Alive", n.get("alive")):
            out.append({"node_id": n["NodeID"], "ip": n.get("NodeManagerAddress", ""), "resources": n["Resources"]})
    return out


def current_node_id() -> str:
    return ray().get_runtime_context().get_node_id()


# -- metadata (GCS key-value store) -----------------------------------------------------
def kv_put(key: str, value: bytes) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key.encode(), value, overwrite=True, namespace=KV_NAMESPACE)


def kv_get(key: str) -> bytes | None:
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key.encode(), namespace=KV_NAMESPACE)


def kv_del(key: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key.encode(), namespace=KV_NAMESPACE)


def kv_keys(prefix: str) -> list[str]:
    from ray.experimental import internal_kv

    return sorted(k.decode() for k in internal_kv._internal_kv_list(prefix.encode(), namespace=KV_NAMESPACE))


# -- actors ------------------------------------------------------------------------------
def actor_options(*, node_id: str | None, num_gpus: float, resources: dict[str, float], name: str | None,
                  max_concurrency: int, num_cpus: float = 0) -> dict[str, Any]:
    """Options that pin an actor to a node and reserve its pool slot."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    opts: dict[str, Any] = {
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "resources": resources,
        "max_concurrency": max_concurrency,
        "max_restarts": 0,
    }
    if node_id:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    if name:
        opts["name"] = name
    return opts


def ship_by_value(cls: type) -> None:
    """Let workers unpickle ``cls`` even if its module is not importable there.

    Classes from notebooks (``__main__``), scripts and test files live in modules that Ray
    worker processes cannot import; installed packages can be imported by reference.
    """
    import sys

    mod = sys.modules.get(cls.__module__)
    file = getattr(mod, "__file__", None) or ""
    if mod is None or cls.__module__ == "__main__" or not file:
        return
    if cls.__module__.split(".")[0] in sys.stdlib_module_names:  # importable everywhere
        return
    pkg_dir = str(Path(__file__).resolve().parent)
    if "site-packages" in file or "dist-packages" in file or str(Path(file).resolve()).startswith(pkg_dir):
        return
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(mod)


def remote_class(cls: type, **options: Any):  # noqa: ANN201
    return ray().remote(cls).options(**options)


def kill(actor: Any) -> None:
    with contextlib.suppress(Exception):
        ray().kill(actor, no_restart=True)


def get(refs: Any, *, timeout_s: float | None = None, what: str = "", worker: str = "", pool: str = "") -> Any:
    """``ray.get`` with Ray's failures turned into rollart_nb errors that name a fix."""
    r = ray()
    try:
        return r.get(refs, timeout=timeout_s)
    except r.exceptions.GetTimeoutError as e:
        raise ClusterError(f"{what or 'call'} on {worker or 'workers'} did not finish within {timeout_s}s") from e
    except (r.exceptions.RayActorError, r.exceptions.ActorDiedError) as e:
        raise WorkerDiedError(
            f"worker {worker or '?'} (pool {pool or '?'}) died during {what or 'a call'}: {_short(e)}",
            worker=worker,
            pool=pool,
            fix="call cluster.restart_worker(index) to rebind it, or rebuild the cluster with sess.cluster(...)",
        ) from e
    except r.exceptions.RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        if isinstance(cause, Exception) and not isinstance(cause, r.exceptions.RayError):
            raise cause from None  # user code raised: surface the user's own exception type
        raise ClusterError(f"{what or 'call'} on {worker or 'workers'} failed: {_short(e)}") from e


def _short(e: BaseException, n: int = 300) -> str:
    """First line of a Ray error, plus the user's exception line when Ray buried it in a traceback."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    head = lines[0][:n]
    cause = next((ln.strip() for ln in reversed(lines) if re.match(r"^\s*\w+(Error|Exception)\b.*:", ln)), "")
    return f"{head} [{cause[:n]}]" if cause and cause not in head else head


async def aget(ref: Any) -> Any:
    """Await an ObjectRef (works inside Jupyter's running loop)."""
    return await ref


def wait(refs: list[Any], *, num_returns: int = 1, timeout_s: float | None = None) -> tuple[list[Any], list[Any]]:
    return ray().wait(refs, num_returns=num_returns, timeout=timeout_s)
