"""Background weight puller for generation workers.

A :class:`WeightPuller` watches a transport for a newer version and pulls it on a background
thread while the worker keeps generating with the weights it has. Between requests the worker
calls :meth:`WeightPuller.poll`, which returns a complete, verified newer state dict or
``None``; it never hands out a half-loaded version. A version that turns out missing, partial
or corrupt is logged and skipped: the worker keeps serving the previous one.

Time spent in the background counts as ``pull_s``; time the worker blocks in
:meth:`WeightPuller.wait_for` (the pipeline's sync point) counts as ``exposed_pull_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from rollart_nb.errors import StateError, WeightSyncError
from rollart_nb.protocols import WeightTransport
from rollart_nb.weights.metrics import WeightSyncMetrics

__all__ = ["WeightPuller"]

logger = logging.getLogger(__name__)


class WeightPuller:
    """Pull the newest weight version in the background; swap only complete versions.

    Args:
        transport: any :class:`~rollart_nb.protocols.WeightTransport`.
        current_version: version the worker already serves (newer ones get pulled).
        poll_interval_s: how often the thread asks ``transport.latest()``.
        max_attempts: tries per version before it is skipped for good.

    Example:
        >>> with WeightPuller(transport, current_version=0) as puller:   # doctest: +SKIP
        ...     while serving:
        ...         state = puller.poll()
        ...         if state is not None:
        ...             backend.load_weights(state, puller.current_version)
        ...         serve_one_request()
    """

    def __init__(
        self,
        transport: WeightTransport,
        *,
        current_version: int = -1,
        poll_interval_s: float = 0.2,
        max_attempts: int = 3,
    ) -> None:
        self.transport = transport
        self.poll_interval_s = poll_interval_s
        self.max_attempts = max_attempts
        self.current_version = current_version
        self._cond = threading.Condition()
        self._ready: tuple[int, dict[str, Any]] | None = None
        self._pulling: int | None = None
        self._failures: dict[int, int] = {}
        self._metrics = WeightSyncMetrics(version=current_version)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> WeightPuller:
        """Start the background thread (idempotent)."""
        if self._stop.is_set():
            raise StateError("WeightPuller is closed; create a new one")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollart-weight-puller", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the thread; a pull in flight finishes first (transports cannot be interrupted)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> WeightPuller:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- worker side -----------------------------------------------------------------------
    def kick(self) -> None:
        """Look for a new version now instead of at the next poll interval (e.g. after a publish)."""
        self._wake.set()

    @property
    def pulling(self) -> int | None:
        """Version being pulled right now, or None."""
        return self._pulling

    def poll(self) -> dict[str, Any] | None:
        """Non-blocking: a complete, verified state newer than :attr:`current_version`, or None.

        On a hit, :attr:`current_version` becomes the returned version.
        """
        with self._cond:
            if self._ready is None or self._ready[0] <= self.current_version:
                return None
            version, state = self._ready
            self._ready = None
            self.current_version = version
            return state

    def wait_for(self, min_version: int, timeout: float | None = None) -> dict[str, Any] | None:
        """Block until a version >= ``min_version`` is ready; the wait counts as exposed time.

        Returns:
            The new state, or None when :attr:`current_version` is already >= ``min_version``.

        Raises:
            WeightSyncError: nothing new enough arrived within ``timeout`` seconds.
        """
        if self.current_version >= min_version:
            return None
        self.start()
        self._wake.set()
        t0 = time.perf_counter()
        deadline = None if timeout is None else t0 + timeout
        with self._cond:
            while self._ready is None or self._ready[0] < min_version:
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    self._metrics.exposed_pull_s += time.perf_counter() - t0
                    raise WeightSyncError(
                        f"weight version {min_version} did not arrive within {timeout}s "
                        f"(serving {self.current_version}); check that the trainer published it"
                    )
                self._cond.wait(left if left is not None else 1.0)
                self._wake.set()
            self._metrics.exposed_pull_s += time.perf_counter() - t0
        return self.poll()

    @property
    def metrics(self) -> WeightSyncMetrics:
        """Counters since the last :meth:`take_metrics`."""
        return self._metrics

    def take_metrics(self) -> WeightSyncMetrics:
        """Return this step's counters and start new ones."""
        with self._cond:
            m, self._metrics = self._metrics, WeightSyncMetrics(version=self._metrics.version)
            return m

    # ---- background thread -----------------------------------------------------------------
    def _newest_known(self) -> int:
        with self._cond:
            ready = self._ready[0] if self._ready is not None else -1
        return max(self.current_version, ready)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                latest = self.transport.latest()
            except Exception as e:  # a flaky control path must not kill the thread
                logger.warning("weight puller: latest() failed (%s); retrying", e)
                latest = None
            if latest is not None and latest > self._newest_known() and self._should_try(latest):
                self._pull(latest)
                continue  # a newer version may have landed while we pulled
            self._wake.wait(self.poll_interval_s)
            self._wake.clear()

    def _should_try(self, version: int) -> bool:
        return self._failures.get(version, 0) < self.max_attempts

    def _pull(self, version: int) -> None:
        self._pulling = version
        t0 = time.perf_counter()
        try:
            state = self.transport.pull(version)
        except Exception as e:  # WeightSyncError or a transport failure: keep serving the old version
            n = self._failures[version] = self._failures.get(version, 0) + 1
            logger.warning(
                "weight version %d could not be loaded (attempt %d/%d): %s; still serving version %d",
                version,
                n,
                self.max_attempts,
                e,
                self._newest_known(),
            )
            return
        finally:
            self._pulling = None
            with self._cond:
                self._metrics.pull_s += time.perf_counter() - t0
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        with self._cond:
            # Replace an older ready-but-unclaimed version: only the newest matters.
            if self._ready is None or self._ready[0] < version:
                self._ready = (version, state)
            self._metrics.bytes += nbytes
            self._metrics.pulls += 1
            self._metrics.version = max(self._metrics.version, version)
            self._cond.notify_all()
