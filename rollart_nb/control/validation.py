"""Validation of a pipeline's policy: greedy scores and sampled pass@k over each task's
validation seeds, with the training rollout held while they run (see :meth:`Pipeline.validate`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from rollart_nb.errors import ConfigError

__all__ = ["Validation"]

log = logging.getLogger(__name__)


class Validation:
    """A pipeline's validation rollouts (:meth:`Pipeline.validate`, :meth:`Pipeline.pass_at`),
    and every ``every`` steps (0: never) greedy, plus pass@``pass_k`` when it is > 1."""

    def __init__(
        self, name: str, rollout: Any, seeds: dict[str, list[int]], *, every: int, pass_k: int, temperature: float
    ) -> None:
        self.name, self.rollout, self.seeds, self.temperature = name, rollout, seeds, temperature
        self.every, self.pass_k = every, pass_k
        self.last: dict[str, dict[str, Any]] = {}  # task -> its newest greedy result

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The rollout held for the block (a step's greedy and sampled validations share one)."""
        self.rollout.hold()
        try:
            yield
        finally:
            try:
                self.rollout.release()
            except Exception:  # the rollout is gone: whatever failed says so, not this
                log.exception("pipeline %s: could not release the rollout after a validation", self.name)

    def greedy(self, tasks: list[str] | None = None) -> dict[str, float]:
        """Greedy score per task (default: all), each full result kept in :attr:`last`."""
        out = {}
        for task in tasks or list(self.seeds):
            res = self.rollout.evaluate(task, self.seeds[task])
            self.last[task] = res
            out[task] = res["score"]
        return out

    def pass_at(self, k: int, tasks: list[str] | None, temperature: float | None) -> dict[str, dict[str, float]]:
        """``{"pass@1": ..., "pass@k": ...}`` per task, held; ConfigError for a bad ``k`` or
        a ``temperature`` (default: the rollout's) that cannot sample."""
        if not isinstance(k, int) or k < 1:
            raise ConfigError(f"pass_at needs a whole number k >= 1, got {k!r}")
        temp = self.temperature if temperature is None else float(temperature)
        if k > 1 and temp <= 0:
            raise ConfigError(f"pass@{k} needs sampling: temperature must be > 0, got {temp}")
        with self.held():
            return self._sampled(k, tasks, temp)

    def _sampled(self, k: int, tasks: list[str] | None, temperature: float) -> dict[str, dict[str, float]]:
        out = {}
        for task in tasks or list(self.seeds):
            res = self.rollout.evaluate(task, self.seeds[task], temperature=temperature, samples=k)
            out[task] = {"pass@1": res["pass@1"], f"pass@{k}": res[f"pass@{k}"]}
        return out

    def after_step(self, rep: Any, clock: Callable[[], float]) -> None:
        """The periodic validation into ``rep`` when its step is due; its seconds go to
        ``rep.phases["validation"]``, after and outside the step's own time."""
        if not self.every or (rep.step + 1) % self.every:
            return
        t = clock()
        with self.held():  # one hold: no training turn between greedy and sampled
            rep.validation = self.greedy()
            if self.pass_k > 1:
                rep.pass_k = self._sampled(self.pass_k, None, self.temperature)
        rep.phases["validation"] = clock() - t
