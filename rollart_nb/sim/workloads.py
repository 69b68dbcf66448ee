"""Workload profiles of agentic task families, and a synthetic env that follows one.

The paper (§2, Table 1) sorts agentic tasks into two shapes: *prefill-heavy* (many turns,
e.g. SWE-bench, FrozenLake, WebShop: up to 30-100 turns of growing history) and
*decode-heavy* (at most ~5 turns, long chains of thought per action, e.g. GEM-Math and
GEM-Game). The presets below encode those shapes; their per-turn token counts and
latencies are illustrative magnitudes chosen to fit a 32k context, not measurements.

:class:`SimEnv` plays a :class:`Workload`: observations of the profile's length (one
synthetic word per :class:`~rollart_nb.sim.tokenizer.SimTokenizer` token), the profile's
number of turns, Gaussian env latency, and a seeded random reward. **Sim rewards carry no
learning signal**: they are uniform in [0, 1] whatever the actions say.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollart_nb.clock import resolve_time_scale
from rollart_nb.clock import sleep as clock_sleep
from rollart_nb.errors import ConfigError, EnvError
from rollart_nb.protocols import GenerationRequest

__all__ = ["PRESETS", "SimEnv", "Workload", "response_tokens_fn", "workload"]


@dataclass(frozen=True)
class Workload:
    """The shape of one task family's rollouts.

    Attributes:
        name: task family name.
        shape: "prefill" (many turns, growing history) or "decode" (few turns, long answers).
        turns: (min, max) turns per episode, inclusive; uniform in between unless
            ``turn_weights`` says otherwise.
        prompt_tokens: tokens of the initial observation (task statement).
        obs_tokens: (mean, std) tokens of each later observation (Gaussian, at least 1).
        response_tokens: (mean, std) tokens of each model response (Gaussian, at least 1).
        env_latency_s: (mean, std) seconds of one ``env.step`` (Gaussian, clipped at 0).
        reset_latency_s: (mean, std) seconds of ``env.reset`` (e.g. pulling a container).
        max_response_tokens: the response budget to request per turn.
        turn_weights: relative frequencies of episodes lasting ``min``, ``min + 1``, ..., ``max``
            turns (e.g. real episodes' counts; FrozenLake's are not uniform). Empty: uniform.
            A trajectory's tokens grow with the square of its turns, so the shape matters.
    """

    name: str
    shape: str
    turns: tuple[int, int]
    prompt_tokens: int
    obs_tokens: tuple[float, float]
    response_tokens: tuple[float, float]
    env_latency_s: tuple[float, float]
    reset_latency_s: tuple[float, float] = (0.0, 0.0)
    max_response_tokens: int = 4096
    turn_weights: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        problems = []
        if self.shape not in ("prefill", "decode"):
            problems.append(f"shape must be 'prefill' or 'decode', got {self.shape!r}")
        lo, hi = self.turns
        if not 1 <= lo <= hi:
            problems.append(f"turns must satisfy 1 <= min <= max, got {self.turns}")
        if self.prompt_tokens < 1:
            problems.append(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        for what in ("obs_tokens", "response_tokens", "env_latency_s", "reset_latency_s"):
            mean, std = getattr(self, what)
            if mean < 0 or std < 0:
                problems.append(f"{what} mean and std must be >= 0, got {(mean, std)}")
        if self.max_response_tokens < 1:
            problems.append(f"max_response_tokens must be >= 1, got {self.max_response_tokens}")
        if self.turn_weights and (
            len(self.turn_weights) != hi - lo + 1 or min(self.turn_weights) < 0 or not sum(self.turn_weights) > 0
        ):
            problems.append(
                f"turn_weights must hold {hi - lo + 1} non-negative weights (turns {lo}..{hi}) with a positive "
                f"sum, got {self.turn_weights}"
            )
        if problems:
            raise ConfigError(problems, where=f"Workload {self.name!r}")

    @property
    def mean_turns(self) -> float:
        lo, hi = self.turns
        if self.turn_weights:
            return sum((lo + i) * w for i, w in enumerate(self.turn_weights)) / sum(self.turn_weights)
        return (lo + hi) / 2.0

    def end_hazard(self, turn: int) -> float:
        """P(the episode ends at ``turn`` | it reached ``turn``): 0 before ``min``, 1 at ``max``;
        uniform lengths give ``1 / (max - turn + 1)``, ``turn_weights`` ``w[turn] / sum(w[turn:])``."""
        lo, hi = self.turns
        if turn < lo:
            return 0.0
        if turn >= hi:
            return 1.0
        if not self.turn_weights:
            return 1.0 / (hi - turn + 1)
        left = sum(self.turn_weights[turn - lo :])
        return self.turn_weights[turn - lo] / left if left > 0 else 1.0


PRESETS: dict[str, Workload] = {
    w.name: w
    for w in [
        # Software engineering in a container: long horizons, bulky tool output, slow steps,
        # and a slow reset (image pull + container start, the paper's env.reset cost).
        Workload(
            "swe",
            "prefill",
            (10, 50),
            1500,
            (500.0, 250.0),
            (150.0, 80.0),
            (2.0, 1.0),
            reset_latency_s=(20.0, 10.0),
            max_response_tokens=1024,
        ),
        # Grid game: many short turns, small observations, near-instant steps.
        Workload(
            "frozenlake", "prefill", (10, 20), 300, (120.0, 20.0), (30.0, 10.0), (0.05, 0.02), max_response_tokens=128
        ),
        # Web shopping: page text observations, moderate step latency (page loads).
        Workload(
            "webshop", "prefill", (10, 30), 600, (400.0, 150.0), (60.0, 25.0), (0.5, 0.3), max_response_tokens=256
        ),
        # Math with tool feedback: few turns, long chains of thought (~1-4k tokens).
        Workload(
            "gem-math", "decode", (1, 3), 200, (40.0, 20.0), (2500.0, 800.0), (0.1, 0.05), max_response_tokens=8192
        ),
        # Text games (GEM): a handful of turns, medium reasoning per move.
        Workload(
            "gem-game", "decode", (2, 5), 250, (80.0, 30.0), (1200.0, 500.0), (0.1, 0.05), max_response_tokens=4096
        ),
    ]
}


def workload(name: str) -> Workload:
    """Look up a preset by name (case-insensitive).

    Example:
        >>> workload("gem-math").shape
        'decode'
    """
    w = PRESETS.get(name.lower())
    if w is None:
        raise ConfigError(f"unknown workload {name!r}; known: {', '.join(sorted(PRESETS))}")
    return w


_preset = workload  # SimEnv's parameter ``workload`` shadows the function


def _gauss_int(rng: np.random.Generator, mean_std: tuple[float, float], lo: int = 1) -> int:
    mean, std = mean_std
    return max(lo, int(round(rng.normal(mean, std) if std > 0 else mean)))


def response_tokens_fn(
    workloads: Workload | Mapping[str, Workload], seed: int = 0
) -> Callable[[GenerationRequest], int]:
    """A ``response_tokens`` function for :class:`~rollart_nb.sim.backend.SimBackend`.

    Each request's length is drawn from its task's ``response_tokens`` Gaussian (clipped to
    ``[1, max_response_tokens]``), seeded by (seed, trajectory id, whole prompt length, held
    prefix included) so a given turn always gets the same length.

    Args:
        workloads: one workload for every task, or a mapping task name -> workload.
        seed: mixed into every draw.

    Raises:
        ConfigError: (when called) the request's task has no workload.
    """

    def fn(request: GenerationRequest) -> int:
        if isinstance(workloads, Workload):
            w = workloads
        elif request.task in workloads:
            w = workloads[request.task]
        else:
            raise ConfigError(f"no workload for task {request.task!r}; known: {', '.join(sorted(workloads))}")
        key = f"{seed}|{request.traj_id}|{request.full_len}".encode()
        rng = np.random.default_rng(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))
        return min(_gauss_int(rng, w.response_tokens), w.max_response_tokens)

    return fn


class SimEnv:
    """A synthetic env that follows a :class:`Workload` (implements the Env protocol).

    * ``reset`` returns ``prompt_tokens`` words; each non-final ``step`` returns about
      ``obs_tokens`` words (one :class:`SimTokenizer` token each); the final step returns "".
    * From ``turns[0]`` on, step ``k`` ends the episode with hazard :meth:`Workload.end_hazard`,
      drawn from a hash of the reset seed and the actions so far: deterministic given the
      actions, yet members of one GRPO group (same seed, different actions) differ.
    * The final step's reward is uniform in [0, 1] from the same hash (no learning signal);
      earlier steps give 0.
    * ``step``/``reset`` sleep ``latency * time_scale`` (:func:`rollart_nb.clock.sleep`);
      ``astep``/``areset`` await :func:`asyncio.sleep`, so thousands run on one event loop.

    Args:
        seed: instance seed, mixed with every reset seed.
        time_scale: seconds slept per modelled second of env latency (0: no sleep); by default
            decided where the env runs (:func:`rollart_nb.clock.resolve_time_scale`).

    Example:
        >>> env = SimEnv("frozenlake", time_scale=0)
        >>> obs, info = env.reset(seed=3)
        >>> len(obs.split()), env.shape
        (300, 'prefill')
    """

    def __init__(self, workload: Workload | str, seed: int = 0, time_scale: float | None = None) -> None:
        if isinstance(workload, str):
            workload = _preset(workload)
        if time_scale is not None and time_scale < 0:
            raise ConfigError(f"time_scale must be >= 0, got {time_scale}", where="SimEnv")
        self.workload, self.seed, self._time_scale = workload, seed, time_scale
        self.shape = workload.shape
        self.max_turns = workload.turns[1]
        self.vocab: list[str] = []  # observations are synthetic words; no fixed vocabulary
        self._episodes = itertools.count()
        self._reset_seed = 0
        self._turn = 0
        self._history = 0  # crc32 chained over the episode's actions
        self._done = True

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        out, latency = self._reset(seed)
        self._block(latency)
        return out

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        out, latency = self._step(action)
        self._block(latency)
        return out

    async def areset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        out, latency = self._reset(seed)
        await asyncio.sleep(latency * self.time_scale)
        return out

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        out, latency = self._step(action)
        await asyncio.sleep(latency * self.time_scale)
        return out

    @property
    def time_scale(self) -> float:
        """Seconds slept per modelled second here (see ``time_scale`` above)."""
        return resolve_time_scale(self._time_scale)

    def __repr__(self) -> str:
        ts = "auto" if self._time_scale is None else f"{self._time_scale:g}"
        return f"SimEnv({self.workload.name!r}, seed={self.seed}, time_scale={ts})"

    def _block(self, latency: float) -> None:
        if self.time_scale > 0 and latency > 0:
            clock_sleep(latency * self.time_scale)  # simulated time on a SimSession's virtual clock

    def _latency(self, mean_std: tuple[float, float]) -> float:
        # Its own stream: latency never depends on the actions, only on (seed, episode, turn).
        rng = np.random.default_rng([self.seed, self._reset_seed, self._turn, 7])
        mean, std = mean_std
        return max(0.0, float(rng.normal(mean, std)) if std > 0 else mean)

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def _words(n: int) -> str:
        # Cached: thousands of envs emit observations of a few hundred distinct lengths.
        return " ".join(f"o{k}" for k in range(n))

    def _reset(self, seed: int | None) -> tuple[tuple[str, dict[str, Any]], float]:
        # Without a seed, successive episodes differ but stay reproducible per instance.
        self._reset_seed = int(seed) if seed is not None else 2**31 + next(self._episodes)
        self._turn, self._history, self._done = 0, 0, False
        info = {"workload": self.workload.name, "shape": self.shape}
        return (self._words(self.workload.prompt_tokens), info), self._latency(self.workload.reset_latency_s)

    def _step(self, action: str) -> tuple[tuple[str, float, bool, bool, dict[str, Any]], float]:
        if self._done:
            raise EnvError(f"{self!r} was stepped after its episode ended; call reset() first")
        self._turn += 1
        self._history = zlib.crc32(action.encode("utf-8"), self._history)
        rng = np.random.default_rng([self.seed, self._reset_seed, self._history, self._turn])
        terminated = self._turn >= self.workload.turns[0] and rng.random() < self.workload.end_hazard(self._turn)
        self._done = terminated
        info: dict[str, Any] = {"turn": self._turn}
        if terminated:
            out = ("", float(rng.random()), True, False, info)
        else:
            out = (self._words(_gauss_int(rng, self.workload.obs_tokens)), 0.0, False, False, info)
        return out, self._latency(self.workload.env_latency_s)
