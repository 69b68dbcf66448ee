"""Every Ray specific of rollart_nb lives here, in :mod:`rollart_nb._ray_connect` (starting,
joining and leaving Ray) and in the object-store weight transport.

The rest of the package calls these helpers, so a Ray API change or a Ray failure mode is
handled in one place, and Ray errors come out as :mod:`rollart_nb.errors` types.
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path
from typing import Any

from rollart_nb.errors import ClusterError, WorkerDiedError

log = logging.getLogger(__name__)

POOL_RESOURCE_PREFIX = "rollart_pool_"
"""Custom Ray resource that stands for one slot of a simulated pool (``rollart_pool_H800``)."""

KV_NAMESPACE = "rollart_nb"

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to "0" in a loopback-only session (and its workers): Ray's node address is 127.0.0.1."""


def ray():  # noqa: ANN201 - lazy import: nothing happens at `import rollart_nb`
    import ray as _ray

    return _ray


def is_initialized() -> bool:
    return ray().is_initialized()


def nodes() -> list[dict[str, Any]]:
    """Alive nodes as {"node_id", "ip", "resources"}."""
    out = []
    for n in ray().nodes():
        if n.get("Alive", n.get("alive")):
            out.append({"node_id": n["NodeID"], "ip": n.get("NodeManagerAddress", ""), "resources": n["Resources"]})
    return out


def node_lost(node_id: str, timeout_s: float = 1.0) -> str | None:
    """Why node ``node_id`` is lost, or None while it is alive.

    The GCS notices a dead raylet only after its health checks fail (seconds to tens of
    seconds); until then a raylet that takes no TCP connection counts as lost too.
    """
    import socket

    for n in ray().nodes():
        if n["NodeID"] != node_id:
            continue
        if not n.get("Alive", n.get("alive")):
            return f"the GCS marks it dead: {n.get('DeathReasonMessage') or 'no reason given'}"
        where = (n.get("NodeManagerAddress", ""), int(n.get("NodeManagerPort", 0)))
        try:
            socket.create_connection(where, timeout=timeout_s).close()
            return None
        except OSError as e:
            return f"its raylet at {where[0]}:{where[1]} does not answer ({type(e).__name__})"
    return "the GCS no longer lists it"


def current_node_id() -> str:
    return ray().get_runtime_context().get_node_id()


def job_id() -> str:
    """This driver's Ray job id (hex); the GCS marks it dead when the driver exits or is killed."""
    return ray().get_runtime_context().get_job_id()


def dead_jobs() -> set[str] | None:
    """Ids of the jobs the GCS marks dead, or None where the job table cannot be read (Ray Client)."""
    try:
        from ray._private.state import state

        return {j["JobID"] for j in state.job_table() if j["IsDead"]}
    except Exception as e:
        log.debug("job table unreadable: %s", e)
        return None


def in_worker_process() -> bool:
    """True inside a Ray worker (an actor or task), False in a driver or without Ray."""
    import sys

    if "ray" not in sys.modules or not is_initialized():
        return False
    try:
        return ray().get_runtime_context().worker.mode == ray().WORKER_MODE
    except Exception:  # a Ray without this attribute: assume a driver (capture nothing)
        return False


# -- metadata (GCS key-value store) -----------------------------------------------------
def kv_put(key: str, value: bytes, overwrite: bool = True) -> bool:
    """Write ``key``; without ``overwrite`` only if it is absent. True if the value was written."""
    from ray.experimental import internal_kv

    existed = internal_kv._internal_kv_put(key.encode(), value, overwrite=overwrite, namespace=KV_NAMESPACE)
    return overwrite or not existed


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
def actor_options(
    *,
    node_id: str | None,
    num_gpus: float,
    resources: dict[str, float],
    name: str | None,
    max_concurrency: int,
    num_cpus: float = 0,
) -> dict[str, Any]:
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


_ACTORS: dict[str, tuple[str, str]] = {}
"""Actor id (hex) -> (worker, pool) of every worker a Cluster started: a death is named after the
worker that died, even when another worker's call is where it surfaced (an argument it produced)."""


def register_actor(actor: Any, worker: str, pool: str) -> None:
    """Remember which worker ``actor`` is, for error messages."""
    try:
        _ACTORS[actor._actor_id.hex()] = (worker, pool)
    except AttributeError:  # not a Ray actor handle
        pass


def actor_worker(e: BaseException) -> tuple[str, str] | None:
    """(worker, pool) of the actor a Ray actor error is about, if a Cluster started it."""
    return _ACTORS.get(getattr(e, "actor_id", None) or "")


def get(refs: Any, *, timeout_s: float | None = None, what: str = "", worker: str = "", pool: str = "") -> Any:
    """``ray.get`` with Ray's failures turned into rollart_nb errors that name a fix."""
    r = ray()
    try:
        return r.get(refs, timeout=timeout_s)
    except r.exceptions.GetTimeoutError as e:
        raise ClusterError(f"{what or 'call'} on {worker or 'workers'} did not finish within {timeout_s}s") from e
    except (r.exceptions.RayActorError, r.exceptions.ActorDiedError) as e:
        dead = actor_worker(e)
        where = ""
        if dead is not None and dead[0] != worker:  # e.g. the trainer, whose weights a generator was loading
            where = f" (seen by {worker or 'a call'})"
            worker, pool = dead
        raise WorkerDiedError(
            f"worker {worker or '?'} (pool {pool or '?'}) died during {what or 'a call'}{where}: {_short(e)}",
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
