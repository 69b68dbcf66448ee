"""RolloutWorker: the actor that hosts EnvManagers, the LLMProxy client, rewards and the SampleBuffer.

Everything on the rollout timeline shares one asyncio loop here, so a turn costs one actor
hop (this actor -> a generation worker). The Pipeline drives it through its Cluster like any
other worker; notebook code never sees ``.remote()``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from rollart_nb.control.env_manager import EnvManager
from rollart_nb.control.proxy import GenTarget, LLMProxy
from rollart_nb.control.reward import RewardDispatcher
from rollart_nb.control.scheduler import RolloutScheduler
from rollart_nb.errors import StateError
from rollart_nb.serverless.client import Endpoint
from rollart_nb.trajectory import Status, Trajectory
from rollart_nb.workers.decorators import register
from rollart_nb.workers.routing import hardware_kinds
from rollart_nb.workers.worker import Worker

if TYPE_CHECKING:
    from rollart_nb.control.shards import ShardPlan

__all__ = ["RolloutWorker", "model_spec"]

log = logging.getLogger(__name__)


class RolloutWorker(Worker):
    """Hosts the rollout side of a pipeline, or one shard of it (see
    :mod:`rollart_nb.control.shards`); runs on the CPU pool.

    Args:
        plan: the envs (one EnvManager each) and batch share this worker runs, with the config.
        model: the policy model (its tokenizer is loaded here).
        targets: generation workers as (actor handle, name, hardware, pool).
        task_affinity: task -> preferred hardware.
        pd: prefill/decode disaggregation.
        max_inflight: per generation worker, before the proxy routes elsewhere.
        dispatch: "direct" (one actor call per turn) or "batched" (turns queued for a busy worker
            go together in one call).
        measured: tasks routed by their measured token profile (see
            :class:`~rollart_nb.control.proxy.LLMProxy`); needs the model's shape, from a
            :class:`~rollart_nb.models.ModelSpec` or the model directory's ``config.json``.
    """

    default_pool = "cpu"

    def __init__(
        self,
        plan: ShardPlan,
        model: Any,
        targets: list[tuple[Any, str, str, str]],
        task_affinity: dict[str, str | None],
        pd: bool = False,
        max_inflight: int = 256,
        dispatch: str = "direct",
        measured: list[str] | None = None,
    ) -> None:
        self._args = (plan, model, targets, task_affinity, pd, max_inflight, dispatch)
        self._measured = set(measured or ())
        self.rewards = RewardDispatcher()
        self.sched: RolloutScheduler | None = None

    def _s(self) -> RolloutScheduler:
        if self.sched is None:
            raise StateError("rollout is not started; call start() first")
        return self.sched

    @register("one")
    async def start(self, version: int = 0, launch: bool = True) -> int:
        """Build the proxy and scheduler inside the actor's event loop; returns E (env count).

        Args:
            version: the policy version the generators serve when the first trajectories start
                (a reused or restored trainer's), so they claim the version that generates them.
            launch: start trajectories now; ``False`` leaves that to the first :meth:`set_version`
                (the pipeline's, once the generators serve ``version``).
        """
        if self.sched is None:
            plan, model, targets, affinity, pd, max_inflight, dispatch = self._args
            proxy = LLMProxy(
                [GenTarget(*t) for t in targets],
                affinity,
                max_inflight=max_inflight,
                pd=pd,
                dispatch=dispatch,
                # routing by token profile only has a choice where both kinds of hardware serve
                measured=self._measured,
                model_spec=model_spec(model) if self._measured and hardware_kinds([t[2] for t in targets]) else None,
            )
            self.sched = RolloutScheduler(plan, model.load_tokenizer(), proxy, self.rewards, id_salt=self.role)
            # nothing runs or is buffered yet: starting at ``version`` aborts and evicts nothing
            self.sched.version = version
            self.sched.buffer.set_version(version)
        if launch:
            self.sched.schedule()
        return self.sched.E

    @register("one")
    async def wait_ready(self, n: int, timeout_s: float | None = None) -> None:
        await self._s().wait_ready(n, timeout_s)

    @register("one")
    async def wait_for_batch(self, n: int, timeout_s: float) -> dict[str, Any]:
        """Wait up to ``timeout_s`` for ``n`` samples, returning early when a generation worker
        dies: ``{"ready": bool, "dead": {index: reason}}``. Raises what :meth:`wait_ready` raises
        for a stalled rollout."""
        s = self._s()
        proxy = s.proxy
        if proxy.dead:
            return {"ready": False, "dead": dict(proxy.dead)}
        waiting = asyncio.ensure_future(s.wait_ready(n, None))
        died = asyncio.ensure_future(proxy.died.wait())
        try:
            await asyncio.wait({waiting, died}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if waiting.done():
                waiting.result()
                return {"ready": True, "dead": dict(proxy.dead)}
            return {"ready": False, "dead": dict(proxy.dead)}
        finally:
            for f in (waiting, died):
                if not f.done():
                    f.cancel()

    @register("one")
    def dead_targets(self) -> dict[int, str]:
        """Generation workers the proxy saw die and that are not replaced yet: index -> reason."""
        return dict(self._s().proxy.dead)

    @register("one")
    def replace_target(self, index: int, target: tuple[Any, str, str, str]) -> None:
        """Route to a new generation worker ``(handle, name, hardware, pool)`` in place of ``index``."""
        self._s().proxy.replace_target(index, GenTarget(*target))

    @register("one")
    def take_batch(self, n: int) -> list[Trajectory]:
        return self._s().take_batch(n)

    @register("one")
    async def set_version(self, version: int, rollback: bool = False) -> dict[str, int]:
        return await self._s().set_version(version, rollback=rollback)

    @register("one")
    async def suspend(self, timeout_s: float | None = None, preempt: bool = False) -> None:
        await self._s().proxy.suspend(timeout_s, preempt=preempt)

    @register("one")
    def resume(self) -> None:
        self._s().proxy.resume()

    @register("one")
    def hold(self) -> None:
        """Hold the rollout (see :meth:`LLMProxy.hold`) until :meth:`release`; holds nest."""
        self._s().proxy.hold()

    @register("one")
    def release(self) -> None:
        """End one :meth:`hold`; the envs that went idle meanwhile start again."""
        s = self._s()
        s.proxy.release()
        s.schedule()

    @register("one")
    def start_iteration(self) -> None:
        self._s().start_iteration()

    @register("one")
    def set_reward(
        self,
        task: str,
        fn: Any = None,
        endpoint: Endpoint | None = None,
        timeout_s: float = 30.0,
        retries: int = 1,
        validate_with: Any = None,
    ) -> int:
        """Register or hot-swap a task's reward (and its validation scorer); returns the new reward version."""
        return self.rewards.set(
            task, fn, endpoint=endpoint, timeout_s=timeout_s, retries=retries, validate_with=validate_with
        ).version

    @register("one")
    def reward_history(self) -> list[dict[str, Any]]:
        return self.rewards.versions()

    @register("one")
    def stats(self) -> dict[str, Any]:
        return self._s().stats() if self.sched else {}

    @register("one")
    def trajectories(
        self, task: str | None = None, status: str | None = None, last: int | None = None, include_running: bool = False
    ) -> list[Trajectory]:
        """Recent trajectories, newest last (see :meth:`RolloutScheduler.trajectories`). Running
        ones are copies: the result is serialized off this loop while they keep growing."""
        out = self._s().trajectories(task, status, last, include_running)
        return [copy.deepcopy(t) if t.status is Status.RUNNING else t for t in out]

    @register("one")
    async def score(self, traj_id: str, task: str, rows: list[list[int]]) -> dict[str, Any]:
        """``rows`` scored on a live generation worker under the weights it serves now (see
        :meth:`LLMProxy.score`): ``{"version", "rows"}``, what ``pipe.replay`` shows."""
        return await self._s().proxy.score(traj_id, task, rows)

    @register("one")
    async def regenerate(self, traj: Trajectory, from_turn: int) -> Trajectory:
        """A new trajectory: ``traj``'s turns before ``from_turn`` played through a fresh copy of
        its task's env from the same seed (their recorded actions), then continued by the policy
        served now and scored by the task's reward; never buffered, counted or trained on.

        Raises:
            StateError: the env answered a replayed action otherwise than when it was recorded.
        """
        s = self._s()
        template = next(m.template for m in s.managers if m.task == traj.task)
        m = EnvManager(-1, traj.task, copy.deepcopy(template), s.tok, s.proxy, s.config.rollout, pool=s.env_pool)
        info = {"regenerated_from": traj.id, "from_turn": from_turn}
        t = Trajectory(traj.task, seed=traj.seed, group_id=f"{traj.group_id}/regenerated", start_version=s.version)
        t.info.update(info)
        s.proxy.exempt.add(t.id)  # goes ahead of a hold, as validation does
        try:
            await m.run(t, prefix=traj.turns[:from_turn])
        finally:
            s.proxy.exempt.discard(t.id)
            s.proxy.forget(t.id)
        if "replay_mismatch" in t.info:
            raise StateError(f"cannot regenerate trajectory {traj.id}: {t.reason.split(': ', 2)[-1]}")
        if not t.status.terminal:
            try:
                await self.rewards.score(t)
                t.finish(Status.COMPLETED, now=time.time())
            except Exception as e:
                t.finish(Status.FAILED, f"reward: {e}", now=time.time())
        return t

    @register("one")
    async def evaluate(
        self, task: str, seeds: list[int], temperature: float = 0.0, concurrency: int = 32, samples: int = 1
    ) -> dict[str, Any]:
        """Validation rollouts of ``task`` over ``seeds`` (greedy at ``temperature`` 0); not buffered or
        trained on. They are scored by the task's ``validate_with`` scorer if it has one, else by its
        reward. Their turns go ahead while the rollout is held (:meth:`hold`, as ``pipe.validate``
        does), so training generation can wait for them.

        Returns mean ``score`` (reward), ``n``, ``failed``, and the final actions' spread:
        ``distinct_actions`` and ``top_actions`` (the 3 commonest, with counts). Every seed runs
        ``samples`` k times; sampled (``temperature`` > 0) or repeated, the result also holds
        ``pass@1`` (the share of all runs that succeed: reward >= 1) and ``pass@k`` (the share of
        seeds with at least one success).
        """
        s = self._s()
        template = next(m.template for m in s.managers if m.task == task)
        sem = asyncio.Semaphore(concurrency)

        async def one(seed: int) -> Trajectory:
            async with sem:
                m = EnvManager(-1, task, copy.deepcopy(template), s.tok, s.proxy, s.config.rollout, pool=s.env_pool)
                t = Trajectory(task, seed=seed, group_id="validation", start_version=s.version)
                s.proxy.exempt.add(t.id)
                try:
                    await m.run(t, temperature=temperature)
                finally:
                    s.proxy.exempt.discard(t.id)
                s.proxy.forget(t.id)
                if not t.status.terminal:
                    try:
                        await self.rewards.score(t, validation=True)
                        t.status = Status.COMPLETED
                    except Exception as e:  # a failing reward must not fail validation
                        t.finish(Status.FAILED, f"reward: {e}")
                return t

        done = await asyncio.gather(*(one(sd) for sd in seeds for _ in range(max(1, samples))))
        ok = [t.reward for t in done if t.status is Status.COMPLETED]
        extra: dict[str, Any] = {}
        if samples > 1 or temperature > 0:
            wins = [t.status is Status.COMPLETED and t.reward >= 1.0 for t in done]
            extra["pass@1"] = sum(wins) / len(wins) if wins else float("nan")
            extra[f"pass@{samples}"] = sum(any(wins[i : i + samples]) for i in range(0, len(wins), samples)) / max(
                1, len(seeds)
            )
        # The final actions show a collapse (one answer everywhere) that a score alone can hide.
        last = Counter(t.turns[-1].action.strip() for t in done if t.status is Status.COMPLETED and t.turns)
        return {
            "score": sum(ok) / len(ok) if ok else float("nan"),
            "n": len(done),
            "failed": len(done) - len(ok),
            "distinct_actions": len(last),
            "top_actions": last.most_common(3),
            **extra,
        }

    @register("one")
    async def shutdown(self) -> dict[str, int]:
        """Cancel in-flight trajectories (accounted as cancelled); returns final counts."""
        if self.sched is None:
            return {}
        await self.sched.close()
        return dict(self.sched.ledger.counts)


def model_spec(model: Any) -> Any:
    """The shape of ``model`` for routing by token profile: a ModelSpec as is, else read from the
    model directory's ``config.json`` with the parameter count the model reference gives (None
    when either is missing)."""
    from rollart_nb.models.spec import ModelSpec

    if isinstance(model, ModelSpec):
        return model
    if not getattr(model, "params", 0):  # counting them would load the weights here, on the rollout's CPU
        log.info("routing by token profile is off: %r does not say its parameter count", model)
        return None
    try:
        from rollart_nb.models.spec import hf_spec

        return hf_spec(model)
    except Exception as e:  # no config.json, an unknown layout: routing keeps the declared hints
        log.info("routing by token profile is off: no model shape for %r (%s)", model, e)
        return None
