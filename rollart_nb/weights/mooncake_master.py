"""Start, attach to and stop a ``mooncake_master`` (the Mooncake store's metadata server).

Used by :class:`~rollart_nb.weights.mooncake.MooncakeTransport` deployments, tests and the
weight-sync benchmark. Everything binds to loopback unless told otherwise.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from rollart_nb.errors import ConfigError, ConnectError

__all__ = ["MooncakeMaster", "find_master_binary"]

logger = logging.getLogger(__name__)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_master_binary() -> str | None:
    """Path of the ``mooncake_master`` binary shipped in the mooncake wheel, or on PATH."""
    spec = importlib.util.find_spec("mooncake")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "mooncake_master"
        if p.is_file():
            return str(p)
    return shutil.which("mooncake_master")


class MooncakeMaster:
    """Start (or attach to) a ``mooncake_master`` metadata server.

    Every port it opens is bound to ``host``; the embedded HTTP metadata server (which binds
    0.0.0.0 regardless) stays off, as clients use ``P2PHANDSHAKE``.

    Args:
        host: address to bind.
        rpc_port / metrics_port: ports (None: a free one each).
        kv_lease_ttl_ms: object lease after a read; must exceed the slowest bucket transfer.
        binary: path of ``mooncake_master`` (None: :func:`find_master_binary`).
        extra_args: more ``--flag=value`` arguments.

    Example:
        >>> with MooncakeMaster() as master:                         # doctest: +SKIP
        ...     transport = MooncakeTransport(master.address, segment_bytes=4 << 30)
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        rpc_port: int | None = None,
        metrics_port: int | None = None,
        kv_lease_ttl_ms: int | None = None,
        binary: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.host = host
        self.rpc_port = rpc_port or _free_port(host)
        self.metrics_port = metrics_port or _free_port(host)
        self.kv_lease_ttl_ms = kv_lease_ttl_ms
        self.binary = binary
        self.extra_args = list(extra_args)
        self.log_path: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def attach(cls, address: str) -> MooncakeMaster:
        """A handle on a master someone else runs at ``"host:port"`` (``stop`` leaves it alone)."""
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"Mooncake master address must be 'host:port', got {address!r}")
        return cls(host, rpc_port=int(port), metrics_port=0)

    @property
    def address(self) -> str:
        """``host:rpc_port`` for :class:`MooncakeTransport`."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def running(self) -> bool:
        """Whether this object started a master process that is still alive."""
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        """The exact command line :meth:`start` runs."""
        binary = self.binary or find_master_binary()
        if binary is None:
            raise ConnectError(
                "mooncake_master not found; pip install 'rollart_nb[mooncake]' (and apt-get install libibverbs1)"
            )
        cmd = [
            binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            "--enable_http_metadata_server=false",
            "--enable_metric_reporting=false",
        ]
        if self.kv_lease_ttl_ms is not None:
            cmd.append(f"--default_kv_lease_ttl={self.kv_lease_ttl_ms}")
        return cmd + self.extra_args

    def start(self, timeout: float = 30.0) -> MooncakeMaster:
        """Launch the master in its own process group and wait until its RPC port accepts.

        Raises:
            ConnectError: it exited or did not listen within ``timeout`` seconds.
        """
        if self.running:
            return self
        cmd = self.command()
        fd, self.log_path = tempfile.mkstemp(prefix="mooncake_master_", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            # Own session: stop() can kill the whole group, no orphan survives a notebook restart.
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ConnectError(f"mooncake_master exited with {self._proc.returncode}: {self._log_tail()}")
            try:
                with socket.create_connection((self.host, self.rpc_port), timeout=0.5):
                    logger.info("mooncake_master ready at %s (log %s)", self.address, self.log_path)
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise ConnectError(f"mooncake_master did not listen on {self.address} within {timeout}s: {self._log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the process group this object started (SIGTERM, then SIGKILL)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout)
        except ProcessLookupError:
            pass

    def _log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.log_path or "").read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
