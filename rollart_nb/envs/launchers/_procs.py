"""What launchers share: the Replica record, env specs, and process plumbing for local replicas."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollart_nb.errors import ConfigError

__all__ = ["Replica", "env_spec"]

log = logging.getLogger(__name__)


@dataclass
class Replica:
    """One env-server replica as a launcher shows it.

    Attributes:
        index: slot number (stable across restarts).
        id: the replica id its answers carry (``info["replica"]``).
        url: base URL ("" until it listens).
        pid: process id (local) or None (Kubernetes).
        state: "starting", "up", "unhealthy", "dead", "failed" (gave up restarting) or "stopped".
        restarts: how many times the monitor replaced it.
        last_error: why it last went down.
    """

    index: int
    id: str
    url: str = ""
    pid: int | None = None
    state: str = "starting"
    restarts: int = 0
    last_error: str = ""


def env_spec(env: Any) -> str:
    """``"module:Class"`` for a spec string or a class (the form ``env-server --env`` takes)."""
    if isinstance(env, str):
        if ":" not in env:
            raise ConfigError(f"env {env!r} is not 'module:Class' (e.g. rollart_nb.envs:CodeTask)")
        return env
    if isinstance(env, type):
        if env.__module__ == "__main__" or "<locals>" in env.__qualname__:
            raise ConfigError(
                f"env class {env.__qualname__} is defined in a notebook or function; move it to a "
                "module the replicas can import and pass 'module:Class'"
            )
        return f"{env.__module__}:{env.__qualname__}"
    raise ConfigError(
        f"env must be 'module:Class' or a class, got {type(env).__name__} (pass the class and "
        "its constructor arguments as kwargs=...)"
    )


def _read_stdout(popen: subprocess.Popen[bytes], p: Any, log_path: str) -> None:
    """Find the LISTENING line, then keep draining stdout into the log (a full pipe would
    block the server on an env's print)."""
    assert popen.stdout is not None
    with open(log_path, "ab") as logf:
        for line in popen.stdout:
            if not p.listening.is_set() and line.startswith(b"LISTENING "):
                p.rep.url = line.split()[1].decode()
                p.listening.set()
            else:
                logf.write(line)
                logf.flush()


def _healthy(url: str, timeout_s: float) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/v1/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the replica's own session: bwrap and everything under it
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _terminate(popen: subprocess.Popen[bytes] | None, grace_s: float = 3.0) -> None:
    if popen is None:
        return
    if popen.poll() is None:
        _killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            _killpg(popen.pid, signal.SIGKILL)
    try:
        popen.wait(grace_s)
    except subprocess.TimeoutExpired:
        log.warning("env-server process %d did not exit after SIGKILL", popen.pid)


def _stop_all(popens: dict[int, subprocess.Popen[bytes]], stop: threading.Event, log_dir: str, state_path: str) -> None:
    """Finalizer (close(), garbage collection or exit): stop the monitor and every replica."""
    import shutil

    stop.set()
    for popen in list(popens.values()):
        _terminate(popen, grace_s=2.0)
    popens.clear()
    shutil.rmtree(log_dir, ignore_errors=True)
    try:
        os.unlink(state_path)
    except FileNotFoundError:
        pass  # never written: the launcher closed before a replica came up


def _tail(log_dir: str, rid: str, n: int = 15) -> str:
    try:
        lines = Path(log_dir, f"{rid}.log").read_text(errors="replace").splitlines()
    except OSError:
        return "    (no log)"
    return "\n".join("    " + ln for ln in lines[-n:]) or "    (empty)"
