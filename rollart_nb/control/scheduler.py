"""RolloutScheduler: keeps E EnvManagers busy, forms GRPO groups, scores, buffers.

- **Groups**: members of a group share the env seed (so the prompt). A group launches
  ``group_size + redundancy`` members; once ``group_size`` are scored the rest are cancelled
  (redundant rollouts). A member that fails or is aborted is replaced while the group is open.
- **Reward overlaps rollout**: each finished trajectory is scored at once (unless the mode
  scores after the batch), while its EnvManager already runs the next one.
- **Staleness** (:class:`~rollart_nb.control.staleness.Staleness`): :meth:`set_version`
  aborts (``cancel``: renews) in-flight trajectories the α rule excludes and evicts stale ones
  from the :class:`SampleBuffer`; a task opens a group only inside the rule's admission window;
  ``wait`` holds :meth:`wait_ready` for what the next bump would abort.
- **Accounting and stalls** (:class:`~rollart_nb.control.ledger.Ledger`): every trajectory
  ends in exactly one terminal status; a task whose recent trajectories all fail stops
  :meth:`wait_ready` with a :class:`~rollart_nb.errors.RolloutStalledError`.
- **Env faults**: sync env calls run on one :class:`~rollart_nb.envs.base.BlockingPool`; hung
  calls are abandoned, their threads replaced (``stats()["env"]``).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollart_nb import _ray
from rollart_nb.control.buffer import SampleBuffer, split_quota
from rollart_nb.control.env_manager import EnvManager, TurnBarrier, env_stats
from rollart_nb.control.ledger import Ledger
from rollart_nb.control.reward import RewardDispatcher, penalize
from rollart_nb.control.staleness import Staleness
from rollart_nb.envs.base import BlockingPool
from rollart_nb.errors import ConfigError, RewardError, RolloutStalledError
from rollart_nb.logs import capture_user_output
from rollart_nb.trajectory import FAILED_IN, Status, Trajectory

if TYPE_CHECKING:
    from rollart_nb.control.shards import ShardPlan

__all__ = ["GroupState", "RolloutScheduler"]

log = logging.getLogger(__name__)


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


class RolloutScheduler:
    """Trajectory-level rollout over many EnvManagers (runs inside one asyncio loop).

    Args:
        plan: the envs (task -> env templates, one EnvManager each), batch share, group size,
            mode and seed this scheduler runs, with the pipeline's config
            (:func:`~rollart_nb.control.shards.plan_rollout`).
        tokenizer: shared tokenizer.
        proxy: the LLMProxy.
        rewards: the RewardDispatcher.
        id_salt: mixed into the seeded trajectory/group id stream (the pipeline's rollout role).
    """

    def __init__(
        self, plan: ShardPlan, tokenizer: Any, proxy: Any, rewards: RewardDispatcher, id_salt: str = ""
    ) -> None:
        self.plan, self.config, self.mode = plan, plan.config, plan.mode
        self.proxy, self.rewards, self.tok = proxy, rewards, tokenizer
        self.staleness = Staleness(plan.config.alpha, plan.mode.abort_stale, plan.config.staleness, plan.config.wait_s)
        self.ledger = Ledger(plan.group_size)
        self._start_envs(plan.envs)
        self.tasks = list(plan.envs)
        self.weights = plan.weights  # uniform by default: each batch holds each task's share of groups
        self.rng = random.Random(plan.seed)
        # Trajectory and group ids from their own seeded stream: a run is reproducible (sampling
        # seeds and sim responses hash the id) and ids never shift the group seeds above. The
        # salt (the rollout worker's role, i.e. the pipeline's name) keeps two pipelines with one
        # seed from sharing ids on the generators they share.
        self._ids = random.Random(f"ids/{plan.seed}/{id_salt}")
        self.curricula = {t: copy.deepcopy(c) for t, c in (plan.curricula or {}).items()}
        self._batch_quota = dict(plan.quota)
        groups = sum(max(q, 1) for q in self._batch_quota.values())
        cap = self.staleness.buffer_capacity(groups, plan.group_size, self.E)
        self.buffer = SampleBuffer(plan.group_size, self.staleness, cap)
        self.version = 0
        self.groups: dict[str, GroupState] = {}
        self.running: dict[str, tuple[Trajectory, asyncio.Task, EnvManager]] = {}
        # per task, kept as they change: running trajectories, and buffered members of open groups
        # (what _ahead() counts, without a pass over every trajectory and group)
        self._running_n: collections.Counter[str] = collections.Counter()
        self._buffered_n: collections.Counter[str] = collections.Counter()
        self.scoring: dict[str, str] = {}  # trajectory id -> task, while its reward runs
        self.started_groups = self.batches_taken = 0
        self.started_by_task: collections.Counter[str] = collections.Counter()
        self.given_up_by_task: collections.Counter[str] = collections.Counter()  # closed, never batched
        self.quota: dict[str, int] = dict.fromkeys(self.tasks, 0)
        self._barrier: TurnBarrier | None = None
        self._pending_reward: list[tuple[Trajectory, GroupState]] = []
        self._closed = False
        self._tasks: set[asyncio.Task] = set()
        if _ray.in_worker_process():  # a rollout actor: env/reward print and logging go to its log file
            capture_user_output()

    def _start_envs(self, envs: dict[str, list[Any]]) -> None:
        """One EnvManager per env template, and one thread per env for its sync calls, apart from
        the loop's default executor (the control plane's), plus replacements for hung calls."""
        n_envs = sum(len(v) for v in envs.values())
        rollout = self.config.rollout
        self.env_pool = BlockingPool("env", size=n_envs, max_replacements=rollout.max_abandoned_threads)
        if hasattr(self.rewards, "reserve_threads"):  # a sync reward runs once per finished trajectory
            self.rewards.reserve_threads(n_envs)
        self.managers: list[EnvManager] = []
        # indices of the managers not running a trajectory (kept by the managers themselves), so
        # schedule() costs what is idle, not every env
        self._idle: set[int] = set()
        for task, templates in envs.items():
            for env in templates:
                m = EnvManager(len(self.managers), task, env, self.tok, self.proxy, rollout, pool=self.env_pool)
                m.idle_set = self._idle
                m.busy = False  # idle: in the set
                self.managers.append(m)
        self.E = len(self.managers)
        self._envs_of = collections.Counter(m.task for m in self.managers)

    # -- launching -------------------------------------------------------------------
    def start_iteration(self) -> None:
        """Quota modes: allow one more iteration's groups (split across tasks by weight)."""
        for t, n in split_quota(self.plan.batch_groups, self.weights).items():
            self.quota[t] += n
        self.schedule()

    def _may_open_group(self, task: str, ahead: collections.Counter[str]) -> bool:
        if not self.mode.continuous:
            return self.quota.get(task, 0) > 0
        # Per-task limits, so a fast task cannot crowd out a slow one that the batch also needs.
        quota = max(self._batch_quota[task], 1)
        if self.mode.admit_by_version:  # groups a batch will still take: opened, less those given up
            live = self.started_by_task[task] - self.given_up_by_task[task]
            return self.staleness.admits(live, self.batches_taken, quota)
        return ahead[task] < self.staleness.ahead_limit(quota, self.plan.group_size, self._envs_of[task])

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
        g = GroupState(f"{self._ids.getrandbits(40):010x}", task, seed, self.plan.group_size + self.config.redundancy)
        self.groups[g.id] = g
        return g

    def schedule(self) -> None:
        """Give every idle EnvManager a trajectory to run, if the mode allows one.

        It runs after every trajectory ends, over thousands of envs in a what-if study, so a task
        that can take no trajectory is found once per call: a call costs O(tasks + G) (G open
        groups) when no task can take one, else O(idle envs + G). Each idle env (in env order)
        joins the oldest open group of its task with budget left, else opens a group if admitted.
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
            t
            for t in self.tasks
            if self.ledger.is_broken(t) or not open_groups[t] and not self._may_open_group(t, ahead)
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
        if plan:
            self._launch(plan)

    def _launch(self, plan: list[tuple[EnvManager, GroupState]]) -> None:
        """Start one trajectory of group ``g`` on each reserved EnvManager ``m`` of ``plan``."""
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
            self.ledger.launched += 1

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
            return None if self._penalize(traj, g) else self._end(traj, g)
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
            self.ledger.buffered(traj, penalized)
        self._on_evicted(rejected)
        if not penalized:  # a penalized one is a failure all the same: the stall and early-stop checks see it
            self.ledger.succeeded(traj.task)
        if len(g.buffered) >= self.plan.group_size:
            self._cancel_surplus(g)

    def _penalize(self, traj: Trajectory, g: GroupState) -> bool:
        """Buffer ``traj`` as a penalized member of open ``g`` if the config says so (see
        :func:`~rollart_nb.control.reward.penalize`); False: nothing changed."""
        if g.closed or not penalize(traj, self.config, self.version):
            return False
        self._accept(traj, g, penalized=True)
        return True

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
        self.ledger.ended_out(traj)
        if g is None or g.closed:
            return
        g.running.discard(traj.id)
        self._buffer_member(g, traj.id, False)
        if traj.status is Status.FAILED:
            g.failures += 1
            if g.failures >= self.config.max_group_failures:  # this env keeps failing: give the group up
                self._close_group(g, f"abandoned after {g.failures} failures")
                return
        if traj.reason.startswith("redundant"):
            return
        if len(g.buffered) + len(g.running) + g.budget < self.plan.group_size:
            g.budget += 1  # replace the lost member (same seed, current version)

    def _on_evicted(self, evicted: list[Trajectory]) -> None:
        for t in evicted:
            g = self.groups.get(t.group_id)
            if self.ledger.evicted(t):  # it was counted completed: its count moved
                if g is None:  # its group was given up while it waited in the buffer
                    continue
                self._buffer_member(g, t.id, False)
                if t.status is Status.CANCELLED:  # dropped for capacity: give the group up, never churn
                    self._close_group(g, t.reason)
                elif not g.closed and len(g.buffered) + len(g.running) + g.budget < self.plan.group_size:
                    g.budget += 1
            else:
                self._end(t, g)

    def _cancel_surplus(self, g: GroupState) -> None:
        g.budget = 0
        for tid in list(g.running):
            traj, task, _ = self.running[tid]
            traj.finish(Status.CANCELLED, "redundant: group complete", now=time.time())
            self.ledger.redundant(traj.task)
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
        """Advance the policy version; abort / evict what the staleness rule now excludes.

        ``rollback=True``: the trainer was restored to an older ``version``; trajectories with a
        turn generated by a newer version (weights that no longer exist) end aborted_stale."""
        aborted = await self._drop_newer(version) if rollback else 0
        self.version = version
        evicted = self.buffer.set_version(version)
        stale = self._abort_stale(version, evicted) if self.staleness.enforced else []
        for _, task in stale:
            task.cancel()
        if stale:
            await self.proxy.abort([t.id for t, _ in stale])
        self._on_evicted(evicted)
        if stale:
            await asyncio.sleep(0)  # let the cancelled tasks account themselves
        self.schedule()
        return {"aborted_in_flight": aborted + len(stale)}

    async def _drop_newer(self, version: int) -> int:
        """End what weights newer than ``version`` (lost in a trainer restore) generated."""
        reason = f"generated by weights newer than version {version}, lost when the trainer was restored to it"
        self._on_evicted(self.buffer.evict(lambda t: t.max_version > version, reason))
        newer = [(t, task) for t, task, _ in self.running.values() if t.max_version > version]
        for t, task in newer:
            t.finish(Status.ABORTED_STALE, reason, now=time.time())
            task.cancel()
        if newer:
            await self.proxy.abort([t.id for t, _ in newer])
            await asyncio.sleep(0)
        return len(newer)

    def _abort_stale(self, version: int, evicted: list[Trajectory]) -> list[tuple[Trajectory, asyncio.Task]]:
        """End the in-flight trajectories the rule excludes at ``version``, and whole groups:
        once a member (in flight or ``evicted`` from the buffer) is too stale its group can no
        longer be trained, so its other members go too (appended to ``evicted``, or returned
        with the in-flight ones) and a fresh group takes its place."""
        rule, now = self.staleness, time.time()
        stale = [(t, task) for t, task, _ in self.running.values() if rule.is_stale(t, version)]
        if rule.policy == "cancel":  # renewed, not ended; an evicted member is replaced, its group goes on
            for t, _ in stale:
                self.ledger.renewed(t, rule.renew(t, version))
            return []
        for t, _ in stale:
            t.finish(Status.ABORTED_STALE, rule.reason(t, version), now=now)
        gids = {t.group_id for t in evicted} | {t.group_id for t, _ in stale}
        if not gids:
            return stale
        why = rule.group_reason(version)
        evicted += self.buffer.evict(lambda t: t.group_id in gids, why)
        stale += [(t, task) for t, task, _ in self.running.values() if t.group_id in gids and not t.status.terminal]
        for t, _ in stale:
            t.finish(Status.ABORTED_STALE, why, now=now)
        for gid in gids:
            g = self.groups.get(gid)
            if g is not None:
                self._close_group(g, why)
        return stale

    async def wait_ready(self, n: int, timeout_s: float | None = None) -> None:
        """Wait until ``n`` samples are ready; raise RolloutStalledError if everything keeps failing."""
        self._check_batch(n)
        self.schedule()
        loop = asyncio.get_running_loop()  # loop time: a SimSession's virtual clock, else monotonic
        deadline = None if timeout_s is None else loop.time() + timeout_s
        led = self.ledger
        while True:
            try:
                await self.buffer.wait_ready(n, 0.5, self.weights)
                ready = True
            except TimeoutError:
                ready = False
            # checked even when ready: penalized failures fill batches, a bug in user code must still stop
            needed = [t for t, q in self._batch_quota.items() if q > 0]
            broken = next((t for t in needed if led.is_broken(t)), None)
            if broken is not None:
                msg = led.broken_message(broken)
                led.same_failure.pop(broken)  # the next wait_ready (after a fix, e.g. a new reward) tries again
                raise RolloutStalledError(msg)
            if ready:  # the wait policy holds it for what the next bump would abort
                await self.staleness.hold(self.version, self.running, self.scoring, led)
                return
            stalled = next((t for t in needed if led.is_stalled(t, self._envs_of[t])), None)
            if stalled is not None:
                raise RolloutStalledError(
                    led.stall_message(stalled, env_stats(self.managers, self.env_pool), self.env_pool.describe())
                )
            if deadline is not None and loop.time() > deadline:
                raise TimeoutError(
                    f"{n} samples not ready within {timeout_s}s ({len(self.buffer)} buffered, "
                    f"{len(self.running)} running, counts {dict(led.counts)})"
                )

    def take_batch(self, n: int) -> list[Trajectory]:
        """Remove ``n`` trajectories (whole groups) from the buffer; their groups close."""
        batch = self.buffer.take_batch(n, self.weights)
        self.ledger.buffered_ids.difference_update(t.id for t in batch)
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
        if n % self.plan.group_size:
            raise ConfigError(f"batch of {n} is not a multiple of group_size {self.plan.group_size}")
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
    def accounting(self) -> dict[str, int]:
        """Every trajectory started, by where it is now: ended (by status) or in flight; ``unaccounted
        = started - ended - running - scoring - pending_reward`` is 0 (a soak test asserts it)."""
        flight = {
            "running": len(self.running),
            "scoring": len(self.scoring),
            "pending_reward": len(self._pending_reward),
        }
        return self.ledger.accounting(flight)

    def stats(self) -> dict[str, Any]:
        """Live rollout stats: :meth:`Ledger.stats`, :meth:`accounting`, ``env``, ``rewards`` and more."""
        return {
            "version": self.version,
            **self.ledger.stats(),
            "running": len(self.running),
            "scoring": len(self.scoring),
            "buffered": len(self.buffer),
            "buffer_peak": self.buffer.peak,
            "groups_open": len(self.groups),
            "envs": self.E,
            "busy_envs": sum(m.busy for m in self.managers),
            "failures": list(self.ledger.failure_reasons)[-8:],
            "accounting": self.accounting(),
            "env": env_stats(self.managers, self.env_pool),
            "rewards": self.rewards.stats() if hasattr(self.rewards, "stats") else {},
            "proxy": self.proxy.stats() if hasattr(self.proxy, "stats") else {},
            "curriculum": {t: c.summary() for t, c in self.curricula.items() if hasattr(c, "summary")},
        }

    def trajectories(
        self, task: str | None = None, status: str | None = None, last: int | None = None, include_running: bool = False
    ) -> list[Trajectory]:
        running = [t for t, _, _ in self.running.values()] if include_running else []
        return self.ledger.select(task, status, last, running)
