"""Trajectories as tables: one row per trajectory, per turn or per token of the whole sequence.

The rows are plain dicts built here without pandas; :func:`frame` turns them into a
``pandas.DataFrame`` (the ``nb`` extra). :class:`TokenDecoder` and :class:`TokenizerRef` give
every view the same decoded text: a trajectory list from ``pipe.trajectories()`` knows its
pipeline, and so the tokenizer of its generation model.

The whole sequence of a trajectory is what the trainer sees: when every turn's prompt extends
the previous turn's prompt + response (the EnvManager builds prompts that way), ONE sequence,
the last turn's ``prompt_ids + response_ids``; each position is on the ``"prompt"`` side
(observation and chat markers: context only, mask 0) or the ``"response"`` side of the turn that
generated it (mask = the turn's ``loss_mask``). Otherwise one sequence (``row``) per turn.
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_nb.errors import ConfigError
from rollart_nb.tokens import starts_with

if TYPE_CHECKING:
    from rollart_nb.trajectory import Trajectory, Turn

__all__ = [
    "COLUMNS",
    "LEVELS",
    "SequenceToken",
    "TokenDecoder",
    "TokenizerRef",
    "frame",
    "importance_ratio",
    "rows",
    "sequence_tokens",
    "to_dataframe",
    "tokenizer_of",
    "version_changes",
    "write_tokens",
]

log = logging.getLogger(__name__)

LEVELS = ("trajectory", "turn", "token")
"""What one row of :func:`rows` / ``to_dataframe(level=...)`` is."""

COLUMNS: dict[str, tuple[str, ...]] = {
    "trajectory": (
        "id", "task", "status", "reason", "reward", "reward_version", "env_return", "seed", "group_id",
        "start_version", "min_version", "max_version", "version_changes", "turns", "tokens", "sequence_tokens",
        "prompt_tokens", "response_tokens", "trained_tokens", "created_s", "finished_s", "duration_s",
        "generate_s", "env_s",
    ),
    "turn": (
        "trajectory_id", "task", "group_id", "turn", "version", "worker", "prompt_tokens", "response_tokens",
        "trained_tokens", "observation", "action", "prompt_text", "response_text", "env_reward", "reward",
        "mean_logprob", "started_s", "generate_s", "env_s",
    ),
    "token": (
        "trajectory_id", "task", "status", "row", "turn", "position", "token_id", "text", "side", "loss_mask",
        "sampler_logprob", "trainer_logprob", "importance_ratio", "advantage", "loss_weight", "entropy",
        "trainer_entropy", "trainer_version", "version", "cross_version", "replay_logprob", "replay_version",
    ),
}  # fmt: skip
"""The columns of each level, in order (an empty list still gives a frame with them)."""


class TokenDecoder:
    """Token id -> text for display, cached; ``#id`` (or None, for tables) without a tokenizer.

    Args:
        tokenizer: anything with ``decode(list[int]) -> str`` (an HF tokenizer, a SimTokenizer),
            or None to show ids.

    Example:
        >>> TokenDecoder()(7)
        '#7'
    """

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    @property
    def known(self) -> bool:
        """Whether a tokenizer decodes (else ids are shown)."""
        return self.tokenizer is not None

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"#{token_id}"
        if token_id not in self._cache:
            try:
                self._cache[token_id] = self.tokenizer.decode([token_id])
            except Exception:  # an id outside the vocabulary still shows
                self._cache[token_id] = f"#{token_id}"
        return self._cache[token_id]

    def token(self, token_id: int) -> str | None:
        """One token's text; None without a tokenizer."""
        return self(token_id) if self.tokenizer is not None else None

    def text(self, ids: Sequence[int]) -> str | None:
        """The text of ``ids`` decoded together; None without a tokenizer (or if it cannot)."""
        if self.tokenizer is None:
            return None
        try:
            return str(self.tokenizer.decode(list(ids)))
        except Exception:  # an id outside the vocabulary: the per-token view still shows it
            return None


_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def tokenizer_of(source: Any) -> Any:
    """The tokenizer of ``source``'s generation model (``source.gen.model.load_tokenizer()``),
    loaded once per source; None when it has none or it cannot be loaded (ids are shown then)."""
    if source is None:
        return None
    try:
        return _TOKENIZERS[source]
    except (KeyError, TypeError):
        pass
    model = getattr(getattr(source, "gen", None), "model", None)
    tok = None
    try:
        tok = model.load_tokenizer() if model is not None else None
    except Exception as e:  # ids are still useful without text
        log.debug("no tokenizer for %r: %s", source, e)
    try:
        _TOKENIZERS[source] = tok
    except TypeError:  # not weak-referenceable: load again next time
        pass
    return tok


class TokenizerRef:
    """A tokenizer given now, or loaded on first use from a source pipeline (held weakly).

    A :class:`~rollart_nb.trajectory.TrajectoryList` shares one with its trajectories, so one
    shown alone decodes with the same tokenizer as the viewer.
    """

    def __init__(self, source: Any = None, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        try:
            self._source: Any = weakref.ref(source) if source is not None else None
        except TypeError:
            self._source = lambda: source

    def get(self) -> Any:
        """The tokenizer, or None."""
        if self.tokenizer is not None:
            return self.tokenizer
        return tokenizer_of(self._source() if self._source is not None else None)


@dataclass(frozen=True)
class SequenceToken:
    """One position of a trajectory's whole sequence (see the module docstring).

    Attributes:
        row: which sequence (0 when the trajectory is one sequence, else the turn's index).
        position: index in that sequence.
        token_id: the token.
        turn: the turn the token belongs to (whose prompt added it, or which generated it).
        side: ``"prompt"`` (observation, chat markers, earlier turns in a per-turn row) or
            ``"response"``.
        mask: 1 if the trainer trains on it, else 0 (every prompt-side token is 0).
        logprob: behaviour logprob for a response token where recorded, else NaN.
        version: the policy version that generated the token; on the prompt side, the one that
            first read it (the first version of the turn whose prompt added it).
        entropy: the sampler's entropy at a response token where recorded, else NaN.
    """

    row: int
    position: int
    token_id: int
    turn: int
    side: str
    mask: int
    logprob: float
    version: int
    entropy: float = math.nan


def _response(turn: Turn) -> tuple[list[int], list[float]]:
    """A turn's response mask and logprobs as the trainer reads them (all trained / NaN when the
    recorded lists do not match the response's length)."""
    n = len(turn.response_ids)
    mask = [int(m) for m in turn.loss_mask] if len(turn.loss_mask) == n else [1] * n
    logprobs = [float(x) for x in turn.logprobs] if len(turn.logprobs) == n else [math.nan] * n
    return mask, logprobs


def _per_token(turn: Turn) -> tuple[list[int], list[float]]:
    """A turn's response: the version that wrote each token, and the sampler's entropy (NaN
    where not recorded)."""
    n = len(turn.response_ids)
    versions = [v for lo, hi, v in turn.segments() for _ in range(lo, hi)]
    entropy = [float(x) for x in turn.entropy] if len(turn.entropy) == n else [math.nan] * n
    return versions, entropy


def _extends(turns: Sequence[Turn]) -> bool:
    """Each turn's prompt is the previous turn's prompt + response + more (one sequence)."""
    return all(starts_with(cur.prompt_ids, (prev.prompt_ids, prev.response_ids)) for prev, cur in pairwise(turns))


def sequence_tokens(t: Trajectory) -> list[SequenceToken]:
    """Every token of the trajectory's whole sequence, prompt side included, in order."""
    out: list[SequenceToken] = []
    one = _extends(t.turns)
    end = 0
    for k, turn in enumerate(t.turns):
        row, start = (0, end) if one else (k, 0)
        mask, logprobs = _response(turn)
        versions, entropy = _per_token(turn)
        read_by = versions[0] if versions else turn.version
        for pos in range(start, len(turn.prompt_ids)):
            out.append(SequenceToken(row, pos, int(turn.prompt_ids[pos]), k, "prompt", 0, math.nan, read_by))
        base = len(turn.prompt_ids)
        for j, tid in enumerate(turn.response_ids):
            tok = SequenceToken(row, base + j, int(tid), k, "response", mask[j], logprobs[j], versions[j], entropy[j])
            out.append(tok)
        end = base + len(turn.response_ids)
    return out


def version_changes(t: Trajectory) -> int:
    """How often the policy version changes along ``t``, from its start version through each
    version segment (a weight update it ran across)."""
    versions = [s.version for s in t.versions]
    return sum(1 for a, b in zip([t.start_version, *versions], versions, strict=False) if a != b)


def _phase_s(turns: Iterable[Turn], phase: str) -> float:
    return float(sum(u.timings.get(phase, 0.0) for u in turns))


def trajectory_row(t: Trajectory) -> dict[str, Any]:
    """One trajectory: who, fate, reward, versions, sizes and timing (``COLUMNS["trajectory"]``)."""
    seq = sequence_tokens(t)
    return {
        "id": t.id,
        "task": t.task,
        "status": t.status.value,
        "reason": t.reason,
        "reward": t.reward,
        "reward_version": t.reward_version,
        "env_return": t.env_return,
        "seed": t.seed,
        "group_id": t.group_id,
        "start_version": t.start_version,
        "min_version": t.min_version,
        "max_version": t.max_version,
        "version_changes": version_changes(t),
        "turns": len(t.turns),
        "tokens": t.num_tokens,
        "sequence_tokens": len(seq),
        "prompt_tokens": sum(len(u.prompt_ids) for u in t.turns),
        "response_tokens": sum(len(u.response_ids) for u in t.turns),
        "trained_tokens": sum(s.mask for s in seq),
        "created_s": t.created_s,
        "finished_s": t.finished_s,
        "duration_s": t.finished_s - t.created_s if t.finished_s else math.nan,
        "generate_s": _phase_s(t.turns, "generate"),
        "env_s": _phase_s(t.turns, "env"),
    }


def turn_rows(t: Trajectory, decode: TokenDecoder) -> list[dict[str, Any]]:
    """One row per turn (``COLUMNS["turn"]``); ``prompt_text`` / ``response_text`` are None
    without a tokenizer."""
    out = []
    for k, u in enumerate(t.turns):
        mask, logprobs = _response(u)
        finite = [x for x in logprobs if not math.isnan(x)]
        rewards = t.turn_rewards or []
        out.append(
            {
                "trajectory_id": t.id,
                "task": t.task,
                "group_id": t.group_id,
                "turn": k,
                "version": u.version,
                "worker": u.worker,
                "prompt_tokens": len(u.prompt_ids),
                "response_tokens": len(u.response_ids),
                "trained_tokens": sum(mask),
                "observation": u.observation,
                "action": u.action,
                "prompt_text": decode.text(u.prompt_ids),
                "response_text": decode.text(u.response_ids),
                "env_reward": u.env_reward,
                "reward": float(rewards[k]) if k < len(rewards) else math.nan,
                "mean_logprob": sum(finite) / len(finite) if finite else math.nan,
                "started_s": float(u.timings.get("t", math.nan)),
                "generate_s": float(u.timings.get("generate", math.nan)),
                "env_s": float(u.timings.get("env", math.nan)),
            }
        )
    return out


def importance_ratio(trainer_logprob: float, sampler_logprob: float) -> float:
    """``exp(trainer - sampler)``: the trainer's probability of a token over the sampler's; NaN
    when either is unknown."""
    d = trainer_logprob - sampler_logprob
    return math.exp(min(d, 80.0)) if math.isfinite(d) else math.nan


def _at(rows: list[Any], row: int, pos: int, key: str | None = None) -> float:
    """``rows[row][key][pos]`` (or ``rows[row][pos]`` without ``key``), NaN where there is none."""
    r = rows[row] if row < len(rows) else None
    if r is not None and key is not None:
        r = r.get(key)
    return float(r[pos]) if r is not None and pos < len(r) else math.nan


def token_rows(t: Trajectory, decode: TokenDecoder) -> list[dict[str, Any]]:
    """One row per token of the sequence(s) the trainer sees (``COLUMNS["token"]``): the sampler's
    figures, the trainer's from ``t.train`` and the replay's from ``t.replay`` (NaN where not
    known); ``text`` is None without a tokenizer."""
    train, replay = t.train or {}, t.replay or {}
    trows, rrows = train.get("rows") or [], replay.get("rows") or []
    adv, oldest = float(train.get("advantage", math.nan)), t.min_version
    out = []
    for s in sequence_tokens(t):
        trainer = _at(trows, s.row, s.position, "logprob")
        out.append(
            {
                "trajectory_id": t.id,
                "task": t.task,
                "status": t.status.value,
                "row": s.row,
                "turn": s.turn,
                "position": s.position,
                "token_id": s.token_id,
                "text": decode.token(s.token_id),
                "side": s.side,
                "loss_mask": s.mask,
                "sampler_logprob": s.logprob,
                "trainer_logprob": trainer,
                "importance_ratio": importance_ratio(trainer, s.logprob),
                "advantage": adv if s.mask else math.nan,
                "loss_weight": _at(trows, s.row, s.position, "loss_weight"),
                "entropy": s.entropy,
                "trainer_entropy": _at(trows, s.row, s.position, "entropy"),
                "trainer_version": train.get("version"),
                "version": s.version,
                "cross_version": s.side == "response" and s.version != oldest,
                "replay_logprob": _at(rrows, s.row, s.position),
                "replay_version": replay.get("version"),
            }
        )
    return out


def check_level(level: str) -> str:
    if level not in LEVELS:
        raise ConfigError(f"level must be one of {', '.join(map(repr, LEVELS))}, got {level!r}")
    return level


def rows(trajectories: Iterable[Trajectory], level: str = "trajectory", tokenizer: Any = None) -> list[dict[str, Any]]:
    """The rows of ``to_dataframe(level)``, as dicts (no pandas needed).

    Args:
        trajectories: the trajectories, in order.
        level: "trajectory", "turn" or "token" (see :data:`COLUMNS`).
        tokenizer: decodes text columns (a tokenizer or a :class:`TokenDecoder`); None leaves
            them None.
    """
    check_level(level)
    decode = tokenizer if isinstance(tokenizer, TokenDecoder) else TokenDecoder(tokenizer)
    out: list[dict[str, Any]] = []
    for t in trajectories:
        if level == "trajectory":
            out.append(trajectory_row(t))
        elif level == "turn":
            out.extend(turn_rows(t, decode))
        else:
            out.extend(token_rows(t, decode))
    return out


def pandas() -> Any:
    """The pandas module, or a ConfigError naming the extra that brings it."""
    try:
        import pandas as pd
    except ImportError as e:
        raise ConfigError(
            f"to_dataframe needs pandas, from the notebook extra: pip install 'rollart_nb[nb]' ({e})"
        ) from e
    return pd


def frame(records: list[dict[str, Any]], columns: Sequence[str]) -> Any:
    """A ``pandas.DataFrame`` of ``records`` with ``columns`` in order (even when empty)."""
    return pandas().DataFrame.from_records(records, columns=list(columns))


def to_dataframe(trajectories: Iterable[Trajectory], level: str = "trajectory", tokenizer: Any = None) -> Any:
    """``rows(...)`` as a DataFrame with the level's columns (see :data:`COLUMNS`)."""
    return frame(rows(trajectories, level, tokenizer), COLUMNS[check_level(level)])


def write_tokens(trajectories: Iterable[Trajectory], path: str | os.PathLike[str], tokenizer: Any = None) -> Path:
    """Write the token frame of ``trajectories`` to ``path``: Parquet for ``.parquet``, JSON
    Lines (one token a line) for ``.jsonl``; returns the path.

    Raises:
        ConfigError: another suffix, or a missing library (pandas, pyarrow: the ``nb`` extra).
    """
    out = Path(path)
    if out.suffix not in (".parquet", ".jsonl"):
        raise ConfigError(f"write the token frame to a .parquet or .jsonl file, not {out.name!r}")
    df = to_dataframe(trajectories, "token", tokenizer)
    if out.suffix == ".jsonl":
        df.to_json(out, orient="records", lines=True)
        return out
    try:
        df.to_parquet(out, index=False)
    except ImportError as e:
        raise ConfigError(f"Parquet needs pyarrow, from the notebook extra: pip install 'rollart_nb[nb]' ({e})") from e
    return out
