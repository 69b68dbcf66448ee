"""Ray's chatter stays out of notebook cells; its warnings and errors do not (no Ray is started)."""

from __future__ import annotations

import logging
import os

import pytest

from rollart_nb import _ray_connect


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_serve_info_is_dropped_and_warnings_pass() -> None:
    # What `import ray.serve` does on the driver: its own stderr handler, level INFO, no propagation.
    # The filter must be in place before (sessions start before Serve is imported) and survive it.
    logging_utils = pytest.importorskip("ray.serve._private.logging_utils")
    logger = logging.getLogger(_ray_connect.SERVE_LOGGER)
    cap = _Capture()
    try:
        _ray_connect.quiet_serve_logs(True)
        _ray_connect.quiet_serve_logs(True)  # idempotent
        logging_utils.configure_default_serve_logger()
        assert logger.getEffectiveLevel() == logging.INFO  # Serve's own level: a level alone would not do
        logger.addHandler(cap)
        logger.info("Started Serve in namespace 'serve'.")
        logger.warning("Serve warning")
        logger.error("Serve error")
        assert [r.getMessage() for r in cap.records] == ["Serve warning", "Serve error"]

        _ray_connect.quiet_serve_logs(False)  # what shutdown() does: INFO is back
        cap.records.clear()
        logger.info("Application 'math' is ready.")
        assert [r.getMessage() for r in cap.records] == ["Application 'math' is ready."]
    finally:
        logger.removeHandler(cap)
        _ray_connect.quiet_serve_logs(False)


def test_retry_notices_off_in_quiet_sessions_unless_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    key = _ray_connect.RETRY_NOTICES_ENV
    monkeypatch.delenv(key, raising=False)
    assert _ray_connect._retry_notices_env(quiet=True) == {key: "0"}
    assert _ray_connect._retry_notices_env(quiet=False) == {key: None}  # log_to_driver: Ray's default
    monkeypatch.setenv(key, "1")
    assert _ray_connect._retry_notices_env(quiet=True) == {key: "1"}  # the user's choice wins


def test_retry_notices_setting_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    if _ray_connect.is_initialized() or _ray_connect._saved_env is not None:
        pytest.skip("a session is active in this process")
    monkeypatch.setattr(_ray_connect, "_refresh_ray_config", lambda: None)  # no Ray C++ config in this test
    key = _ray_connect.RETRY_NOTICES_ENV
    monkeypatch.delenv(key, raising=False)
    _ray_connect._set_env(_ray_connect._retry_notices_env(quiet=True))
    assert os.environ[key] == "0"
    _ray_connect.restore_env()
    assert key not in os.environ
