"""PromptCurriculum: choose a task's prompts (env seeds) by how learnable they are right now.

A GRPO group learns only from the spread of its rewards. A prompt the policy always solves, or
never, gives a flat group (no gradient under an exact reward, little under a shaped one) and
spends a whole group of rollouts on it. The curriculum keeps a success estimate ``p`` per seed
from the rewards the scheduler sees and draws seeds with weight ``p * (1 - p)`` (learnability,
highest at p = 0.5), mixed with uniform draws so that no seed is starved and a forgotten one
comes back. Unseen seeds start at p = 0.5: every prompt is tried early.

The scheduler owns the curriculum of each task: it calls :meth:`PromptCurriculum.next_seed` when
it opens a group and :meth:`PromptCurriculum.update` for every scored trajectory. In a pipeline
that is the rollout worker's copy (the object passed to ``sess.tasks`` is a template).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from typing import Any

from rollart_nb.errors import ConfigError

__all__ = ["PromptCurriculum", "curriculum_problems"]


def curriculum_problems(curricula: dict[str, Any], tasks: Iterable[str] | None = None) -> list[str]:
    """What is wrong with task -> curriculum ``curricula`` (empty when nothing): a task not among
    ``tasks`` (when given), or an object without ``next_seed(rng)`` and ``update(seed, reward)``."""
    known = None if tasks is None else set(tasks)
    p = []
    for name, cur in curricula.items():
        if known is not None and name not in known:
            p.append(f"curriculum for unknown task {name!r}; tasks are {sorted(known)}")
        elif not (callable(getattr(cur, "next_seed", None)) and callable(getattr(cur, "update", None))):
            p.append(f"curriculum of {name!r}: {type(cur).__name__} has no next_seed(rng) and update(seed, reward)")
    return p


class PromptCurriculum:
    """Learnability-weighted sampling over a finite set of env seeds.

    Args:
        seeds: the prompts to train on, as env seeds (e.g. ``Arithmetic().validation_seeds()``,
            every problem once, or the indices of a dataset).
        success: a trajectory whose reward is at least this counts as solved.
        uniform: share of draws made uniformly over ``seeds`` (the rest by learnability).
        decay: weight kept by a seed's past outcomes at each new outcome of that seed (0.9:
            roughly the last ten rollouts count).

    Example:
        >>> env = rn.envs.Arithmetic()
        >>> tasks = sess.tasks({"math": env}, curriculum={"math": rn.PromptCurriculum(env.validation_seeds())})
        ...                                                                     # doctest: +SKIP
    """

    def __init__(
        self, seeds: Iterable[int], *, success: float = 1.0, uniform: float = 0.25, decay: float = 0.9
    ) -> None:
        self.seeds = [int(s) for s in seeds]
        p = []
        if not self.seeds:
            p.append("seeds must not be empty")
        if len(set(self.seeds)) != len(self.seeds):
            p.append("seeds must be distinct")
        if not 0.0 <= uniform <= 1.0:
            p.append(f"uniform must be in [0, 1], got {uniform}")
        if not 0.0 <= decay < 1.0:
            p.append(f"decay must be in [0, 1), got {decay}")
        if not math.isfinite(success):
            p.append(f"success must be finite, got {success}")
        if p:
            raise ConfigError(p, where="PromptCurriculum")
        self.success, self.uniform, self.decay = float(success), float(uniform), float(decay)
        self._index = {s: i for i, s in enumerate(self.seeds)}
        self._hits = [0.0] * len(self.seeds)  # decayed counts of solved / all outcomes per seed
        self._trials = [0.0] * len(self.seeds)
        self.draws = 0
        self.updates = 0

    def p(self, seed: int) -> float:
        """Success estimate of ``seed``: decayed hits over decayed trials, with one pseudo-trial
        at 0.5 (so an unseen seed is 0.5 and one outcome does not make it 0 or 1)."""
        return self._estimate(self._index[seed])

    def _estimate(self, i: int) -> float:
        return (self._hits[i] + 0.5) / (self._trials[i] + 1.0)

    def _learnability(self) -> list[float]:
        """p * (1 - p) of each seed, in ``seeds`` order."""
        return [x * (1.0 - x) for x in map(self._estimate, range(len(self.seeds)))]

    def weights(self) -> list[float]:
        """Sampling weight of each seed (sums to 1)."""
        learn = self._learnability()
        total = sum(learn)
        n = len(self.seeds)
        return [self.uniform / n + (1.0 - self.uniform) * w / total for w in learn]

    def next_seed(self, rng: random.Random) -> int:
        """Draw the seed of the next group."""
        self.draws += 1
        if rng.random() < self.uniform:
            return self.seeds[rng.randrange(len(self.seeds))]
        return rng.choices(self.seeds, weights=self._learnability())[0]

    def update(self, seed: int, reward: float) -> None:
        """Record one scored trajectory of ``seed`` (seeds outside the set are ignored)."""
        i = self._index.get(seed)
        if i is None or not math.isfinite(reward):
            return
        self._hits[i] = self._hits[i] * self.decay + (1.0 if reward >= self.success else 0.0)
        self._trials[i] = self._trials[i] * self.decay + 1.0
        self.updates += 1

    def summary(self) -> dict[str, Any]:
        """Counts and the spread of the success estimates (for reports and notebooks)."""
        ps = sorted(self.p(s) for s in self.seeds)
        seen = sum(1 for t in self._trials if t > 0)
        return {
            "seeds": len(self.seeds),
            "seen": seen,
            "draws": self.draws,
            "updates": self.updates,
            "solved": sum(1 for x in ps if x >= 0.8),
            "p_median": round(ps[len(ps) // 2], 3),
        }

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"PromptCurriculum({s['seeds']} seeds, seen {s['seen']}, solved {s['solved']}, "
            f"median p {s['p_median']}, uniform={self.uniform})"
        )
