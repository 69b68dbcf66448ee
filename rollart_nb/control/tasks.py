"""TaskSet: the tasks of a run, their env templates and how many env instances each gets."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from rollart_nb.control.curriculum import curriculum_problems
from rollart_nb.errors import ConfigError

__all__ = ["TaskSet"]


@dataclass
class TaskSet:
    """Tasks -> env templates, env counts and batch weights. Built by ``sess.tasks(...)``.

    Attributes:
        envs: task name -> env template (deep-copied per EnvManager).
        envs_per_task: task name -> number of concurrent env instances.
        weights: task name -> share of each training batch (None: uniform).
        curricula: task name -> prompt curriculum (see :class:`~rollart_nb.PromptCurriculum`).
        launchers: task name -> the launcher serving its envs (its env template is then a
            :class:`~rollart_nb.envs.RemoteEnv`); the session owns and stops them.
    """

    envs: dict[str, Any]
    envs_per_task: dict[str, int] = field(default_factory=dict)
    weights: dict[str, float] | None = None
    curricula: dict[str, Any] = field(default_factory=dict)
    launchers: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        p = []
        if not self.envs:
            p.append("no tasks given")
        for name, env in self.envs.items():
            if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
                p.append(f"task {name!r}: {type(env).__name__} is not an env (needs reset(seed) and step(action))")
            if name not in self.envs_per_task:
                p.append(f"task {name!r}: envs_per_task has no count for it (give every task one, or one int for all)")
                continue
            n = self.envs_per_task[name]
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                p.append(f"task {name!r}: envs_per_task must be an int >= 1, got {n!r}")
        for name in self.envs_per_task:
            if name not in self.envs:
                p.append(f"envs_per_task for unknown task {name!r}; tasks are {sorted(self.envs)}")
        for name, w in (self.weights or {}).items():
            if name not in self.envs:
                p.append(f"weight for unknown task {name!r}")
            elif w < 0:
                p.append(f"weight of {name!r} must be >= 0")
        p += curriculum_problems(self.curricula, self.envs)
        if p:
            raise ConfigError(p, where="sess.tasks(...)")

    def check(self, task: str) -> None:
        if task not in self.envs:
            raise ConfigError(f"unknown task {task!r}; tasks are {sorted(self.envs)}")

    def expand(self) -> dict[str, list[Any]]:
        """task -> one env copy per EnvManager."""
        return {t: [copy.deepcopy(e) for _ in range(self.envs_per_task[t])] for t, e in self.envs.items()}

    def validation_seeds(self, default: int = 16) -> dict[str, list[int]]:
        out = {}
        for t, env in self.envs.items():
            fn = getattr(env, "validation_seeds", None)
            out[t] = list(fn()) if callable(fn) else list(range(default))
        return out

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{t}: {type(e).__name__} x{self.envs_per_task[t]}"
            + (f" on {type(self.launchers[t]).__name__}" if t in self.launchers else "")
            for t, e in self.envs.items()
        )
        return f"TaskSet({parts})"
