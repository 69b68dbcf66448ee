"""The staleness rule α: which trajectories a policy version may still train on.

A trajectory whose oldest turn was generated at version ``v`` is usable at policy version ``n``
only while ``v >= n - alpha``. Three uses: buffer eviction, the abort of in-flight work (whole
GRPO groups) at a version bump, and the admission window for new groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollart_nb.trajectory import Trajectory

__all__ = ["Staleness"]


@dataclass(frozen=True)
class Staleness:
    """The α bound of one run (``alpha`` is validated by :class:`~rollart_nb.config.PipelineConfig`).

    Args:
        alpha: versions a trajectory may lag the policy (0: on-policy only).
        abort_stale: whether buffered and in-flight trajectories are held to the bound (rollart);
            False leaves only the admission window (AReaL checks staleness when a group starts).

    Example:
        >>> rule = Staleness(alpha=1)
        >>> rule.is_stale(Trajectory("t", start_version=3), version=5)
        True
        >>> rule.admits(live_groups=5, batches_taken=2, quota=2)
        True
    """

    alpha: int
    abort_stale: bool = True

    def floor(self, version: int) -> int:
        """The oldest start version still usable at ``version``."""
        return version - self.alpha

    def is_stale(self, traj: Trajectory, version: int) -> bool:
        """Whether ``traj`` must leave (buffer or flight) at policy ``version``."""
        return self.abort_stale and traj.min_version < self.floor(version)

    def reason(self, traj: Trajectory, version: int) -> str:
        return f"stale: began at version {traj.min_version}, policy is at {version}, alpha={self.alpha}"

    def group_reason(self, version: int) -> str:
        return (
            f"stale group: a member began before version {self.floor(version)}, policy is at {version}, "
            f"alpha={self.alpha}"
        )

    def admits(self, live_groups: int, batches_taken: int, quota: int) -> bool:
        """Whether a task may open one more group: the groups a batch will still take stay within
        ``(batches_taken + alpha + 1) * quota``, one version per batch taken, since a group opened
        beyond that would be trained on at least ``alpha + 1`` versions after it began."""
        return live_groups < (batches_taken + self.alpha + 1) * quota

    def ahead_limit(self, quota: int, group_size: int, envs: int) -> int:
        """Trajectories a task may have running, scored or buffered (modes without the version
        window): ``alpha + 1`` batches' share of it, plus one per env."""
        return (self.alpha + 1) * quota * group_size + envs

    def buffer_capacity(self, groups: int, group_size: int, envs: int) -> int:
        """The buffer's hard cap, above every task's :meth:`ahead_limit` summed, so it only ever
        acts as a safety net (the O(alpha * E) bound)."""
        return (self.alpha + 2) * groups * group_size + envs
