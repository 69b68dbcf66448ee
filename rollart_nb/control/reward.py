"""Reward dispatch: versioned reward functions per task, called as trajectories finish.

A reward is a plain callable ``fn(trajectory) -> float`` (or a list of per-turn floats), sync
or async, run locally, or an HTTP endpoint (Ray Serve, any serverless function). Sync ones run
on the dispatcher's own :class:`~rollart_nb.envs.base.BlockingPool` (not the loop's default
executor, which the control plane needs), so rollout keeps going; a sync call past its timeout
is abandoned, counted, and its thread replaced. Swapping a task's reward bumps its version;
every scored trajectory records the version that scored it. A reward that raises, times out or
returns NaN/inf/non-number is retried, then reported as a :class:`RewardError` (one that
raised carries its traceback, trimmed to the user's frames).

A task may also have a separate *validation* scorer (``validate_with``): greedy validation then
measures e.g. exact match while training follows a shaped reward. It stays across reward swaps
until replaced.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from rollart_nb._checks import is_number, is_whole
from rollart_nb.envs.base import DEFAULT_MAX_REPLACEMENTS, BlockingPool
from rollart_nb.errors import ConfigError, RewardError
from rollart_nb.logs import user_traceback
from rollart_nb.redact import redact_url
from rollart_nb.serverless.client import Endpoint, acall
from rollart_nb.trajectory import FAILED_IN, FAILURE, Status, Trajectory

if TYPE_CHECKING:
    from rollart_nb.config import PipelineConfig

__all__ = ["RewardDispatcher", "RewardSpec", "check_reward_value", "penalize"]


@dataclass
class RewardSpec:
    """One version of a task's reward.

    Attributes:
        task: task name.
        version: starts at 0; each swap adds one.
        fn: a local callable, or None when ``endpoint`` serves it.
        endpoint: an HTTP endpoint (JSON contract of :mod:`rollart_nb.serverless.client`).
        timeout_s: per call.
        retries: retries after the first failure.
        source: source code (for ``reward_history``), when available; an endpoint's URL, redacted.
        created: unix time.
    """

    task: str
    version: int
    fn: Any = None
    endpoint: Endpoint | None = None
    timeout_s: float = 30.0
    retries: int = 1
    source: str = ""
    created: float = field(default_factory=time.time)

    @property
    def name(self) -> str:
        if self.endpoint is not None:
            return f"endpoint:{self.endpoint.name}"
        return getattr(self.fn, "__qualname__", type(self.fn).__name__)


def check_reward_value(value: Any, turns: int) -> tuple[float, list[float] | None]:
    """Validate a reward's return: a finite number, or one finite number per turn (summed)."""
    if isinstance(value, bool) or value is None:
        raise RewardError(f"reward returned {value!r}, not a number")
    if isinstance(value, list | tuple):
        if len(value) != turns:
            raise RewardError(f"per-turn reward has {len(value)} values for {turns} turns")
        vals = [check_reward_value(v, 1)[0] for v in value]
        return float(sum(vals)), vals
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise RewardError(f"reward returned {type(value).__name__} {value!r:.60}, not a number") from None
    if not math.isfinite(x):
        raise RewardError(f"reward returned {x}, not a finite number")
    return x, None


def penalize(traj: Trajectory, config: PipelineConfig, version: int) -> bool:
    """With ``failed_trajectories="penalize"``: make ``traj``, failed after the model acted (in
    an env step or its reward), a completed trajectory with reward ``failure_reward``, its
    failure kept as ``info["rollart_failure"]``. Returns False (nothing changed) for any other
    trajectory, and for one with turns of weights newer than ``version`` (lost in a restore)."""
    if (
        config.failed_trajectories != "penalize"
        or traj.status is not Status.FAILED
        or traj.info.get(FAILED_IN) not in ("env_step", "reward")
        or not any(t.response_ids for t in traj.turns)
        or traj.max_version > version
    ):
        return False
    reason = traj.reason
    traj.info[FAILURE] = reason
    traj.reward, traj.turn_rewards, traj.reward_version = float(config.failure_reward), None, -1
    traj.status, traj.reason, traj.finished_s = Status.COMPLETED, f"penalized: {reason}", time.time()
    return True


def _source(fn: Any) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return repr(fn)


def option_problems(validate_with: Any, timeout_s: Any, retries: Any) -> list[str]:
    """What is wrong with a reward's ``validate_with``, ``timeout_s`` and ``retries`` (empty: nothing)."""
    p = []
    if validate_with is not None and not callable(validate_with):
        p.append(
            f"validate_with={validate_with!r:.80} ({type(validate_with).__name__}) must be callable: "
            "fn(trajectory) -> float, e.g. rn.rewards.exact_answer"
        )
    if not (is_number(timeout_s) and timeout_s > 0):
        p.append(f"timeout_s={timeout_s!r} must be a finite number of seconds > 0")
    if not is_whole(retries) or retries < 0:
        p.append(f"retries={retries!r} must be a whole number >= 0 (0: no retry)")
    return p


class RewardDispatcher:
    """Holds each task's current reward (and its history) and scores trajectories.

    Args:
        default: reward for tasks with none registered (default: the env's own return).
        threads: sync reward calls that may run at once (the scheduler raises it to its env
            count with :meth:`reserve_threads`).
        max_abandoned_threads: hung sync reward calls whose threads are replaced (the cap of
            the reward thread pool is ``threads`` plus this).

    Attributes:
        calls / failures / timeouts: reward attempts, trajectories whose reward failed for good,
            attempts that timed out.
        pool: the :class:`~rollart_nb.envs.base.BlockingPool` sync rewards run on.
    """

    def __init__(
        self, default: Any = None, *, threads: int = 8, max_abandoned_threads: int = DEFAULT_MAX_REPLACEMENTS
    ) -> None:
        from rollart_nb.rewards.rules import env_return

        self.default = default or env_return
        self.current: dict[str, RewardSpec] = {}
        self.history: list[RewardSpec] = []
        self.validators: dict[str, Any] = {}
        self.calls = self.failures = self.timeouts = 0
        self.pool = BlockingPool("reward", size=threads, max_replacements=max_abandoned_threads)

    def reserve_threads(self, n: int) -> None:
        """Let ``n`` sync reward calls run at once (one per env that may finish together)."""
        self.pool.ensure_size(n)

    def set(
        self,
        task: str,
        fn: Any = None,
        *,
        endpoint: Endpoint | None = None,
        timeout_s: float = 30.0,
        retries: int = 1,
        validate_with: Any = None,
    ) -> RewardSpec:
        """Register (or swap) ``task``'s reward; returns the new version's spec. ``validate_with``
        (a local callable) scores ``task``'s validation rollouts from now on instead of the reward.

        Raises:
            ConfigError: listing every bad argument (nothing is registered then).
        """
        p = []
        if not isinstance(task, str) or not task:
            p.append(f"task={task!r} must be a task name (a non-empty string)")
        if (fn is None) == (endpoint is None):
            p.append("give exactly one of a callable fn or an endpoint")
        elif fn is not None and not callable(fn):
            p.append(f"fn={fn!r:.80} ({type(fn).__name__}) must be callable: fn(trajectory) -> float")
        elif endpoint is not None and not isinstance(endpoint, Endpoint):
            p.append(
                f"endpoint={endpoint!r:.80} must be an Endpoint(name, url); for a bare URL use "
                "sess.reward(task, url=...)"
            )
        p += option_problems(validate_with, timeout_s, retries)
        if p:
            raise ConfigError(p, where=f"reward for task {task!r}")
        if validate_with is not None:
            self.validators[task] = validate_with
        old = self.current.get(task)
        source = redact_url(endpoint.url) if endpoint is not None else _source(fn)  # exactly one is given
        spec = RewardSpec(task, 0 if old is None else old.version + 1, fn, endpoint, timeout_s, retries, source)
        self.current[task] = spec
        self.history.append(spec)
        return spec

    def spec(self, task: str) -> RewardSpec:
        if task not in self.current:
            self.set(task, self.default)
        return self.current[task]

    async def score(self, traj: Trajectory, validation: bool = False) -> None:
        """Score ``traj`` in place (reward, turn_rewards, reward_version). Raises RewardError.

        ``validation``: score with the task's ``validate_with`` scorer, if it has one.
        """
        spec = self.spec(traj.task)  # the version current when scoring starts scores it
        if validation and traj.task in self.validators:
            spec = replace(spec, fn=self.validators[traj.task], endpoint=None)
        last: Exception | None = None
        for attempt in range(spec.retries + 1):
            self.calls += 1
            try:
                value = await asyncio.wait_for(self._call(spec, traj), timeout=spec.timeout_s)
                traj.reward, traj.turn_rewards = check_reward_value(value, len(traj.turns))
                traj.reward_version = spec.version
                return
            except TimeoutError:
                self.timeouts += 1
                last = RewardError(
                    f"timed out after {spec.timeout_s:g}s (a sync call still running was abandoned; "
                    "make a slow reward async, or raise its timeout_s)"
                )
            except RewardError as e:
                last = e
            except Exception as e:  # the user's reward raised: keep its type, message and where
                last = RewardError(f"{type(e).__name__}: {e}\n{user_traceback(e)}")
            if attempt < spec.retries:
                await asyncio.sleep(0.05 * 2**attempt)
        self.failures += 1
        raise RewardError(
            f"reward {spec.name} v{spec.version} for task {traj.task!r} (trajectory {traj.id}) failed "
            f"after {spec.retries + 1} attempt(s): {last}"
        )

    async def _call(self, spec: RewardSpec, traj: Trajectory) -> Any:
        if spec.endpoint is not None:
            return await acall(spec.endpoint, [traj.to_dict()], {})
        if inspect.iscoroutinefunction(spec.fn) or inspect.iscoroutinefunction(spec.fn.__call__):
            return await spec.fn(traj)
        return await self.pool.call(spec.fn, traj)

    def stats(self) -> dict[str, Any]:
        """calls, failures, timeouts, abandoned_threads, hung_threads, threads, thread_cap, at_cap."""
        pool = self.pool.stats()
        names = {"abandoned_threads": "abandoned", "hung_threads": "hung", "thread_cap": "cap"}
        own = {"calls": self.calls, "failures": self.failures, "timeouts": self.timeouts}
        return own | {
            k: pool[names.get(k, k)] for k in ("abandoned_threads", "hung_threads", "threads", "thread_cap", "at_cap")
        }

    def versions(self) -> list[dict[str, Any]]:
        """Every version ever registered, with its source and time."""
        return [
            {"task": s.task, "version": s.version, "name": s.name, "source": s.source, "created": s.created}
            for s in self.history
        ]
