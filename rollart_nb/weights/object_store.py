"""Weight transport over the Ray object store (the default transport).

The publisher ``ray.put`` s each bucket and registers the references plus the manifest in a
small named Ray actor (the *registry*). Any process attached to the same Ray cluster and
namespace finds the registry by name, asks it for ``latest()`` and pulls the buckets. The
publishing process owns the objects and the registry borrows them: they are freed when ``gc``
drops them, and lost if the publisher process dies (a pull then raises WeightSyncError).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rollart_nb.errors import ConnectError, WeightSyncError
from rollart_nb.weights.buckets import DEFAULT_BUCKET_BYTES, Manifest, pack, unpack
from rollart_nb.weights.metrics import WeightSyncMetrics

__all__ = ["ObjectStoreTransport"]

logger = logging.getLogger(__name__)

DEFAULT_REGISTRY = "rollart_nb/weights"
"""Name of the registry actor when none is given."""


class _Registry:
    """Ray actor: version -> (manifest JSON, bucket refs). Holding the refs keeps the objects alive."""

    def __init__(self) -> None:
        self._versions: dict[int, tuple[bytes, list[Any]]] = {}

    def register(self, version: int, manifest_json: bytes, refs: list[Any]) -> None:
        # refs arrive nested in a list, so Ray hands us ObjectRefs (not their values).
        self._versions[version] = (manifest_json, refs)

    def get(self, version: int) -> tuple[bytes, list[Any]] | None:
        return self._versions.get(version)

    def latest(self) -> int | None:
        return max(self._versions) if self._versions else None

    def versions(self) -> list[int]:
        return sorted(self._versions)

    def gc(self, keep: int) -> list[int]:
        old = sorted(self._versions)[:-keep] if keep > 0 else sorted(self._versions)
        for v in old:
            del self._versions[v]
        return old


def _ray():
    import ray

    if not ray.is_initialized():
        raise ConnectError("Ray is not initialised in this process; call ray.init() or rn.Session.local() first")
    return ray


class ObjectStoreTransport:
    """Publish and pull bucketed, versioned weights through Ray's object store.

    Args:
        name: registry actor name; publishers and pullers that share it share versions.
        bucket_bytes: bucket size used by :meth:`publish`.
        namespace: Ray namespace of the registry (``None``: the current job's namespace).

    Example:
        >>> t = ObjectStoreTransport("demo")                      # doctest: +SKIP
        >>> t.publish(1, model.state_dict()); t.latest()          # doctest: +SKIP
        1
        >>> state = ObjectStoreTransport("demo").pull(1)          # doctest: +SKIP
    """

    def __init__(
        self,
        name: str = DEFAULT_REGISTRY,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        namespace: str | None = None,
    ) -> None:
        self.name = name
        self.bucket_bytes = bucket_bytes
        self.namespace = namespace
        self.metrics = WeightSyncMetrics()
        self._registry_handle: Any = None

    # The handle is resolved lazily so that the transport can be pickled into Ray workers.
    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["_registry_handle"] = None
        d["metrics"] = WeightSyncMetrics()
        return d

    @property
    def _registry(self) -> Any:
        if self._registry_handle is None:
            ray = _ray()
            actor = ray.remote(num_cpus=0, max_concurrency=8)(_Registry)
            self._registry_handle = actor.options(
                name=self.name, namespace=self.namespace, get_if_exists=True, lifetime=None
            ).remote()
        return self._registry_handle

    def publish(self, version: int, state: dict[str, Any]) -> Manifest:
        """Pack ``state`` into buckets, put them in the object store and register the version.

        Returns:
            The manifest of the published version.
        """
        ray = _ray()
        t0 = time.perf_counter()
        manifest, buckets = pack(state, self.bucket_bytes, version=version)
        registry = self._registry
        # This process owns the objects (Ray >= 2.56 dropped put(_owner=...)); the registry borrows
        # them, so they live until gc drops them there, or until this publisher process exits.
        refs = [ray.put(b) for b in buckets]
        ray.get(registry.register.remote(version, manifest.to_json(), refs))
        dt = time.perf_counter() - t0
        self.metrics.push_s += dt
        self.metrics.version = max(self.metrics.version, version)
        logger.debug(
            "published weight version %d: %d buckets, %d bytes in %.3fs",
            version,
            manifest.num_buckets,
            manifest.total_bytes,
            dt,
        )
        return manifest

    def manifest(self, version: int) -> Manifest:
        """Manifest of a published version.

        Raises:
            WeightSyncError: the version is not (or no longer) published.
        """
        entry = _ray().get(self._registry.get.remote(version))
        if entry is None:
            raise self._missing(version)
        return Manifest.from_json(entry[0])

    def pull(self, version: int | None = None, *, copy: bool = True) -> dict[str, Any]:
        """Fetch and verify one version (``None``: the latest).

        Args:
            version: weight version to pull.
            copy: return writable tensors; ``False`` returns read-only views of shared memory.

        Raises:
            WeightSyncError: the version is missing, lost from the store, or corrupt.
        """
        ray = _ray()
        t0 = time.perf_counter()
        if version is None:
            version = self.latest()
            if version is None:
                raise WeightSyncError(f"no weight version is published in registry {self.name!r} yet")
        entry = ray.get(self._registry.get.remote(version))
        if entry is None:
            raise self._missing(version)
        manifest_json, refs = entry
        manifest = Manifest.from_json(manifest_json)
        try:
            buckets = ray.get(refs)
        except ray.exceptions.ObjectLostError as e:
            raise WeightSyncError(
                f"weight version {version} lost a bucket from the object store ({e}); republish it"
            ) from e
        state = unpack(manifest, buckets, copy_readonly=copy)
        self.metrics.pull_s += time.perf_counter() - t0
        self.metrics.bytes += manifest.total_bytes
        self.metrics.pulls += 1
        self.metrics.version = max(self.metrics.version, version)
        return state

    def latest(self) -> int | None:
        """Newest published version, or None."""
        return _ray().get(self._registry.latest.remote())

    def versions(self) -> list[int]:
        """All versions still held, oldest first."""
        return _ray().get(self._registry.versions.remote())

    def gc(self, keep: int = 2) -> None:
        """Forget all but the newest ``keep`` versions; the object store frees their buckets."""
        dropped = _ray().get(self._registry.gc.remote(keep))
        if dropped:
            logger.debug("weight registry %r dropped versions %s", self.name, dropped)

    def close(self) -> None:
        """Kill the registry actor (every version it holds is freed)."""
        if self._registry_handle is not None:
            _ray().kill(self._registry_handle)
            self._registry_handle = None

    def take_metrics(self) -> WeightSyncMetrics:
        """Return this step's counters and start new ones."""
        m, self.metrics = self.metrics, WeightSyncMetrics(version=self.metrics.version)
        return m

    def _missing(self, version: int) -> WeightSyncError:
        have = self.versions()
        return WeightSyncError(
            f"weight version {version} is not published in registry {self.name!r} "
            f"(available: {have}); pull latest() instead"
        )
