"""Experiment results: our ratios next to the paper's, a printed table, a plotly figure.

Every experiment returns the dict built by :func:`result`::

    {"experiment": "r1_affinity", "ours": {metric: ratio}, "paper": {metric: [lo, hi] or value},
     "wasted": {run: share of its generated tokens aborted as stale},
     "deviation": {metric: relative gap to the paper's range (0 inside it)},
     "notes": [why a metric is > 25% off, naming the modelling simplification], "raw": {...},
     "figure": "<out>/r1_affinity.html", "wall_s": ...}
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["TOLERANCE", "deviation", "format_table", "result", "write_figure"]

TOLERANCE = 0.25
"""Relative gap to the paper's range above which a metric needs a note saying why."""

LAG_WARN = 0.5
"""Loop lag (fraction of the probe period) above which a result carries a fidelity note."""

Paper = float | tuple[float, float] | None


def deviation(ours: float, paper: Paper) -> float:
    """Relative distance of ``ours`` from the paper's value or [lo, hi] range (0 inside it)."""
    if paper is None or ours is None or (isinstance(ours, float) and math.isnan(ours)):
        return math.nan
    lo, hi = paper if isinstance(paper, tuple) else (paper, paper)
    if ours < lo:
        return (lo - ours) / lo
    if ours > hi:
        return (ours - hi) / hi
    return 0.0


def result(
    name: str,
    ours: dict[str, float],
    paper: Mapping[str, Paper],
    why: dict[str, Any],
    raw: dict[str, Any],
    *,
    description: str,
) -> dict[str, Any]:
    """Assemble an experiment's record; a note is added for every metric > :data:`TOLERANCE` off.

    Args:
        name: experiment name.
        ours: metric -> our ratio.
        paper: metric -> the paper's value, (lo, hi) range, or None (not reported).
        why: metric (or "*") -> the modelling simplification that explains a gap: a string, or
            ``{"below": ..., "above": ...}`` by the gap's direction (used only when needed).
        raw: per-configuration measurements.
        description: one line on what was run.
    """
    dev = {k: deviation(v, paper.get(k)) for k, v in ours.items()}
    notes = []
    for k, d in dev.items():
        if not math.isnan(d) and d > TOLERANCE:
            side = "below" if ours[k] < _lo(paper[k]) else "above"
            reason = why.get(k, why.get("*", "No modelled cause identified."))
            if isinstance(reason, dict):
                reason = reason.get(side, "No modelled cause identified.")
            notes.append(f"{k}: ours {ours[k]:.2f}x is {d:.0%} {side} the paper's {_fmt(paper[k])}. " + reason)
    lags = [v["lag_frac"] for v in _runs(raw)]
    if lags and max(lags) > LAG_WARN:
        notes.append(
            f"sim fidelity: the event loop lagged up to {max(lags):.0%} of a 10 ms sleep (control-plane CPU "
            "time is not scaled down with time_scale; wall-clock sleeps end late), so modelled durations "
            "are stretched unevenly and ratios carry extra noise; see raw[...]['lag_frac']."
        )
    return {
        "experiment": name,
        "description": description,
        "wasted": _wasted(raw),
        "ours": {k: round(v, 3) for k, v in ours.items()},
        "paper": {k: (list(v) if isinstance(v, tuple) else v) for k, v in paper.items()},
        "deviation": {k: (None if math.isnan(d) else round(d, 3)) for k, d in dev.items()},
        "notes": notes,
        "raw": raw,
    }


def format_table(res: dict[str, Any]) -> str:
    """Plain-text table: metric | ours | paper | gap, then the notes."""
    rows = [("metric", "ours", "paper", "gap")]
    for k, v in res["ours"].items():
        p = res["paper"].get(k)
        d = res["deviation"].get(k)
        rows.append(
            (
                k,
                f"{v:.2f}x",
                _fmt(tuple(p) if isinstance(p, list) else p),
                "-" if d is None else ("in range" if d == 0 else f"{d:.0%}"),
            )
        )
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"== {res['experiment']} ({res.get('wall_s', '?')} s): {res['description']}"]
    lines += ["  " + "  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows]
    wasted = {k: v for k, v in res.get("wasted", {}).items() if v}
    if wasted:
        lines.append(
            "  wasted (stale-aborted share of generated tokens): "
            + ", ".join(f"{k} {v:.0%}" for k, v in wasted.items())
        )
    lines += [f"  note: {n}" for n in res["notes"]]
    return "\n".join(lines)


def write_figure(res: dict[str, Any], out: str, title: str) -> str | None:
    """Grouped bars, ours vs the paper (range midpoint, error bar to its ends); returns the path.

    Returns None when plotly is not installed (the ``nb`` extra).
    """
    try:
        import plotly.graph_objects as go
    except ImportError:
        return None
    keys = list(res["ours"])
    paper = [res["paper"].get(k) for k in keys]
    mid = [None if p is None else (sum(p) / 2 if isinstance(p, list) else p) for p in paper]
    err = [0 if p is None or not isinstance(p, list) else (p[1] - p[0]) / 2 for p in paper]
    fig = go.Figure(
        [
            go.Bar(name="ours (sim)", x=keys, y=[res["ours"][k] for k in keys]),
            go.Bar(name="paper", x=keys, y=mid, error_y={"type": "data", "array": err, "visible": True}),
        ]
    )
    fig.update_layout(barmode="group", title=title, yaxis_title="speed-up (x)", template="plotly_white")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{res['experiment']}.html")
    fig.write_html(path, include_plotlyjs="cdn")
    return path


def finish(
    res: dict[str, Any], out: str, printer: Callable[[str], None] | None, title: str, started: float
) -> dict[str, Any]:
    """Record ``wall_s`` since ``started`` (``time.monotonic()``), write the figure, print the table
    (``printer``; None prints nothing), return ``res``."""
    res["wall_s"] = round(time.monotonic() - started, 1)
    res["figure"] = write_figure(res, out, title)
    if printer is not None:
        printer(format_table(res))
    return res


def _wasted(raw: Any) -> dict[str, float]:
    """Run name -> the share of its generated tokens aborted as stale, for every simulate() record in ``raw``."""
    out: dict[str, float] = {}
    for name, run in _named_runs(raw).items():
        frac = run.get("aborted_token_frac", 0.0)
        if isinstance(frac, float) and not math.isnan(frac):
            out[name] = round(frac, 3)
    return out


def _runs(raw: Any) -> list[dict[str, Any]]:
    """Every simulate() record nested in ``raw``."""
    return list(_named_runs(raw).values())


def _named_runs(raw: Any, prefix: str = "") -> dict[str, dict[str, Any]]:
    """Every simulate() record nested in ``raw``, by its path of keys ("moe_2P2D/pd")."""
    if not isinstance(raw, dict):
        return {}
    if "lag_frac" in raw:
        return {prefix: raw}
    out: dict[str, dict[str, Any]] = {}
    for k, v in raw.items():
        out.update(_named_runs(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def _lo(p: Paper) -> float:
    return p[0] if isinstance(p, tuple) else float(p)  # type: ignore[arg-type]


def _fmt(p: Any) -> str:
    if p is None:
        return "-"
    if isinstance(p, tuple | list):
        return f"{p[0]:.2f}-{p[1]:.2f}x"
    return f"{p:.2f}x"
