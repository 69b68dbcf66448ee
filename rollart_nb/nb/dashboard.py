"""Live dashboard: a Pipeline's progress as plotly figures, a status line, a failure banner, controls.

A daemon thread (the *watcher*) polls the pipeline's ``reports``, ``state`` and ``error`` and
pushes widget updates from that thread, so the plots move whatever the kernel does (IOPub takes
messages from any thread; only the buttons need the main thread). Updates are incremental
(:class:`~rollart_nb.nb.live.LivePlots`) and pushed only once ``throttle_s`` has passed
(stretched to four times the last push's cost) and the browser has drawn the previous push or
``ack_timeout_s`` has passed: fast steps never queue redraws the browser cannot keep up with.
The watcher stops when the pipeline or widget closes, and never raises: a drawing problem is
logged once, and the run goes on.
"""

from __future__ import annotations

import html
import logging
import re
import threading
import time
from typing import Any

import ipywidgets as widgets

from rollart_nb.nb import figures, timeline
from rollart_nb.nb.live import LivePlots, spec_of

__all__ = ["Dashboard"]

log = logging.getLogger(__name__)

_FIGURES = ("reward", "tasks", "training", "failures", "step_time", "staleness", "throughput", "utilization")
_TRAJ = re.compile(r"trajectory ([0-9a-f]{4,})")
_RED, _AMBER = "#b00020", "#8a5a00"


class Dashboard(widgets.VBox):
    """A Pipeline's reward, trainer metrics, failures, step phases, staleness, throughput and pool
    utilization, live, with a status line and a failure banner. Built by ``pipe.dashboard()``.

    Args:
        pipe: the :class:`~rollart_nb.control.Pipeline` to watch.
        throttle_s: at least this long between two figure updates (steps in between coalesce).
        trajectories_last: how many recent trajectories feed the utilization timeline.
        window_s: the utilization timeline shows this many seconds before the latest event.
        steps: default number of steps for the Resume button.
        poll_s: how often the watcher looks at the pipeline.
        timeline_every_s: at least this long between two reads of the trajectories.
        ack_timeout_s: wait at most this long for the browser to draw the last update.
        watch: start the watcher thread (False: updates only on :meth:`update` and the buttons).

    Example:
        >>> dash = pipe.dashboard()              # doctest: +SKIP
        >>> dash                                 # doctest: +SKIP
        >>> pipe.run(200, background=True)       # doctest: +SKIP
        >>> # the plots move while other cells run; Pause stops after the step in progress
    """

    def __init__(
        self,
        pipe: Any,
        throttle_s: float = 0.5,
        *,
        trajectories_last: int = 200,
        window_s: float | None = 60.0,
        steps: int = 10,
        poll_s: float = 0.1,
        timeline_every_s: float = 2.0,
        ack_timeout_s: float = 1.0,
        watch: bool = True,
    ) -> None:
        self.pipe, self.throttle_s, self.poll_s = pipe, float(throttle_s), float(poll_s)
        self.trajectories_last, self.window_s, self.timeline_every_s = trajectories_last, window_s, timeline_every_s
        self.redraws = 0
        self.figures: dict[str, Any] = {}  # name -> the plotly Figure last built
        self.failure: dict[str, str] | None = None  # the run's fatal error: text, type, trajectory
        self._draw_lock = threading.RLock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._drawn_n, self._last_push, self._push_cost = -1, 0.0, 0.0
        self._seen_error: BaseException | None = None
        self._running_until, self._note = 0.0, ""
        self._status_key: tuple[str, ...] = ("",)
        self._segments: dict[tuple[Any, ...], dict[str, Any]] = {}  # timeline segments, in order seen
        self._t0: float | None = None
        self._traj_at = -1e9
        self._swaps: list[dict[str, Any]] = []
        self._worker: threading.Thread | None = None
        self._logged: set[str] = set()

        self.status = widgets.HTML()
        self.banner = widgets.HTML(layout=widgets.Layout(display="none", width="100%"))
        self.plots = LivePlots(
            order=list(_FIGURES), wide=["tasks", "training", "utilization"], ack_timeout_s=ack_timeout_s
        )
        self.plots.on_msg(self._poke)  # a view drew the last update: the next may go at once
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
        controls = widgets.HBox(
            [self.pause_button, self.resume_button, self.step_button, self.steps_box, self.status],
            layout=widgets.Layout(flex_flow="row wrap", align_items="center"),
        )
        super().__init__(children=[controls, self.banner, self.plots], layout=widgets.Layout(width="100%"))
        self.add_class("rollart-dashboard")
        self.update(force=True)
        self._watcher: threading.Thread | None = None
        if watch:
            self._watcher = threading.Thread(target=self._watch, name="rollart-dashboard-watch", daemon=True)
            self._watcher.start()

    # -- controls ------------------------------------------------------------------------
    def run(self, steps: int) -> None:
        """Start ``pipe.run(steps, background=True)``; returns at once (None: a cell ending in
        ``dash.run(n)`` does not show a second copy of the dashboard)."""
        self._note = ""
        try:
            self.pipe.run(steps, background=True, progress=False, on_step=self._poke)
        except Exception as e:  # a button must not raise into the kernel's log: say it instead
            self._note = f"could not start: {e}"
        self._running_until = time.monotonic() + 1.0
        self._poke()

    def pause(self, wait: bool = True) -> None:
        """Stop the background run after the step in progress.

        Args:
            wait: block until that step has finished (no orphaned work). The Pause button does
                not block the kernel; the watcher shows when the run has stopped.
        """
        self.pipe.pause()
        self._note = "pausing after the step in progress …"
        self._poke()
        if wait:
            self.wait()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the background run (and a Step-button step) to end, then update; re-raises
        the run's error (as ``pipe.wait`` does), which the banner keeps showing."""
        try:
            self._see_error(self.pipe.error)  # pipe.wait() hands the error over once: keep it first
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
        self._note = "stepping …"
        self._worker.start()
        return self._worker

    def _step_safely(self) -> None:
        try:
            self.pipe.step()
            self._note = ""
        except Exception as e:  # shown in the banner; the kernel must not see a thread die
            log.warning("dashboard step failed: %s", e)
            self._note = ""
            self._see_error(e)
        self.update(force=True)

    def _poke(self, *_: Any) -> None:
        """Wake the watcher (also the ``on_step`` of runs the dashboard starts)."""
        self._wake.set()

    def close(self) -> None:
        """Stop the watcher and close the widgets."""
        self._stop.set()
        self._wake.set()
        w = self._watcher
        if w is not None and w is not threading.current_thread():
            w.join(timeout=5)
        for child in (self.plots, self.status, self.banner):
            child.close()
        super().close()

    # -- the watcher -----------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                closed = self._tick()
            except Exception as e:  # never into the user's cells: log each kind of problem once
                closed = False
                if type(e).__name__ not in self._logged:
                    self._logged.add(type(e).__name__)
                    log.exception("dashboard update failed (the run is not affected)")
            if closed:
                return
            self._wake.wait(self.poll_s)
            self._wake.clear()

    def _tick(self) -> bool:
        """One look at the pipeline: status at once, figures when due. True once it is closed."""
        self._see_error(self.pipe.error)
        key = self._status()
        closed = key[0] == "closed"
        due = self._due()
        stopped = self._status_key[0] == "running" and key[0] != "running"
        if len(self.pipe.reports) != self._drawn_n and (due or stopped or closed):
            self.update(force=True)
        elif key != self._status_key:
            with self._draw_lock:
                self._show_status(key)
        if stopped or closed:
            with self._draw_lock:
                self.plots.sync()  # the whole state into the model: a reloaded page shows it
        return closed

    def _due(self) -> bool:
        """The throttle interval has passed and the browser has drawn the last push (or its
        answer is overdue)."""
        interval = max(self.throttle_s, 4 * self._push_cost)
        return time.monotonic() - self._last_push >= interval and not self.plots.awaiting_draw()

    # -- drawing -------------------------------------------------------------------------
    def update(self, *_: Any, force: bool = False) -> bool:
        """Send what changed since the last update (status, banner, new points).

        Args:
            force: update now; else only when due.

        Returns:
            True when it updated.
        """
        if not force and not self._due():
            self._poke()  # the watcher draws it when the interval ends
            return False
        with self._draw_lock:
            t = time.monotonic()
            try:
                self._push()
            except Exception:
                log.exception("dashboard update failed")
            self._last_push = time.monotonic()
            self._push_cost = self._last_push - t
            self.redraws += 1
        return True

    def _push(self) -> None:
        reports = list(self.pipe.reports)
        self._drawn_n = len(reports)
        if time.monotonic() - self._traj_at >= self.timeline_every_s or self.pipe.state == "closed":
            self._read_rollout(reports)
        segs = list(self._segments.values())
        built = {
            "reward": figures.reward_figure(reports, swaps=self._swaps),
            "tasks": figures.task_figure(reports),
            "training": figures.training_figure(reports),
            "failures": figures.failed_aborted_figure(reports),
            "step_time": figures.step_time_figure(reports),
            "staleness": figures.staleness_figure(reports),
            "throughput": figures.throughput_figure(reports),
            "utilization": timeline.timeline_figure(
                segs, [e for r in reports for e in r.events], t0=self._t0, window_s=self.window_s
            ),
        }
        self.figures = built
        self.plots.update({name: spec_of(fig) for name, fig in built.items()})
        self._show_status(self._status(), reports)

    def _read_rollout(self, reports: list[Any]) -> None:
        """New timeline segments and the reward swaps (calls into the rollout: not every update)."""
        self._traj_at = time.monotonic()
        try:
            trajs = list(self.pipe.trajectories(last=self.trajectories_last))
        except Exception as e:  # a closed pipeline keeps its curves; only the timeline stops
            log.debug("no trajectories for the timeline: %s", e)
            trajs = []
        for s in timeline.utilization_segments(trajs, reports[-50:]):
            self._segments.setdefault((s["row"], s["kind"], s["start"], s["label"]), s)
        if self.window_s is not None and self._segments:
            # segments long out of the window go, once they are as many as the rest (the timeline
            # is then sent whole, which is rare: the browser keeps no more than about two windows)
            latest = max(s["end"] for s in self._segments.values())
            old = [k for k, s in self._segments.items() if s["end"] < latest - self.window_s]
            if len(old) > max(500, len(self._segments) // 2):
                for k in old:
                    del self._segments[k]
        if self._t0 is None and self._segments:
            self._t0 = min(s["start"] for s in self._segments.values())
        try:
            self._swaps = list(self.pipe.reward_history())
        except Exception:
            pass  # closed: the swaps drawn so far stay

    # -- status and banner -------------------------------------------------------------
    def _see_error(self, err: BaseException | None) -> None:
        if err is None or err is self._seen_error:
            return
        self._seen_error = err
        text = str(err)
        traj = getattr(err, "trajectory", None) or getattr(err, "trajectory_id", None)
        m = _TRAJ.search(text)
        self.failure = {
            "type": type(err).__name__,
            "text": text,
            "trajectory": str(traj) if traj else (m.group(1) if m else ""),
            "after_step": str(len(self.pipe.reports)),
        }
        if not self.failure["trajectory"]:  # e.g. a stalled rollout: name the newest failed trajectory
            self.failure.update(self._last_failed())
        self._poke()

    def _last_failed(self) -> dict[str, str]:
        try:
            last = list(self.pipe.trajectories(status="failed", last=1))
        except Exception:  # closed already: the reports' reasons are all there is
            last = []
        if last:
            return {"trajectory": str(last[-1].id), "reason": str(last[-1].reason)}
        for r in reversed(self.pipe.reports[-5:]):
            for reasons in r.failures.values():
                for reason in reversed(reasons):
                    if m := _TRAJ.search(reason):
                        return {"trajectory": m.group(1), "reason": reason}
        return {}

    def _status(self) -> tuple[str, ...]:
        """(state, note): the pipeline's state as the status line says it."""
        state, now = str(self.pipe.state), time.monotonic()
        if state == "failed":  # the run ended with an error just now: the banner says which
            self._see_error(self.pipe.error)
        if self.failure is not None and len(self.pipe.reports) > int(self.failure["after_step"]):
            self.failure = None  # a later step succeeded: the failure is history
        running = getattr(self.pipe, "running", None)  # a background run in progress
        if state == "running":
            self._running_until = now + 0.5
        elif (
            state == "idle"
            and self.failure is None
            and (
                running if running is not None else now < self._running_until  # between two steps
            )
        ):
            state = "running"
        if state == "closed":
            self._note = ""
        elif self.failure is not None and state != "running":
            state = "failed"
        if state != "running" and self._note.startswith(("pausing", "stepping")):
            self._note = ""
        return state, self._note, str(len(self.pipe.reports))

    def _show_status(self, key: tuple[str, ...], reports: list[Any] | None = None) -> None:
        self._status_key = key
        state, note = key[0], key[1]
        reports = list(self.pipe.reports) if reports is None else reports
        last = reports[-1] if reports else None
        color = {"failed": _RED, "running": "#1a7f37", "closed": "#555"}.get(state, "inherit")
        label = state
        if state == "failed" and self.failure is not None:
            label = f"failed: {self.failure['type']}"
        parts = [f"<b style='color:{color}' class='rollart-state'>{html.escape(label)}</b>", f"{len(reports)} step(s)"]
        if last is not None:
            rate = figures.failure_rate(last)
            parts.append(
                f"v{last.version} &middot; {last.step_s:.2f}s/step &middot; reward {last.mean_reward:.3f}"
                + (f" &middot; {rate:.0%} failed" if rate else "")
            )
        for line in (figures.env_faults_line(reports), figures.failover_line(reports), figures.engines_line(last)):
            if line:
                parts.append(html.escape(line))
        if note:
            parts.append(html.escape(note))
        self.status.value = " &middot; ".join(parts)
        self._show_banner(reports)

    def _show_banner(self, reports: list[Any]) -> None:
        msg, color = "", _AMBER
        if self.failure is not None:
            f, color = self.failure, _RED
            where = f" &middot; trajectory <code>{html.escape(f['trajectory'])}</code>" if f["trajectory"] else ""
            if f.get("reason"):
                where += f": {html.escape(f['reason'][:300])}"
            msg = (
                f"<b>Run failed after step {int(f['after_step']) - 1}: {html.escape(f['type'])}</b>{where}"
                f"<pre style='white-space:pre-wrap;margin:4px 0 0'>{html.escape(f['text'][:2000])}</pre>"
            )
        else:
            tail = reports[-4:]  # the first only says which reasons were already there
            steps = list(zip(tail, figures.step_failures(tail), strict=True))[-3:]
            recent = [(r, new, unnamed) for r, (new, unnamed) in steps if new or unnamed]
            if recent:
                r, new, unnamed = recent[-1]
                kinds: dict[str, int] = {}
                for task, reason in new:
                    kind = f"{task}: {figures.reason_kind(reason, 120)}"
                    kinds[kind] = kinds.get(kind, 0) + 1
                ids = [m.group(1) for _t, reason in new if (m := _TRAJ.search(reason))]
                msg = (
                    f"<b>{len(new) + unnamed} trajector{'y' if len(new) + unnamed == 1 else 'ies'} failed in step "
                    f"{r.step}</b>: "
                    + "; ".join(f"{c} &times; {html.escape(k)}" for k, c in kinds.items())
                    + (f" &middot; e.g. trajectory <code>{html.escape(ids[-1])}</code>" if ids else "")
                    + " &middot; <code>pipe.trajectories(status='failed')</code> shows them"
                )
        value = (
            f"<div class='rollart-banner' style='border-left:4px solid {color};background:{color}14;"
            f"color:{color};padding:6px 10px;margin:4px 0'>{msg}</div>"
            if msg
            else ""
        )
        if value != self.banner.value:
            self.banner.value = value
            self.banner.layout.display = "block" if msg else "none"
