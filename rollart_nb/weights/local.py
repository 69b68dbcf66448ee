"""In-process weight transport: the fake for the WeightTransport seam.

Keeps packed buckets in a dict, so publish/pull run the same pack, checksum and unpack code
as the real transports without Ray or Mooncake. Used by sim backends and fast tests.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rollart_nb.errors import WeightSyncError
from rollart_nb.weights.buckets import DEFAULT_BUCKET_BYTES, Manifest, pack, unpack
from rollart_nb.weights.metrics import WeightSyncMetrics

__all__ = ["LocalTransport"]


class LocalTransport:
    """Versions held in this process's memory.

    Args:
        bucket_bytes: bucket size used by :meth:`publish`.

    Example:
        >>> import torch
        >>> t = LocalTransport()
        >>> _ = t.publish(1, {"w": torch.zeros(2)})
        >>> t.latest(), t.pull(1)["w"].tolist()
        (1, [0.0, 0.0])
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.bucket_bytes = bucket_bytes
        self.metrics = WeightSyncMetrics()
        self._lock = threading.Lock()
        self._versions: dict[int, tuple[Manifest, list[Any]]] = {}

    def publish(self, version: int, state: dict[str, Any]) -> Manifest:
        """Pack ``state`` and keep its buckets under ``version``."""
        t0 = time.perf_counter()
        manifest, buckets = pack(state, self.bucket_bytes, version=version)
        with self._lock:
            self._versions[version] = (manifest, buckets)
        self.metrics.push_s += time.perf_counter() - t0
        return manifest

    def buckets(self, version: int) -> list[Any]:
        """The stored bucket buffers of ``version`` (tests corrupt them on purpose)."""
        return self._get(version)[1]

    def pull(self, version: int | None = None) -> dict[str, Any]:
        """Verify and unpack a copy of ``version`` (None: latest)."""
        t0 = time.perf_counter()
        if version is None:
            version = self.latest()
        manifest, buckets = self._get(version)
        state = unpack(manifest, [b.copy() for b in buckets])
        self.metrics.pull_s += time.perf_counter() - t0
        self.metrics.bytes += manifest.total_bytes
        self.metrics.pulls += 1
        return state

    def latest(self) -> int | None:
        """Newest version held, or None."""
        with self._lock:
            return max(self._versions) if self._versions else None

    def gc(self, keep: int = 2) -> None:
        """Drop all but the newest ``keep`` versions."""
        with self._lock:
            for v in sorted(self._versions)[: max(0, len(self._versions) - keep)]:
                del self._versions[v]

    def _get(self, version: int | None) -> tuple[Manifest, list[Any]]:
        with self._lock:
            entry = self._versions.get(version) if version is not None else None
            have = sorted(self._versions)
        if entry is None:
            raise WeightSyncError(f"weight version {version} is not held (available: {have}); pull latest()")
        return entry
