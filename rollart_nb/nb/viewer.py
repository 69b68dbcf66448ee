"""TrajectoryViewer: browse a pipeline's trajectories turn by turn, token by token, group by group.

The HTML of one trajectory comes from pure functions (:func:`trajectory_html` and friends),
usable without widgets: ``IPython.display.HTML(trajectory_html(traj))``. Tokens are shown over
the whole sequence the trainer sees (see :mod:`rollart_nb.trajectory_frames`): prompt-side
tokens (observations, chat markers) in yellow, trained response tokens in blue, untrained ones
in grey. The widget adds filters, a selector, a GRPO group pane (members side by side with
rewards and advantages), live refresh from the pipeline and export to JSONL / pandas.
"""

from __future__ import annotations

import html
import json
import math
import threading
from pathlib import Path
from typing import Any

import ipywidgets as widgets

from rollart_nb.errors import ConfigError
from rollart_nb.nb.overlay import OVERLAYS, mismatch_of, token_html
from rollart_nb.trajectory import Status, Trajectory, TrajectoryList, Turn
from rollart_nb.trajectory_frames import (
    SequenceToken,
    TokenDecoder,
    sequence_tokens,
    to_dataframe,
    tokenizer_of,
    version_changes,
)
from rollart_nb.trajectory_groups import TrajectoryGroup, algo_of, group_html, group_key, groups_of

__all__ = [
    "TokenDecoder",
    "TrajectoryViewer",
    "group_html",
    "logprob_strip_html",
    "sequence_html",
    "tokens_html",
    "trajectory_html",
    "trajectory_summary",
]

_STATUS_COLORS = {
    "completed": "#2e7d32",
    "failed": "#c62828",
    "aborted_stale": "#ef6c00",
    "cancelled": "#757575",
    "running": "#1565c0",
}
_TRAINED_BG, _MASKED_BG, _PROMPT_BG = "#d7ecff", "#eeeeee", "#fff3cd"


def _token_span(tid: int, side: str, m: int, lp: float, decode: TokenDecoder) -> str:
    text = decode(tid).replace("\n", "\u21b5") or "\u2205"
    bg = _PROMPT_BG if side == "prompt" else _TRAINED_BG if m else _MASKED_BG
    return (
        f'<span class="rn-tok rn-{side} rn-mask-{int(bool(m))}" title="id {tid} &middot; {side} &middot; '
        f'mask {m} &middot; logprob {lp:.3f}" style="background:{bg};'
        f'margin:0 1px;padding:0 2px;border-radius:2px;font-family:monospace">{html.escape(text)}</span>'
    )


def tokens_html(ids: list[int], loss_mask: list[int], logprobs: list[float], decode: TokenDecoder) -> str:
    """One span per response token: blue background where ``loss_mask`` is 1 (trained on), grey
    where 0. Each span's tooltip gives the token id, side, mask and logprob."""
    return "".join(
        _token_span(
            tid,
            "response",
            loss_mask[i] if i < len(loss_mask) else 0,
            logprobs[i] if i < len(logprobs) else math.nan,
            decode,
        )
        for i, tid in enumerate(ids)
    )


def sequence_html(tokens: list[SequenceToken], decode: TokenDecoder) -> str:
    """One span per token of a whole sequence (or a part of one): yellow on the prompt side,
    blue for trained response tokens, grey for untrained ones."""
    return "".join(_token_span(s.token_id, s.side, s.mask, s.logprob, decode) for s in tokens)


def logprob_strip_html(logprobs: list[float], *, floor: float = -10.0) -> str:
    """A strip of cells, one per token, dark for confident (logprob near 0), light for unlikely."""
    cells = []
    for lp in logprobs:
        frac = 0.0 if math.isnan(lp) else max(0.0, min(1.0, 1.0 - lp / floor))
        shade = int(235 - 200 * frac)
        cells.append(
            f'<span title="{lp:.3f}" style="display:inline-block;width:6px;height:12px;'
            f'background:rgb({shade},{shade},255)"></span>'
        )
    return f'<div class="rn-logprobs" style="line-height:0">{"".join(cells)}</div>'


def trajectory_summary(t: Trajectory) -> str:
    """One line: id, task, status, reward, versions, turns (the selector's labels)."""
    r = "-" if math.isnan(t.reward) else f"{t.reward:.3g}"
    vmax = t.max_version
    return f"{t.id} · {t.task} · {t.status.value} · r={r} · v{t.start_version}..{vmax} · {len(t.turns)} turns"


def _turn_html(
    i: int,
    turn: Turn,
    prev_version: int,
    decode: TokenDecoder,
    segment: list[SequenceToken],
    replica: str = "",
    max_prompt_tokens: int = 2048,
) -> str:
    changed = turn.version != prev_version
    marker = (
        (
            f'<span class="rn-version-change" style="color:#ef6c00;font-weight:bold">'
            f"&#9888; policy v{prev_version} &rarr; v{turn.version}</span>"
        )
        if changed
        else ""
    )
    timings = ", ".join(
        f"{k} {v:.3f}s"
        for k, v in turn.timings.items()
        if k != "t" and isinstance(v, int | float) and not k.endswith("tokens")
    )
    extra = ", ".join(f"{k} {int(v)}" for k, v in turn.timings.items() if k.endswith("tokens"))
    prompt = [s for s in segment if s.side == "prompt"]
    response = [s for s in segment if s.side == "response"]
    new = len(prompt) < len(turn.prompt_ids)  # one sequence: this turn adds only its new context
    hidden = max(0, len(prompt) - max_prompt_tokens)  # the latest context matters most; a row per turn repeats it
    cut = f"<small>&hellip; {hidden} earlier prompt token(s) not shown</small> " if hidden else ""
    return (
        f'<div class="rn-turn" style="border-left:3px solid {"#ef6c00" if changed else "#ccc"};'
        f'padding-left:6px;margin:6px 0">'
        f"<b>turn {i}</b> &middot; policy v{turn.version} {marker} &middot; {html.escape(turn.worker or '-')}"
        f" &middot; env reward {turn.env_reward:g}"
        + (f' &middot; env replica <code class="rn-replica">{html.escape(replica)}</code>' if replica else "")
        + f'<div><small>observation</small><pre style="margin:2px 0;white-space:pre-wrap">'
        f"{html.escape(turn.observation)}</pre></div>"
        f'<div><small>action</small><pre style="margin:2px 0;white-space:pre-wrap">{html.escape(turn.action)}</pre></div>'
        f"<div><small>prompt side ({len(prompt)} token(s){', new in this turn' if new else ''}, not trained)"
        f'</small><br>{cut}<span class="rn-prompt-side">{sequence_html(prompt[hidden:], decode)}</span></div>'
        f"<div><small>response tokens ({len(response)}, {sum(s.mask for s in response)} trained)</small><br>"
        f"{sequence_html(response, decode)}</div>"
        f"<div><small>logprobs</small>{logprob_strip_html(turn.logprobs)}</div>"
        f"<div><small>timings: {html.escape(timings or '-')}{'; ' + html.escape(extra) if extra else ''}"
        f"</small></div></div>"
    )


def trajectory_html(t: Trajectory, tokenizer: Any = None, *, max_turns: int = 50, max_prompt_tokens: int = 2048) -> str:
    """The whole trajectory: status and reason, reward and reward version, every turn.

    Args:
        t: the trajectory.
        tokenizer: decodes token ids; default the trajectory's own, else ids are shown.
        max_turns: render at most this many turns (the rest are counted).
        max_prompt_tokens: per turn, render at most the last this many prompt-side tokens.
    """
    if tokenizer is None:
        tokenizer = t.tokenizer
    decode = tokenizer if isinstance(tokenizer, TokenDecoder) else TokenDecoder(tokenizer)
    seq = sequence_tokens(t)
    rows = len({s.row for s in seq})
    color = _STATUS_COLORS.get(t.status.value, "#000")
    r = "not scored" if math.isnan(t.reward) else f"{t.reward:.4g}"
    rv = "-" if t.reward_version is None else f"v{t.reward_version}"
    reason = f' &middot; reason: <code class="rn-reason">{html.escape(t.reason)}</code>' if t.reason else ""
    changes = version_changes(t)
    head = (
        f'<div class="rn-trajectory"><b>{html.escape(t.id)}</b> &middot; task <b>{html.escape(t.task)}</b> '
        f'&middot; <span class="rn-status" style="color:{color};font-weight:bold">{t.status.value}</span>'
        f"{reason}<br>reward <b>{r}</b> (reward fn {rv}) &middot; env return {t.env_return:g} &middot; "
        f"seed {t.seed} &middot; group {html.escape(t.group_id or '-')} &middot; started at policy "
        f"v{t.start_version}, {changes} version change(s) &middot; {len(t.turns)} turn(s), {t.num_tokens} tokens"
        f'<br><span class="rn-sequence">sequence: {len(seq)} token(s) in {rows} row(s), '
        f"{sum(1 for s in seq if s.side == 'prompt')} prompt side, {sum(s.mask for s in seq)} trained</span>"
        f" &middot; {_LEGEND}{'' if decode.known else ' &middot; no tokenizer: token ids shown'}"
    )
    prev, body = t.start_version, []
    replicas = _replicas(t)
    segments: dict[int, list[SequenceToken]] = {}
    for s in seq:
        segments.setdefault(s.turn, []).append(s)
    for i, turn in enumerate(t.turns[:max_turns]):
        replica = replicas[i] if i < len(replicas) else ""
        body.append(_turn_html(i, turn, prev, decode, segments.get(i, []), replica, max_prompt_tokens))
        prev = turn.version
    if len(t.turns) > max_turns:
        body.append(f"<p>... {len(t.turns) - max_turns} more turn(s)</p>")
    return head + "".join(body) + "</div>"


_LEGEND = (
    f'<span style="background:{_PROMPT_BG};padding:0 3px">prompt side</span> '
    f'<span style="background:{_TRAINED_BG};padding:0 3px">trained</span> '
    f'<span style="background:{_MASKED_BG};padding:0 3px">response, not trained</span>'
)


def _replicas(t: Trajectory) -> list[str]:
    """Per turn, the env-server replica that stepped it (RemoteEnv puts ``replica`` in each step's
    info, which the EnvManager keeps in ``info["step_info"]``); "" for a local env."""
    steps = t.info.get("step_info") or []
    if not steps or not all(isinstance(s, dict) and "replica" in s for s in steps):
        return []  # turns without a step info would misalign the list
    return [str(s["replica"]) for s in steps]


_ANY = "any"


class TrajectoryViewer(widgets.VBox):
    """Browse trajectories: filters, a selector, one trajectory's turns or GRPO group, export.

    Args:
        trajectories: a :class:`~rollart_nb.trajectory.TrajectoryList` (or any list of
            trajectories); when it has a ``source`` (the Pipeline), Refresh pulls new ones with
            its ``filters``.
        tokenizer: decodes token ids in the loss-mask view; default: the list's tokenizer.
        live_s: refresh from the source every this many seconds while the Live box is ticked.

    Example:
        >>> v = pipe.viewer(task="math")                       # doctest: +SKIP
        >>> v.set_filters(status="failed"); v.select(0)        # doctest: +SKIP
        >>> v.pane.value = "group"                             # doctest: +SKIP
        >>> v.to_dataframe(level="token")                      # doctest: +SKIP
    """

    def __init__(self, trajectories: Any, tokenizer: Any = None, *, live_s: float = 2.0) -> None:
        self.source = getattr(trajectories, "source", None)
        self.query = dict(getattr(trajectories, "filters", {}) or {})
        self.items: list[Trajectory] = list(trajectories)
        self.live_s = live_s
        if tokenizer is None and isinstance(trajectories, TrajectoryList):
            tokenizer = trajectories.tokenizer
        self._tokenizer = tokenizer
        self._decoder: TokenDecoder | None = None
        self._timer: threading.Timer | None = None
        self._filter_widgets()
        self._mismatch: dict[str, float] = {}  # per trajectory id, its largest |log ratio|
        self.selector = widgets.Select(rows=8, layout=widgets.Layout(width="100%"))
        self.pane = widgets.ToggleButtons(
            options=["trajectory", "tokens", "group"],
            value="trajectory",
            tooltips=[
                "the selected trajectory, turn by turn",
                "its tokens coloured by a column of the token frame (hover: the token's row)",
                "its GRPO group side by side, with advantages",
            ],
        )
        self.detail = widgets.HTML()
        self.count = widgets.HTML()
        self.refresh_button = widgets.Button(description="Refresh", icon="refresh", disabled=self.source is None)
        self.live = widgets.Checkbox(
            value=False,
            description="Live",
            disabled=self.source is None,
            indent=False,
            layout=widgets.Layout(width="70px"),
        )
        self.export_path = widgets.Text(value="trajectories.jsonl", layout=widgets.Layout(width="220px"))
        self.export_button = widgets.Button(description="Export JSONL", icon="download")
        for w in (self.task, self.status, self.min_reward, self.version, self.min_mismatch, self.cross_version):
            w.observe(lambda _c: self._apply(), names="value")
        self.colour.observe(lambda _c: self._show(), names="value")
        self.selector.observe(lambda _c: self._show(), names="value")
        self.pane.observe(lambda _c: self._show(), names="value")
        self.refresh_button.on_click(lambda _b: self.refresh())
        self.live.observe(self._on_live, names="value")
        self.export_button.on_click(lambda _b: self._export())
        super().__init__(
            children=[
                widgets.HBox([self.task, self.status, self.min_reward, self.version]),
                widgets.HBox([self.min_mismatch, self.cross_version, self.colour]),
                widgets.HBox([self.refresh_button, self.live, self.export_path, self.export_button, self.count]),
                self.selector,
                self.pane,
                self.detail,
            ]
        )
        self.add_class("rollart-viewer")
        self._set_options()
        self._apply()

    def _filter_widgets(self) -> None:
        """The filters (task, status, reward, version, mismatch, cross-version) and the colour."""
        self.task = widgets.Dropdown(description="task", layout=widgets.Layout(width="200px"))
        self.status = widgets.Dropdown(
            description="status", options=[_ANY] + [s.value for s in Status], layout=widgets.Layout(width="220px")
        )
        text = {"value": "", "placeholder": _ANY, "continuous_update": False}
        self.min_reward = widgets.Text(description="min reward", layout=widgets.Layout(width="180px"), **text)
        self.version = widgets.Dropdown(description="version", layout=widgets.Layout(width="180px"))
        self.min_mismatch = widgets.Text(description="|log ratio| >", layout=widgets.Layout(width="190px"), **text)
        self.cross_version = widgets.Checkbox(
            description="cross-version", indent=False, layout=widgets.Layout(width="130px")
        )
        self.colour = widgets.Dropdown(
            description="colour", options=list(OVERLAYS), value="mask", layout=widgets.Layout(width="240px")
        )

    # -- public API ------------------------------------------------------------------------
    @property
    def filtered(self) -> list[Trajectory]:
        """The trajectories that pass the current filters, in list order."""
        task, status, version = self.task.value, self.status.value, self.version.value
        low, worst = _parse_float(self.min_reward.value), _parse_float(self.min_mismatch.value)
        out = []
        for t in self.items:
            if task not in (None, _ANY) and t.task != task:
                continue
            if status not in (None, _ANY) and t.status.value != status:
                continue
            if low is not None and (math.isnan(t.reward) or t.reward < low):
                continue
            if version not in (None, _ANY) and int(version) not in {t.start_version, *(s.version for s in t.versions)}:
                continue
            if self.cross_version.value and len({s.version for s in t.versions}) < 2:
                continue
            if worst is not None and not self._mismatch_of(t) > worst:
                continue
            out.append(t)
        return out

    @property
    def selected(self) -> Trajectory | None:
        """The trajectory shown in detail (None when the filters leave nothing)."""
        return next((t for t in self.items if t.id == self.selector.value), None)

    def set_filters(
        self,
        task: str | None = None,
        status: str | None = None,
        min_reward: float | None = None,
        version: int | None = None,
        min_mismatch: float | None = None,
        cross_version: bool = False,
    ) -> list[Trajectory]:
        """Set the filters (None: any); returns :attr:`filtered`. ``min_mismatch``: keep
        trajectories with a trained token whose |log importance ratio| exceeds it;
        ``cross_version``: keep those written by two or more policy versions."""
        self.min_mismatch.value = "" if min_mismatch is None else repr(float(min_mismatch))
        self.cross_version.value = bool(cross_version)
        self.task.value = task if task in self.task.options else _ANY
        self.status.value = status or _ANY
        self.min_reward.value = "" if min_reward is None else repr(float(min_reward))
        self.version.value = str(version) if version is not None and str(version) in self.version.options else _ANY
        return self.filtered

    def colour_by(self, column: str) -> None:
        """Show the selected trajectory's tokens coloured by ``column``, one of
        :data:`~rollart_nb.nb.overlay.OVERLAYS` (e.g. "importance_ratio", "version")."""
        if column not in OVERLAYS:
            raise ConfigError(f"colour_by: one of {', '.join(OVERLAYS)}, not {column!r}")
        self.colour.value, self.pane.value = column, "tokens"

    def select(self, index_or_id: int | str) -> Trajectory:
        """Show one trajectory: an index into :attr:`filtered`, or a trajectory id."""
        shown = self.filtered
        t = shown[index_or_id] if isinstance(index_or_id, int) else next(t for t in shown if t.id == index_or_id)
        self.selector.value = t.id
        return t

    def refresh(self) -> int:
        """Pull the newest trajectories from the source pipeline (its original query).

        Returns:
            How many trajectories were not shown before.
        """
        if self.source is None:
            return 0
        fresh = list(self.source.trajectories(**self.query))
        known = {t.id for t in self.items}
        self.items = fresh
        self._set_options()
        self._apply()
        return sum(1 for t in fresh if t.id not in known)

    @property
    def group(self) -> TrajectoryGroup | None:
        """The selected trajectory's GRPO group, advantages computed over every loaded
        trajectory of it (None when nothing is selected)."""
        t = self.selected
        if t is None:
            return None
        key = group_key(t)
        members = [u for u in self.items if group_key(u) == key]
        return groups_of(members, algo_of(self.source), self._decode())[0]

    def to_dataframe(self, which: str = "filtered", level: str = "trajectory") -> Any:
        """The trajectories as a DataFrame; needs pandas.

        Args:
            which: "filtered", "all" or "selected".
            level: "trajectory", "turn" or "token" (see
                :meth:`~rollart_nb.trajectory.TrajectoryList.to_dataframe`), decoded with the
                viewer's tokenizer.
        """
        return to_dataframe(self._which(which), level, self._decode())

    def to_jsonl(self, path: str | Path, which: str = "filtered") -> Path:
        """Write full trajectories (turns, token ids, masks, logprobs) as JSON lines."""
        path = Path(path)
        with path.open("w") as f:
            for t in self._which(which):
                f.write(json.dumps(t.to_dict(), default=str) + "\n")
        return path

    def close(self) -> None:
        """Stop the live timer and close the widgets."""
        self.live.value = False
        super().close()

    # -- internals -------------------------------------------------------------------------
    def _which(self, which: str) -> list[Trajectory]:
        if which == "all":
            return list(self.items)
        if which == "selected":
            return [self.selected] if self.selected is not None else []
        if which == "filtered":
            return self.filtered
        raise ValueError(f"which must be 'filtered', 'all' or 'selected', got {which!r}")

    def _set_options(self) -> None:
        tasks = sorted({t.task for t in self.items})
        versions = sorted({v for t in self.items for v in (t.start_version, *(s.version for s in t.versions))})
        keep_task, keep_version = self.task.value, self.version.value
        self.task.options = [_ANY, *tasks]
        self.version.options = [_ANY, *map(str, versions)]
        self.task.value = keep_task if keep_task in self.task.options else _ANY
        self.version.value = keep_version if keep_version in self.version.options else _ANY

    def _apply(self) -> None:
        shown = self.filtered
        keep = self.selector.value
        self.selector.options = [(trajectory_summary(t), t.id) for t in shown]
        ids = [t.id for t in shown]
        self.selector.value = keep if keep in ids else (ids[-1] if ids else None)
        self.count.value = f"{len(shown)} of {len(self.items)} trajectories"
        self._show()

    def _show(self) -> None:
        t = self.selected
        if t is None:
            self.detail.value = "<p>no trajectory matches</p>"
        elif self.pane.value == "tokens":
            self.detail.value = token_html(t, self.colour.value, self._decode())
        elif self.pane.value == "group" and (g := self.group) is not None:
            self.detail.value = group_html(g, self._decode())
        else:
            self.detail.value = trajectory_html(t, self._decode())

    def _mismatch_of(self, t: Trajectory) -> float:
        key = f"{t.id}@{(t.train or {}).get('step')}"  # a refresh may bring the train step's record
        if key not in self._mismatch:
            self._mismatch[key] = mismatch_of(t)
        return self._mismatch[key]

    def _decode(self) -> TokenDecoder:
        if self._decoder is None:
            tok = self._tokenizer if self._tokenizer is not None else tokenizer_of(self.source)
            self._decoder = TokenDecoder(tok)
        return self._decoder

    def _on_live(self, change: dict[str, Any]) -> None:
        if change["new"]:
            self._schedule()
        elif self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self) -> None:
        self._timer = threading.Timer(self.live_s, self._tick)
        self._timer.daemon = True
        self._timer.start()

    def _tick(self) -> None:
        try:
            self.refresh()
        except Exception as e:  # e.g. the pipeline was closed: stop being live, say why
            self.count.value += f" &middot; live refresh stopped: {html.escape(str(e))}"
            self.live.value = False
            return
        if self.live.value:
            self._schedule()

    def _export(self) -> None:
        try:
            p = self.to_jsonl(self.export_path.value)
            self.count.value = f"{len(self.filtered)} trajectories written to {html.escape(str(p))}"
        except OSError as e:
            self.count.value = f"export failed: {html.escape(str(e))}"


def _parse_float(text: str) -> float | None:
    try:
        return float(text) if text.strip() and text.strip() != _ANY else None
    except ValueError:
        return None
