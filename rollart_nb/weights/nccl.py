"""Weight transport over ``torch.distributed`` broadcast (same-cluster sync, NCCL on GPUs).

A *collective*: :meth:`NcclTransport.publish` on the source rank must be matched by
:meth:`NcclTransport.pull` on every other rank of the group; nothing is kept afterwards.
Buckets live on the group's device and carry no checksum (that would cost a device-to-host
copy; a broken link fails the collective loudly). With gloo it runs on CPU.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from rollart_nb.errors import ConnectError, WeightSyncError
from rollart_nb.weights.buckets import DEFAULT_BUCKET_BYTES, Manifest, pack, unpack
from rollart_nb.weights.metrics import WeightSyncMetrics

__all__ = ["NcclTransport"]

logger = logging.getLogger(__name__)


class NcclTransport:
    """Broadcast bucketed, versioned weights from ``src`` to the rest of a process group.

    Args:
        src: global rank that publishes.
        group: process group (None: the default group).
        bucket_bytes: bucket size (each bucket is one ``broadcast``).
        device: where buckets live; None: ``cuda:<current>`` for NCCL, CPU otherwise.

    Example:
        >>> # every rank, after dist.init_process_group("nccl", ...)
        >>> t = NcclTransport(src=0)                                       # doctest: +SKIP
        >>> if rank == 0: t.publish(5, model.state_dict())                 # doctest: +SKIP
        ... else: engine.load_weights(t.pull(5), 5)                        # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        src: int = 0,
        group: Any = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str | None = None,
    ) -> None:
        self.src = src
        self.group = group
        self.bucket_bytes = bucket_bytes
        self._device = torch.device(device) if device is not None else None
        self._latest: int | None = None
        self.metrics = WeightSyncMetrics()

    @staticmethod
    def _dist() -> Any:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ConnectError("torch.distributed is not initialised; call dist.init_process_group(...) on every rank")
        return dist

    @property
    def device(self) -> torch.device:
        """Device that buckets are packed on and received into."""
        if self._device is None:
            backend = self._dist().get_backend(self.group)
            self._device = (
                torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            )
        return self._device

    def publish(self, version: int, state: dict[str, Any]) -> Manifest:
        """Source rank: broadcast the manifest, then every bucket. Collective."""
        dist = self._dist()
        if dist.get_rank() != self.src:
            raise WeightSyncError(
                f"publish() runs on the source rank {self.src}, not rank {dist.get_rank()}; "
                "call pull() on the other ranks"
            )
        t0 = time.perf_counter()
        manifest, buckets = pack(state, self.bucket_bytes, version=version, device=self.device)
        dist.broadcast_object_list([manifest.to_json()], src=self.src, group=self.group, device=self.device)
        for b in buckets:
            dist.broadcast(b, src=self.src, group=self.group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # timing and buffer reuse need the sends finished
        self._latest = version
        self.metrics.push_s += time.perf_counter() - t0
        self.metrics.version = max(self.metrics.version, version)
        return manifest

    def pull(self, version: int | None = None) -> dict[str, Any]:
        """Receiving ranks: take part in the broadcast and rebuild the state. Collective.

        Args:
            version: the version this rank expects (None: whatever the source sends).

        Raises:
            WeightSyncError: the source sent a different version (after the collective
                completed, so the group stays in step).
        """
        dist = self._dist()
        t0 = time.perf_counter()
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.group, device=self.device)
        manifest = Manifest.from_json(box[0])
        buckets = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in manifest.bucket_sizes]
        for b in buckets:
            dist.broadcast(b, src=self.src, group=self.group)
        if version is not None and manifest.version != version:
            raise WeightSyncError(
                f"rank {dist.get_rank()} expected weight version {version} but rank {self.src} broadcast "
                f"version {manifest.version}; keep publish/pull calls in the same order on every rank"
            )
        state = unpack(manifest, buckets)
        self._latest = manifest.version
        self.metrics.pull_s += time.perf_counter() - t0
        self.metrics.bytes += manifest.total_bytes
        self.metrics.pulls += 1
        self.metrics.version = max(self.metrics.version, manifest.version)
        return state

    def latest(self) -> int | None:
        """Last version this rank sent or received."""
        return self._latest

    def gc(self, keep: int = 2) -> None:
        """Nothing to free: broadcasts keep no copies."""

    def take_metrics(self) -> WeightSyncMetrics:
        """Return this step's counters and start new ones."""
        m, self.metrics = self.metrics, WeightSyncMetrics(version=self.metrics.version)
        return m
