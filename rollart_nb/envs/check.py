"""``rn.envs.check``: drive an env (and a reward) in this process before a run uses it.

Like gymnasium's ``check_env``: a deep copy is stepped with actions from its ``vocab``, each
answer checked against the env protocol and scored by the reward; the first problem raises with
the user's traceback, in the cell that declared the task.

Example:
    >>> from rollart_nb.envs import Arithmetic, check
    >>> check(Arithmetic(), seeds=2)                                     # doctest: +ELLIPSIS
    EnvCheck(Arithmetic: 3 episodes, ... steps ok)
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollart_nb.envs.base import env_name
from rollart_nb.errors import ConfigError, EnvError, RewardError, RollartError, brief
from rollart_nb.logs import user_traceback
from rollart_nb.tokens import Tokens

__all__ = ["EnvCheck", "check", "checkable"]

log = logging.getLogger(__name__)

_FALLBACK_WORDS = ("0", "1", "42", "left", "right", "up", "down", "yes", "no", "<answer>", "</answer>", "")


@dataclass
class EnvCheck:
    """What :func:`check` ran: episodes, steps, validation seeds seen, rewards scored, skipped parts."""

    env: str
    episodes: int = 0
    steps: int = 0
    validation_seeds: int = 0
    rewards: list[float] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        parts = [f"{self.episodes} episodes, {self.steps} steps ok"]
        if self.rewards:
            parts.append(f"reward in [{min(self.rewards):g}, {max(self.rewards):g}]")
        parts += [f"skipped {s}" for s in self.skipped]
        return f"EnvCheck({self.env}: {', '.join(parts)})"


def checkable(env: Any) -> bool:
    """Whether :func:`check` can drive ``env`` here: not a launcher, not a remote env handle."""
    from rollart_nb.envs.remote import RemoteEnv

    if callable(getattr(env, "handle", None)) and callable(getattr(env, "start", None)):  # a launcher
        return False
    inner = getattr(env, "unwrapped", env)
    if isinstance(env, RemoteEnv) or isinstance(inner, RemoteEnv):
        return False
    has_sync = callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))
    has_async = callable(getattr(env, "areset", None)) and callable(getattr(env, "astep", None))
    return has_sync or has_async


def check(
    env: Any,
    task: str | None = None,
    reward: Callable[..., Any] | None = None,
    seeds: int = 3,
    steps: int = 16,
    *,
    budget_s: float = 1.0,
    rng_seed: int = 0,
) -> EnvCheck:
    """Run ``env`` (a deep copy) for ``seeds`` episodes plus one on its first validation seed.

    An :class:`~rollart_nb.errors.EnvError` the env raises ends that episode and is noted; only
    other exceptions and protocol violations fail the check.

    Args:
        env: a text env (:class:`~rollart_nb.protocols.Env`); the object itself is not touched.
        task: task name, for messages.
        reward: ``fn(trajectory) -> float`` (sync or async) to score each episode with.
        seeds: episodes on seeds ``0 .. seeds-1``.
        steps: at most this many steps per episode (and the env's ``max_turns``).
        budget_s: time for the whole check; the report says what a slow env left unchecked.
        rng_seed: seeds the action draws.

    Returns:
        An :class:`EnvCheck` report.

    Raises:
        EnvError: the env cannot be copied, raised, or returned something of the wrong shape;
            the message has the user's traceback (file and line) when the env's code raised.
        RewardError: ``reward`` raised or returned something that is not a finite number.
        ConfigError: ``seeds`` or ``steps`` is not a whole number >= 1.
    """
    if not isinstance(seeds, int) or seeds < 0 or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"seeds must be an int >= 0 and steps an int >= 1, got seeds={seeds!r}, steps={steps!r}")
    name = env_name(env)
    where = f"env {name}" + (f" of task {task!r}" if task else "")
    report = EnvCheck(name)
    try:
        env = copy.deepcopy(env)
    except Exception as e:
        raise EnvError(f"{where} cannot be deep-copied (each env instance is a copy): {_why(e)}") from e
    episode_seeds = list(range(seeds))
    vs = getattr(env, "validation_seeds", None)
    clock = _Budget(budget_s)
    if callable(vs):
        try:
            got = _user_call(clock, lambda: list(vs()), where, "validation_seeds()")
        except (_OutOfTime, _OwnEnvError) as e:
            report.skipped.append(f"validation_seeds(): {type(e).__name__}")
            got = []
        if got and not all(isinstance(s, int) for s in got):
            raise EnvError(f"{where}: validation_seeds() must return ints, got {got[:5]!r}")
        report.validation_seeds = len(got)
        if got:
            episode_seeds.append(got[0])
    words = [w for w in getattr(env, "vocab", None) or [] if isinstance(w, str)] or list(_FALLBACK_WORDS)
    rng = random.Random(rng_seed)
    max_steps = min(steps, int(getattr(env, "max_turns", None) or steps))
    try:
        for seed in episode_seeds:
            traj = _episode(env, seed, words, rng, max_steps, where, report, clock)
            report.episodes += 1
            if reward is not None and traj is not None:
                report.rewards.append(_score(reward, traj, where, clock))
    except _OutOfTime as e:
        report.skipped.append(f"the rest: {e} did not finish within the {budget_s:g}s budget")
        log.info("rn.envs.check of %s stopped early: %s", where, report.skipped[-1])
    return report


class _OutOfTime(Exception):
    """The check's time budget ran out during a call (the call was left running on its thread)."""


class _Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def run(self, fn: Callable[[], Any], what: str) -> Any:
        """``fn()`` on a daemon thread, given the time left; raises what it raised."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _OutOfTime(what)
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # re-raised in the caller's thread
                box["error"] = e

        t = threading.Thread(target=target, name="rollart-env-check", daemon=True)
        t.start()
        t.join(left)
        if t.is_alive():
            raise _OutOfTime(what)
        if "error" in box:
            raise box["error"]
        return box.get("value")


def _episode(  # noqa: ANN202
    env: Any,
    seed: int,
    words: list[str],
    rng: random.Random,
    max_steps: int,
    where: str,
    report: EnvCheck,
    clock: _Budget,
):
    """One episode; None when the env raised an EnvError of its own (noted in ``report.skipped``)."""
    from rollart_nb.trajectory import Trajectory, Turn

    what = f"reset(seed={seed})"
    try:
        got = _user_call(clock, functools.partial(_call, env, "reset", seed), where, what)
    except _OwnEnvError as e:
        report.skipped.append(f"seed {seed}: the env raised its own EnvError in {what}: {e}")
        return None
    if not isinstance(got, tuple | list) or len(got) != 2:
        raise EnvError(f"{where}: reset(seed={seed}) returned {brief(got)}, expected (obs, info)")
    obs, info = got
    _expect(
        isinstance(obs, str | Tokens),
        where,
        f"reset(seed={seed})",
        f"obs must be a str or Tokens, got {type(obs).__name__}",
    )
    _expect(isinstance(info, dict | type(None)), where, f"reset(seed={seed})", "info must be a dict")
    traj = Trajectory(task="check", seed=seed, info=dict(info or {}))
    for k in range(max_steps):
        action = " ".join(rng.choice(words) for _ in range(rng.randint(1, 3)))
        call = f"step({action!r}) (seed {seed}, turn {k})"
        try:
            out = _user_call(clock, functools.partial(_call, env, "step", action), where, call)
        except _OwnEnvError as e:
            report.skipped.append(f"seed {seed}: the env raised its own EnvError in {call}: {e}")
            return None
        if not isinstance(out, tuple | list) or len(out) != 5:
            raise EnvError(
                f"{where}: {call} returned {brief(out)}, expected (obs, reward, terminated, truncated, info)"
            )
        nobs, r, term, trunc, sinfo = out
        _expect(isinstance(nobs, str | Tokens), where, call, f"obs must be a str or Tokens, got {type(nobs).__name__}")
        ok_r = isinstance(r, int | float) and not isinstance(r, bool) and math.isfinite(float(r))
        _expect(ok_r, where, call, f"reward must be a finite number, got {brief(r, 40)}")
        _expect(isinstance(sinfo, dict | type(None)), where, call, "info must be a dict")
        traj.turns.append(Turn(observation=obs, action=action, env_reward=float(r)))
        report.steps += 1
        obs = nobs
        if term or trunc:
            traj.info["terminated"] = bool(term)
            break
    return traj


def _score(reward: Callable[..., Any], traj: Any, where: str, clock: _Budget) -> float:
    from rollart_nb.control.reward import check_reward_value

    try:
        value = clock.run(functools.partial(_run_sync, reward, traj), f"reward {_fn_name(reward)}")
    except (RollartError, _OutOfTime):
        raise
    except Exception as e:
        raise RewardError(f"reward {_fn_name(reward)} for {where} raised: {_why(e)}") from e
    try:
        return check_reward_value(value, len(traj.turns))[0]
    except RewardError as e:
        raise RewardError(f"reward {_fn_name(reward)} for {where}: {e}") from None


def _expect(ok: bool, where: str, call: str, what: str) -> None:
    if not ok:
        raise EnvError(f"{where}: {call}: {what}")


class _OwnEnvError(Exception):
    """The env raised an EnvError itself: its own way to fail an episode, not a bug."""


def _user_call(clock: _Budget, fn: Callable[[], Any], where: str, call: str) -> Any:
    try:
        return clock.run(fn, f"{call}")
    except _OutOfTime:
        raise
    except EnvError as e:
        raise _OwnEnvError(str(e).splitlines()[0][:200]) from e
    except RollartError:
        raise
    except Exception as e:
        raise EnvError(f"{where} raised in {call}: {_why(e)}") from e


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n{user_traceback(e)}"


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def _call(env: Any, method: str, arg: Any) -> Any:  # on a thread of its own: no loop runs there
    """``env.reset(arg)`` / ``env.step(arg)``; an async-only env's ``areset``/``astep``."""
    sync = getattr(env, method, None)
    if callable(sync):
        return sync(arg)
    return _run_sync(getattr(env, "a" + method), arg)


def _run_sync(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, awaited when it returns a coroutine (called on a check thread: no loop runs)."""
    res = fn(*args)
    return asyncio.run(res) if asyncio.iscoroutine(res) else res
