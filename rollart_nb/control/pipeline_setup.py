"""A pipeline's rollout, built from its config: each task's preferred hardware, the sharded
rollout over the generators, and each task's reward."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rollart_nb.control.shards import ShardedRollout
from rollart_nb.workers.routing import shape_affinity

if TYPE_CHECKING:
    from rollart_nb.config import PipelineConfig
    from rollart_nb.control.tasks import TaskSet
    from rollart_nb.runtime.base import Runtime
    from rollart_nb.workers.cluster import ClusterBase

__all__ = ["build_rollout"]


def build_rollout(
    runtime: Runtime,
    name: str,
    gen: ClusterBase,
    tasks: TaskSet,
    plans: Any,
    c: PipelineConfig,
    rewards: dict[str, dict[str, Any]] | None,
) -> tuple[ShardedRollout, dict[str, Any]]:
    """The rollout of pipeline ``name`` over ``gen`` (its actors started, not yet launching
    trajectories) and the task -> preferred hardware it routes by."""
    # the generator's @hw_mapping, else the env's shape hint until the task's measured token
    # profile decides (in the rollout's proxy)
    tagged = {t: gen.affinity("generate", t) for t in tasks.envs} if c.hw_affinity else {}
    affinity = {t: tag or shape_affinity(getattr(tasks.envs[t], "shape", None)) for t, tag in tagged.items()}
    rollout = ShardedRollout(
        runtime,
        f"{name}.rollout",
        plans,
        model=gen.model,
        targets=[(h.actor, h.binding.worker, h.binding.hardware, h.binding.pool) for h in gen.workers],
        task_affinity=affinity,
        measured=sorted(t for t, tag in tagged.items() if not tag),
        pd=c.pd,
        max_inflight=c.max_inflight,
        dispatch=c.dispatch,
    )
    # closed with the pipeline: a call on it afterwards points to the pipeline, not to sess.cluster
    rollout.closed_fix = (
        f"it was the rollout of pipeline {name!r}, closed with it: create a new pipeline with "
        f"sess.pipeline(..., name={name!r})"
    )
    for task, spec in (rewards or {}).items():
        rollout.set_reward(task, **spec)
    return rollout, affinity
