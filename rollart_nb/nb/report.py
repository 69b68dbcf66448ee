"""The run's standalone outputs: the learning curves as an SVG and the HTML report.

``rollart-nb train`` writes both into its ``out`` directory as the run goes.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from rollart_nb.control.report import StepReport
from rollart_nb.nb.figures import (
    TASK_COLORS,
    failures_figure,
    reward_figure,
    staleness_figure,
    step_time_figure,
    task_figure,
    throughput_figure,
    training_figure,
)

__all__ = ["curves_svg", "report_html"]


class _Plot:
    """The curves' plot area inside a ``width`` x ``height`` SVG, x from 0 to ``x_max``, y from 0 to 1."""

    left, right, top, bottom = 44, 160, 28, 36  # margins: the legend sits on the right

    def __init__(self, width: int, height: int, x_max: float) -> None:
        self.width, self.height, self.x_max = width, height, x_max
        self.w, self.h = width - self.left - self.right, height - self.top - self.bottom

    def x(self, x: float) -> float:
        return self.left + self.w * x / self.x_max

    def y(self, y: float) -> float:
        return self.top + self.h * (1 - min(max(y, 0.0), 1.0))

    def axes(self, x_title: str) -> list[str]:
        """The y grid (0, 0.2, ..., 1) with its labels, the x ticks and the x title."""
        out = []
        for i in range(6):
            y = self.y(i / 5)
            out.append(
                f'<line x1="{self.left}" x2="{self.left + self.w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
                f'<text x="{self.left - 6}" y="{y + 4:.1f}" text-anchor="end">{i / 5:.1f}</text>'
            )
        step = _nice_step(self.x_max / 6)
        for k in range(int(self.x_max / step) + 1):
            tick = self.top + self.h + 14
            out.append(f'<text x="{self.x(k * step):.1f}" y="{tick}" text-anchor="middle">{k * step:g}</text>')
        out.append(f'<text x="{self.left + self.w / 2}" y="{self.height - 6}" text-anchor="middle">{x_title}</text>')
        return out

    def task(self, i: int, name: str, reward: list[tuple[float, float]], val: list[tuple[float, float]]) -> list[str]:
        """Task ``i``'s batch reward (thin, faded), validation (line with dots) and legend."""
        color = TASK_COLORS[i % len(TASK_COLORS)]
        pts = [[f"{self.x(x):.1f},{self.y(y):.1f}" for x, y in line] for line in (reward, val)]
        out = []
        if reward:
            out.append(
                f'<polyline fill="none" stroke="{color}" stroke-opacity="0.35" stroke-width="1" '
                f'points="{" ".join(pts[0])}"/>'
            )
        if val:
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{" ".join(pts[1])}"/>')
            out += [
                f'<circle cx="{cx}" cy="{cy}" r="2.2" fill="{color}"/>' for cx, cy in (p.split(",") for p in pts[1])
            ]
        x0, ly, label = self.left + self.w + 10, self.top + 14 + 34 * i, html.escape(name)
        for dy, style, what in ((0, 'stroke-width="2"', "validation"), (15, 'stroke-opacity="0.35"', "reward")):
            out.append(
                f'<line x1="{x0}" x2="{x0 + 18}" y1="{ly + dy}" y2="{ly + dy}" stroke="{color}" {style}/>'
                f'<text x="{x0 + 22}" y="{ly + dy + 4}">{label} {what}</text>'
            )
        return out


def curves_svg(
    reports: Sequence[StepReport],
    *,
    before: dict[str, float] | None = None,
    after: dict[str, float] | None = None,
    title: str = "Learning curves",
    width: int = 760,
    height: int = 300,
) -> str:
    """The learning curves as one standalone SVG: per task, validation score and mean reward.

    Args:
        reports: step reports, in order (x axis: ``started_at``, else the step index).
        before: validation scores before training, drawn at x = 0.
        after: validation scores after the last step, drawn at the end of the x axis.
        title: the chart's title.
        width / height: the SVG's size in pixels.
    """
    timed = any(r.started_at for r in reports)
    t0 = reports[0].started_at if timed and reports else 0.0

    def x_of(r: StepReport) -> float:
        return (r.started_at + r.step_s - t0) if timed else float(r.step + 1)

    before, after = before or {}, after or {}
    tasks = sorted({t for r in reports for t in (*r.reward, *r.validation)} | set(before) | set(after))
    plot = _Plot(width, height, max([x_of(r) for r in reports] + [1e-9]))
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{plot.left}" y="16" font-size="13">{html.escape(title)}</text>',
        *plot.axes("wall seconds" if timed else "step"),
    ]
    for i, task in enumerate(tasks):
        rew = [(x_of(r), r.reward[task]) for r in reports if task in r.reward]
        val = [(0.0, before[task])] if task in before else []
        val += [(x_of(r), r.validation[task]) for r in reports if task in r.validation]
        val += [(plot.x_max, after[task])] if task in after else []
        out += plot.task(i, task, [p for p in rew if math.isfinite(p[1])], [p for p in val if math.isfinite(p[1])])
    out.append("</svg>")
    return "\n".join(out)


def _nice_step(raw: float) -> float:
    """1, 2 or 5 times a power of ten, at least ``raw``."""
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def _fmt(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"


def report_html(
    reports: Sequence[StepReport],
    *,
    title: str = "rollart_nb run",
    before: dict[str, float] | None = None,
    after: dict[str, float] | None = None,
) -> str:
    """A standalone HTML report: validation before/after, learning curves, the training metrics,
    step times, a table."""
    parts = [f"<h1>{html.escape(title)}</h1>"]
    if before or after:
        tasks = sorted(set(before or {}) | set(after or {}))
        rows = "".join(
            f"<tr><td>{html.escape(t)}</td><td>{_fmt((before or {}).get(t))}</td>"
            f"<td>{_fmt((after or {}).get(t))}</td></tr>"
            for t in tasks
        )
        parts.append(
            f"<h2>Validation (greedy)</h2><table border=1><tr><th>task</th><th>before</th>"
            f"<th>after</th></tr>{rows}</table>"
        )
    try:
        import plotly.io as pio

        for i, fig in enumerate(
            [
                reward_figure(reports),
                task_figure(reports),
                training_figure(reports),
                step_time_figure(reports),
                staleness_figure(reports),
                failures_figure(reports),
                throughput_figure(reports),
            ]
        ):
            parts.append(pio.to_html(fig, full_html=False, include_plotlyjs="cdn" if i else True))
    except ImportError:
        parts.append("<p>(install plotly for charts: pip install 'rollart_nb[nb]')</p>")
    keys = list(reports[0].row()) if reports else []
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(r.row().get(k, '')))}</td>" for k in keys) + "</tr>" for r in reports
    )
    parts.append(
        "<h2>Steps</h2><table border=1><tr>"
        + "".join(f"<th>{html.escape(k)}</th>" for k in keys)
        + f"</tr>{body}</table>"
    )
    return "<html><head><meta charset='utf-8'></head><body>" + "".join(parts) + "</body></html>"
