"""The pool utilization timeline: what each worker did, and when, as a Gantt chart.

Segments come from trajectories' turn timings and StepReports' train steps; the live dashboard
appends new segments to the bars already drawn.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rollart_nb.control.report import StepReport
from rollart_nb.trajectory import Trajectory

__all__ = ["TRAIN_ROW", "timeline_figure", "utilization_figure", "utilization_segments"]

#: Modes whose train step runs inside the step (after rollout_wait) rather than behind the next rollout.
_INLINE_TRAIN_MODES = ("sync", "sync+")
#: Row label of train steps in the utilization timeline.
TRAIN_ROW = "trainer"


def utilization_segments(
    trajectories: Iterable[Trajectory], reports: Sequence[StepReport] = (), *, window_s: float | None = None
) -> list[dict[str, Any]]:
    """What each worker did, and when: one segment per generated turn and per train step.

    Generation segments come from each turn's ``timings["t"]``, ``timings["generate"]`` and
    ``worker`` (turns without them are skipped); train ones from ``started_at`` and ``train_s``.

    Args:
        trajectories: trajectories to read turns from (any status).
        reports: step reports for the train row.
        window_s: keep only segments that end within this many seconds of the latest end.

    Returns:
        Dicts with ``row`` (worker name or :data:`TRAIN_ROW`), ``kind`` ("generate" / "train"),
        ``start`` and ``end`` (unix seconds), ``label`` (hover text), sorted by start.
    """
    segs: list[dict[str, Any]] = []
    for traj in trajectories:
        for i, turn in enumerate(traj.turns):
            t, dur = turn.timings.get("t"), turn.timings.get("generate")
            if t is None or dur is None or not turn.worker:
                continue
            segs.append(
                {
                    "row": turn.worker,
                    "kind": "generate",
                    "start": float(t),
                    "end": float(t) + float(dur),
                    "label": f"{traj.task} {traj.id} turn {i} v{turn.version}",
                }
            )
    for r in reports:
        if r.train_s <= 0 or r.started_at <= 0:
            continue
        start = r.started_at + (r.phases.get("rollout_wait", 0.0) if r.mode in _INLINE_TRAIN_MODES else r.step_s)
        segs.append(
            {
                "row": TRAIN_ROW,
                "kind": "train",
                "start": start,
                "end": start + r.train_s,
                "label": f"train step {r.step} (v{r.version})",
            }
        )
    if window_s is not None and segs:
        latest = max(s["end"] for s in segs)
        segs = [s for s in segs if s["end"] >= latest - window_s]
    return sorted(segs, key=lambda s: s["start"])


def utilization_figure(
    trajectories: Iterable[Trajectory], reports: Sequence[StepReport] = (), *, window_s: float | None = None
) -> Any:
    """Pool utilization timeline: a Gantt row per generation worker plus the trainer.

    The x axis is seconds since the earliest segment shown; the title gives each row's busy
    fraction over the shown span (overlapping turns of a batching worker count once).
    """
    segs = utilization_segments(trajectories, reports, window_s=window_s)
    return timeline_figure(segs, [e for r in reports for e in r.events])


def timeline_figure(
    segs: Sequence[dict[str, Any]],
    events: Sequence[dict[str, Any]] = (),
    *,
    t0: float | None = None,
    window_s: float | None = None,
) -> Any:
    """The utilization timeline of :func:`utilization_segments`' segments, drawn in the order given.

    Args:
        segs: segments (``row``, ``kind``, ``start``, ``end``, ``label``), in the order seen.
        events: failover events (``kind``, ``worker``, ``at``): a mark on the worker's row.
        t0: unix time of x = 0 (default: the earliest segment).
        window_s: show only the last ``window_s`` seconds (default: everything).
    """
    import plotly.graph_objects as go

    fig = go.Figure()
    if t0 is None:
        t0 = min((s["start"] for s in segs), default=0.0)
    latest = max((s["end"] for s in segs), default=t0)
    lo = t0 if window_s is None else max(t0, latest - window_s)
    for kind, color in (("generate", "#4c78a8"), ("train", "#54a24b")):
        ks = [s for s in segs if s["kind"] == kind]
        fig.add_trace(
            go.Bar(
                y=[s["row"] for s in ks],
                x=[round(s["end"] - s["start"], 3) for s in ks],  # milliseconds: enough for a timeline, and
                base=[round(s["start"] - t0, 3) for s in ks],  # a third of the bytes of full precision
                orientation="h",
                name=kind,
                marker_color=color,
                hovertext=[s["label"] for s in ks],
                hoverinfo="text+x",
            )
        )
    shown = [e for e in events if segs and e.get("at", 0) >= t0]
    if shown:  # replacements and restores: a mark on the worker's row when it happened
        fig.add_trace(
            go.Scatter(
                y=[TRAIN_ROW if e["kind"] == "trainer_restored" else e["worker"] for e in shown],
                x=[e["at"] - t0 for e in shown],
                mode="markers",
                name="failover",
                marker={"symbol": "x", "size": 12, "color": "#d62728"},
                hovertext=[
                    f"{e['kind'].replace('_', ' ')}: {e['worker']} (v{e.get('version')}; "
                    f"{str(e.get('reason', ''))[:120]})"
                    for e in shown
                ],
                hoverinfo="text",
            )
        )
    span = latest - lo
    clipped = [{**s, "start": max(s["start"], lo)} for s in segs if s["end"] > lo]
    busy = {row: _busy(clipped, row) / span for row in sorted({s["row"] for s in segs})} if span > 0 else {}
    util = ", ".join(f"{row} {frac:.0%}" for row, frac in busy.items())
    fig.update_layout(
        title=f"Pool utilization ({util})" if util else "Pool utilization",
        barmode="overlay",
        xaxis_title="seconds",
        height=120 + 30 * max(1, len(busy)),
        margin={"l": 40, "r": 10, "t": 40, "b": 40},
    )
    if window_s is not None and segs:
        fig.update_xaxes(range=[lo - t0, latest - t0])
    return fig


def _busy(segs: Sequence[dict[str, Any]], row: str) -> float:
    """Union length of a row's segments (concurrent turns on one worker count once)."""
    total, cur_start, cur_end = 0.0, None, None
    for s in sorted((s for s in segs if s["row"] == row), key=lambda s: s["start"]):
        if cur_end is None or s["start"] > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s["start"], s["end"]
        else:
            cur_end = max(cur_end, s["end"])
    if cur_end is not None:
        total += cur_end - cur_start
    return total
