"""Core data types shared by every plane: :class:`Turn` and :class:`Trajectory`.

Plain dataclasses (picklable, cheap to ship through Ray). Token ids are lists of ints,
never tensors, so a trajectory serializes compactly (``to_dict`` / ``from_dict``).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from rollart_nb.redact import redact

__all__ = ["Status", "Trajectory", "TrajectoryList", "Turn"]


class Status(StrEnum):
    """Lifecycle of a trajectory. Every trajectory ends in exactly one terminal status."""

    RUNNING = "running"
    COMPLETED = "completed"
    ABORTED_STALE = "aborted_stale"
    CANCELLED = "cancelled"  # surplus of a redundant rollout
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self is not Status.RUNNING


@dataclass
class Turn:
    """One agent turn: the observation shown, the action generated, and how.

    Attributes:
        observation: text the env returned before this turn.
        action: decoded text of the generated response.
        prompt_ids: token ids fed to the model for this turn (whole history), shape [P].
        response_ids: generated token ids, shape [R].
        logprobs: behaviour log-probabilities of ``response_ids``, shape [R].
        loss_mask: 1 for tokens trained on (assistant tokens), shape [R].
        version: policy version of the weights that generated this turn.
        env_reward: reward returned by ``env.step`` for this action.
        timings: seconds spent per phase ("generate", "env", "barrier", ...) and the wall-clock
            start of the turn's generation (``"t"``, unix seconds) for timelines.
        worker: the generation worker that produced the response.
        ref_logprobs: log-probabilities of ``response_ids`` under the KL reference policy, shape
            [R], when a :class:`~rollart_nb.backends.torch_train.ReferencePolicy` worker computed
            them (the trainer then skips its own reference pass); empty otherwise.
    """

    observation: str
    action: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    version: int = 0
    env_reward: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    worker: str = ""
    ref_logprobs: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class Trajectory:
    """A multi-turn rollout of one env instance, plus its reward and fate.

    Attributes:
        task: task name as given to ``Session.tasks``.
        seed: env seed; members of one GRPO group share it (and so share the prompt).
        group_id: id of the GRPO group this trajectory belongs to.
        id: unique id.
        turns: the turns so far.
        start_version: policy version when the trajectory began.
        status: see :class:`Status`.
        reason: why it failed / was aborted (empty when completed); secrets in it are masked
            (:func:`~rollart_nb.redact.redact`) when :meth:`finish` records it.
        reward: scalar reward (set by the reward worker), NaN until scored.
        turn_rewards: optional per-turn rewards.
        reward_version: version of the reward function that scored it.
        info: env ``reset`` info plus anything envs/rewards want to carry (e.g. ``answer``).
        created_s / finished_s: wall-clock timestamps.
    """

    task: str
    seed: int = 0
    group_id: str = ""
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    turns: list[Turn] = field(default_factory=list)
    start_version: int = 0
    status: Status = Status.RUNNING
    reason: str = ""
    reward: float = math.nan
    turn_rewards: list[float] | None = None
    reward_version: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    created_s: float = 0.0
    finished_s: float = 0.0

    # -- derived views -------------------------------------------------------------
    @property
    def versions(self) -> list[int]:
        """Policy version of every turn."""
        return [t.version for t in self.turns]

    @property
    def min_version(self) -> int:
        """Oldest policy version that contributed to this trajectory."""
        return min([self.start_version, *self.versions])

    @property
    def max_version(self) -> int:
        """Newest policy version that generated a turn of this trajectory (its start version if none)."""
        return max(self.versions, default=self.start_version)

    @property
    def env_return(self) -> float:
        """Sum of the env's own step rewards."""
        return float(sum(t.env_reward for t in self.turns))

    @property
    def num_tokens(self) -> int:
        """Prompt + response tokens over all turns (the paper's throughput numerator)."""
        return sum(t.num_tokens for t in self.turns)

    @property
    def scored(self) -> bool:
        return self.reward_version is not None and not math.isnan(self.reward)

    def finish(self, status: Status, reason: str = "", *, now: float = 0.0) -> None:
        """Move to a terminal status, once; later calls are ignored (first fate wins).

        ``reason`` is recorded redacted: it often quotes an exception, which may quote a URL.
        """
        if self.status.terminal:
            return
        self.status, self.reason, self.finished_s = status, redact(reason), now

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (token ids as lists of ints)."""
        d = asdict(self)
        d["status"] = self.status.value
        if math.isnan(self.reward):
            d["reward"] = None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        d = dict(d)
        d["turns"] = [Turn(**t) for t in d.get("turns", [])]
        d["status"] = Status(d.get("status", "running"))
        if d.get("reward") is None:
            d["reward"] = math.nan
        return cls(**d)

    def __repr__(self) -> str:
        r = "-" if math.isnan(self.reward) else f"{self.reward:.3g}"
        return (
            f"Trajectory(id={self.id!r}, task={self.task!r}, status={self.status.value}, "
            f"turns={len(self.turns)}, reward={r}, versions={self.start_version}..{self.max_version})"
        )

    def _repr_html_(self) -> str:
        """In a notebook: status and reason, reward and its version, every turn (the viewer's detail pane)."""
        from rollart_nb.errors import ConfigError
        from rollart_nb.views import view

        try:
            return view("trajectory_html", self)
        except ConfigError:  # no notebook extra: the plain repr, escaped
            import html

            return f"<pre>{html.escape(repr(self))}</pre>"


class TrajectoryList(list):
    """A list of trajectories that shows itself as the TrajectoryViewer in a notebook.

    ``source`` (optional) is the Pipeline they came from and ``filters`` the query, so the
    viewer can keep updating as new trajectories land.
    """

    def __init__(self, items: Iterable[Trajectory] = (), source: Any = None, filters: dict[str, Any] | None = None):
        super().__init__(items)
        self.source, self.filters = source, dict(filters or {})

    def to_dicts(self) -> list[dict[str, Any]]:
        return [t.to_dict() for t in self]

    def _ipython_display_(self) -> None:
        from IPython.display import display

        from rollart_nb.views import view

        display(view("trajectories", self))
