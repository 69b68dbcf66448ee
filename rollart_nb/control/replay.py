"""Replay and regeneration of stored trajectories, for debugging; training is never touched.

:func:`replay` re-scores a trajectory's sequences (those the trainer sees) on a live generation
worker, through the rollout's LLM proxy, under the weights it serves now; :func:`regenerate` checks the turn a regeneration
starts from (the rollout worker plays the rest, see
:meth:`~rollart_nb.control.rollout_worker.RolloutWorker.regenerate`).
"""

from __future__ import annotations

import copy
from itertools import groupby
from typing import Any

from rollart_nb.errors import ConfigError
from rollart_nb.trajectory import Trajectory
from rollart_nb.trajectory_frames import sequence_tokens

__all__ = ["check_from_turn", "find", "replay"]


def find(traj: Trajectory | str, trajectories: Any) -> Trajectory:
    """``traj`` itself, or the trajectory of that id among ``trajectories()`` (running included)."""
    if isinstance(traj, Trajectory):
        return traj
    found = [t for t in trajectories(last=None, include_running=True) if t.id == traj]
    if not found:
        raise ConfigError(
            f"no trajectory {traj!r} among the pipeline's recent ones; pass a Trajectory from pipe.trajectories()"
        )
    return found[0]


def replay(rollout: Any, traj: Trajectory) -> Trajectory:
    """A copy of ``traj`` whose ``replay`` holds every position's logprob under the weights a
    generation worker serves now, with that version (``rollout``: the pipeline's
    :class:`~rollart_nb.control.shards.ShardedRollout`; see :meth:`LLMProxy.score
    <rollart_nb.control.proxy.LLMProxy.score>`)."""
    if not any(t.response_ids for t in traj.turns):
        raise ConfigError(f"trajectory {traj.id} has no generated tokens to replay")
    rows = [[s.token_id for s in part] for _, part in groupby(sequence_tokens(traj), key=lambda s: s.row)]
    out = copy.copy(traj)  # the tokenizer it shows text with comes along
    out.replay = rollout.score(traj, rows)
    return out


def check_from_turn(traj: Trajectory, from_turn: int) -> None:
    """ConfigError unless a regeneration of ``traj`` can start at turn ``from_turn``."""
    if not isinstance(from_turn, int) or not 0 <= from_turn <= len(traj.turns):
        raise ConfigError(
            f"from_turn must be an int in 0..{len(traj.turns)} (trajectory {traj.id} has {len(traj.turns)} "
            f"turns), got {from_turn!r}"
        )
