"""ResourceManager: binds workers to pools by affinity, falls back instead of stalling.

``bind(role, index, prefer=...)`` checks the preferred pool's free slots and binds there;
if that pool is full or absent it falls back to a compatible pool (an explicit list, or by
default the other pools of the same kind: GPU -> GPU, CPU -> GPU hosts, serverless -> CPU).
Every binding is recorded in the metadata store as
``(worker, role, pool, node, hardware, fell_back, reason, time)``; bindings drive dispatch,
failover (:meth:`rebind`) and reconfiguration.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from rollart_nb.errors import NoCapacityError, UnknownPoolError
from rollart_nb.protocols import MetadataStore
from rollart_nb.resources.pools import Pool
from rollart_nb.resources.profiles import PROFILES

__all__ = ["Binding", "ResourceManager"]


@dataclass(frozen=True)
class Binding:
    """Where one worker runs and why.

    Attributes:
        worker: "<role>/<index>".
        role: cluster name (e.g. "actor_gen").
        index: worker rank in its cluster.
        pool: pool it is bound to.
        node: Ray node id.
        hardware: hardware profile name of the pool.
        fell_back: True when it is not on the preferred pool.
        reason: why it fell back (empty otherwise).
        time: unix time of the binding.
        prefer: the pool that was asked for.
        slots: pool slots it holds.
        resource: the Ray resource a slot consumes.
        simulated: True on a simulated pool.
    """

    worker: str
    role: str
    index: int
    pool: str
    node: str
    hardware: str
    fell_back: bool
    reason: str
    time: float
    prefer: str
    slots: float = 1.0
    resource: str = "GPU"
    simulated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ResourceManager:
    """Binds workers to pools and keeps the record in a metadata store.

    Args:
        pools: the session's pools (their ``used`` counts are kept up to date here).
        store: where bindings and the pool view are recorded.

    Example:
        >>> rm = ResourceManager(sess.pools, sess.store)            # doctest: +SKIP
        >>> rm.bind("actor_train", 0, prefer="H800").pool           # doctest: +SKIP
        'H800'
    """

    def __init__(self, pools: dict[str, Pool], store: MetadataStore) -> None:
        self.pools = pools
        self.store = store
        self._lock = threading.Lock()
        self._bindings: dict[str, Binding] = {}
        self._used: dict[tuple[str, str], float] = {}  # (pool, node) -> slots
        self.publish_pools()

    # -- queries ---------------------------------------------------------------------
    def bindings(self, role: str | None = None) -> list[Binding]:
        with self._lock:
            return [b for b in self._bindings.values() if role is None or b.role == role]

    def free(self, pool: str, node: str | None = None) -> float:
        p = self.pools[pool]
        nodes = [node] if node else p.nodes
        return sum(p.slots_per_node.get(n, 0.0) - self._used.get((pool, n), 0.0) for n in nodes)

    def compatible(self, prefer: str) -> list[str]:
        """Default fallback order for ``prefer``: same kind first, most free slots first."""
        kind = self._kind(prefer)
        order = {"gpu": ["gpu"], "cpu": ["cpu", "gpu"], "serverless": ["serverless", "cpu"]}.get(kind, [kind])
        out: list[str] = []
        for k in order:
            same = [n for n, p in self.pools.items() if p.hardware.kind == k and n != prefer]
            same.sort(key=lambda n: -self.free(n))
            out += same
        return out

    # -- binding ---------------------------------------------------------------------
    def check_pool_name(self, name: str) -> None:
        """Unknown names raise; a known hardware type absent from this cluster is allowed (fallback)."""
        if name in self.pools or name.upper() in PROFILES or name.lower() in ("cpu", "serverless"):
            return
        raise UnknownPoolError(
            f"unknown pool {name!r}; this session has pools {sorted(self.pools)} "
            f"(known hardware types: {sorted(PROFILES)})"
        )

    def bind(
        self,
        role: str,
        index: int,
        *,
        prefer: str,
        fallback: list[str] | None = None,
        slots: float = 1.0,
        exclude_nodes: frozenset[str] = frozenset(),
    ) -> Binding:
        """Bind worker ``role/index`` to ``prefer`` or, failing that, a compatible pool.

        Raises:
            UnknownPoolError: ``prefer`` or a fallback name is not a pool or known hardware type.
            NoCapacityError: no candidate pool has ``slots`` free on one node.
        """
        self.check_pool_name(prefer)
        for f in fallback or []:
            self.check_pool_name(f)
        candidates = [prefer] + (list(fallback) if fallback is not None else self.compatible(prefer))
        reasons: list[str] = []
        with self._lock:
            key = f"{role}/{index}"
            if key in self._bindings:
                self._release_locked(key)
            for pool_name in candidates:
                pool = self.pools.get(pool_name)
                if pool is None:
                    reasons.append(f"{pool_name} absent")
                    continue
                node = self._pick_node(pool, slots, exclude_nodes)
                if node is None:
                    used = sum(self._used.get((pool_name, n), 0.0) for n in pool.nodes)
                    reasons.append(f"{pool_name} full ({used:g}/{pool.capacity:g} slots used)")
                    continue
                b = Binding(
                    worker=key,
                    role=role,
                    index=index,
                    pool=pool_name,
                    node=node,
                    hardware=pool.hardware.name,
                    fell_back=pool_name != prefer,
                    reason="; ".join(reasons) if pool_name != prefer else "",
                    time=time.time(),
                    prefer=prefer,
                    slots=slots,
                    resource=pool.resource,
                    simulated=pool.simulated,
                )
                self._bindings[key] = b
                self._used[(pool_name, node)] = self._used.get((pool_name, node), 0.0) + slots
                pool.used += slots
                self.store.put(f"bindings/{key}", b.to_dict())
                self.publish_pools()
                return b
        raise NoCapacityError(
            f"no pool can host {role}/{index} ({slots:g} slot(s)): asked for {prefer!r}, tried "
            f"{', '.join(reasons) or 'nothing'}; pools: "
            + ", ".join(f"{n} {self.free(n):g}/{p.capacity:g} free" for n, p in self.pools.items())
            + ". Free slots (sess.close_cluster(name)), lower replicas, or add fallback pools."
        )

    def release(self, role: str, index: int | None = None) -> None:
        """Release one worker's binding, or every binding of ``role``."""
        with self._lock:
            keys = [k for k, b in self._bindings.items() if b.role == role and (index is None or b.index == index)]
            for k in keys:
                self._release_locked(k)
            self.publish_pools()

    def rebind(self, role: str, index: int, *, avoid_node: bool = True) -> Binding:
        """Failover: bind a dead worker's slot again, avoiding its old node when possible."""
        old = self._bindings.get(f"{role}/{index}")
        if old is None:
            raise UnknownPoolError(f"no binding for {role}/{index} to rebind")
        exclude = frozenset({old.node}) if avoid_node else frozenset()
        try:
            return self.bind(role, index, prefer=old.prefer, slots=old.slots, exclude_nodes=exclude)
        except NoCapacityError:
            return self.bind(role, index, prefer=old.prefer, slots=old.slots)

    def publish_pools(self) -> None:
        for name, p in self.pools.items():
            self.store.put(f"pools/{name}", {**p.to_dict(), "used": p.used, "capacity": p.capacity})

    # -- internals -------------------------------------------------------------------
    def _release_locked(self, key: str) -> None:
        b = self._bindings.pop(key)
        self._used[(b.pool, b.node)] = self._used.get((b.pool, b.node), 0.0) - b.slots
        self.pools[b.pool].used -= b.slots
        self.store.delete(f"bindings/{key}")

    def _pick_node(self, pool: Pool, slots: float, exclude: frozenset[str]) -> str | None:
        best, best_free = None, -1.0
        for node, cap in pool.slots_per_node.items():
            if node in exclude:
                continue
            free = cap - self._used.get((pool.name, node), 0.0)
            if free >= slots - 1e-9 and free > best_free:
                best, best_free = node, free
        return best

    def _kind(self, name: str) -> str:
        if name in self.pools:
            return self.pools[name].hardware.kind
        if name.lower() == "serverless":
            return "serverless"
        if name.lower() == "cpu":
            return "cpu"
        return PROFILES[name.upper()].kind
