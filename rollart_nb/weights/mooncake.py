"""Weight transport over the Mooncake store (cross-cluster, asynchronous).

The trainer publishes bucketed weights to a CPU-resident Mooncake store; workers fetch the
newest on demand, usually on a :class:`~rollart_nb.weights.puller.WeightPuller` thread.

Store layout for one ``prefix``::

    {prefix}/v{version}/bucket{i}    bucket payloads (hard-pinned: never evicted)
    {prefix}/v{version}/manifest     Manifest JSON, written after every bucket is in
    {prefix}/latest                  newest complete version, written last

Needs the ``mooncake`` extra and ``libibverbs1`` (linked even when only TCP is used).
"""

from __future__ import annotations

import atexit
import logging
import socket
import time
import weakref
from typing import Any

import numpy as np

from rollart_nb.errors import ConnectError, WeightSyncError
from rollart_nb.weights.buckets import DEFAULT_BUCKET_BYTES, Manifest, pack, unpack
from rollart_nb.weights.metrics import WeightSyncMetrics
from rollart_nb.weights.mooncake_master import MooncakeMaster

__all__ = ["MooncakeMaster", "MooncakeTransport"]

logger = logging.getLogger(__name__)

# Return codes seen from mooncake.store (see Mooncake's docs/error codes).
_CODES = {-704: "object not found", -706: "object leased by a reader", -707: "lease expired during transfer"}


def _code(rc: int) -> str:
    return f"{rc} ({_CODES[rc]})" if rc in _CODES else str(rc)


# Clients still open when the interpreter exits are closed by an atexit hook, while Python is
# whole: a store left to its C++ destructor during interpreter teardown still has engine
# threads talking to the master, and can crash the exit.
_open: weakref.WeakSet[MooncakeTransport] = weakref.WeakSet()


@atexit.register
def _close_open_clients() -> None:
    for t in list(_open):
        try:
            t.close()
        except Exception:  # exiting anyway; one bad client must not keep the others open
            logger.debug("closing a Mooncake client at exit failed", exc_info=True)


class MooncakeTransport:
    """Publish and pull bucketed, versioned weights through a Mooncake store.

    The client connects lazily on first use, so a transport can be built in a driver and
    shipped to Ray workers.

    Args:
        master: ``"host:port"`` of the master, or a :class:`MooncakeMaster`.
        prefix: key namespace, one per model/job.
        bucket_bytes: bucket size used by :meth:`publish`.
        segment_bytes: memory this client contributes to the store (a publisher needs about
            ``(keep + 1) * model bytes``; pullers 0).
        local_buffer_bytes: client staging buffer (holds manifests and the latest pointer).
        protocol: ``"tcp"`` or ``"rdma"``.
        device_name: RDMA device list for ``protocol="rdma"``.
        local_hostname: address other clients reach this one at.
        metadata_server: transfer-engine metadata; ``"P2PHANDSHAKE"`` needs no extra service.
        connect_timeout_s: how long to wait for the master's port before giving up.
        get_retries: re-reads of a bucket whose read lease lapsed mid-transfer (-707).
    """

    def __init__(
        self,
        master: str | MooncakeMaster,
        *,
        prefix: str = "rollart",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        segment_bytes: int = 0,
        local_buffer_bytes: int = 64 << 20,
        protocol: str = "tcp",
        device_name: str = "",
        local_hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        connect_timeout_s: float = 5.0,
        get_retries: int = 2,
    ) -> None:
        self.master_address = master.address if isinstance(master, MooncakeMaster) else master
        self.prefix = prefix
        self.bucket_bytes = bucket_bytes
        self.segment_bytes = segment_bytes
        self.local_buffer_bytes = local_buffer_bytes
        self.protocol = protocol
        self.device_name = device_name
        self.local_hostname = local_hostname
        self.metadata_server = metadata_server
        self.connect_timeout_s = connect_timeout_s
        self.get_retries = get_retries
        self.metrics = WeightSyncMetrics()
        self._store: Any = None
        self._published: dict[int, int] = {}  # version -> number of buckets (for gc)
        self._pending_gc: list[str] = []

    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.update(_store=None, _published={}, _pending_gc=[], metrics=WeightSyncMetrics())
        return d

    # ---- connection ------------------------------------------------------------------------
    def connect(self) -> MooncakeTransport:
        """Set up the store client now (otherwise done on first use)."""
        if self._store is not None:
            return self
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ConnectError(
                f"mooncake is not usable here ({e}); pip install 'rollart_nb[mooncake]' and apt-get install libibverbs1"
            ) from e
        # setup() against a dead master retries for ~90 s; a TCP probe fails in milliseconds.
        host, _, port = self.master_address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=self.connect_timeout_s).close()
        except (OSError, ValueError) as e:
            raise ConnectError(
                f"no Mooncake master answers at {self.master_address} ({e}); "
                "start one with MooncakeMaster().start() or check the address"
            ) from e
        store = MooncakeDistributedStore()
        rc = store.setup(
            self.local_hostname,
            self.metadata_server,
            self.segment_bytes,
            self.local_buffer_bytes,
            self.protocol,
            self.device_name,
            self.master_address,
        )
        if rc != 0:
            raise ConnectError(
                f"cannot reach the Mooncake master at {self.master_address} (setup returned {rc}); "
                "start one with MooncakeMaster().start() or check the address"
            )
        self._store = store
        _open.add(self)
        return self

    @property
    def store(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (connected)."""
        return self.connect()._store

    def close(self) -> None:
        """Close the client (its contributed segment, and buckets stored in it, go away)."""
        if self._store is not None:
            store, self._store = self._store, None
            _open.discard(self)
            store.close()

    def __enter__(self) -> MooncakeTransport:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- keys ------------------------------------------------------------------------------
    def bucket_key(self, version: int, i: int) -> str:
        """Store key of bucket ``i`` of ``version``."""
        return f"{self.prefix}/v{version}/bucket{i}"

    def manifest_key(self, version: int) -> str:
        """Store key of the manifest of ``version``."""
        return f"{self.prefix}/v{version}/manifest"

    @property
    def latest_key(self) -> str:
        """Store key of the newest-version pointer."""
        return f"{self.prefix}/latest"

    # ---- publish ---------------------------------------------------------------------------
    def publish(self, version: int, state: dict[str, Any]) -> Manifest:
        """Pack ``state``, put every bucket zero-copy, then its manifest, then the pointer.

        Raises:
            WeightSyncError: the store refused a bucket (e.g. no segment has room).
        """
        from mooncake.store import ReplicateConfig

        store = self.store
        t0 = time.perf_counter()
        if store.is_exist(self.manifest_key(version)) == 1:
            # Mooncake answers 0 to a put on an existing key without replacing it, so a silent
            # republish would leave old buckets under a new manifest.
            raise WeightSyncError(
                f"weight version {version} is already in the store under prefix {self.prefix!r}; "
                "versions are immutable, publish under a new version number"
            )
        manifest, buckets = pack(state, self.bucket_bytes, version=version)
        config = ReplicateConfig()
        config.with_hard_pin = True  # weights must never be evicted under memory pressure
        keys = [self.bucket_key(version, i) for i in range(len(buckets))]
        ptrs = [b.ctypes.data for b in buckets]
        sizes = [b.nbytes for b in buckets]
        for p, n in zip(ptrs, sizes, strict=True):
            store.register_buffer(p, n)
        try:
            rcs = store.batch_put_from(keys, ptrs, sizes, config) if keys else []
        finally:
            for p in ptrs:
                store.unregister_buffer(p)
        bad = [(i, rc) for i, rc in enumerate(rcs) if rc != 0]
        if bad:
            store.batch_remove([k for k, rc in zip(keys, rcs, strict=True) if rc == 0], True)
            i, rc = bad[0]
            raise WeightSyncError(
                f"publishing weight version {version} failed: bucket {i} put returned {_code(rc)} "
                f"({len(bad)} of {len(keys)} buckets failed); the store needs about {manifest.total_bytes} "
                "free bytes in contributed segments (raise segment_bytes or gc old versions)"
            )
        rc = store.put(self.manifest_key(version), manifest.to_json(), config)
        if rc != 0:
            store.batch_remove(keys, True)
            raise WeightSyncError(f"publishing the manifest of weight version {version} failed ({_code(rc)})")
        latest = self.latest()
        # Never move the pointer backwards (an older version published late stays pullable by number).
        rc = store.upsert(self.latest_key, str(version).encode()) if latest is None or version > latest else 0
        if rc != 0:
            raise WeightSyncError(
                f"weight version {version} is stored but the latest pointer update failed ({_code(rc)}); publish again"
            )
        self._published[version] = manifest.num_buckets
        self.metrics.push_s += time.perf_counter() - t0
        self.metrics.version = max(self.metrics.version, version)
        return manifest

    # ---- pull ------------------------------------------------------------------------------
    def latest(self) -> int | None:
        """Newest complete version in the store, or None."""
        raw = self.store.get(self.latest_key)
        return int(raw) if raw else None

    def manifest(self, version: int) -> Manifest:
        """Manifest of ``version``.

        Raises:
            WeightSyncError: it is not in the store (never published, or garbage-collected).
        """
        raw = self.store.get(self.manifest_key(version))
        if not raw:
            raise WeightSyncError(
                f"weight version {version} is not in the Mooncake store under prefix {self.prefix!r} "
                f"(latest is {self.latest()}); pull the latest version instead"
            )
        return Manifest.from_json(raw)

    def pull(self, version: int | None = None) -> dict[str, Any]:
        """Fetch ``version`` (None: latest) into fresh registered memory and verify it.

        Returns:
            name -> tensor, zero-copy views into one buffer per pull.

        Raises:
            WeightSyncError: missing, partial (a bucket could not be read) or corrupt.
        """
        store = self.store
        t0 = time.perf_counter()
        if version is None:
            version = self.latest()
            if version is None:
                raise WeightSyncError(f"no weight version published under prefix {self.prefix!r} yet")
        manifest = self.manifest(version)
        sizes = list(manifest.bucket_sizes)
        offsets = np.cumsum([0, *sizes])
        buf = np.empty(int(offsets[-1]), dtype=np.uint8)
        keys = [self.bucket_key(version, i) for i in range(len(sizes))]
        ptrs = [buf.ctypes.data + int(o) for o in offsets[:-1]]
        if keys:
            store.register_buffer(buf.ctypes.data, buf.nbytes)
            try:
                self._get_buckets(version, keys, ptrs, sizes)
            finally:
                store.unregister_buffer(buf.ctypes.data)
        buckets = [buf[offsets[i] : offsets[i + 1]] for i in range(len(sizes))]
        state = unpack(manifest, buckets)
        self.metrics.pull_s += time.perf_counter() - t0
        self.metrics.bytes += manifest.total_bytes
        self.metrics.pulls += 1
        self.metrics.version = max(self.metrics.version, version)
        return state

    def _get_buckets(self, version: int, keys: list[str], ptrs: list[int], sizes: list[int]) -> None:
        """Read buckets in batches of about one bucket, retrying a lapsed lease.

        A batch takes its read leases when it starts, so a whole 1 GiB+ batch on a slow or
        loaded link can outlive the master's lease (-707); per-bucket batches keep each
        transfer well inside it.
        """
        i = 0
        while i < len(keys):
            j, n = i + 1, sizes[i]
            while j < len(keys) and n + sizes[j] <= self.bucket_bytes:  # batch small buckets
                n += sizes[j]
                j += 1
            for attempt in range(self.get_retries + 1):
                got = self.store.batch_get_into(keys[i:j], ptrs[i:j], sizes[i:j])
                bad = [(k, rc) for k, rc in zip(range(i, j), got, strict=True) if rc != sizes[k]]
                if not bad or any(rc != -707 for _, rc in bad) or attempt == self.get_retries:
                    break
                logger.debug("mooncake: lease lapsed reading %s, retrying", keys[bad[0][0]])
            if bad:
                k, rc = bad[0]
                raise WeightSyncError(
                    f"weight version {version} is partial: bucket {k} ({keys[k]}) returned {_code(rc)} "
                    f"instead of {sizes[k]} bytes; it was garbage-collected or lost, pull a newer version"
                )
            i = j

    # ---- gc --------------------------------------------------------------------------------
    def gc(self, keep: int = 2, *, force: bool = False) -> None:
        """Remove all but the newest ``keep`` versions this transport published.

        Manifests go first (forced), so no new reader can start on an old version; buckets
        still leased by a reader in flight are retried on the next call.

        Args:
            keep: versions to keep.
            force: also remove leased buckets now. Only safe when no reader can still be
                reading the old versions (a reader caught mid-pull gets a partial or corrupt
                version, which it rejects and skips).
        """
        store = self.store
        old = sorted(self._published)[:-keep] if keep > 0 else sorted(self._published)
        keys = list(self._pending_gc)
        for v in old:
            n = self._published.pop(v)
            store.remove(self.manifest_key(v), True)
            keys += [self.bucket_key(v, i) for i in range(n)]
        if not keys:
            return
        rcs = store.batch_remove(keys, force)
        self._pending_gc = [k for k, rc in zip(keys, rcs, strict=True) if rc not in (0, -704)]
        if self._pending_gc:
            logger.debug("mooncake gc: %d buckets still leased, retried next gc", len(self._pending_gc))

    def take_metrics(self) -> WeightSyncMetrics:
        """Return this step's counters and start new ones."""
        m, self.metrics = self.metrics, WeightSyncMetrics(version=self.metrics.version)
        return m
