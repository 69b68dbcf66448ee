"""Core data types shared by every plane: :class:`Turn` and :class:`Trajectory`.

Plain dataclasses (picklable, cheap to ship through Ray). Token ids are lists of ints, or
read-only :class:`~rollart_nb.tokens.TokenView` s of one shared per-trajectory buffer (what the
EnvManager records, so the history is stored once, not once per turn), never tensors;
``to_dict`` writes plain lists and ``from_dict`` reads them back.

In a notebook, :class:`TrajectoryList` (what ``pipe.trajectories()`` returns) is the way in:
``to_dataframe(level=...)`` for pandas, ``group(...)`` / ``groups()`` for GRPO groups with their
advantages, and the viewer; a trajectory taken from it decodes its tokens with the pipeline's
tokenizer when shown alone.
"""

from __future__ import annotations

import copy
import math
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import TYPE_CHECKING, Any, SupportsIndex, overload

from rollart_nb.errors import ConfigError
from rollart_nb.redact import redact
from rollart_nb.trajectory_frames import TokenizerRef, frame, to_dataframe
from rollart_nb.trajectory_groups import GROUP_COLUMNS, TrajectoryGroup, algo_of, group_key, groups_of
from rollart_nb.views import view

if TYPE_CHECKING:
    from rollart_nb.algo.grpo import GRPO

__all__ = ["Status", "Trajectory", "TrajectoryList", "Turn"]

FAILED_IN = "rollart_failed_in"
"""``Trajectory.info`` key of where a failed trajectory failed: "env_reset", "env_step" or "reward"."""
FAILURE = "rollart_failure"
"""``Trajectory.info`` key of the failure reason of a trajectory trained on with the failure reward."""


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
        prompt_ids: token ids fed to the model for this turn (whole history), shape [P]: a list,
            or a :class:`~rollart_nb.tokens.TokenView` of the trajectory's one token buffer.
        response_ids: generated token ids, shape [R] (a list or a view, as ``prompt_ids``).
        logprobs: behaviour log-probabilities of ``response_ids``, shape [R].
        loss_mask: 1 for tokens trained on (assistant tokens), shape [R].
        version: policy version of the weights that generated this turn.
        env_reward: reward returned by ``env.step`` for this action.
        timings: seconds per phase ("generate", "env", ...) and the start time ``"t"``.
        worker: the generation worker that produced the response.
        ref_logprobs: reference-policy log-probabilities of ``response_ids``, shape [R], when
            a :class:`~rollart_nb.backends.torch_train.ReferencePolicy` filled them; else empty.
    """

    observation: str
    action: str = ""
    prompt_ids: Sequence[int] = field(default_factory=list)
    response_ids: Sequence[int] = field(default_factory=list)
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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: token ids as plain lists of ints."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("prompt_ids", "response_ids", "logprobs", "loss_mask", "ref_logprobs"):
            d[name] = list(d[name])
        d["timings"] = dict(self.timings)
        return d


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
        reason: why it failed / was aborted (empty when completed), secrets masked.
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
        """Oldest policy version that generated a turn of this trajectory (the version it was
        initiated by, in the staleness bound's sense; its start version while it has no turn).

        A trajectory launched while the rollout is suspended for a weight update starts under
        the old version but its first action comes from the new weights: that is its version."""
        return min(self.versions, default=self.start_version)

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
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "turns"}
        d["turns"] = [t.to_dict() for t in self.turns]
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

    # -- views -----------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The tokenizer this trajectory's views decode with: that of the
        :class:`TrajectoryList` it came from (its pipeline's model), else None (ids are shown)."""
        ref = self.__dict__.get("_tokenizer_ref")
        return ref.get() if ref is not None else None

    def to_dataframe(self, level: str = "trajectory", tokenizer: Any = None) -> Any:
        """This trajectory as a table (see :meth:`TrajectoryList.to_dataframe`)."""
        return to_dataframe([self], level, tokenizer if tokenizer is not None else self.tokenizer)

    def __getstate__(self) -> dict[str, Any]:
        # The display tokenizer (and the pipeline behind it) stays on this process.
        state = dict(self.__dict__)
        state.pop("_tokenizer_ref", None)
        return state

    def __repr__(self) -> str:
        r = "-" if math.isnan(self.reward) else f"{self.reward:.3g}"
        last = self.turns[-1].action if self.turns else ""
        if len(last) > 60:
            last = last[:60] + "..."
        action = f", last_action={last!r}" if last else ""
        return (
            f"Trajectory(id={self.id!r}, task={self.task!r}, status={self.status.value}, "
            f"turns={len(self.turns)}, reward={r}, versions={self.start_version}..{self.max_version}{action})"
        )

    def _repr_html_(self) -> str:
        """In a notebook: status and reason, reward and its version, every turn with its text and
        the whole sequence's masks (the viewer's detail pane), decoded with :attr:`tokenizer`."""
        try:
            return view("trajectory_html", self, self.tokenizer)
        except ConfigError:  # no notebook extra: the plain repr, escaped
            import html

            return f"<pre>{html.escape(repr(self))}</pre>"


class TrajectoryList(list):
    """A list of trajectories that shows itself as the TrajectoryViewer in a notebook.

    ``source`` (optional) is the Pipeline they came from and ``filters`` the query, so the
    viewer can keep updating as new trajectories land; text is decoded with ``tokenizer``, else
    the tokenizer of the source's generation model. Its trajectories share that tokenizer, so
    one shown alone (``tl[0]``) shows text too. Slices are TrajectoryLists of the same source.

    Example:
        >>> tl = pipe.trajectories(task="math")                    # doctest: +SKIP
        >>> tl.to_dataframe(level="token").query("mask == 1")      # doctest: +SKIP
        >>> tl.group(tl[0])                                        # doctest: +SKIP
    """

    def __init__(
        self,
        items: Iterable[Trajectory] = (),
        source: Any = None,
        filters: dict[str, Any] | None = None,
        *,
        tokenizer: Any = None,
    ):
        super().__init__(items)
        self.source, self.filters = source, dict(filters or {})
        self._tokenizer_ref = TokenizerRef(source, tokenizer)
        if source is not None or tokenizer is not None:
            for t in self:
                t.__dict__["_tokenizer_ref"] = self._tokenizer_ref

    @property
    def tokenizer(self) -> Any:
        """The tokenizer views decode with (given, or loaded from the source's model); None: ids."""
        return self._tokenizer_ref.get()

    @overload
    def __getitem__(self, i: SupportsIndex) -> Trajectory: ...

    @overload
    def __getitem__(self, i: slice) -> TrajectoryList: ...

    def __getitem__(self, i: SupportsIndex | slice) -> Trajectory | TrajectoryList:
        if isinstance(i, slice):
            return TrajectoryList(
                super().__getitem__(i), self.source, self.filters, tokenizer=self._tokenizer_ref.tokenizer
            )
        return super().__getitem__(i)

    def to_dicts(self) -> list[dict[str, Any]]:
        return [t.to_dict() for t in self]

    def to_dataframe(self, level: str = "trajectory", tokenizer: Any = None) -> Any:
        """The trajectories as a ``pandas.DataFrame`` (the ``nb`` extra).

        Args:
            level: what a row is:

                * ``"trajectory"`` (default): ids, status, reward, versions, token counts and
                  timings of each trajectory.
                * ``"turn"``: per turn its version, worker, token counts, observation, action,
                  decoded text (None without a tokenizer), rewards, mean logprob and timings.
                * ``"token"``: per token of the whole sequence: id, text, side, mask, logprob
                  (NaN where none), turn and version (see :mod:`rollart_nb.trajectory_frames`).
            tokenizer: decodes text (default :attr:`tokenizer`).

        Raises:
            ConfigError: an unknown level, or pandas is not installed.
        """
        return to_dataframe(self, level, tokenizer if tokenizer is not None else self.tokenizer)

    def groups(self, algo: GRPO | None = None) -> Any:
        """Every GRPO group here, one row per member with its reward and advantage (a DataFrame;
        see :mod:`rollart_nb.trajectory_groups`). ``algo``: the GRPO settings (default: the
        source pipeline's, else GRPO's defaults)."""
        return frame([row for g in self._groups(algo) for row in g.rows()], GROUP_COLUMNS)

    def group(self, group: str | Trajectory, algo: GRPO | None = None) -> TrajectoryGroup:
        """One GRPO group (by id, or the group of a trajectory): its members side by side with
        rewards and advantages; shows as HTML in a notebook, ``.to_dataframe()`` for pandas.

        Raises:
            ConfigError: no trajectory here is in that group.
        """
        key = group if isinstance(group, str) else group_key(group)
        for g in self._groups(algo):
            if g.group_id == key:
                return g
        raise ConfigError(f"no trajectory in this list is in group {key!r}; .groups() lists the groups here")

    def _groups(self, algo: GRPO | None) -> list[TrajectoryGroup]:
        return groups_of(self, algo or algo_of(self.source), self.tokenizer)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(view("trajectories", self))
