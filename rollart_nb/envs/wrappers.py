"""Wrappers that inject latency and failures into any env, for experiments and tests.

Both have a sync path (:func:`rollart_nb.clock.sleep`, simulated inside a SimSession) and an
async one (:func:`asyncio.sleep`). Each env *instance* draws from its own random stream: deep
copy ``k`` reseeds from ``(seed, k)``, so a recreated env never replays its predecessor's draws.
"""

from __future__ import annotations

import asyncio
import copy
import random
from typing import Any

from rollart_nb.clock import sleep
from rollart_nb.envs.base import EnvWrapper, StepResult, env_reset, env_step
from rollart_nb.errors import ConfigError, EnvError

__all__ = ["WithFailures", "WithLatency"]


class _PerInstanceRng(EnvWrapper):
    """An EnvWrapper whose deep copies get their own seeded random stream (see the module doc).

    Attributes:
        instance: this instance's copy path, ``()`` for the object the user built, ``(k,)``
            for its k-th deep copy (1-based), ``(k, j)`` for the j-th copy of that one.
    """

    def _seed_rng(self, seed: int | str | None) -> None:
        self._seed = seed  # None: every instance draws from OS entropy
        self.instance: tuple[int, ...] = ()
        self._copies = 0  # a plain int (not itertools.count): it pickles into Ray actors
        self._rng = self._new_rng()

    def _new_rng(self) -> random.Random:
        if self._seed is None:
            return random.Random()
        if not self.instance:
            return random.Random(self._seed)
        # a str seed is hashed with SHA-512: the same stream in every process, unlike hash()
        return random.Random("/".join(map(str, (self._seed, *self.instance))))

    def __deepcopy__(self, memo: dict) -> _PerInstanceRng:
        new = copy.copy(self)
        memo[id(self)] = new
        new.env = copy.deepcopy(self.env, memo)
        self._copies += 1
        new.instance, new._copies = (*self.instance, self._copies), 0
        new._rng = new._new_rng()
        return new


class WithLatency(_PerInstanceRng):
    """Delay every ``reset`` and ``step`` by a random latency, like a remote env would.

    The latency is Gaussian ``N(mean_s, std_s)`` clipped at 0; with probability
    ``long_tail_p`` it is multiplied by ``long_tail_scale`` (stragglers). The latency
    sampled for a call is reported in its ``info["latency_s"]``.

    Args:
        env: the env to wrap.
        mean_s: mean latency in seconds.
        std_s: standard deviation in seconds.
        long_tail_p: probability that a call is a straggler.
        long_tail_scale: how much longer a straggler takes.
        seed: seed of the latency sampler (None: nondeterministic); deep copy ``k`` draws
            from ``(seed, k)``.

    Example:
        >>> from rollart_nb.envs import Arithmetic
        >>> env = WithLatency(Arithmetic(), mean_s=0.01, std_s=0.0)
        >>> obs, info = env.reset(seed=0)
        >>> info["latency_s"]
        0.01
    """

    def __init__(
        self,
        env: Any,
        mean_s: float,
        std_s: float,
        long_tail_p: float = 0.0,
        long_tail_scale: float = 10.0,
        seed: int | str | None = None,
    ) -> None:
        problems = []
        if mean_s < 0 or std_s < 0:
            problems.append(f"mean_s and std_s must be >= 0, got {mean_s}, {std_s}")
        if not 0.0 <= long_tail_p <= 1.0:
            problems.append(f"long_tail_p must be in [0, 1], got {long_tail_p}")
        if long_tail_scale < 1.0:
            problems.append(f"long_tail_scale must be >= 1, got {long_tail_scale}")
        if problems:
            raise ConfigError(problems, where="WithLatency")
        super().__init__(env)
        self.mean_s, self.std_s = mean_s, std_s
        self.long_tail_p, self.long_tail_scale = long_tail_p, long_tail_scale
        self._seed_rng(seed)

    def sample_latency(self) -> float:
        """Draw one latency in seconds (>= 0)."""
        latency = max(0.0, self._rng.gauss(self.mean_s, self.std_s))
        if self.long_tail_p and self._rng.random() < self.long_tail_p:
            latency *= self.long_tail_scale
        return latency

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        latency = self.sample_latency()
        sleep(latency)
        obs, info = self.env.reset(seed)
        return obs, {**info, "latency_s": latency}

    def step(self, action: str) -> StepResult:
        latency = self.sample_latency()
        sleep(latency)
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, reward, terminated, truncated, {**info, "latency_s": latency}

    async def areset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        latency = self.sample_latency()
        await asyncio.sleep(latency)
        obs, info = await env_reset(self.env, seed)
        return obs, {**info, "latency_s": latency}

    async def astep(self, action: str) -> StepResult:
        latency = self.sample_latency()
        await asyncio.sleep(latency)
        obs, reward, terminated, truncated, info = await env_step(self.env, action)
        return obs, reward, terminated, truncated, {**info, "latency_s": latency}

    def __repr__(self) -> str:
        return f"WithLatency({self.env!r}, mean_s={self.mean_s}, std_s={self.std_s})"


class WithFailures(_PerInstanceRng):
    """Make ``reset``/``step`` fail: raise :class:`~rollart_nb.errors.EnvError` with
    probability ``p_raise``, or hang for ``hang_s`` seconds with probability ``p_hang``.

    One uniform draw per call decides its fate; each env instance draws from its own stream.
    A hang ends by raising ``EnvError``; its async form is a cancellable :func:`asyncio.sleep`.

    Args:
        env: the env to wrap.
        p_raise: probability that a call raises.
        p_hang: probability that a call hangs (``p_raise + p_hang <= 1``).
        hang_s: how long a hang lasts.
        on: which calls may fail, among ``"reset"`` and ``"step"``.
        seed: seed of the failure sampler (None: nondeterministic); deep copy ``k`` draws
            from ``(seed, k)``.

    Example:
        >>> from rollart_nb.envs import Arithmetic
        >>> env = WithFailures(Arithmetic(), p_raise=1.0)
        >>> env.reset(seed=0)
        Traceback (most recent call last):
        ...
        rollart_nb.errors.EnvError: injected failure in Arithmetic.reset (WithFailures p_raise=1.0)
    """

    def __init__(
        self,
        env: Any,
        p_raise: float = 0.0,
        p_hang: float = 0.0,
        hang_s: float = 3600.0,
        on: tuple[str, ...] = ("reset", "step"),
        seed: int | str | None = None,
    ) -> None:
        problems = []
        if not (0.0 <= p_raise <= 1.0 and 0.0 <= p_hang <= 1.0):
            problems.append(f"p_raise and p_hang must be in [0, 1], got {p_raise}, {p_hang}")
        elif p_raise + p_hang > 1.0:
            problems.append(f"p_raise + p_hang must be <= 1, got {p_raise} + {p_hang}")
        if hang_s < 0:
            problems.append(f"hang_s must be >= 0, got {hang_s}")
        if set(on) - {"reset", "step"}:
            problems.append(f"on may only hold 'reset' and 'step', got {on!r}")
        if problems:
            raise ConfigError(problems, where="WithFailures")
        super().__init__(env)
        self.p_raise, self.p_hang, self.hang_s, self.on = p_raise, p_hang, hang_s, tuple(on)
        self._seed_rng(seed)

    def _fate(self, call: str) -> str:
        """``"ok"``, ``"raise"`` or ``"hang"`` for the next ``call``, from one uniform draw."""
        if call not in self.on:
            return "ok"
        u = self._rng.random()
        if u < self.p_raise:
            return "raise"
        if u < self.p_raise + self.p_hang:
            return "hang"
        return "ok"

    def _error(self, call: str, fate: str) -> EnvError:
        name = type(self.unwrapped).__name__
        if fate == "raise":
            return EnvError(f"injected failure in {name}.{call} (WithFailures p_raise={self.p_raise})")
        return EnvError(f"injected hang of {self.hang_s:g}s in {name}.{call} (WithFailures p_hang={self.p_hang})")

    def _sync_fail(self, call: str) -> None:
        fate = self._fate(call)
        if fate == "hang":
            sleep(self.hang_s)
        if fate != "ok":
            raise self._error(call, fate)

    async def _async_fail(self, call: str) -> None:
        fate = self._fate(call)
        if fate == "hang":
            await asyncio.sleep(self.hang_s)
        if fate != "ok":
            raise self._error(call, fate)

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        self._sync_fail("reset")
        return self.env.reset(seed)

    def step(self, action: str) -> StepResult:
        self._sync_fail("step")
        return self.env.step(action)

    async def areset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        await self._async_fail("reset")
        return await env_reset(self.env, seed)

    async def astep(self, action: str) -> StepResult:
        await self._async_fail("step")
        return await env_step(self.env, action)

    def __repr__(self) -> str:
        return f"WithFailures({self.env!r}, p_raise={self.p_raise}, p_hang={self.p_hang})"
