"""Sharded rollout: a pipeline's envs over several RolloutWorker actors, driven as one.

One :class:`~rollart_nb.control.rollout_worker.RolloutWorker` runs every EnvManager of a
pipeline on one asyncio loop, so one core. :class:`ShardedRollout` splits the envs over N of
them (each its own cluster on the CPU pool) and keeps the pipeline's view single:

- **Batch shares** (:func:`plan_shards`): the batch's per-task group quota is computed once,
  then each task's groups and envs are split over the shards that hold envs of that task. A
  shard's plan has its per-task quota as ``task_weights`` (``split_quota(sum(q), q) == q``), so
  every batch holds exactly the unsharded composition; a group lives on one shard.
- **One staleness rule**: :meth:`ShardedRollout.set_version` reaches every shard before the
  pipeline goes on; the admission limits add up to the unsharded ones.
- **Distinct streams**: each shard has its own seed and id salt (its cluster name). With one
  shard nothing changes: same cluster name, ids and seeds.

Calls that every shard must see (versions, suspend/resume, holds, rewards, generator
replacement) go to all shards concurrently.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollart_nb._checks import is_number, is_whole
from rollart_nb.config import PipelineConfig, RolloutConfig
from rollart_nb.control.buffer import split_quota
from rollart_nb.control.curriculum import curriculum_problems
from rollart_nb.control.modes import Mode
from rollart_nb.control.modes import mode as get_mode
from rollart_nb.control.rollout_worker import RolloutWorker
from rollart_nb.errors import ConfigError
from rollart_nb.runtime.base import ClusterSpec
from rollart_nb.trajectory import Trajectory

if TYPE_CHECKING:
    from rollart_nb.runtime.base import Runtime
    from rollart_nb.workers.cluster import ClusterBase

__all__ = ["ENVS_PER_SHARD", "ShardPlan", "ShardedRollout", "auto_shards", "max_shards", "plan_rollout", "plan_shards"]

ENVS_PER_SHARD = 1024
"""Envs per rollout shard when the pipeline picks the shard count (``rollout_shards=None``)."""


@dataclass(frozen=True)
class ShardPlan:
    """What one rollout scheduler runs besides its :class:`~rollart_nb.config.PipelineConfig`:
    the whole run's envs and batch (:func:`plan_rollout`), or one shard's (:func:`plan_shards`).

    Attributes:
        config: the pipeline's config, whole (every loop setting and default lives there).
        envs: task -> env templates (a shard's: a disjoint slice of every task's envs).
        group_size: GRPO group size (the algorithm's).
        mode: the resolved pipeline mode.
        seed: seeds env seeds and task sampling (each shard has its own).
        quota: task -> groups of each batch this plan supplies.
        task_weights: task -> weight in each batch (None: uniform).
        curricula: task -> :class:`~rollart_nb.control.curriculum.PromptCurriculum` (or anything
            with ``next_seed(rng)`` and ``update(seed, reward)``): that task's groups draw their
            seeds from it. Each scheduler works on its own copy.
    """

    config: PipelineConfig
    envs: dict[str, list[Any]]
    group_size: int
    mode: Mode
    seed: int
    quota: dict[str, int]
    task_weights: dict[str, float] | None = None
    curricula: dict[str, Any] | None = None

    @property
    def batch_groups(self) -> int:
        return sum(self.quota.values())

    @property
    def batch_size(self) -> int:
        """Trajectories of each batch this plan supplies."""
        return self.batch_groups * self.group_size

    @property
    def alpha(self) -> int:
        """The config's staleness bound (what readers of the plan ask for besides the batch)."""
        return self.config.alpha

    @property
    def rollout(self) -> RolloutConfig:
        return self.config.rollout

    @property
    def weights(self) -> dict[str, float]:
        """Task -> sampling weight, every task of :attr:`envs` (uniform unless weighted)."""
        w = self.task_weights
        return {t: w.get(t, 0.0) if w else 1.0 for t in self.envs}


def plan_rollout(
    envs: dict[str, list[Any]],
    config: PipelineConfig,
    group_size: int,
    seed: int = 0,
    task_weights: dict[str, float] | None = None,
    curricula: dict[str, Any] | None = None,
) -> ShardPlan:
    """The whole run's plan. It makes, once, the checks that ``config`` cannot make alone (it
    knows neither the algorithm's group size nor the tasks).

    Raises:
        ConfigError: every problem at once: no envs, ``group_size`` not a whole number >= 1,
            ``config.batch_size`` not a multiple of it, ``seed`` not whole, bad ``task_weights``
            or ``curricula``.
    """
    p = [] if any(envs.values()) else ["no environments: pass tasks with envs_per_task >= 1"]
    if isinstance(curricula or {}, dict):
        p += curriculum_problems(curricula or {}, envs)
    else:
        p.append(f"curricula={curricula!r} must be a dict task -> curriculum, or None")
    if not is_whole(group_size) or group_size < 1:
        p.append(f"group_size={group_size!r} must be a whole number >= 1 (trajectories per GRPO group)")
    elif config.batch_size % group_size:
        lo = max(config.batch_size // group_size, 1) * group_size
        p.append(
            f"batch_size={config.batch_size} must be a positive multiple of group_size={group_size}; "
            f"use e.g. batch_size={lo} or {lo + group_size}"
        )
    if not is_whole(seed):
        p.append(f"seed={seed!r} must be a whole number")
    if task_weights is not None and not isinstance(task_weights, dict):
        p.append(f"task_weights={task_weights!r} must be a dict task -> weight, or None (uniform)")
    elif task_weights:
        bad = {t: w for t, w in task_weights.items() if not (is_number(w) and w >= 0)}
        if bad:
            p.append(f"task_weights {bad!r} must be finite numbers >= 0")
        elif not sum(task_weights.values()) > 0:
            p.append(f"task_weights={task_weights!r} must have a positive sum (give some task a weight > 0)")
    if p:
        raise ConfigError(p, where="pipeline config")
    plan = ShardPlan(config, envs, int(group_size), get_mode(config.mode), int(seed), {}, task_weights, curricula)
    return dataclasses.replace(plan, quota=split_quota(config.batch_size // group_size, plan.weights))


def max_shards(plan: ShardPlan) -> int:
    """The most shards that each get envs and a share of every batch: per task with a share,
    no more shards than its envs or its groups."""
    return max(1, sum(min(len(plan.envs[t]), q) for t, q in plan.quota.items() if q > 0))


def auto_shards(plan: ShardPlan, cpus: float | None) -> int:
    """Shards when none are asked for: one per :data:`ENVS_PER_SHARD` envs (rounded up), at most
    ``cpus`` (the CPU pool's free slots, when known) and :func:`max_shards`, at least 1."""
    n = math.ceil(sum(len(v) for v in plan.envs.values()) / ENVS_PER_SHARD)
    if cpus is not None:
        n = min(n, int(cpus))
    return max(1, min(n, max_shards(plan)))


def _shard_seed(seed: int, index: int) -> int:
    """Shard ``index``'s scheduler seed: its own stream, derived from the pipeline's seed."""
    return random.Random(f"rollout-shard/{seed}/{index}").getrandbits(62)


def plan_shards(plan: ShardPlan, n: int) -> list[ShardPlan]:
    """Split the whole run's ``plan`` (envs and each batch's groups) over ``n`` shards (see the
    module docstring).

    Each task with a share of the batch goes to ``min(n, its envs, its groups)`` shards, the
    ones with the fewest envs so far, so each of those gets at least one group and one env;
    a task without a share (weight 0) goes to the shards with the fewest envs. ``n == 1``
    returns ``plan`` unchanged.

    Raises:
        ConfigError: more shards than can each get envs and a share of every batch
            (:func:`max_shards`).
    """
    if n == 1:
        return [plan]
    envs, quota = plan.envs, plan.quota
    most = max_shards(plan)
    if n > most:
        raise ConfigError(
            f"rollout_shards={n}, but at most {most} shard(s) can each get envs and a share of every batch "
            f"(batch of {plan.batch_groups} group(s) of {plan.group_size}, envs per task "
            f"{ {t: len(v) for t, v in envs.items()} }); use rollout_shards<={most}, or None to choose",
            where="pipeline config",
        )
    shard_envs: list[dict[str, list[Any]]] = [{} for _ in range(n)]
    shard_quota: list[dict[str, int]] = [{} for _ in range(n)]
    load, groups = [0] * n, [0] * n  # envs and groups per shard so far
    shared = [t for t in envs if quota[t] > 0]
    for task in shared + [t for t in envs if quota[t] <= 0]:
        q, templates = quota[task], envs[task]
        if not templates:
            continue
        pool = range(n) if q > 0 else [s for s in range(n) if groups[s] > 0]
        k = min(len(pool), len(templates), q) if q > 0 else min(len(pool), len(templates))
        chosen = sorted(pool, key=lambda s: (load[s], groups[s], s))[:k]
        for j, s in enumerate(chosen):
            shard_envs[s][task] = templates[j::k]
            load[s] += len(shard_envs[s][task])
        for j, s in enumerate(sorted(chosen, key=lambda s: (groups[s], s))):  # the odd groups to the fewest
            shard_quota[s][task] = q // k + (j < q % k)
            groups[s] += shard_quota[s][task]
    return [
        dataclasses.replace(
            plan,
            envs=e,
            quota=dict(qt),
            task_weights=dict(qt),
            seed=_shard_seed(plan.seed, i),
            curricula={t: c for t, c in (plan.curricula or {}).items() if t in e} or None,
        )
        for i, (e, qt) in enumerate(zip(shard_envs, shard_quota, strict=True))
    ]


def _results(futures: list[Any]) -> list[Any]:
    """Every future's result, in order; the first error is raised once all have ended."""
    out, error = [], None
    for f in futures:
        try:
            out.append(f.result())
        except Exception as e:
            out.append(None)
            error = error or e
    if error is not None:
        raise error
    return out


def _merge(values: list[Any], key: str = "") -> Any:
    """Per-shard stats as one: numbers add up (durations ``*_s`` and ``version`` take the most),
    flags any, dicts merge by key, equal-length number lists add element-wise (per generator),
    other lists concatenate, anything else is the first shard's."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    first = values[0]
    if all(isinstance(v, bool) for v in values):
        return any(values)
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return max(values) if key == "version" or key.endswith("_s") else sum(values)
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        return {k: _merge([v.get(k) for v in values], str(k)) for k in keys}
    if all(isinstance(v, list) for v in values):
        numeric = all(isinstance(x, int | float) and not isinstance(x, bool) for v in values for x in v)
        if numeric and len({len(v) for v in values}) == 1:
            return [sum(xs) for xs in zip(*values, strict=True)]
        return [x for v in values for x in v]
    return first


def merge_engines(per_shard: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each shard's proxy view of the engines (``LLMProxy.engines()``) as one: turns in flight
    and queued add up, occupancy is recomputed from the sum."""
    out: dict[str, dict[str, Any]] = {}
    for engines in per_shard:
        for e in engines:
            row = out.setdefault(e["name"], {**e, "inflight": 0, "queued": 0})
            row["inflight"] += e.get("inflight", 0)
            row["queued"] += e.get("queued", 0)
            row["capacity"] = row.get("capacity") or e.get("capacity")
            row["dead"] = bool(row.get("dead")) or bool(e.get("dead"))
    for row in out.values():
        cap = row.get("capacity")
        row["occupancy"] = min(row["inflight"] / cap, 1.0) if cap else None
    return list(out.values())


class ShardedRollout:
    """The rollout of one pipeline over ``len(plans)`` RolloutWorker clusters, as one object.

    It has the methods the Pipeline calls on its rollout (those of
    :class:`~rollart_nb.control.rollout_worker.RolloutWorker`, without ``.remote()``).

    Args:
        runtime: builds and closes the shard clusters.
        name: the rollout's name (``<pipeline>.rollout``); one shard is the cluster of that
            name, several are ``<name>.0``, ``<name>.1``, ...
        plans: from :func:`plan_shards`.
        **worker_kwargs: the other RolloutWorker arguments (model, targets, task_affinity, pd,
            max_inflight, dispatch), the same for every shard.

    Example:
        >>> plans = plan_shards(plan_rollout(tasks.expand(), cfg, group_size=4), 2)   # doctest: +SKIP
        >>> rollout = ShardedRollout(runtime, "p.rollout", plans, model=m, targets=t,  # doctest: +SKIP
        ...                          task_affinity={})
        >>> rollout.start(0)                                                          # doctest: +SKIP
        16
    """

    def __init__(self, runtime: Runtime, name: str, plans: list[ShardPlan], **worker_kwargs: Any) -> None:
        self.runtime, self.name, self.plans = runtime, name, plans
        self.names = [name] if len(plans) == 1 else [f"{name}.{i}" for i in range(len(plans))]
        self.clusters: list[ClusterBase] = []
        # the rollout needs neither the trackers nor the weight transport, objects that may not pickle
        sent = [dataclasses.replace(p, config=p.config.replace(trackers=(), weights="direct")) for p in plans]
        try:
            for shard, plan in zip(self.names, sent, strict=True):
                self.clusters.append(
                    runtime.cluster(ClusterSpec.of(shard, RolloutWorker, pool="cpu", plan=plan, **worker_kwargs))
                )
        except BaseException:
            self.close()
            raise
        self.batch_size = sum(p.batch_size for p in plans)
        # tasks in env order: a batch lists its groups task by task, as one scheduler does
        self._task_order = {t: i for i, t in enumerate(dict.fromkeys(t for p in plans for t in p.envs))}

    # -- plumbing ------------------------------------------------------------------------
    @property
    def shards(self) -> int:
        """Number of rollout shards."""
        return len(self.clusters)

    @property
    def workers(self) -> list[Any]:
        """Every shard's worker handles, shard by shard."""
        return [h for c in self.clusters for h in c.workers]

    @property
    def closed_fix(self) -> str:
        """What a call after close should do instead (set on every shard cluster)."""
        return self.clusters[0].closed_fix if self.clusters else ""

    @closed_fix.setter
    def closed_fix(self, fix: str) -> None:
        for c in self.clusters:
            c.closed_fix = fix

    def _each(self, method: str, args: Callable[[int], tuple[tuple, dict]] | None = None) -> list[Any]:
        """Call ``method`` on every shard at once (``args(i)``: shard ``i``'s arguments); results in order."""
        futures = []
        for i, c in enumerate(self.clusters):
            a, kw = args(i) if args is not None else ((), {})
            futures.append(getattr(c, method)(*a, blocking=False, **kw))
        return _results(futures)

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` with the same arguments on every shard at once."""
        return self._each(method, lambda _i: (args, kwargs))

    def _shares(self, n: int) -> list[int]:
        """Each shard's part of a batch of ``n``."""
        if len(self.plans) == 1:
            return [n]
        if n != self.batch_size:
            raise ConfigError(
                f"a rollout of {self.shards} shards forms batches of {self.batch_size} (its batch_size); "
                f"{n} was asked for. Build the pipeline with batch_size={n} instead",
                where=self.name,
            )
        return [p.batch_size for p in self.plans]

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, version: int = 0, launch: bool = True) -> int:
        """Start every shard (see :meth:`RolloutWorker.start`); returns the envs of all shards."""
        return sum(self._all("start", version, launch))

    def shutdown(self) -> dict[str, int]:
        """Cancel every shard's in-flight trajectories; returns the final counts, summed."""
        return _merge(self._all("shutdown")) or {}

    def close(self) -> None:
        """Close every shard cluster (idempotent)."""
        for name in self.names[: len(self.clusters)]:
            self.runtime.close_cluster(name)

    # -- batches -------------------------------------------------------------------------
    def wait_ready(self, n: int, timeout_s: float | None = None) -> None:
        """Wait until every shard holds its share of a batch of ``n``."""
        shares = self._shares(n)
        self._each("wait_ready", lambda i: ((shares[i], timeout_s), {}))

    def wait_for_batch(self, n: int, timeout_s: float) -> dict[str, Any]:
        """:meth:`RolloutWorker.wait_for_batch` on every shard: ready when all are, ``dead`` merged."""
        shares = self._shares(n)
        res = self._each("wait_for_batch", lambda i: ((shares[i], timeout_s), {}))
        dead: dict[int, str] = {}
        for r in res:
            for k, v in r["dead"].items():
                dead.setdefault(k, v)
        return {"ready": all(r["ready"] for r in res), "dead": dead}

    def take_batch(self, n: int) -> list[Trajectory]:
        """Every shard's share (whole groups), task by task."""
        shares = self._shares(n)
        parts = self._each("take_batch", lambda i: ((shares[i],), {}))
        if len(parts) == 1:
            return parts[0]
        return sorted((t for p in parts for t in p), key=lambda t: self._task_order.get(t.task, 0))

    def set_version(self, version: int, rollback: bool = False) -> dict[str, int]:
        """Every shard moves to ``version`` (one staleness rule); counts summed."""
        return _merge(self._all("set_version", version, rollback=rollback)) or {}

    def start_iteration(self) -> None:
        self._all("start_iteration")

    def suspend(self, timeout_s: float | None = None, preempt: bool = False) -> None:
        self._all("suspend", timeout_s, preempt=preempt)

    def resume(self) -> None:
        self._all("resume")

    def hold(self) -> None:
        self._all("hold")

    def release(self) -> None:
        self._all("release")

    # -- generators ----------------------------------------------------------------------
    def dead_targets(self) -> dict[int, str]:
        """Generation workers any shard saw die: index -> reason."""
        out: dict[int, str] = {}
        for d in self._all("dead_targets"):
            for k, v in d.items():
                out.setdefault(k, v)
        return out

    def replace_target(self, index: int, target: tuple[Any, str, str, str]) -> None:
        self._all("replace_target", index, target)

    # -- rewards and validation ------------------------------------------------------------
    def set_reward(self, task: str, fn: Any = None, **kwargs: Any) -> int:
        """Register or swap ``task``'s reward on every shard; returns the new reward version."""
        return int(self._all("set_reward", task, fn, **kwargs)[0])

    def reward_history(self) -> list[dict[str, Any]]:
        return self.clusters[0].reward_history()

    def evaluate(self, task: str, seeds: list[int], **kwargs: Any) -> dict[str, Any]:
        """Validation of ``task`` (see :meth:`RolloutWorker.evaluate`) on a shard that has its envs."""
        return self._shard_of(task).evaluate(task, seeds, **kwargs)

    def score(self, traj: Trajectory, rows: list[list[int]]) -> dict[str, Any]:
        """``traj``'s sequences ``rows`` scored under the served weights (see
        :meth:`RolloutWorker.score`) through a shard that has its task's envs."""
        return self._shard_of(traj.task).score(traj.id, traj.task, rows)

    def regenerate(self, traj: Trajectory, from_turn: int) -> Trajectory:
        """``traj`` regenerated from ``from_turn`` (see :meth:`RolloutWorker.regenerate`) on a
        shard that has its task's envs."""
        return self._shard_of(traj.task).regenerate(traj, from_turn)

    def _shard_of(self, task: str) -> ClusterBase:
        """The rollout cluster of the first shard that has ``task``'s envs (the first shard if none has)."""
        return self.clusters[next((i for i, p in enumerate(self.plans) if task in p.envs), 0)]

    # -- views -----------------------------------------------------------------------------
    def trajectories(
        self, task: str | None = None, status: str | None = None, last: int | None = None, include_running: bool = False
    ) -> list[Trajectory]:
        """Recent trajectories of every shard, ended ones by end time, then running ones; newest last."""
        parts = self._all("trajectories", task, status, last, include_running)
        if len(parts) == 1:
            return parts[0]
        merged = sorted(
            (t for p in parts for t in p),
            key=lambda t: (not t.finished_s, t.finished_s or t.created_s),
        )
        return merged[-last:] if last else merged

    def stats(self) -> dict[str, Any]:
        """Every shard's stats as one (see :func:`_merge`: counts, events, accounting, env,
        rewards and proxy counters summed; ``version`` the shards'; ``curriculum`` per task from
        the first shard with it); ``shards`` lists each shard's own ``name``, ``envs``,
        ``batch_size``, ``quota``, ``accounting``, ``proxy`` and ``curriculum``."""
        per = self._all("stats")
        if len(per) == 1:
            out = dict(per[0])
        else:
            out = _merge([{k: v for k, v in s.items() if k != "curriculum"} for s in per]) or {}
            out["failures"] = out.get("failures", [])[-8:]
            curriculum: dict[str, Any] = {}
            for s in per:
                for t, summary in (s.get("curriculum") or {}).items():
                    curriculum.setdefault(t, summary)
            out["curriculum"] = curriculum
            if isinstance(out.get("proxy"), dict):  # one row per engine, not one per engine and shard
                out["proxy"]["engines"] = merge_engines([s.get("proxy", {}).get("engines", []) for s in per])
        out["shards"] = [
            {
                "name": name,
                "envs": s.get("envs", 0),
                "batch_size": p.batch_size,
                "quota": dict(p.quota),
                "accounting": s.get("accounting", {}),
                "proxy": s.get("proxy", {}),
                "curriculum": s.get("curriculum", {}),
            }
            for name, p, s in zip(self.names, self.plans, per, strict=True)
        ]
        return out

    def __repr__(self) -> str:
        return f"ShardedRollout({self.name!r}, shards={self.shards}, batch_size={self.batch_size})"
