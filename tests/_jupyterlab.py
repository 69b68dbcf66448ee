"""What the browser tests share: JupyterLab on 127.0.0.1 (random port, a token, a temp root) and
Debian's Chromium driven by Playwright's Python API (no Playwright browser download)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("ROLLART_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def skip_without_a_browser() -> None:
    """Skip the calling test (or fixture) unless Chromium, Playwright and JupyterLab are here."""
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        pytest.skip("needs Debian chromium (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="needs the playwright Python package")
    pytest.importorskip("jupyterlab", reason="needs jupyterlab")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyterlab(root: Path, env: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
    """JupyterLab serving ``root``; yields ``{"base", "token", "root"}`` and stops it afterwards."""
    port, token = free_port(), secrets.token_hex(16)
    full_env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(root / ".jupyter"),
        JUPYTER_RUNTIME_DIR=str(root / ".runtime"),
        JUPYTERLAB_WORKSPACES_DIR=str(root / ".workspaces"),
        **(env or {}),
    )
    log = open(root / "lab.log", "w")  # noqa: SIM115  (closed below)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            "--allow-root",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        cwd=root,
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    log.flush()
                    pytest.fail(f"JupyterLab did not start:\n{(root / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield {"base": base, "token": token, "root": root}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def chromium_context(pw: Any, profile: Path, *, width: int = 1500, height: int = 1000) -> Any:
    """A headless Chromium context (Debian's binary) from a Playwright instance."""
    return pw.chromium.launch_persistent_context(
        str(profile),
        executable_path=CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium"),
        headless=True,
        viewport={"width": width, "height": height},
        args=CHROMIUM_ARGS,
    )
