"""GRPO groups of trajectories side by side: rewards and the group-relative advantages.

Advantages come from :func:`~rollart_nb.algo.grpo.group_advantages`, the function every
trainer calls, with the pipeline's GRPO settings (``adv_eps``, ``scale_by_std``). A group is a
``group_id`` (else ``task/seed``), as in :func:`~rollart_nb.algo.grpo.batch_advantages`. Only
members the trainer could train on (completed, with a finite reward) get an advantage; the
others (failed, aborted, cancelled, not yet scored) show NaN. The advantages are those of a
batch holding exactly the trained members listed, which is the trainer's batch when the whole
group is in the list.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollart_nb.algo.grpo import GRPO, group_advantages
from rollart_nb.trajectory_frames import TokenDecoder, frame

if TYPE_CHECKING:
    from rollart_nb.trajectory import Trajectory

__all__ = ["GROUP_COLUMNS", "TrajectoryGroup", "algo_of", "group_html", "group_key", "groups_of"]

GROUP_COLUMNS = (
    "group_id", "id", "task", "seed", "status", "reward", "advantage", "trained", "group_size", "group_trained",
    "group_mean", "group_std", "scale_by_std", "turns", "tokens", "min_version", "max_version", "last_action",
)  # fmt: skip
"""Columns of a group table: one row per member."""


def group_key(t: Trajectory) -> str:
    """The GRPO group of ``t`` as the trainer forms it: its ``group_id``, else ``task/seed``."""
    return t.group_id or f"{t.task}/{t.seed}"


def _trained(t: Trajectory) -> bool:
    return t.status.value == "completed" and math.isfinite(t.reward)


def algo_of(source: Any) -> GRPO:
    """The source pipeline's GRPO settings when it has them, else the defaults."""
    algo = getattr(source, "algo", None)
    return algo if isinstance(algo, GRPO) else GRPO()


@dataclass
class TrajectoryGroup:
    """One GRPO group: its members in list order, with rewards and advantages.

    Attributes:
        group_id: the group (see :func:`group_key`).
        members: its trajectories.
        advantages: per member, the advantage the trainer computes; NaN for untrained members.
        scale_by_std: whether the advantages divide by the group's reward std.
        tokenizer: decodes text in the HTML (optional).

    Example:
        >>> g = pipe.trajectories().group("3f2a9c0b1d")     # doctest: +SKIP
        >>> g.to_dataframe()[["id", "reward", "advantage"]]  # doctest: +SKIP
    """

    group_id: str
    members: list[Trajectory]
    advantages: list[float]
    scale_by_std: bool = True
    tokenizer: Any = field(default=None, repr=False)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.members]

    @property
    def trained(self) -> list[Trajectory]:
        """Members the trainer trains on (completed and scored)."""
        return [t for t in self.members if _trained(t)]

    @property
    def mean(self) -> float:
        """Mean reward of the trained members (NaN if none)."""
        r = [t.reward for t in self.trained]
        return sum(r) / len(r) if r else math.nan

    @property
    def std(self) -> float:
        """Population std of the trained members' rewards, the one advantages divide by."""
        r = [t.reward for t in self.trained]
        if not r:
            return math.nan
        m = sum(r) / len(r)
        return math.sqrt(sum((x - m) ** 2 for x in r) / len(r))

    def rows(self) -> list[dict[str, Any]]:
        """One dict per member (:data:`GROUP_COLUMNS`)."""
        n_trained, mean, std = len(self.trained), self.mean, self.std
        return [
            {
                "group_id": self.group_id,
                "id": t.id,
                "task": t.task,
                "seed": t.seed,
                "status": t.status.value,
                "reward": t.reward,
                "advantage": a,
                "trained": _trained(t),
                "group_size": len(self.members),
                "group_trained": n_trained,
                "group_mean": mean,
                "group_std": std,
                "scale_by_std": self.scale_by_std,
                "turns": len(t.turns),
                "tokens": t.num_tokens,
                "min_version": t.min_version,
                "max_version": t.max_version,
                "last_action": t.turns[-1].action if t.turns else "",
            }
            for t, a in zip(self.members, self.advantages, strict=True)
        ]

    def to_dataframe(self) -> Any:
        """One row per member (:data:`GROUP_COLUMNS`); needs pandas."""
        return frame(self.rows(), GROUP_COLUMNS)

    def _repr_html_(self) -> str:
        return group_html(self)


def groups_of(
    trajectories: Iterable[Trajectory], algo: GRPO | None = None, tokenizer: Any = None
) -> list[TrajectoryGroup]:
    """Every group among ``trajectories`` (in order of first appearance), advantages computed
    over the trained members of each, with ``algo``'s settings (default: :class:`GRPO`'s)."""
    algo = algo or GRPO()
    by_key: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        by_key.setdefault(group_key(t), []).append(t)
    trained = [t for members in by_key.values() for t in members if _trained(t)]
    adv: dict[str, float] = {}
    if trained:
        scales = algo.std_scaling([t.task for t in trained])
        values = group_advantages(
            [t.reward for t in trained], [group_key(t) for t in trained], eps=algo.adv_eps, scale_by_std=scales
        ).tolist()
        adv = {t.id: float(a) for t, a in zip(trained, values, strict=True)}
    return [
        TrajectoryGroup(
            key,
            members,
            [adv.get(t.id, math.nan) if _trained(t) else math.nan for t in members],
            algo.std_scaling([members[0].task])[0],
            tokenizer,
        )
        for key, members in by_key.items()
    ]


def _fmt(x: float, spec: str = ".3g") -> str:
    return "-" if math.isnan(x) else format(x, spec)


def _member_cell(t: Trajectory, adv: float, decode: TokenDecoder, max_chars: int) -> str:
    color = "#2e7d32" if adv > 0 else "#c62828" if adv < 0 else "#555"
    lines = []
    for k, u in enumerate(t.turns):
        text = (decode.text(u.response_ids) if decode.known else None) or u.action
        lines.append(f"{k}: {text}")
    body = "\n".join(lines)
    if len(body) > max_chars:
        body = body[:max_chars] + f"\u2026 ({len(body) - max_chars} more chars)"
    return (
        f'<td class="rn-member" style="vertical-align:top;padding:4px 8px;border-left:1px solid #ddd">'
        f"<b>{html.escape(t.id)}</b><br>{html.escape(t.status.value)} &middot; v{t.min_version}..{t.max_version}"
        f" &middot; {len(t.turns)} turn(s)<br>reward <b>{_fmt(t.reward, '.4g')}</b><br>"
        f'advantage <b class="rn-adv" style="color:{color}">{_fmt(adv, "+.4f")}</b>'
        f'<pre style="margin:4px 0;white-space:pre-wrap;max-width:28em">{html.escape(body)}</pre></td>'
    )


def group_html(g: TrajectoryGroup, tokenizer: Any = None, *, max_chars: int = 600) -> str:
    """The members side by side: status, versions, reward, advantage and each turn's response.

    Args:
        g: the group.
        tokenizer: decodes responses (default the group's); without one, each turn's ``action``.
        max_chars: text shown per member before it is cut.
    """
    tok = tokenizer if tokenizer is not None else g.tokenizer
    decode = tok if isinstance(tok, TokenDecoder) else TokenDecoder(tok)
    how = "(r - mean) / (std + eps)" if g.scale_by_std else "r - mean"
    tasks = sorted({t.task for t in g.members})
    head = (
        f'<div class="rn-group"><b>group {html.escape(g.group_id)}</b> &middot; task '
        f"{html.escape(', '.join(tasks))} &middot; {len(g.members)} member(s), {len(g.trained)} trained"
        f" &middot; mean reward {_fmt(g.mean)} &middot; std {_fmt(g.std)} &middot; advantage = {how}"
    )
    cells = "".join(_member_cell(t, a, decode, max_chars) for t, a in zip(g.members, g.advantages, strict=True))
    return f'{head}<table class="rn-group-table"><tr>{cells}</tr></table></div>'
