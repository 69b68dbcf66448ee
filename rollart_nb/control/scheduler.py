"""RolloutScheduler: keeps E EnvManagers busy, forms GRPO groups, scores, buffers.

- **Groups**: members of a group share the env seed (so the prompt). A group launches
  ``group_size + redundancy`` members; once ``group_size`` are scored the rest are cancelled
  (redundant rollouts). A member that fails or is aborted is replaced while the group is open.
- **Reward overlaps rollout**: each finished trajectory is scored at once (unless the mode
  scores after the batch), while its EnvManager already runs the next one.
- **Staleness**: :meth:`set_version` aborts in-flight trajectories begun before
  ``version - alpha`` (rollart) and evicts stale ones from the :class:`SampleBuffer`.
- **Accounting**: every trajectory ends in exactly one terminal status (completed,
  aborted_stale, cancelled, failed with a reason); ``stats()["accounting"]`` checks that
  ``started == ended + in flight`` (``unaccounted`` is 0). Counts and the last trajectories
  are kept for reports and the viewer.
- **Env faults**: sync env calls run on one :class:`~rollart_nb.envs.base.BlockingPool` sized
  for the envs, apart from the loop's default executor; hung calls are abandoned and their
  threads replaced. ``stats()["env"]`` counts env restarts, timeouts and abandoned threads.
- **Stalls**: a task whose recent trajectories all fail stops :meth:`wait_ready` with a
  :class:`~rollart_nb.errors.RolloutStalledError`; when the failures are one user-code error
  (same reason, with a traceback) and the task never succeeded, after ``group_size`` of them.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rollart_nb import _ray
from rollart_nb.config import FAILED_POLICIES, PipelineConfig
from rollart_nb.control.buffer import SampleBuffer, split_quota
from rollart_nb.control.curriculum import curriculum_problems
from rollart_nb.control.env_manager import EnvManager, RolloutConfig, TurnBarrier
from rollart_nb.control.modes import Mode
from rollart_nb.control.reward import RewardDispatcher
from rollart_nb.envs.base import BlockingPool
from rollart_nb.errors import ConfigError, RewardError, RolloutStalledError
from rollart_nb.logs import TRACEBACK_HEAD, capture_user_output
from rollart_nb.trajectory import FAILED_IN, FAILURE, Status, Trajectory

__all__ = ["GroupState", "RolloutScheduler", "SchedulerConfig"]

log = logging.getLogger(__name__)

# Failure reasons name the env manager and trajectory; the stall message groups reasons without them.
_ENV_INDEX = re.compile(r"env #\d+")
_TRAJ_ID = re.compile(r"trajectory [0-9a-f]+")


def _reason_key(reason: str) -> str:
    """A failure reason without the ids that differ between trajectories of one error."""
    return _TRAJ_ID.sub("trajectory …", _ENV_INDEX.sub("env #…", reason))


def _env_number(name: str) -> int:
    return int(name.rsplit("#", 1)[1])


_DEFAULTS = PipelineConfig()  # the loop's defaults are defined once, in PipelineConfig


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler needs to know about the run.

    Attributes:
        batch_size: trajectories per training batch (a whole number >= 1, a multiple of group_size).
        group_size: GRPO group size (a whole number >= 1).
        alpha: staleness bound (a whole number of versions >= 0).
        mode: pipeline mode switches: a :class:`~rollart_nb.control.modes.Mode`, or the name of
            one of :data:`~rollart_nb.control.modes.MODES` (replaced by that Mode).
        redundancy: extra members launched per group (cancelled once the group is complete).
        seed: seeds env seeds and task sampling (a whole number).
        task_weights: task -> weight in each batch (finite, >= 0, a positive sum; default uniform).
        max_group_failures: failures after which a group is abandoned (its env keeps failing; >= 1).
        failed_trajectories: "exclude" or "penalize" (see :class:`~rollart_nb.config.PipelineConfig`).
        failure_reward: the reward of a penalized failed trajectory.
        rollout: EnvManager settings.
        curricula: task -> :class:`~rollart_nb.control.curriculum.PromptCurriculum` (or anything
            with ``next_seed(rng)`` and ``update(seed, reward)``): that task's groups draw their
            seeds from it, and every scored trajectory updates it. The scheduler works on its
            own copy.
    """

    batch_size: int
    group_size: int
    alpha: int = _DEFAULTS.alpha
    mode: Mode = field(default_factory=lambda: Mode(_DEFAULTS.mode))
    redundancy: int = _DEFAULTS.redundancy
    seed: int = 0
    task_weights: dict[str, float] | None = None
    max_group_failures: int = 16
    failed_trajectories: str = _DEFAULTS.failed_trajectories
    failure_reward: float = _DEFAULTS.failure_reward
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    curricula: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        import difflib
        import math
        import numbers

        from rollart_nb._checks import is_number
        from rollart_nb._checks import is_whole as whole
        from rollart_nb.control.modes import MODES

        if isinstance(self.curricula or {}, dict):
            p = curriculum_problems(self.curricula or {})
        else:
            p = [f"curricula={self.curricula!r} must be a dict task -> curriculum, or None"]
        group_ok = whole(self.group_size) and self.group_size >= 1
        if not group_ok:
            p.append(f"group_size={self.group_size!r} must be a whole number >= 1 (trajectories per GRPO group)")
        if not whole(self.batch_size) or self.batch_size < 1 or group_ok and self.batch_size % self.group_size:
            msg = f"batch_size={self.batch_size!r} must be a positive multiple of group_size={self.group_size!r}"
            if group_ok and isinstance(self.batch_size, numbers.Real) and 0 < self.batch_size < math.inf:
                lo = max(int(self.batch_size // self.group_size), 1) * self.group_size
                msg += f"; use e.g. batch_size={lo} or {lo + self.group_size}"
            p.append(msg)
        if not whole(self.alpha) or self.alpha < 0:
            p.append(f"alpha={self.alpha!r} must be a whole number of versions >= 0 (0: on-policy only)")
        if not whole(self.redundancy) or self.redundancy < 0:
            p.append(f"redundancy={self.redundancy!r} must be a whole number >= 0 (extra members per group)")
        if not whole(self.max_group_failures) or self.max_group_failures < 1:
            p.append(f"max_group_failures={self.max_group_failures!r} must be a whole number >= 1")
        if self.failed_trajectories not in FAILED_POLICIES:
            p.append(f"failed_trajectories={self.failed_trajectories!r} must be one of {', '.join(FAILED_POLICIES)}")
        if not is_number(self.failure_reward) or not math.isfinite(self.failure_reward):
            p.append(f"failure_reward={self.failure_reward!r} must be a finite number")
        if not whole(self.seed):
            p.append(f"seed={self.seed!r} must be a whole number")
        if isinstance(self.mode, str) and self.mode in MODES:
            object.__setattr__(self, "mode", MODES[self.mode])  # a name stands for its Mode
        elif not isinstance(self.mode, Mode):
            close = difflib.get_close_matches(str(self.mode), MODES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            p.append(f"mode={self.mode!r} is not a known mode{hint}; choose one of {', '.join(MODES)}")
        if not isinstance(self.rollout, RolloutConfig):
            p.append(f"rollout={self.rollout!r} must be a RolloutConfig(...)")
        weights = self.task_weights
        if weights is not None and not isinstance(weights, dict):
            p.append(f"task_weights={weights!r} must be a dict task -> weight, or None (uniform)")
        elif weights:
            bad = {t: w for t, w in weights.items() if not (is_number(w) and w >= 0)}
            if bad:
                p.append(f"task_weights {bad!r} must be finite numbers >= 0")
            elif not sum(weights.values()) > 0:
                p.append(f"task_weights={weights!r} must have a positive sum (give some task a weight > 0)")
        if p:
            raise ConfigError(p, where="pipeline config")

    @property
    def batch_groups(self) -> int:
        return self.batch_size // self.group_size


@dataclass
class GroupState:
    """Bookkeeping of one GRPO group."""

    id: str
    task: str
    seed: int
    budget: int  # members still to launch
    running: set[str] = field(default_factory=set)
    buffered: set[str] = field(default_factory=set)
    failures: int = 0
    closed: bool = False
    close_reason: str = ""


class EndedLog:
    """The most recently ended trajectories, whole (for the viewer and ``pipe.trajectories``),
    bounded by count and by tokens: the oldest leave first, so a long run's memory stays flat
    whatever its trajectories' lengths.

    Args:
        max_trajectories: most trajectories kept.
        max_tokens: most tokens kept (each trajectory's conversation plus its generated tokens,
            whose log-probabilities and masks are stored per token).
    """

    def __init__(self, max_trajectories: int = 4096, max_tokens: int = 1 << 21) -> None:
        self.max_trajectories, self.max_tokens = max_trajectories, max_tokens
        self._items: collections.deque[tuple[Trajectory, int]] = collections.deque()
        self.tokens = 0

    def append(self, traj: Trajectory) -> None:
        last = traj.turns[-1] if traj.turns else None
        size = (len(last.prompt_ids) + len(last.response_ids) if last is not None else 0) + _generated(traj)
        self._items.append((traj, size))
        self.tokens += size
        while self._items and (len(self._items) > self.max_trajectories or self.tokens > self.max_tokens):
            self.tokens -= self._items.popleft()[1]

    def __iter__(self) -> Iterator[Trajectory]:
        return (t for t, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)


class RolloutScheduler:
    """Trajectory-level rollout over many EnvManagers (runs inside one asyncio loop).

    Args:
        envs: task -> list of env templates (one EnvManager each).
        tokenizer: shared tokenizer.
        proxy: the LLMProxy.
        rewards: the RewardDispatcher.
        config: :class:`SchedulerConfig`.
        id_salt: mixed into the seeded trajectory/group id stream (the pipeline's rollout role).
    """

    def __init__(
        self,
        envs: dict[str, list[Any]],
        tokenizer: Any,
        proxy: Any,
        rewards: RewardDispatcher,
        config: SchedulerConfig,
        id_salt: str = "",
    ) -> None:
        self.cfg, self.mode = config, config.mode
        self.proxy, self.rewards, self.tok = proxy, rewards, tokenizer
        n_envs = sum(len(v) for v in envs.values())
        if not n_envs:
            raise ConfigError("no environments: pass tasks with envs_per_task >= 1")
        # One thread per env for its sync calls, apart from the loop's default executor (the
        # control plane's), plus replacements for hung calls up to the configured cap.
        self.env_pool = BlockingPool("env", size=n_envs, max_replacements=config.rollout.max_abandoned_threads)
        if hasattr(rewards, "reserve_threads"):  # a sync reward runs once per finished trajectory
            rewards.reserve_threads(n_envs)
        self.managers: list[EnvManager] = []
        # indices of the managers not running a trajectory (kept by the managers themselves), so
        # schedule() costs what is idle, not every env
        self._idle: set[int] = set()
        for task, templates in envs.items():
            for env in templates:
                m = EnvManager(len(self.managers), task, env, tokenizer, proxy, config.rollout, pool=self.env_pool)
                m.idle_set = self._idle
                m.busy = False  # idle: in the set
                self.managers.append(m)
        self.tasks = list(envs)
        # uniform task sampling by default: each batch holds each task's share of groups
        self.weights = {t: (config.task_weights or {}).get(t, 0.0) if config.task_weights else 1.0 for t in self.tasks}
        self.E = len(self.managers)
        self._envs_of = collections.Counter(m.task for m in self.managers)
        self.rng = random.Random(config.seed)
        # Trajectory and group ids from their own seeded stream: a run is reproducible (sampling
        # seeds and sim responses hash the id) and ids never shift the group seeds above. The
        # salt (the rollout worker's role, i.e. the pipeline's name) keeps two pipelines with one
        # seed from sharing ids on the generators they share.
        self._ids = random.Random(f"ids/{config.seed}/{id_salt}")
        problems = curriculum_problems(config.curricula or {}, envs)
        if problems:  # the config checked the objects; only here are the task names known
            raise ConfigError(problems, where="pipeline config")
        self.curricula = {t: copy.deepcopy(c) for t, c in (config.curricula or {}).items()}
        self._batch_quota = split_quota(config.batch_groups, self.weights)
        # The admission rules below keep each task under (alpha+1) * its share + its envs; the
        # hard cap sits above that sum so it only ever acts as a safety net.
        groups = sum(max(q, 1) for q in self._batch_quota.values())
        cap = (config.alpha + 2) * groups * config.group_size + self.E
        self.buffer = SampleBuffer(config.group_size, config.alpha if self.mode.abort_stale else None, cap)
        self.version = 0
        self.groups: dict[str, GroupState] = {}
        self.running: dict[str, tuple[Trajectory, asyncio.Task, EnvManager]] = {}
        # per task, kept as they change: running trajectories, and buffered members of open groups
        # (what _ahead() counts, without a pass over every trajectory and group)
        self._running_n: collections.Counter[str] = collections.Counter()
        self._buffered_n: collections.Counter[str] = collections.Counter()
        self.scoring: dict[str, str] = {}  # trajectory id -> task, while its reward runs
        # counts: trajectories by their current end status (a buffered sample evicted later moves
        # from completed to aborted_stale); events: endings as they happen, never decremented
        self.counts: collections.Counter[str] = collections.Counter()
        self.events: collections.Counter[str] = collections.Counter()
        # generated (response) tokens of ended trajectories, by how they ended: wasted work shows here
        self.generated: collections.Counter[str] = collections.Counter()
        # the same as events that only grow: "ended" (every trajectory once, at its first ending)
        # and, by kind, tokens that became waste ("aborted_stale", "cancelled": at the ending or
        # when the buffer evicts a completed sample), so a step's wasted share is a difference
        self.token_events: collections.Counter[str] = collections.Counter()
        # the same per task: task -> kind -> count (every step's per-task endings come from it)
        self.task_events: collections.defaultdict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.ended = EndedLog()
        self._buffered_ids: set[str] = set()  # counted completed and still in the buffer
        self.failure_reasons: collections.deque[tuple[str, str]] = collections.deque(maxlen=64)
        self.started_groups = 0
        self.quota: dict[str, int] = dict.fromkeys(self.tasks, 0)
        self._barrier: TurnBarrier | None = None
        self._pending_reward: list[tuple[Trajectory, GroupState]] = []
        self._closed = False
        self.consecutive_failures: collections.Counter[str] = collections.Counter()  # per task
        # per task: (reason without env/trajectory ids, failures in a row with it, the first one's reason)
        self._same_failure: dict[str, tuple[str, int, str]] = {}
        self.completed_by_task: collections.Counter[str] = collections.Counter()
        if _ray.in_worker_process():  # a rollout actor: env/reward print and logging go to its log file
            capture_user_output()
        self.launched = 0
        self.batches_taken = 0
        self.started_by_task: collections.Counter[str] = collections.Counter()
        self.given_up_by_task: collections.Counter[str] = collections.Counter()  # closed, never batched
        self._tasks: set[asyncio.Task] = set()

    # -- launching -------------------------------------------------------------------
    def start_iteration(self) -> None:
        """Quota modes: allow one more iteration's groups (split across tasks by weight)."""
        for t, n in split_quota(self.cfg.batch_groups, self.weights).items():
            self.quota[t] += n
        self.schedule()

    def _may_open_group(self, task: str, ahead: collections.Counter[str]) -> bool:
        if not self.mode.continuous:
            return self.quota.get(task, 0) > 0
        # Per-task limits, so a fast task cannot crowd out a slow one that the batch also needs.
        quota = max(self._batch_quota[task], 1)
        if self.mode.admit_by_version:
            # groups a batch will still take (opened, less those given up) <= (batches taken + alpha + 1)
            # batches' worth, one version per batch taken: a group opened beyond that would be
            # trained on at least alpha + 1 versions after it began (too stale to use)
            live = self.started_by_task[task] - self.given_up_by_task[task]
            return live < (self.batches_taken + self.cfg.alpha + 1) * quota
        return ahead[task] < (self.cfg.alpha + 1) * quota * self.cfg.group_size + self._envs_of[task]

    def _ahead(self) -> collections.Counter[str]:
        """Per task: trajectories running, being scored or buffered in an open group."""
        ahead = self._running_n + self._buffered_n
        ahead.update(self.scoring.values())
        return ahead

    def _buffer_member(self, g: GroupState, tid: str, add: bool) -> None:
        """Add ``tid`` to (or remove it from) ``g``'s buffered members, keeping the per-task count."""
        if (tid in g.buffered) == add:
            return
        (g.buffered.add if add else g.buffered.discard)(tid)
        if self.groups.get(g.id) is g:
            self._buffered_n[g.task] += 1 if add else -1

    def _unrun(self, traj_id: str) -> tuple[Trajectory, asyncio.Task, EnvManager] | None:
        """Remove a trajectory from :attr:`running` (None if it was not there)."""
        item = self.running.pop(traj_id, None)
        if item is not None:
            self._running_n[item[0].task] -= 1
        return item

    def _open_group(self, task: str) -> GroupState:
        if not self.mode.continuous:
            self.quota[task] -= 1
        self.started_groups += 1
        self.started_by_task[task] += 1
        cur = self.curricula.get(task)
        seed = int(cur.next_seed(self.rng)) if cur is not None else self.rng.randrange(2**31)
        g = GroupState(f"{self._ids.getrandbits(40):010x}", task, seed, self.cfg.group_size + self.cfg.redundancy)
        self.groups[g.id] = g
        return g

    def schedule(self) -> None:
        """Give every idle EnvManager a trajectory to run, if the mode allows one.

        It runs after every trajectory ends, and a what-if study has thousands of envs, most of
        them idle while the admission rule holds their task back: so a task that can take no
        trajectory is found once per call (not once per idle env), and a call where no task
        can take one costs O(tasks + G) (G open groups), else O(idle envs + G). Each idle env
        (in env order) joins the oldest open group of its task with budget left, else opens a
        group if the admission rule allows.
        """
        if self._closed or getattr(self.proxy, "held", False):
            return  # a validation holds the rollout: no new trajectory until it ends
        if self.mode.batch_env and (self.running or self._pending_reward):
            return  # batch-level: the next wave starts when this one (and its scoring) is done
        if not self._idle:
            return
        ahead = self._ahead()  # as of this call; the plan's own launches are not counted
        open_groups: dict[str, collections.deque[GroupState]] = collections.defaultdict(collections.deque)
        for g in self.groups.values():  # insertion order: oldest group first
            if not g.closed and g.budget > 0:
                open_groups[g.task].append(g)
        # Tasks that can take no trajectory now: broken ones (wait_ready is about to stop the
        # run), and those with no open group and no admission. Within one call, opening a group
        # only turns _may_open_group from True to False (``ahead`` is fixed; the quota and the
        # groups started only move toward the limit), so a task found full stays full.
        full = {
            t for t in self.tasks if self._is_broken(t) or not open_groups[t] and not self._may_open_group(t, ahead)
        }
        if len(full) == len(self.tasks):
            return
        plan: list[tuple[EnvManager, GroupState]] = []
        for i in sorted(self._idle):
            m = self.managers[i]
            if m.task in full:
                continue
            q = open_groups[m.task]
            if not q:
                if not self._may_open_group(m.task, ahead):
                    full.add(m.task)
                    if len(full) == len(self.tasks):
                        break
                    continue
                q.append(self._open_group(m.task))
            g = q[0]
            g.budget -= 1
            if g.budget <= 0:
                q.popleft()
            m.busy = True  # reserved until its task starts
            plan.append((m, g))
        if not plan:
            return
        self._barrier = TurnBarrier(len(plan)) if self.mode.batch_env else None
        for m, g in plan:
            traj = Trajectory(
                g.task,
                seed=g.seed,
                group_id=g.id,
                start_version=self.version,
                created_s=time.time(),
                id=f"{self._ids.getrandbits(48):012x}",
            )
            g.running.add(traj.id)
            task = asyncio.get_running_loop().create_task(self._run(m, traj, g, self._barrier))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

            def reap(_t: asyncio.Task, traj: Trajectory = traj, g: GroupState = g, m: EnvManager = m) -> None:
                self._reap(traj, g, m)

            task.add_done_callback(reap)
            self.running[traj.id] = (traj, task, m)
            self._running_n[traj.task] += 1
            self.launched += 1

    async def _run(self, m: EnvManager, traj: Trajectory, g: GroupState, barrier: TurnBarrier | None) -> None:
        try:
            if m.failures_in_a_row:  # back off a failing env (or backend) instead of spinning on it
                await asyncio.sleep(min(2.0, 0.01 * 2 ** min(m.failures_in_a_row, 8)))
            await m.run(traj, barrier=barrier)
        except asyncio.CancelledError:
            traj.finish(Status.CANCELLED, "cancelled", now=time.time())  # no-op if the canceller set a status
            m.busy = False
        except Exception as e:  # a bug must not lose the trajectory (its group would wait for it forever)
            log.exception("rollout of trajectory %s on env #%d failed", traj.id, m.index)
            traj.finish(
                Status.FAILED,
                f"rollout error: {type(e).__name__}: {e} [env #{m.index}, task {traj.task!r}]",
                now=time.time(),
            )
            m.busy = False
        finally:
            self._unrun(traj.id)
            g.running.discard(traj.id)
            self.proxy.forget(traj.id)
        if traj.status is Status.FAILED:
            m.failures_in_a_row += 1
        elif not traj.status.terminal:
            m.failures_in_a_row = 0
        if traj.status.terminal:
            if not self._penalize(traj, g):
                self._end(traj, g)
            self.schedule()
            return
        if self.mode.reward_after_batch:
            self._pending_reward.append((traj, g))
            if not self.running:
                pending, self._pending_reward = self._pending_reward, []
                self.scoring.update((t.id, t.task) for t, _ in pending)
                await asyncio.gather(*(self._score(t, grp) for t, grp in pending))
            self.schedule()
            return
        self.scoring[traj.id] = traj.task
        self.schedule()  # the env is free again while the reward runs
        await self._score(traj, g)
        self.schedule()

    async def _score(self, traj: Trajectory, g: GroupState) -> None:
        try:
            await self.rewards.score(traj)
        except RewardError as e:
            traj.finish(Status.FAILED, f"reward: {e}", now=time.time())
            traj.info[FAILED_IN] = "reward"
        except Exception as e:  # not the reward's own failure (RewardError) but still this trajectory's end
            log.exception("scoring trajectory %s failed", traj.id)
            traj.finish(
                Status.FAILED,
                f"reward: {type(e).__name__}: {e} [task {traj.task!r}, trajectory {traj.id}]",
                now=time.time(),
            )
        except asyncio.CancelledError:
            traj.finish(Status.CANCELLED, "pipeline closed while scoring", now=time.time())
            self._end(traj, g)
            raise
        finally:
            self.scoring.pop(traj.id, None)
        if traj.status.terminal:
            if not self._penalize(traj, g):
                self._end(traj, g)
            return
        if g.closed:
            traj.finish(Status.CANCELLED, f"group already closed ({g.close_reason})", now=time.time())
            self._end(traj, g)
            return
        if traj.max_version > self.version:  # scored across a trainer restore
            traj.finish(
                Status.ABORTED_STALE,
                f"generated by weights newer than version {self.version}, lost when the trainer was restored",
                now=time.time(),
            )
            self._end(traj, g)
            return
        traj.status, traj.finished_s = Status.COMPLETED, time.time()
        self._accept(traj, g)

    def _accept(self, traj: Trajectory, g: GroupState, penalized: bool = False) -> None:
        """Buffer a completed trajectory as a member of its group (or account its eviction)."""
        cur = self.curricula.get(traj.task)
        if cur is not None and not penalized:
            try:
                cur.update(traj.seed, traj.reward)
            except Exception:  # a curriculum bug costs its statistics, not the scored sample
                log.exception("curriculum of task %r failed to update", traj.task)
        rejected = self.buffer.put(traj)
        if traj not in rejected:
            self._buffer_member(g, traj.id, True)
            self._buffered_ids.add(traj.id)
            self.counts["completed"] += 1
            self.generated["completed"] += _generated(traj)
            self.token_events["ended"] += _generated(traj)
            self._count(traj.task, "completed")
            if penalized:  # counted only once it is in: a stale or surplus one ends as such instead
                self._count(traj.task, "penalized")
                self._note_failure(traj.task, traj.reason)
            self.ended.append(traj)
        self._on_evicted(rejected)
        if not penalized:  # a penalized one is a failure all the same: the stall and early-stop checks see it
            self.consecutive_failures[traj.task] = 0
            self.completed_by_task[traj.task] += 1
            self._same_failure.pop(traj.task, None)
        if len(g.buffered) >= self.cfg.group_size:
            self._cancel_surplus(g)

    def _penalize(self, traj: Trajectory, g: GroupState) -> bool:
        """With ``failed_trajectories="penalize"``: a trajectory that failed after the model acted
        (in an env step or its reward) becomes a completed member of its group with reward
        ``failure_reward``, its failure kept as ``info["rollart_failure"]``; counted ``penalized``
        once the buffer takes it (a stale or surplus one ends aborted_stale or cancelled).
        Returns False (nothing changed) for any other trajectory."""
        if (
            self.cfg.failed_trajectories != "penalize"
            or traj.status is not Status.FAILED
            or traj.info.get(FAILED_IN) not in ("env_step", "reward")
            or not any(t.response_ids for t in traj.turns)
            or g.closed
            or traj.max_version > self.version  # made by weights lost in a trainer restore
        ):
            return False
        reason = traj.reason
        traj.info[FAILURE] = reason
        traj.reward, traj.turn_rewards, traj.reward_version = float(self.cfg.failure_reward), None, -1
        traj.status, traj.reason, traj.finished_s = Status.COMPLETED, f"penalized: {reason}", time.time()
        self._accept(traj, g, penalized=True)
        return True

    def _count(self, task: str, kind: str) -> None:
        """One more ``kind`` ending (a status, "penalized" or "redundant_cancelled"), overall and for ``task``."""
        self.events[kind] += 1
        self.task_events[task][kind] += 1

    def _note_failure(self, task: str, reason: str) -> None:
        self.failure_reasons.append((task, reason))
        self.consecutive_failures[task] += 1
        key = _reason_key(reason)
        prev = self._same_failure.get(task)
        if prev is not None and prev[0] == key:
            self._same_failure[task] = (key, prev[1] + 1, prev[2])
        else:
            self._same_failure[task] = (key, 1, reason)

    # -- endings ---------------------------------------------------------------------
    def _reap(self, traj: Trajectory, g: GroupState, m: EnvManager) -> None:
        """Account a task cancelled before its body ever ran (it never reached its own cleanup)."""
        if self._unrun(traj.id) is None:
            return
        g.running.discard(traj.id)
        m.busy = False
        self.proxy.forget(traj.id)
        traj.finish(Status.CANCELLED, "cancelled before it started", now=time.time())
        self._end(traj, g)
        self.schedule()  # its env is free again

    def _end(self, traj: Trajectory, g: GroupState | None) -> None:
        """Account a trajectory that ended without entering the buffer (or left it)."""
        n = _generated(traj)
        self.counts[traj.status.value] += 1
        self.generated[traj.status.value] += n
        self.token_events["ended"] += n
        if traj.status in (Status.ABORTED_STALE, Status.CANCELLED):
            self.token_events[traj.status.value] += n
        self._count(traj.task, traj.status.value)
        self.ended.append(traj)
        if traj.status is Status.FAILED:
            self._note_failure(traj.task, traj.reason)
        if g is None or g.closed:
            return
        g.running.discard(traj.id)
        self._buffer_member(g, traj.id, False)
        if traj.status is Status.FAILED:
            g.failures += 1
            if g.failures >= self.cfg.max_group_failures:  # this env keeps failing: give the group up
                self._close_group(g, f"abandoned after {g.failures} failures")
                return
        if traj.reason.startswith("redundant"):
            return
        if len(g.buffered) + len(g.running) + g.budget < self.cfg.group_size:
            g.budget += 1  # replace the lost member (same seed, current version)

    def _on_evicted(self, evicted: list[Trajectory]) -> None:
        for t in evicted:
            g = self.groups.get(t.group_id)
            if t.id in self._buffered_ids:  # it was counted completed: move its count
                self._buffered_ids.discard(t.id)
                self.counts["completed"] -= 1
                self.counts[t.status.value] += 1
                n = _generated(t)
                self.generated["completed"] -= n
                self.generated[t.status.value] += n
                self.token_events[t.status.value] += n  # trained on by nobody after all
                self._count(t.task, t.status.value)  # events only grow: a step reports its own endings
                if g is None:  # its group was given up while it waited in the buffer
                    continue
                self._buffer_member(g, t.id, False)
                if t.status is Status.CANCELLED:  # dropped for capacity: give the group up, never churn
                    self._close_group(g, t.reason)
                elif not g.closed and len(g.buffered) + len(g.running) + g.budget < self.cfg.group_size:
                    g.budget += 1
            else:
                self._end(t, g)

    def _cancel_surplus(self, g: GroupState) -> None:
        g.budget = 0
        for tid in list(g.running):
            traj, task, _ = self.running[tid]
            traj.finish(Status.CANCELLED, "redundant: group complete", now=time.time())
            self.counts["redundant_cancelled"] += 1
            self._count(traj.task, "redundant_cancelled")
            task.cancel()

    def _close_group(self, g: GroupState, reason: str, taken: bool = False) -> None:
        """Close ``g``: its running members end cancelled. Members it has buffered stay there
        (counted completed) until the staleness bound or the buffer's capacity evicts them.
        ``taken``: a batch took the group (else it is given up)."""
        if not g.closed and not taken:
            self.given_up_by_task[g.task] += 1
        g.closed, g.budget, g.close_reason = True, 0, reason
        for tid in list(g.running):
            traj, task, _ = self.running[tid]
            traj.finish(Status.CANCELLED, reason, now=time.time())
            task.cancel()
        if self.groups.pop(g.id, None) is g:  # its buffered members no longer count as ahead
            self._buffered_n[g.task] -= len(g.buffered)

    # -- versions and batches ----------------------------------------------------------
    async def set_version(self, version: int, rollback: bool = False) -> dict[str, int]:
        """Advance the policy version; abort / evict what the staleness bound now excludes.

        ``rollback=True``: the trainer was restored to an older ``version``; trajectories with a
        turn generated by a newer version (weights that no longer exist) end aborted_stale.
        """
        aborted = 0
        if rollback:
            reason = (
                f"generated by weights newer than version {version}, lost when the trainer was restored "
                f"to version {version}"
            )
            self._on_evicted(self.buffer.evict(lambda t: t.max_version > version, reason))
            newer = [(t, task) for t, task, _ in self.running.values() if t.max_version > version]
            for t, task in newer:
                t.finish(Status.ABORTED_STALE, reason, now=time.time())
                task.cancel()
            aborted = len(newer)
            if newer:
                await self.proxy.abort([t.id for t, _ in newer])
                await asyncio.sleep(0)
        self.version = version
        evicted = self.buffer.set_version(version)
        stale: list[tuple[Trajectory, asyncio.Task]] = []
        if self.mode.abort_stale:
            floor = version - self.cfg.alpha
            stale = [(t, task) for t, task, _ in self.running.values() if t.min_version < floor]
            for t, _ in stale:
                t.finish(
                    Status.ABORTED_STALE,
                    f"stale: began at version {t.min_version}, policy is at {version}, alpha={self.cfg.alpha}",
                    now=time.time(),
                )
            # A GRPO group is trained whole: once a member is too stale the group can no longer be,
            # so its other members go too (a replacement would join a group whose older members
            # expire before it ends) and a fresh group takes its place.
            gids = {t.group_id for t in evicted} | {t.group_id for t, _ in stale}
            if gids:
                why = f"stale group: a member began before version {floor}, policy is at {version}, alpha={self.cfg.alpha}"
                evicted += self.buffer.evict(lambda t: t.group_id in gids, why)
                stale += [
                    (t, task) for t, task, _ in self.running.values() if t.group_id in gids and not t.status.terminal
                ]
                for t, _ in stale:
                    t.finish(Status.ABORTED_STALE, why, now=time.time())
                for gid in gids:
                    g = self.groups.get(gid)
                    if g is not None:
                        self._close_group(g, why)
            for _, task in stale:
                task.cancel()
            aborted += len(stale)
            if stale:
                await self.proxy.abort([t.id for t, _ in stale])
        self._on_evicted(evicted)
        if stale:
            await asyncio.sleep(0)  # let the cancelled tasks account themselves
        self.schedule()
        return {"aborted_in_flight": aborted}

    async def wait_ready(self, n: int, timeout_s: float | None = None) -> None:
        """Wait until ``n`` samples are ready; raise RolloutStalledError if everything keeps failing."""
        self._check_batch(n)
        self.schedule()
        loop = asyncio.get_running_loop()  # loop time: a SimSession's virtual clock, else monotonic
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            try:
                await self.buffer.wait_ready(n, 0.5, self.weights)
                ready = True
            except TimeoutError:
                ready = False
            # checked even when ready: penalized failures fill batches, a bug in user code must still stop
            broken = next((t for t, q in self._batch_quota.items() if q > 0 and self._is_broken(t)), None)
            if broken is not None:
                msg = self._broken_message(broken)
                self._same_failure.pop(broken)  # the next wait_ready (after a fix, e.g. a new reward) tries again
                raise RolloutStalledError(msg)
            if ready:
                return
            stalled = self._stalled_task()
            if stalled is not None:
                raise RolloutStalledError(self._stall_message(stalled))
            if deadline is not None and loop.time() > deadline:
                raise TimeoutError(
                    f"{n} samples not ready within {timeout_s}s ({len(self.buffer)} buffered, "
                    f"{len(self.running)} running, counts {dict(self.counts)})"
                )

    def _stall_message(self, task: str) -> str:
        """Why ``task`` cannot fill its share: its commonest failure reasons, each with the envs
        it hit (the reasons name the failing component: env call, reward, generator), and the
        env thread pool's state (hung calls at the cap make healthy envs wait)."""
        reasons: collections.Counter[str] = collections.Counter()
        envs: dict[str, set[str]] = collections.defaultdict(set)
        for t, r in self.failure_reasons:
            if t == task:
                key = _TRAJ_ID.sub("trajectory …", _ENV_INDEX.sub("env #…", r))
                reasons[key] += 1
                envs[key].update(_ENV_INDEX.findall(r))
        lines = [
            f"  {c} x {r[:400]}" + (f" (on {', '.join(sorted(envs[r], key=_env_number))})" if envs[r] else "")
            for r, c in reasons.most_common(3)
        ]
        env = self._env_stats()
        return (
            f"the last {self.consecutive_failures[task]} trajectories of task {task!r} all failed, and each batch "
            "needs its share of that task. Most common reasons:\n"
            + "\n".join(lines)
            + f"\nEnv faults so far: {env['restarts']} env restart(s), {env['timeouts']} env timeout(s); "
            + self.env_pool.describe()
            + ".\nFix the env/reward/generator, or give the task weight 0 in sess.tasks(..., weights=...)."
        )

    def _is_broken(self, task: str) -> bool:
        """``task`` never completed a trajectory and its last ``group_size`` (at least 2)
        trajectories failed with one error of user code (an env or reward bug, with traceback)."""
        same = self._same_failure.get(task)
        if same is None or self.completed_by_task[task]:
            return False
        return same[1] >= max(self.cfg.group_size, 2) and TRACEBACK_HEAD in same[2]

    def _broken_message(self, task: str) -> str:
        _, n, first = self._same_failure[task]
        return (
            f"the last {n} trajectories of task {task!r} all failed with the same error, and none of the task's "
            f"trajectories succeeded: stopping early. The first of them:\n{first}\n"
            "Fix the env or reward (rn.envs.check(env, reward=fn) reproduces it in this process), "
            "or give the task weight 0 in sess.tasks(..., weights=...)."
        )

    def _stalled_task(self) -> str | None:
        """A task the batch needs whose recent trajectories all failed (a batch cannot form)."""
        for task, q in self._batch_quota.items():
            envs = self._envs_of[task]
            if q > 0 and self.consecutive_failures[task] >= max(4 * envs, 4 * self.cfg.group_size, 16):
                return task
        return None

    def take_batch(self, n: int) -> list[Trajectory]:
        """Remove ``n`` trajectories (whole groups) from the buffer; their groups close."""
        batch = self.buffer.take_batch(n, self.weights)
        self._buffered_ids.difference_update(t.id for t in batch)
        self.batches_taken += 1
        for gid in {t.group_id for t in batch}:
            g = self.groups.get(gid)
            if g is not None:
                self._close_group(g, "redundant: group taken by a batch", taken=True)
        self.schedule()
        return batch

    async def get_batch(self, n: int, timeout_s: float | None = None) -> list[Trajectory]:
        await self.wait_ready(n, timeout_s)
        return self.take_batch(n)

    def _check_batch(self, n: int) -> None:
        if n % self.cfg.group_size:
            raise ConfigError(f"batch of {n} is not a multiple of group_size {self.cfg.group_size}")
        if not self.mode.continuous and sum(self.quota.values()) == 0 and not self.groups:
            self.start_iteration()

    async def close(self) -> None:
        """Cancel everything in flight (each ends cancelled and is accounted)."""
        self._closed = True
        for traj, _, _ in list(self.running.values()):
            traj.finish(Status.CANCELLED, "pipeline closed", now=time.time())
        tasks = list(self._tasks)  # rollouts and the scoring that follows them
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pending, self._pending_reward = self._pending_reward, []  # rolled out, never scored
        for traj, g in pending:
            traj.finish(Status.CANCELLED, "pipeline closed before scoring", now=time.time())
            self._end(traj, g)
        self.env_pool.shutdown()  # idle threads leave; hung ones are daemons and never waited for

    # -- views -----------------------------------------------------------------------
    def _env_stats(self) -> dict[str, Any]:
        pool = self.env_pool.stats()
        return {
            "restarts": sum(m.restarts for m in self.managers),
            "timeouts": sum(m.timeouts for m in self.managers),
            "abandoned_threads": pool["abandoned"],
            "hung_threads": pool["hung"],
            "threads": pool["threads"],
            "thread_cap": pool["cap"],
            "at_cap": pool["at_cap"],
            "cap_hits": pool["cap_hits"],
        }

    def accounting(self) -> dict[str, int]:
        """Every trajectory started, by where it is now: ended (by status) or in flight.

        ``unaccounted = started - ended - running - scoring - pending_reward`` is 0 unless a
        trajectory was lost (a bug); a soak test asserts it.
        """
        ended = {k: self.counts.get(k, 0) for k in ("completed", "aborted_stale", "cancelled", "failed")}
        flight = {
            "running": len(self.running),
            "scoring": len(self.scoring),
            "pending_reward": len(self._pending_reward),
        }
        return {
            "started": self.launched,
            **ended,
            **flight,
            "unaccounted": self.launched - sum(ended.values()) - sum(flight.values()),
        }

    def stats(self) -> dict[str, Any]:
        """Live rollout stats. Keys include ``counts`` (by current status), ``generated_tokens``
        (response tokens of ended trajectories, by the same statuses), ``token_events``
        (response tokens as growing counters: ``ended``, and ``aborted_stale`` / ``cancelled``
        once they became waste), ``events`` (endings,
        only growing), ``accounting`` (:meth:`accounting`), ``env`` (restarts, timeouts,
        abandoned_threads, hung_threads, threads, thread_cap, at_cap, cap_hits) and ``rewards``
        (the RewardDispatcher's calls, failures, timeouts and reward thread pool)."""
        return {
            "version": self.version,
            "counts": dict(self.counts),
            "generated_tokens": dict(self.generated),
            "token_events": dict(self.token_events),
            "events": dict(self.events),
            "task_events": {t: dict(c) for t, c in self.task_events.items()},
            "running": len(self.running),
            "scoring": len(self.scoring),
            "buffered": len(self.buffer),
            "buffer_peak": self.buffer.peak,
            "groups_open": len(self.groups),
            "envs": self.E,
            "busy_envs": sum(m.busy for m in self.managers),
            "failures": list(self.failure_reasons)[-8:],
            "accounting": self.accounting(),
            "env": self._env_stats(),
            "rewards": self.rewards.stats() if hasattr(self.rewards, "stats") else {},
            "proxy": self.proxy.stats() if hasattr(self.proxy, "stats") else {},
            "curriculum": {t: c.summary() for t, c in self.curricula.items() if hasattr(c, "summary")},
        }

    def trajectories(
        self, task: str | None = None, status: str | None = None, last: int | None = None, include_running: bool = False
    ) -> list[Trajectory]:
        pool = list(self.ended)
        if include_running:
            pool += [t for t, _, _ in self.running.values()]
        out = [t for t in pool if (task is None or t.task == task) and (status is None or t.status.value == status)]
        return out[-last:] if last else out


def _generated(traj: Trajectory) -> int:
    """Response tokens generated for ``traj`` so far (every turn, trained on or not)."""
    return sum(len(t.response_ids) for t in traj.turns)
