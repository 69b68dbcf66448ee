"""Token overlays: a trajectory's tokens coloured by any column of its token frame.

:func:`token_html` draws one span per token of the sequence the trainer sees, its background
from one column (:data:`OVERLAYS`: logprobs, the importance ratio, the mismatch, the advantage,
entropy, the version that wrote it), a legend with the scale and its range, and a tooltip that
carries the token's whole row. It is plain HTML built by string joins (a 32k-token trajectory in
well under a second), shown by the viewer's ``tokens`` pane and by :func:`compare`.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

from rollart_nb.errors import ConfigError
from rollart_nb.trajectory import Trajectory
from rollart_nb.trajectory_frames import TokenDecoder, rows

__all__ = ["OVERLAYS", "Comparison", "colour", "compare", "mismatch_of", "token_html"]

OVERLAYS: dict[str, tuple[str, str]] = {
    "mask": ("categorical", "prompt side, trained, not trained"),
    "sampler_logprob": ("sequential", "the sampler's logprob"),
    "trainer_logprob": ("sequential", "the trainer's logprob"),
    "replay_logprob": ("sequential", "the replay's logprob"),
    "importance_ratio": ("diverging", "trainer / sampler probability (log scale)"),
    "mismatch": ("sequential", "|log importance ratio|"),
    "advantage": ("diverging", "GRPO advantage"),
    "entropy": ("sequential", "the sampler's entropy (nats)"),
    "version": ("categorical", "policy version that wrote the token"),
}
"""What a token can be coloured by: column (or ``mismatch``, ``mask``) -> (scale kind, meaning)."""

_NAN = "#f4f4f4"
_VERSION_COLOURS = ("#c6dbef", "#fdd0a2", "#c7e9c0", "#dadaeb", "#fcbba1", "#d9d9d9", "#fee391", "#a1d99b")
_MASK_COLOURS = {"prompt": "#fff3cd", "trained": "#d7ecff", "untrained": "#eeeeee"}
_ROW_KEYS = (
    ("turn", "turn"), ("position", "pos"), ("token_id", "id"), ("side", ""), ("loss_mask", "mask"),
    ("sampler_logprob", "sampler"), ("trainer_logprob", "trainer"), ("importance_ratio", "ratio"),
    ("advantage", "adv"), ("loss_weight", "weight"), ("entropy", "entropy"), ("trainer_entropy", "trainer entropy"),
    ("version", "v"), ("trainer_version", "trainer v"), ("replay_logprob", "replay"),
)  # fmt: skip
"""The token frame's columns a tooltip shows, with the short name it shows each under."""
_STEPS = 32  # colours per scale: a page of 32k tokens uses a few dozen CSS classes


def _value(r: dict[str, Any], column: str) -> float:
    if column == "mismatch":
        ratio = r["importance_ratio"]
        return abs(math.log(ratio)) if ratio > 0 else math.nan
    v = r.get(column)
    return float(v) if isinstance(v, int | float) and v is not None else math.nan


def _mix(a: tuple[int, int, int], b: tuple[int, int, int], f: float) -> str:
    f = round(max(0.0, min(1.0, f)) * _STEPS) / _STEPS
    return "#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b, strict=True))


_WHITE, _BLUE, _RED, _PURPLE = (255, 255, 255), (33, 102, 172), (178, 24, 43), (84, 39, 143)


def colour(kind: str, value: float, lo: float, hi: float) -> str:
    """The background of ``value`` on a scale from ``lo`` to ``hi``: ``sequential`` from white to
    purple; ``diverging`` blue below the middle, red above, white at it; NaN a pale grey."""
    if math.isnan(value):
        return _NAN
    if kind == "diverging":
        mid = (lo + hi) / 2
        half = (hi - lo) / 2 or 1.0
        f = (value - mid) / half
        return _mix(_WHITE, _RED, f) if f >= 0 else _mix(_WHITE, _BLUE, -f)
    return _mix(_WHITE, _PURPLE, (value - lo) / ((hi - lo) or 1.0))


def _scale(column: str, values: Sequence[float]) -> tuple[float, float]:
    """The range a column's colours span: fixed where the column has a natural one (the ratio
    over [0.5, 2] on a log scale, logprobs over [-10, 0]), else the data's."""
    finite = [v for v in values if math.isfinite(v)]
    if column == "importance_ratio":
        return math.log(0.5), math.log(2.0)
    if column.endswith("logprob"):
        return -10.0, 0.0
    if column == "mismatch":
        return 0.0, max([math.log(2.0), *finite])
    if column == "advantage":
        m = max([abs(v) for v in finite] or [1.0]) or 1.0
        return -m, m
    return (min(finite), max(finite)) if finite else (0.0, 1.0)


def _tooltip(r: dict[str, Any]) -> str:
    parts = []
    for k, name in _ROW_KEYS:
        v = r.get(k)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        parts.append(f"{name} {v:.4g}" if isinstance(v, float) else f"{name}{' ' if name else ''}{v}")
    return html.escape(", ".join(parts), quote=True)


def _background(column: str, kind: str, r: dict[str, Any], value: float, lo: float, hi: float) -> str:
    if column == "mask":
        return _MASK_COLOURS["prompt" if r["side"] == "prompt" else "trained" if r["loss_mask"] else "untrained"]
    if column == "version":
        return _VERSION_COLOURS[int(r["version"]) % len(_VERSION_COLOURS)]
    if column == "importance_ratio" and value > 0:
        return colour(kind, math.log(value), lo, hi)
    return colour(kind, value, lo, hi)


def _legend(column: str, kind: str, lo: float, hi: float, versions: Sequence[int]) -> str:
    sw = '<span style="display:inline-block;padding:0 4px;background:{}">{}</span>'
    if column == "mask":
        body = "".join(sw.format(c, k) for k, c in _MASK_COLOURS.items())
    elif column == "version":
        body = "".join(sw.format(_VERSION_COLOURS[v % len(_VERSION_COLOURS)], f"v{v}") for v in versions)
    else:
        show = (math.exp(lo), math.exp(hi)) if column == "importance_ratio" else (lo, hi)
        ends = [colour(kind, lo + (hi - lo) * i / 4, lo, hi) for i in range(5)]
        body = (
            f"{show[0]:.3g} "
            f'<span style="display:inline-block;width:120px;height:10px;vertical-align:middle;'
            f'background:linear-gradient(to right,{",".join(ends)})"></span> {show[1]:.3g} '
            + sw.format(_NAN, "unknown")
        )
    meaning = OVERLAYS[column][1]
    return f'<div class="rn-legend"><small>colour: <b>{column}</b> ({html.escape(meaning)}): {body}</small></div>'


def token_html(traj: Trajectory | Sequence[dict[str, Any]], colour_by: str = "mask", tokenizer: Any = None) -> str:
    """Every token of ``traj`` (or of rows of its token frame) coloured by ``colour_by``, one of
    :data:`OVERLAYS`, with a legend; a token's tooltip holds its row.

    Raises:
        ConfigError: an unknown ``colour_by``.
    """
    if colour_by not in OVERLAYS:
        raise ConfigError(f"colour_by must be one of {', '.join(OVERLAYS)}, got {colour_by!r}")
    if isinstance(traj, Trajectory):
        tok = tokenizer if tokenizer is not None else traj.tokenizer
        decode = tok if isinstance(tok, TokenDecoder) else TokenDecoder(tok)
        records = rows([traj], "token", decode)
    else:
        decode, records = TokenDecoder(tokenizer), list(traj)
    kind = OVERLAYS[colour_by][0]
    values = [_value(r, colour_by) for r in records]
    lo, hi = _scale(colour_by, values)
    spans: list[str] = []
    turn, classes = None, dict[str, str]()
    for r, v in zip(records, values, strict=True):
        if r["turn"] != turn and r["side"] == "prompt":
            turn = r["turn"]
            spans.append(f'<br><small class="rn-turn-mark" style="color:#888">turn {turn}</small> ')
        raw = r.get("text")
        text = html.escape((raw if raw is not None else decode(int(r["token_id"]))).replace("\n", "\u21b5") or "\u2205")
        c = classes.setdefault(_background(colour_by, kind, r, v, lo, hi), f"c{len(classes)}")
        spans.append(f'<span class="rn-t {c}" title="{_tooltip(r)}">{text}</span>')
    versions = sorted({int(r["version"]) for r in records})
    scope = f"rn-o{id(records):x}"  # this output's colour classes only
    style = "".join(f".{scope} .{c}{{background:{bg}}}" for bg, c in classes.items())
    return (
        _legend(colour_by, kind, lo, hi, versions)
        + f"<style>{style}</style>"
        + f'<div class="rn-overlay {scope}" style="font-family:monospace;line-height:1.6;word-break:break-all">'
        + "".join(spans)
        + "</div>"
    )


def mismatch_of(traj: Trajectory) -> float:
    """The largest |log importance ratio| over ``traj``'s trained tokens (NaN before training)."""
    trained = [_value(r, "mismatch") for r in rows([traj], "token") if r["loss_mask"]]
    return max((v for v in trained if not math.isnan(v)), default=math.nan)


class Comparison:
    """Two trajectories side by side, turn by turn, or one under the sampler and its replay."""

    def __init__(self, a: Trajectory, b: Trajectory | None = None, tokenizer: Any = None) -> None:
        if b is None and a.replay is None:
            raise ConfigError("compare(a) alone needs a trajectory from pipe.replay(...); else pass two trajectories")
        self.a, self.b, self.tokenizer = a, b, tokenizer

    def _columns(self) -> tuple[list[tuple[str, list[dict[str, Any]]]], str]:
        decode = TokenDecoder(self.tokenizer if self.tokenizer is not None else self.a.tokenizer)
        ra = rows([self.a], "token", decode)
        if self.b is None:
            v = (self.a.replay or {}).get("version")
            return [(f"sampler ({self.a.id})", ra), (f"replay under v{v}", ra)], "replay_logprob"
        return [(self.a.id, ra), (self.b.id, rows([self.b], "token", decode))], "sampler_logprob"

    def _repr_html_(self) -> str:
        cols, second = self._columns()
        (na, ra), (nb, rb) = cols
        cells = []
        for k in range(max([r["turn"] for r in ra + rb], default=-1) + 1):
            left = token_html([r for r in ra if r["turn"] == k], "sampler_logprob", self.tokenizer)
            right = token_html([r for r in rb if r["turn"] == k], second, self.tokenizer)
            cells.append(
                f'<tr><td style="vertical-align:top">turn {k}</td><td style="vertical-align:top;width:48%">{left}</td>'
                f'<td style="vertical-align:top;width:48%">{right}</td></tr>'
            )
        head = f"<tr><th></th><th>{html.escape(na)}</th><th>{html.escape(nb)}</th></tr>"
        return f'<table class="rn-compare" style="width:100%">{head}{"".join(cells)}</table>'


def compare(a: Trajectory, b: Trajectory | None = None, tokenizer: Any = None) -> Comparison:
    """``a`` and ``b`` side by side, aligned by turn, their tokens coloured by the sampler's
    logprob; with ``a`` alone (from ``pipe.replay``), its sampler's logprobs beside the replay's.

    Example:
        >>> rn.nb.compare(pipe.replay(traj))           # doctest: +SKIP
        >>> rn.nb.compare(traj, pipe.regenerate(traj, from_turn=1))  # doctest: +SKIP
    """
    return Comparison(a, b, tokenizer)
