"""Per-step weight-synchronisation metrics (the paper's Table 4 columns).

``push_s`` is the trainer's publish time, ``pull_s`` the accumulated time generation workers
spent pulling (in the background or not), and ``exposed_pull_s`` the part of it that rollout
actually waited for. Asynchronous pulls aim to make ``exposed_pull_s`` small next to
``pull_s``; the paper hides 67-78% of the pull cost this way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["WeightSyncMetrics"]


@dataclass
class WeightSyncMetrics:
    """Weight-sync counters for one pipeline step (or a sum over steps).

    Attributes:
        version: newest weight version these counters cover (-1: none yet).
        push_s: seconds the publisher spent packing and publishing.
        pull_s: accumulated seconds spent pulling, background and foreground.
        exposed_pull_s: seconds rollout was blocked waiting for weights.
        bytes: payload bytes moved by the pulls.
        pulls: number of completed pulls.

    Example:
        >>> m = WeightSyncMetrics(version=3, push_s=1.0, pull_s=4.0, exposed_pull_s=1.0, bytes=8 * 10**9)
        >>> m.hidden_fraction, m.pull_gbps
        (0.75, 2.0)
    """

    version: int = -1
    push_s: float = 0.0
    pull_s: float = 0.0
    exposed_pull_s: float = 0.0
    bytes: int = 0
    pulls: int = 0

    @property
    def hidden_fraction(self) -> float:
        """Share of the accumulated pull time hidden behind rollout (0 when nothing was pulled)."""
        if self.pull_s <= 0:
            return 0.0
        return max(0.0, 1.0 - self.exposed_pull_s / self.pull_s)

    @property
    def pull_gbps(self) -> float:
        """Raw pull throughput in GB/s (10^9 bytes) over the accumulated pull time."""
        return self.bytes / 1e9 / self.pull_s if self.pull_s > 0 else 0.0

    @property
    def effective_gbps(self) -> float:
        """Throughput as rollout experiences it: bytes over push plus exposed pull time."""
        t = self.push_s + self.exposed_pull_s
        return self.bytes / 1e9 / t if t > 0 else float("inf") if self.bytes else 0.0

    def add(self, other: WeightSyncMetrics) -> WeightSyncMetrics:
        """Sum of two counters (the newer version wins)."""
        return WeightSyncMetrics(
            version=max(self.version, other.version),
            push_s=self.push_s + other.push_s,
            pull_s=self.pull_s + other.pull_s,
            exposed_pull_s=self.exposed_pull_s + other.exposed_pull_s,
            bytes=self.bytes + other.bytes,
            pulls=self.pulls + other.pulls,
        )

    def as_dict(self) -> dict[str, Any]:
        """Fields plus the derived ratios, for a StepReport row or JSON."""
        d = asdict(self)
        d.update(hidden_fraction=self.hidden_fraction, pull_gbps=self.pull_gbps, effective_gbps=self.effective_gbps)
        return d
