"""ResourceManager: binds workers to pools by affinity, falls back instead of stalling.

``bind(role, index, prefer=...)`` checks the preferred pool's free slots and binds there;
if that pool is full or absent it falls back to a compatible pool (an explicit list, or by
default the other pools of the same kind: GPU -> GPU, CPU -> GPU hosts, serverless -> CPU).
Every binding is recorded in the metadata store as
``(worker, role, pool, node, hardware, fell_back, reason, time)``; bindings drive dispatch,
failover (:meth:`rebind`) and reconfiguration.

Sessions that share a Ray cluster share its pools: each session's holdings (worker, pool, node,
slots) are one record under ``holders/<session id>`` in the cluster-wide ``shared`` store, written
under a short cluster-wide lock, and every bind first reads the others' records. A slot another
session holds is not free here, and a request that cannot be met raises :class:`PoolHeldError`
at once, naming the holder. A session that closes deletes its record; a record whose Ray job
the GCS marks dead (its driver exited or was killed) is deleted by the next session that reads it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from rollart_nb.errors import NoCapacityError, PoolHeldError, StoreError, UnknownPoolError
from rollart_nb.protocols import MetadataStore
from rollart_nb.resources.pools import Pool
from rollart_nb.resources.profiles import PROFILES

__all__ = ["Binding", "Holder", "ResourceManager"]

log = logging.getLogger(__name__)

HOLDERS = "holders/"
"""Shared-store key prefix of the sessions' holdings records (one per session)."""
LOCK_KEY = "holders.lock"
LOCK_STALE_S = 10.0
"""A lock older than this was left by a process that died while binding: it is broken."""
LOCK_WAIT_S = 5.0


@dataclass(frozen=True)
class Holder:
    """Who holds pool slots: one session, as other sessions name it.

    Attributes:
        id: the session id (key of its record).
        name: what users read, e.g. "session 3fa2b1c0 (pid 1234 on host-a, since 12:40:01 UTC)".
        job: its Ray job id; the record is stale once the GCS marks that job dead.
    """

    id: str
    name: str
    job: str = ""

    @classmethod
    def of_session(cls, session_id: str, *, pid: int, host: str, created: float, job: str) -> Holder:
        since = time.strftime("%H:%M:%S UTC", time.gmtime(created))
        return cls(session_id, f"session {session_id} (pid {pid} on {host}, since {since})", job)


def short(node: str) -> str:
    """A node id as messages show it (its first 8 hex digits)."""
    return node[:8]


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
        pools: the session's pools (their ``used`` and ``held_elsewhere`` are kept up to date here).
        store: where this session's bindings and pool view are recorded.
        shared: the cluster-wide store where sessions record their holdings (None: this
            session's pools are its own, as in a simulated session).
        holder: this session as other sessions name it (needed with ``shared``).
        discover: reads the cluster's pools afresh (alive nodes only): nodes added since are
            used, and a node gone is known as dead (its slots leave its pool).
        dead_jobs: the Ray job ids the GCS marks dead (None: unknown); their holdings are released.
        node_lost: why a node is lost (None: alive); asked at failover about the dead worker's node.

    Example:
        >>> rm = ResourceManager(sess.pools, sess.store)            # doctest: +SKIP
        >>> rm.bind("actor_train", 0, prefer="H800").pool           # doctest: +SKIP
        'H800'
    """

    def __init__(
        self,
        pools: dict[str, Pool],
        store: MetadataStore,
        *,
        shared: MetadataStore | None = None,
        holder: Holder | None = None,
        discover: Callable[[], dict[str, Pool]] | None = None,
        dead_jobs: Callable[[], set[str] | None] | None = None,
        node_lost: Callable[[str], str | None] | None = None,
    ) -> None:
        if shared is not None and holder is None:
            raise ValueError("a shared store needs the holder that records in it")
        self.pools = pools
        self.store = store
        self.shared, self.holder = shared, holder
        self._discover, self._dead_jobs, self._node_lost = discover, dead_jobs, node_lost
        self._lock = threading.Lock()
        self._bindings: dict[str, Binding] = {}
        self._used: dict[tuple[str, str], float] = {}  # (pool, node) -> slots
        self._elsewhere: dict[tuple[str, str], list[tuple[str, str, float]]] = {}  # -> [(holder, worker, slots)]
        self.dead_nodes: dict[str, str] = {}  # node id -> pool it was in (they are never used again)
        self.refresh()

    # -- queries ---------------------------------------------------------------------
    def bindings(self, role: str | None = None) -> list[Binding]:
        with self._lock:
            return [b for b in self._bindings.values() if role is None or b.role == role]

    def free(self, pool: str, node: str | None = None) -> float:
        p = self.pools[pool]
        nodes = [node] if node else p.nodes
        return sum(p.slots_per_node.get(n, 0.0) - self._taken(pool, n) for n in nodes)

    def held_elsewhere(self, pool: str) -> dict[str, float]:
        """Holder name -> slots of ``pool`` that other sessions hold (as last read)."""
        out: dict[str, float] = {}
        for (p, _), held in self._elsewhere.items():
            if p != pool:
                continue
            for who, _, slots in held:
                out[who] = out.get(who, 0.0) + slots
        return out

    def absent(self, pool: str) -> bool:
        """True when ``pool`` is not in this cluster, or none of its nodes is alive."""
        return pool not in self.pools or not self.pools[pool].slots_per_node

    def absent_pool_notes(self, bindings: list[Binding]) -> list[str]:
        """One note per pool that ``bindings`` asked for and fell back from because it is not here."""
        out = []
        for prefer in sorted({b.prefer for b in bindings if b.fell_back and self.absent(b.prefer)}):
            moved = [b for b in bindings if b.prefer == prefer and b.fell_back]
            out.append(
                f"pool {prefer!r} is not in this cluster ({moved[0].reason}): {len(moved)} worker(s) of "
                f"{moved[0].role} run on {', '.join(sorted({b.pool for b in moved}))} instead. To add it, start "
                f"nodes with `ray start --num-gpus N --resources '{{\"accelerator_type:{prefer}\": 1}}'`, or "
                "map a resource of yours with Session.attach(..., pool_map={...})"
            )
        return out

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

    def refresh(self) -> None:
        """Read what other sessions hold, then publish the pool view."""
        with self._lock:
            self._read_others()
            self.publish_pools()

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
        cause: str = "",
    ) -> Binding:
        """Bind worker ``role/index`` to ``prefer`` or, failing that, a compatible pool.

        ``cause`` (failover: why the worker needs a new place) opens the reason of a fallback.

        Raises:
            UnknownPoolError: ``prefer`` or a fallback name is not a pool or known hardware type.
            PoolHeldError: slots that would fit are held by another session (named).
            NoCapacityError: no candidate pool has ``slots`` free on one node.
        """
        self.check_pool_name(prefer)
        for f in fallback or []:
            self.check_pool_name(f)
        try:
            return self._bind_once(role, index, prefer, fallback, slots, exclude_nodes, cause)
        except NoCapacityError:
            if self._discover is None:
                raise
            self._refresh_pools()  # nodes added since attach may fit it
            return self._bind_once(role, index, prefer, fallback, slots, exclude_nodes, cause)

    def _bind_once(
        self,
        role: str,
        index: int,
        prefer: str,
        fallback: list[str] | None,
        slots: float,
        exclude: frozenset[str],
        cause: str,
    ) -> Binding:
        key = f"{role}/{index}"
        with self._lock, self._cluster_lock():
            self._read_others()
            if key in self._bindings:
                self._release_locked(key)
            candidates = [prefer] + (list(fallback) if fallback is not None else self.compatible(prefer))
            reasons: list[str] = [cause] if cause else []
            for pool_name in candidates:
                pool = self.pools.get(pool_name)
                node = None if pool is None else self._pick_node(pool, slots, exclude)
                if pool is None or node is None:
                    reasons.append(self._shortfall(pool_name, exclude))
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
                self._publish_holdings()
                self.publish_pools()
                return b
            self.publish_pools()
            raise self._no_capacity(key, slots, prefer, candidates, reasons)

    def _no_capacity(
        self, key: str, slots: float, prefer: str, candidates: list[str], reasons: list[str]
    ) -> NoCapacityError:
        free = ", ".join(f"{n} {self.free(n):g}/{p.capacity:g} free" for n, p in self.pools.items())
        head = (
            f"no pool can host {key} ({slots:g} slot(s)): asked for {prefer!r}, tried "
            f"{'; '.join(reasons) or 'nothing'}; pools: {free}."
        )
        holders = sorted({who for c in candidates if c in self.pools for who in self.held_elsewhere(c)})
        if holders:
            return PoolHeldError(
                f"{head} Held by {', '.join(holders)}: close that session (its sess.close(); a session "
                "whose process died frees its slots by itself), lower replicas, or add nodes to the pool "
                f"(ray start --num-gpus N --resources '{{\"accelerator_type:{prefer}\": 1}}' on a new node).",
                holders=holders,
            )
        return NoCapacityError(f"{head} Free slots (sess.close_cluster(name)), lower replicas, or add fallback pools.")

    def release(self, role: str, index: int | None = None) -> None:
        """Release one worker's binding, or every binding of ``role``."""
        with self._lock:
            keys = [k for k, b in self._bindings.items() if b.role == role and (index is None or b.index == index)]
            for k in keys:
                self._release_locked(k)
            self._publish_holdings()
            self.publish_pools()

    def rebind(self, role: str, index: int, *, avoid_node: bool = True) -> Binding:
        """Failover: bind a dead worker's slot again, avoiding its old node when possible.

        The pools are read afresh first, so a node that died leaves its pool; the binding's
        reason names the node and why it was left.
        """
        old = self._bindings.get(f"{role}/{index}")
        if old is None:
            raise UnknownPoolError(f"no binding for {role}/{index} to rebind")
        lost = self._node_lost(old.node) if self._node_lost is not None else None
        if lost is not None:
            self._drop_node(old.node, old.pool)
        if self._discover is not None:
            self._refresh_pools()
        if old.node in self.dead_nodes:
            cause = f"node {short(old.node)} of {old.pool} died ({lost or 'it left the cluster'})"
        else:
            cause = f"{old.worker} died on node {short(old.node)} of {old.pool}"
        exclude = frozenset({old.node}) if avoid_node else frozenset()
        try:
            return self.bind(role, index, prefer=old.prefer, slots=old.slots, exclude_nodes=exclude, cause=cause)
        except NoCapacityError:
            if old.node in self.dead_nodes:
                raise
            return self.bind(role, index, prefer=old.prefer, slots=old.slots, cause=cause)

    def publish_pools(self) -> None:
        for name, p in self.pools.items():
            p.held_elsewhere = sum(self.held_elsewhere(name).values())
            self.store.put(
                f"pools/{name}",
                {**p.to_dict(), "used": p.used, "held_elsewhere": p.held_elsewhere, "capacity": p.capacity},
            )

    def close(self) -> None:
        """Delete this session's holdings record (its workers are gone)."""
        if self.shared is not None and self.holder is not None:
            with contextlib.suppress(Exception):
                self.shared.delete(HOLDERS + self.holder.id)

    # -- internals -------------------------------------------------------------------
    def _taken(self, pool: str, node: str) -> float:
        return self._used.get((pool, node), 0.0) + sum(s for _, _, s in self._elsewhere.get((pool, node), ()))

    def _shortfall(self, name: str, exclude: frozenset[str]) -> str:
        """Why pool ``name`` cannot take the worker, in words that name nodes and holders."""
        dead = [short(n) for n, p in self.dead_nodes.items() if p == name]
        if self.absent(name):
            return f"{name} has no live node left (node {', '.join(dead)} died)" if dead else f"{name} absent"
        pool = self.pools[name]
        live = pool.nodes
        if all(n in exclude for n in live):
            return f"{name} has no other node"
        used = sum(self._taken(name, n) for n in live)
        held = self.held_elsewhere(name)
        by = "".join(f"; {s:g} held by {who}" for who, s in held.items())
        return f"{name} full ({used:g}/{pool.capacity:g} slots used{by})"

    def _read_others(self) -> None:
        """Refresh ``_elsewhere`` from the other sessions' records; delete those of dead jobs."""
        self._elsewhere = {}
        if self.shared is None or self.holder is None:
            return
        dead: set[str] | None = None
        for key in self.shared.keys(HOLDERS):
            rec = self.shared.get(key) if key != HOLDERS + self.holder.id else None
            if not rec:
                continue
            if dead is None and self._dead_jobs is not None:
                dead = self._dead_jobs() or set()
            if dead and rec.get("job") in dead:
                self.shared.delete(key)
                log.warning("released the pool slots of %s: its Ray job %s has ended", rec["name"], rec["job"])
                continue
            for h in rec.get("held", []):
                pool = self.pools.get(h["pool"])
                if pool is not None and h["node"] in pool.slots_per_node:
                    self._elsewhere.setdefault((h["pool"], h["node"]), []).append(
                        (rec["name"], h["worker"], h["slots"])
                    )

    def _publish_holdings(self) -> None:
        if self.shared is None or self.holder is None:
            return
        held = [{"worker": b.worker, "pool": b.pool, "node": b.node, "slots": b.slots} for b in self._bindings.values()]
        h = self.holder
        self.shared.put(HOLDERS + h.id, {"name": h.name, "job": h.job, "held": held, "time": time.time()})

    @contextlib.contextmanager
    def _cluster_lock(self) -> Iterator[None]:
        """Hold the cluster-wide lock on the holdings records (none without a shared store)."""
        if self.shared is None or self.holder is None:
            yield
            return
        deadline = time.monotonic() + LOCK_WAIT_S
        while not self.shared.put_new(LOCK_KEY, {"holder": self.holder.name, "time": time.time()}):
            rec = self.shared.get(LOCK_KEY)
            if rec is not None and time.time() - rec["time"] > LOCK_STALE_S:
                log.warning("breaking a pool lock left by %s %.0f s ago", rec["holder"], time.time() - rec["time"])
                self.shared.delete(LOCK_KEY)
            elif rec is not None and time.monotonic() > deadline:
                raise StoreError(
                    f"the cluster's pool records stayed locked by {rec['holder']} for {LOCK_WAIT_S:g} s; "
                    "try again (a lock of a dead process is broken after "
                    f"{LOCK_STALE_S:g} s)"
                )
            time.sleep(0.02)
        try:
            yield
        finally:
            self.shared.delete(LOCK_KEY)

    def _refresh_pools(self) -> None:
        """Read the cluster's pools afresh: new nodes join their pools, gone nodes leave as dead."""
        assert self._discover is not None
        fresh = self._discover()
        with self._lock:
            for name, p in fresh.items():
                cur = self.pools.setdefault(name, p)
                cur.slots_per_node.update({n: v for n, v in p.slots_per_node.items() if n not in self.dead_nodes})
            for name, cur in self.pools.items():
                alive = fresh[name].slots_per_node if name in fresh else {}
                for node in [n for n in cur.slots_per_node if n not in alive]:
                    self._drop_node(node, name)

    def _drop_node(self, node: str, pool: str) -> None:
        """Node ``node`` is lost: its slots leave ``pool`` for good."""
        if self.pools.get(pool) is not None and self.pools[pool].slots_per_node.pop(node, None) is not None:
            log.warning("node %s of pool %s is lost; its slots leave the pool", short(node), pool)
        self.dead_nodes[node] = pool

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
            free = cap - self._taken(pool.name, node)
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
