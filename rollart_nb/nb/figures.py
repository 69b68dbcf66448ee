"""Figures as pure functions: StepReports in, plotly Figures (or HTML) out.

Testable without a kernel; the live dashboard wraps them in FigureWidgets and the demo's HTML
report embeds them.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from typing import Any

from rollart_nb.algo.grpo import TASK_METRICS, TRAIN_METRICS, per_task
from rollart_nb.control.report import ENV_FAULTS, PHASES, StepReport

__all__ = [
    "env_faults_line",
    "failed_aborted_figure",
    "failover_line",
    "failure_rate",
    "failures_figure",
    "reward_figure",
    "reason_kind",
    "staleness_figure",
    "step_failures",
    "step_time_figure",
    "swap_step",
    "task_figure",
    "throughput_figure",
    "training_figure",
]

#: One color per task, in sorted task order, in every per-task plot (the curves SVG too).
TASK_COLORS = ("#4c78a8", "#e45756", "#54a24b", "#b279a2", "#f58518", "#72b7b2")

_PHASE_COLORS = {
    "rollout_wait": "#4c78a8",
    "suspend": "#f58518",
    "update": "#e45756",
    "resume": "#72b7b2",
    "train": "#54a24b",
}


def _go() -> Any:
    import plotly.graph_objects as go

    return go


def reward_figure(
    reports: Sequence[StepReport], *, validation: bool = True, swaps: Sequence[dict[str, Any]] = ()
) -> Any:
    """Reward per task per step (solid), validation score (dashed markers), reward swaps.

    Args:
        reports: step reports, in order.
        validation: draw validation scores where a step has them.
        swaps: entries of ``Pipeline.reward_history()`` (``task``, ``version``, ``created``);
            each version > 0 becomes a dotted vertical line at the first step that began after it.
    """
    go = _go()
    fig = go.Figure()
    tasks = sorted({t for r in reports for t in r.reward})
    for task in tasks:
        pts = [(r.step, r.reward[task]) for r in reports if task in r.reward]
        fig.add_trace(
            go.Scatter(x=[p[0] for p in pts], y=[_finite(p[1]) for p in pts], mode="lines", name=f"reward/{task}")
        )
        if validation:
            vs = [(r.step, r.validation[task]) for r in reports if task in r.validation]
            if vs:
                fig.add_trace(
                    go.Scatter(
                        x=[p[0] for p in vs],
                        y=[_finite(p[1]) for p in vs],
                        mode="lines+markers",
                        line={"dash": "dash"},
                        name=f"validation/{task}",
                    )
                )
    if reports:  # the mean averages what completed: the failure rate beside it says how much did not
        fig.add_trace(
            go.Scatter(
                x=[r.step for r in reports],
                y=[failure_rate(r) for r in reports],
                mode="lines",
                line={"dash": "dot", "color": "#d62728"},
                name="failure rate",
                yaxis="y2",
            )
        )
    for sw in swaps:
        step = swap_step(reports, sw)
        if step is not None:
            fig.add_vline(
                x=step - 0.5,
                line_dash="dot",
                line_color="#888",
                annotation_text=f"{sw['task']} reward v{sw['version']}",
                annotation_position="top left",
            )
    fig.update_layout(
        title="Reward (mean of completed) · failure rate",
        xaxis_title="step",
        yaxis_title="reward",
        yaxis2={
            "title": {"text": "failed"},
            "overlaying": "y",
            "side": "right",
            "range": [0, 1],
            "tickformat": ".0%",
            "showgrid": False,
        },
        legend={"orientation": "h", "y": -0.25},
        height=340,
        margin={"l": 40, "r": 50 if reports else 10, "t": 40, "b": 40},
    )
    return fig


_TRAIN_TITLES = {
    "loss": "loss",
    "entropy": "entropy (per token)",
    "grad_norm": "grad norm",
    "clip_frac": "clip fraction",
    "response_length": "response length (tokens)",
    "mismatch_kl": "sampler/trainer KL (k3)",
    "mismatch_ratio_out": "tokens with ratio outside [0.5, 2]",
    "cross_version_frac": "cross-version token share",
}


def training_figure(reports: Sequence[StepReport]) -> Any:
    """The trainer's metrics over steps (``StepReport.train``), one small plot each: loss, KL,
    entropy, grad norm, clip fraction, response length, and the sampler/trainer mismatch and
    cross-version share (:data:`~rollart_nb.algo.grpo.TRAIN_METRICS`).

    An unreported metric leaves no point, NaN a gap. KL is to the reference policy when the steps
    report ``kl_ref``, else from the behaviour policy. New steps only extend traces.
    """
    go = _go()
    from plotly.subplots import make_subplots

    kl_ref = any("kl_ref" in r.train for r in reports)
    titles = dict(_TRAIN_TITLES, kl="KL to reference (k3)" if kl_ref else "KL from behaviour policy (approx.)")
    fig = make_subplots(
        rows=3,
        cols=3,
        subplot_titles=[titles[k] for k in TRAIN_METRICS],
        horizontal_spacing=0.08,
        vertical_spacing=0.12,
    )
    for i, key in enumerate(TRAIN_METRICS):
        pts = [(r.step, r.train[key]) for r in reports if key in r.train]
        fig.add_trace(
            go.Scatter(
                x=[p[0] for p in pts],
                y=[_finite(p[1]) for p in pts],
                mode="lines+markers",
                marker={"size": 4},
                name=key,
                line={"color": TASK_COLORS[i % len(TASK_COLORS)]},
            ),
            row=i // 3 + 1,
            col=i % 3 + 1,
        )
    fig.update_layout(title="Training", showlegend=False, height=600, margin={"l": 40, "r": 10, "t": 60, "b": 40})
    return fig


_TASK_PANELS = (
    ("reward", "reward (batch mean)"),
    ("validation", "held-out score (greedy)"),
    ("pass_k", "held-out pass@k (dotted: pass@1)"),
    ("entropy", "entropy (per token)"),
    ("kl", "KL"),
    ("response_length", "response length (tokens)"),
    ("clip_frac", "clip fraction"),
    ("mismatch_kl", "sampler/trainer KL (k3)"),
    ("mismatch_ratio_out", "ratio outside [0.5, 2]"),
    ("cross_version_frac", "cross-version token share"),
    ("corrected_frac", "importance-weighted stale token share"),
    ("tis_clip_frac", "importance weight at its cap"),
)


def _pass_k_name(reports: Sequence[StepReport]) -> str | None:
    """The ``pass@k`` key (k > 1) that the reports' sampled validations carry, if any."""
    return next((k for r in reports for ks in r.pass_k.values() for k in ks if k != "pass@1"), None)


def task_figure(reports: Sequence[StepReport]) -> Any:
    """Per-task curves, one color per task: reward, held-out score and pass@k, and the trainer's
    :data:`~rollart_nb.algo.grpo.TASK_METRICS`. Every task has all its traces from the start, so
    new steps only extend them (live updates).
    """
    go = _go()
    from plotly.subplots import make_subplots

    kl_ref = any("kl_ref" in r.train for r in reports)
    k_name = _pass_k_name(reports) or "pass@k"
    titles = dict(_TASK_PANELS)
    titles["kl"] = "KL to reference (k3)" if kl_ref else "KL from behaviour policy"
    titles["pass_k"] = f"held-out {k_name} (dotted: pass@1)"
    fig = make_subplots(
        rows=3,
        cols=4,
        subplot_titles=[titles[k] for k, _ in _TASK_PANELS],
        horizontal_spacing=0.06,
        vertical_spacing=0.12,
    )
    tasks = sorted({t for r in reports for t in (*r.reward, *r.validation, *r.pass_k, *per_task(r.train))})
    trained = [(r.step, per_task(r.train)) for r in reports]
    panels = [name for name, _ in _TASK_PANELS]
    for i, task in enumerate(tasks):
        color = TASK_COLORS[i % len(TASK_COLORS)]
        series: list[tuple[str, list[tuple[int, float]], dict[str, Any]]] = [
            ("reward", [(r.step, r.reward[task]) for r in reports if task in r.reward], {}),
            ("validation", [(r.step, r.validation[task]) for r in reports if task in r.validation], {}),
            ("pass_k", [(r.step, r.pass_k[task][k_name]) for r in reports if k_name in r.pass_k.get(task, {})], {}),
            (
                "pass_k",
                [(r.step, r.pass_k[task]["pass@1"]) for r in reports if "pass@1" in r.pass_k.get(task, {})],
                {"dash": "dot"},
            ),
        ]
        series += [(m, [(s, t[task][m]) for s, t in trained if m in t.get(task, {})], {}) for m in TASK_METRICS]
        for j, (panel, pts, line) in enumerate(series):
            n = panels.index(panel)
            fig.add_trace(
                go.Scatter(
                    x=[p[0] for p in pts],
                    y=[_finite(p[1]) for p in pts],
                    mode="lines+markers",
                    marker={"size": 3},
                    name=task,
                    legendgroup=task,
                    showlegend=j == 0,
                    line={"color": color, **line},
                ),
                row=n // 4 + 1,
                col=n % 4 + 1,
            )
    fig.update_layout(
        title="Per task",
        height=640,
        legend={"orientation": "h", "x": 0.78, "y": 0.2},
        margin={"l": 40, "r": 10, "t": 60, "b": 40},
    )
    return fig


def failure_rate(report: StepReport) -> float | None:
    """Failed / (completed + failed) among the trajectories that ended during the step, penalized
    ones (completed, trained on with the failure reward) counted as failed (None: none ended)."""
    failed, done = int(report.counts.get("failed", 0)), int(report.counts.get("completed", 0))
    return (failed + int(report.counts.get("penalized", 0))) / (failed + done) if failed + done else None


def _finite(v: float) -> float | None:
    """NaN/inf -> None (a gap in the line): widget state must be valid JSON."""
    return v if isinstance(v, int | float) and math.isfinite(v) else None


def swap_step(reports: Sequence[StepReport], swap: dict[str, Any]) -> int | None:
    """The first step that began after a reward swap (None for version 0 or no such step)."""
    if not swap.get("version"):
        return None
    created = float(swap.get("created", 0.0))
    return next((r.step for r in reports if r.started_at >= created), None)


def step_time_figure(reports: Sequence[StepReport]) -> Any:
    """Step time stacked by phase (rollout wait, suspend, update, resume, train)."""
    go = _go()
    fig = go.Figure()
    steps = [r.step for r in reports]
    for ph in PHASES:
        fig.add_trace(
            go.Bar(x=steps, y=[r.phases.get(ph, 0.0) for r in reports], name=ph, marker_color=_PHASE_COLORS[ph])
        )
    fig.update_layout(
        barmode="stack",
        title="Step time by phase",
        xaxis_title="step",
        yaxis_title="seconds",
        height=320,
        margin={"l": 40, "r": 10, "t": 40, "b": 40},
    )
    return fig


def staleness_figure(reports: Sequence[StepReport]) -> Any:
    """Histogram of version gaps in the trained batches, plus aborted-stale counts per step (and,
    under the ``cancel`` staleness policy, trajectories renewed instead of aborted)."""
    go = _go()
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("staleness (versions) in batches", "aborted stale per step"))
    gaps: dict[int, int] = {}
    for r in reports:
        for g, c in r.staleness.items():
            gaps[int(g)] = gaps.get(int(g), 0) + c
    fig.add_trace(go.Bar(x=sorted(gaps), y=[gaps[g] for g in sorted(gaps)], name="samples"), row=1, col=1)
    fig.add_trace(
        go.Bar(x=[r.step for r in reports], y=[r.counts.get("aborted_stale", 0) for r in reports], name="aborted"),
        row=1,
        col=2,
    )
    if any(r.counts.get("renewed") for r in reports):  # the cancel staleness policy's renewals
        fig.add_trace(
            go.Bar(x=[r.step for r in reports], y=[r.counts.get("renewed", 0) for r in reports], name="renewed"),
            row=1,
            col=2,
        )
        fig.update_layout(barmode="stack")
    fig.update_layout(height=300, showlegend=False, margin={"l": 40, "r": 10, "t": 40, "b": 40})
    return fig


def failures_figure(reports: Sequence[StepReport]) -> Any:
    """Per step: failed trajectories and the env faults behind them (env restarts, env call
    timeouts, sync env calls abandoned on their threads), from ``counts`` and ``env``."""
    go = _go()
    steps = [r.step for r in reports]
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            x=steps, y=[r.counts.get("failed", 0) for r in reports], name="trajectories failed", marker_color="#e45756"
        )
    )
    for key, color in zip(ENV_FAULTS, ("#f58518", "#b279a2", "#72b7b2"), strict=True):
        fig.add_trace(
            go.Bar(
                x=steps, y=[r.env.get(key, 0) for r in reports], name=f"env {key.replace('_', ' ')}", marker_color=color
            )
        )
    fig.update_layout(
        barmode="group",
        title="Failures and env faults per step",
        xaxis_title="step",
        yaxis_title="count",
        height=300,
        margin={"l": 40, "r": 10, "t": 40, "b": 40},
    )
    return fig


_TRAJ_ID = re.compile(r"trajectory [0-9a-f]{4,}")
_ENV_NO = re.compile(r"env #\d+")
_EXC_NAME = re.compile(r"\b[A-Z]\w*(?:Error|Exception|Timeout|Exit)\b")
_STAGE = re.compile(r"^(\w+): ")


def reason_kind(reason: str, limit: int = 60) -> str:
    """A failure reason without its trajectory ids and env numbers, cut to its last exception, e.g.
    ``"reward: reward f v1 for task 'math' (trajectory 3fa2) failed after 2 attempt(s): ValueError: bad"``
    -> ``"reward: ValueError: bad"``: reasons that differ only by trajectory group together."""
    r = _ENV_NO.sub("env #…", _TRAJ_ID.sub("trajectory …", " ".join(str(reason).split())))
    last = max(_EXC_NAME.finditer(r), key=lambda m: m.start(), default=None)
    if last is not None and last.start() > 0:
        stage = _STAGE.match(r)
        r = (f"{stage.group(1)}: " if stage else "") + r[last.start() :]
    return r if len(r) <= limit else r[: limit - 1] + "…"


def step_failures(reports: Sequence[StepReport]) -> list[tuple[list[tuple[str, str]], int]]:
    """Per report: the step's failures (penalized ones included) as ``(task, reason)`` pairs, and
    how many more trajectories failed in it whose reason the report does not hold (the rollout
    keeps only its most recent reasons)."""
    out: list[tuple[list[tuple[str, str]], int]] = []
    for r in reports:
        failed = int(r.counts.get("failed", 0)) + int(r.counts.get("penalized", 0))
        new = [(t, x) for t, xs in r.failures.items() for x in xs][-failed:] if failed else []
        out.append((new, failed - len(new)))
    return out


_FAIL_COLORS = ("#d62728", "#ff7f0e", "#8c564b", "#e377c2", "#bcbd22", "#9467bd")
_ABORT_COLORS = ("#bab0ac", "#8c8c8c", "#d4cfcb", "#6f6f6f")


def failed_aborted_figure(reports: Sequence[StepReport]) -> Any:
    """Per step, stacked: trajectories aborted as stale per task, and failed by task and reason.

    One bar trace per ``aborted (stale) · task`` and ``failed · task: reason`` (``penalized`` when
    trained on with the failure reward), in order of first appearance, so a live view appends.
    """
    go = _go()
    fig = go.Figure()
    aborted: dict[str, dict[str, list[Any]]] = {}
    for r in reports:
        per_task = {t: int(c.get("aborted_stale", 0)) for t, c in r.task_counts.items() if c.get("aborted_stale")}
        rest = int(r.counts.get("aborted_stale", 0)) - sum(per_task.values())
        if rest > 0:
            per_task[""] = rest
        for task, n in per_task.items():
            c = aborted.setdefault(task, {"x": [], "y": []})
            c["x"].append(r.step)
            c["y"].append(n)
    for i, (task, c) in enumerate(aborted.items()):
        name = f"aborted (stale) · {task}" if task else "aborted (stale)"
        fig.add_trace(go.Bar(x=c["x"], y=c["y"], name=name, marker_color=_ABORT_COLORS[i % len(_ABORT_COLORS)]))
    cats: dict[str, dict[str, list[Any]]] = {}
    for r, (new, unnamed) in zip(reports, step_failures(reports), strict=True):
        per: dict[str, list[str]] = {}
        for task, reason in new:
            if reason.startswith("penalized: "):
                label = f"penalized · {task}: {reason_kind(reason[len('penalized: ') :])}"
            else:
                label = f"failed · {task}: {reason_kind(reason)}"
            per.setdefault(label, []).append(reason)
        if unnamed > 0:
            per.setdefault("failed · reason not kept", []).extend([""] * unnamed)
        for name, reasons in per.items():
            c = cats.setdefault(name, {"x": [], "y": [], "text": []})
            c["x"].append(r.step)
            c["y"].append(len(reasons))
            c["text"].append(html.escape(reasons[-1][:300]))
    for i, (name, c) in enumerate(cats.items()):
        fig.add_trace(
            go.Bar(
                x=c["x"],
                y=c["y"],
                name=name,
                text=c["text"],
                textposition="none",
                hovertemplate="%{y} %{fullData.name}<br>%{text}<extra>step %{x}</extra>",
                marker_color=_FAIL_COLORS[i % len(_FAIL_COLORS)],
            )
        )
    fig.update_layout(
        barmode="stack",
        title="Failed and aborted per step",
        xaxis_title="step",
        yaxis_title="trajectories",
        legend={"orientation": "h", "y": -0.25},
        height=340,
        margin={"l": 40, "r": 10, "t": 40, "b": 40},
    )
    return fig


def env_faults_line(reports: Sequence[StepReport]) -> str:
    """Env faults over all ``reports`` as one short line ("" when there were none), e.g.
    ``"env faults: 3 restarts, 2 timeouts, 2 abandoned threads"``."""
    totals = {k: sum(int(r.env.get(k, 0)) for r in reports) for k in ENV_FAULTS}
    if not any(totals.values()):
        return ""
    return "env faults: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in totals.items())


def failover_line(reports: Sequence[StepReport]) -> str:
    """Worker replacements and trainer restores over all ``reports`` as one short line ("" when
    there were none), e.g. ``"failover: 2 generators replaced (actor_gen/0, actor_gen/1), 1
    trainer restore (to v10)"``."""
    events = [e for r in reports for e in r.events]
    gens = [e["worker"] for e in events if e["kind"] == "generator_replaced"]
    restores = [e for e in events if e["kind"] == "trainer_restored"]
    parts = []
    if gens:
        parts.append(f"{len(gens)} generator(s) replaced ({', '.join(sorted(set(gens)))})")
    if restores:
        parts.append(f"{len(restores)} trainer restore(s) (last to v{restores[-1]['version']})")
    return "failover: " + ", ".join(parts) if parts else ""


def engines_line(report: StepReport | None) -> str:
    """The generation engines' load at the end of ``report``'s step as one short line ("" when
    unknown), e.g. ``"engines: actor_gen/0 480/512 (94%), actor_gen/1 12/512 (2%) +30 queued"``."""
    if report is None or not report.engines:
        return ""
    parts = []
    for e in report.engines:
        cap = e.get("capacity")
        load = f"{e['inflight']}/{cap} ({e['inflight'] / cap:.0%})" if cap else f"{e['inflight']} in flight"
        queued = f" +{e['queued']} queued" if e.get("queued") else ""
        parts.append(f"{e['name']} {load}{queued}")
    return "engines: " + ", ".join(parts)


def throughput_figure(reports: Sequence[StepReport]) -> Any:
    """Tokens per second per step (the paper's throughput metric)."""
    go = _go()
    fig = go.Figure(
        go.Scatter(
            x=[r.step for r in reports], y=[r.throughput for r in reports], mode="lines+markers", name="tokens/s"
        )
    )
    fig.update_layout(
        title="Throughput",
        xaxis_title="step",
        yaxis_title="tokens / s",
        height=300,
        margin={"l": 40, "r": 10, "t": 40, "b": 40},
    )
    return fig
