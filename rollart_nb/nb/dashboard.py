"""Live dashboard: plotly figures over a Pipeline's step reports, with run controls.

The figures come from the pure functions of :mod:`rollart_nb.nb.figures`; the dashboard shows
each in an ``ipywidgets.Output`` as a plotly mime bundle (redrawn only when it changed). Live
``FigureWidget`` deltas rendered blank at times in JupyterLab 4 (checked in headless Chromium),
so they are not used. Redraws are driven by the pipeline's ``on_step`` callback and
throttled, so a fast sim run cannot flood the frontend.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import threading
import time
from typing import Any

import ipywidgets as widgets

from rollart_nb.nb import figures

__all__ = ["Dashboard"]

log = logging.getLogger(__name__)

_FIGURES = ("reward", "step_time", "staleness", "throughput", "utilization")


class Dashboard(widgets.VBox):
    """Reward, step-time phases, staleness, pool utilization and throughput of a Pipeline, live;
    the status line adds the run's env faults (restarts, timeouts, abandoned threads), if any.

    Built by ``pipe.dashboard()``. Works outside a running kernel too (the widgets are plain
    objects until displayed), which is how the tests drive it.

    Args:
        pipe: the :class:`~rollart_nb.control.Pipeline` to watch (``reports``, ``trajectories``,
            ``reward_history``, ``step``, ``run``, ``pause``, ``wait``, ``state``).
        throttle_s: at most one redraw per this many seconds; a skipped update is drawn
            when the interval ends, so the last step always shows.
        trajectories_last: how many recent trajectories feed the utilization timeline.
        window_s: the utilization timeline shows this many seconds before the latest event.
        steps: default number of steps for the Resume button.

    Example:
        >>> dash = pipe.dashboard()     # doctest: +SKIP
        >>> dash                        # doctest: +SKIP
        >>> dash.run(20)                # returns at once; Pause stops after the step in progress
    """

    def __init__(
        self,
        pipe: Any,
        throttle_s: float = 0.5,
        *,
        trajectories_last: int = 200,
        window_s: float | None = 60.0,
        steps: int = 10,
    ) -> None:
        self.pipe, self.throttle_s = pipe, float(throttle_s)
        self.trajectories_last, self.window_s = trajectories_last, window_s
        self.redraws = 0
        self._lock = threading.Lock()
        self._last_draw = 0.0
        self._timer: threading.Timer | None = None
        self._worker: threading.Thread | None = None
        self._drawn: dict[str, str] = {}
        try:  # in a kernel: the main thread's loop; widget messages are sent from there only
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self.figures: dict[str, Any] = {}  # name -> the plotly Figure shown
        self.views: dict[str, widgets.Output] = {name: widgets.Output() for name in _FIGURES}
        self.status = widgets.HTML()
        self.pause_button = widgets.Button(description="Pause", icon="pause", tooltip="stop after the step in progress")
        self.resume_button = widgets.Button(
            description="Resume", icon="play", tooltip="run more steps in the background"
        )
        self.step_button = widgets.Button(description="Step", icon="step-forward", tooltip="run one step")
        self.steps_box = widgets.BoundedIntText(
            value=steps, min=1, max=100_000, description="steps", layout=widgets.Layout(width="140px")
        )
        self.pause_button.on_click(lambda _b: self.pause(wait=False))
        self.resume_button.on_click(lambda _b: self.run(self.steps_box.value))
        self.step_button.on_click(lambda _b: self.step(background=True))
        v = self.views
        super().__init__(
            children=[
                widgets.HBox([self.pause_button, self.resume_button, self.step_button, self.steps_box, self.status]),
                widgets.HBox([v["reward"], v["step_time"]]),
                widgets.HBox([v["staleness"], v["throughput"]]),
                v["utilization"],
            ]
        )
        self.add_class("rollart-dashboard")
        self.update(force=True)

    # -- controls ------------------------------------------------------------------------
    def run(self, steps: int) -> None:
        """Start ``pipe.run(steps, background=True)`` redrawing after every step; returns at once.

        Returns None, so a cell ending in ``dash.run(n)`` does not show a second copy of the
        dashboard.
        """
        self.pipe.run(steps, background=True, progress=False, on_step=self._on_step)
        self._set_status()

    def pause(self, wait: bool = True) -> None:
        """Stop the background run after the step in progress.

        Args:
            wait: block until that step has finished (no orphaned work). The Pause button
                does not block the kernel: it waits on a helper thread and redraws after.
        """
        self.pipe.pause()
        self._set_status("pausing after the step in progress ...")
        if wait:
            self.wait()
        else:
            threading.Thread(target=self.wait, name="rollart-dashboard-pause", daemon=True).start()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the background run (and a Step-button step) to end, then redraw."""
        try:
            self.pipe.wait(timeout)
            if self._worker is not None:
                self._worker.join(timeout)
        finally:
            self.update(force=True)

    def step(self, background: bool = False) -> Any:
        """Run one ``pipe.step()``; with ``background=True`` on a thread (the Step button)."""
        if not background:
            rep = self.pipe.step()
            self.update(force=True)
            return rep
        if self._worker is not None and self._worker.is_alive():
            return None
        self._worker = threading.Thread(target=self._step_safely, name="rollart-dashboard-step", daemon=True)
        self._set_status("stepping ...")
        self._worker.start()
        return self._worker

    def _step_safely(self) -> None:
        try:
            self.pipe.step()
        except Exception as e:  # shown in the status line; the kernel must not see a thread die
            log.warning("dashboard step failed: %s", e)
            self._set_status(f"step failed: {e}")
            return
        self.update(force=True)

    def _on_step(self, report: Any) -> None:
        try:
            self.update(report)
        except Exception:  # a drawing bug must never stop training
            log.exception("dashboard update failed")

    # -- drawing -------------------------------------------------------------------------
    def update(self, report: Any = None, *, force: bool = False) -> bool:
        """Redraw from ``pipe.reports`` unless one was drawn less than ``throttle_s`` ago.

        A throttled call schedules one trailing redraw at the end of the interval.

        Args:
            report: the step that triggered the update (the on_step argument; unused: the
                dashboard always draws every report the pipeline holds).
            force: draw now regardless of the throttle.

        Returns:
            True when it redrew now.
        """
        with self._lock:
            wait = self._last_draw + self.throttle_s - time.monotonic()
            if wait > 0 and not force:
                if self._timer is None:
                    self._timer = threading.Timer(wait, self._trailing)
                    self._timer.daemon = True
                    self._timer.start()
                return False
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._last_draw = time.monotonic()
        if self._loop is not None and threading.current_thread() is not threading.main_thread():
            # a background step: hand the drawing to the kernel's thread (zmq sockets are not
            # thread-safe, and widgets created off-thread can lose their messages)
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._draw)
            return True
        self._draw()
        return True

    def _draw(self) -> None:
        try:
            self._redraw()
        except Exception:
            log.exception("dashboard redraw failed")
        finally:  # the interval counts from the end of a draw, so slow draws cannot pile up
            with self._lock:
                self._last_draw = time.monotonic()

    def _trailing(self) -> None:
        with self._lock:
            self._timer = None
        try:
            self.update(force=True)
        except Exception:
            log.exception("dashboard update failed")

    def _redraw(self) -> None:
        reports = list(self.pipe.reports)
        try:
            trajs = list(self.pipe.trajectories(last=self.trajectories_last))
        except Exception as e:  # a closed pipeline keeps its curves; only the timeline stops
            log.debug("no trajectories for the timeline: %s", e)
            trajs = []
        try:
            swaps = list(self.pipe.reward_history())
        except Exception:
            swaps = []
        new = {
            "reward": figures.reward_figure(reports, swaps=swaps),
            "step_time": figures.step_time_figure(reports),
            "staleness": figures.staleness_figure(reports),
            "utilization": figures.utilization_figure(trajs, reports, window_s=self.window_s),
            "throughput": figures.throughput_figure(reports),
        }
        # Each figure goes out as one plotly mime bundle in an Output widget: JupyterLab's plotly
        # renderer draws it reliably, where streamed FigureWidget updates rendered blank at times.
        for name, fig in new.items():
            spec = fig.to_json()
            if spec == self._drawn.get(name):
                continue  # unchanged: no message, no flicker
            self.figures[name], self._drawn[name] = fig, spec
            self.views[name].outputs = (
                {
                    "output_type": "display_data",
                    "metadata": {},
                    "data": {
                        "application/vnd.plotly.v1+json": {**json.loads(spec), "config": {"displaylogo": False}},
                        "text/plain": f"<{name} figure>",
                    },
                },
            )
        self.redraws += 1
        self._set_status()

    def _set_status(self, note: str = "") -> None:
        reports = self.pipe.reports
        last = reports[-1] if reports else None
        parts = [f"<b>{html.escape(str(self.pipe.state))}</b>", f"{len(reports)} step(s)"]
        if last is not None:
            parts.append(f"v{last.version} &middot; {last.step_s:.2f}s/step &middot; reward {last.mean_reward:.3f}")
        faults = figures.env_faults_line(reports)  # env restarts / timeouts: rare, so a line, not a chart
        if faults:
            parts.append(html.escape(faults))
        failover = figures.failover_line(reports)  # replaced generators, restored trainers
        if failover:
            parts.append(f"<span style='color:#d62728'>{html.escape(failover)}</span>")
        if note:
            parts.append(html.escape(note))
        self.status.value = " &middot; ".join(parts)
