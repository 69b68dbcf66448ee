"""A widget that follows the session's worker logs live (``sess.log_tail()``).

A daemon thread reads what was added to the log files every ``poll_s``
(:class:`~rollart_nb.logs.LogFollower`) and updates the widget at most once per look, so a
chatty worker never floods the page. Lines are HTML-escaped and redacted.
"""

from __future__ import annotations

import heapq
import html
import itertools
import logging
import threading
from collections import deque

import ipywidgets as widgets

from rollart_nb.logs import LogFollower, worker_matches

__all__ = ["LogTailWidget"]

log = logging.getLogger(__name__)

_ALL = ""


class LogTailWidget(widgets.VBox):
    """The session's worker logs, live: a scrolling pane, a worker filter, Pause and Clear.

    Args:
        log_dir: the session's log directory (``sess.log_dir``).
        worker: show only this worker's lines, e.g. ``"pipeline.rollout"``; None: every worker's.
        last: lines kept and shown per worker, also those of each existing file it starts with.
        poll_s: how often the files are looked at.
        height: CSS height of the scrolling pane.
        watch: start the polling thread (False: the pane changes only on :meth:`refresh`).

    Example:
        >>> tail = sess.log_tail("rollout")                            # doctest: +SKIP
        >>> tail                                                       # doctest: +SKIP
        >>> tail.close()                                               # doctest: +SKIP
    """

    def __init__(
        self,
        log_dir: str,
        worker: str | None = None,
        last: int = 200,
        poll_s: float = 1.0,
        *,
        height: str = "24em",
        watch: bool = True,
    ) -> None:
        self.log_dir, self.last, self.poll_s, self.height = log_dir, max(int(last), 1), float(poll_s), height
        self.follower = LogFollower(log_dir, last=self.last)
        self.updates = 0  # how many times the pane changed
        self._lines: dict[str, deque[tuple[int, str, str]]] = {}  # worker -> (arrival number, worker, line)
        self._count = itertools.count()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._paused = False
        self._logged: set[str] = set()
        self._shown = ""
        self._syncing = False

        self.pane = widgets.HTML()
        self.worker_filter = widgets.Dropdown(
            options=self._options([], worker or _ALL), value=worker or _ALL, description="worker"
        )
        self.pause_button = widgets.Button(description="Pause", icon="pause", tooltip="stop following the logs")
        self.clear_button = widgets.Button(description="Clear", icon="eraser", tooltip="empty the pane")
        self.info = widgets.HTML()
        self.worker_filter.observe(lambda _c: self._syncing or self._render(), names="value")
        self.pause_button.on_click(lambda _b: self.resume() if self._paused else self.pause())
        self.clear_button.on_click(lambda _b: self.clear())
        controls = widgets.HBox(
            [self.worker_filter, self.pause_button, self.clear_button, self.info],
            layout=widgets.Layout(flex_flow="row wrap", align_items="center"),
        )
        super().__init__(children=[controls, self.pane], layout=widgets.Layout(width="100%"))
        self.add_class("rollart-log-tail")
        self.refresh()
        self._thread: threading.Thread | None = None
        if watch:
            self._thread = threading.Thread(target=self._follow, name="rollart-log-tail", daemon=True)
            self._thread.start()

    # -- what it shows -------------------------------------------------------------------
    @property
    def worker(self) -> str | None:
        """The worker whose lines are shown (None: all)."""
        return self.worker_filter.value or None

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def text(self) -> str:
        """The lines shown now, oldest first (``[worker] line`` when several workers are shown)."""
        with self._lock:
            shown = [w for w in self._lines if worker_matches(self.worker, w)]
            lines = list(heapq.merge(*(self._lines[w] for w in shown)))[-self.last :]
            return "\n".join(f"[{w}] {ln}" if len(shown) > 1 else ln for _n, w, ln in lines)

    # -- controls ------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Read what the files gained and show it (one update at most). True when the pane
        changed; nothing while paused."""
        if self._paused:
            return False
        with self._lock:
            for worker, line in self.follower.poll():
                self._lines.setdefault(worker, deque(maxlen=self.last)).append((next(self._count), worker, line))
            self._sync_workers()
            return self._render()

    def pause(self) -> None:
        """Stop following (the pane stays as it is); :meth:`resume` catches up on what came."""
        self._paused = True
        self.pause_button.description, self.pause_button.icon = "Resume", "play"
        self._render()

    def resume(self) -> None:
        """Follow again, starting with what came while paused."""
        self._paused = False
        self.pause_button.description, self.pause_button.icon = "Pause", "pause"
        self.refresh()

    def clear(self) -> None:
        """Empty the pane; lines that come later show as usual."""
        with self._lock:
            self._lines.clear()
            self._render()

    def close(self) -> None:
        """Stop the polling thread and close the widgets."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
        for child in (self.pane, self.worker_filter, self.pause_button, self.clear_button, self.info):
            child.close()
        super().close()

    # -- the thread ----------------------------------------------------------------------
    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.comm is None:  # the widget was closed (its comm too): nobody can see it
                return
            try:
                self.refresh()
            except Exception as e:  # never into the user's cells: log each kind of problem once
                if type(e).__name__ not in self._logged:
                    self._logged.add(type(e).__name__)
                    log.exception("log tail update failed")

    # -- drawing -------------------------------------------------------------------------
    def _sync_workers(self) -> None:
        """The dropdown lists the log files present (new options reset a Dropdown's value: keep it)."""
        options = self._options(self.follower.workers, self.worker_filter.value)
        if options != list(self.worker_filter.options):
            self._syncing = True
            try:
                selected = self.worker_filter.value  # read last: a choice made meanwhile is kept
                self.worker_filter.options = self._options(self.follower.workers, selected)
                self.worker_filter.value = selected
            finally:
                self._syncing = False

    def _options(self, workers: list[str], selected: str) -> list[tuple[str, str]]:
        options = [("all workers", _ALL)] + [(w, w) for w in workers]
        if selected and selected not in workers:  # a part of a name (or a worker yet to log)
            options.append((selected, selected))
        return options

    def _render(self) -> bool:
        with self._lock:
            text = self.text
            n = len(text.splitlines())
            state = " &middot; paused" if self._paused else ""
            self.info.value = (
                f"<span style='color:#555'>{n} line(s) &middot; {len(self._lines)} worker(s){state}</span>"
            )
            if text == self._shown:
                return False
            self._shown = text
            # column-reverse keeps the scroll at the bottom, where the newest line is
            self.pane.value = (
                f"<div style='max-height:{html.escape(self.height)};overflow:auto;display:flex;"
                f"flex-direction:column-reverse;border:1px solid #ddd'>"
                f"<pre style='margin:0;padding:4px 6px;white-space:pre-wrap'>{html.escape(text)}</pre></div>"
            )
            self.updates += 1
            return True
