"""Run model-written code against hidden tests, with the isolation below Python.

Model-written code is hostile, including code that targets its own grader. A run uses two
processes, each in its own bubblewrap sandbox (see :mod:`rollart_nb.sandbox.isolation`: new
user/PID/network/IPC/UTS/cgroup namespaces, an unprivileged uid, a read-only runtime, a
size-capped tmpfs work directory, an empty environment):

* the **solution** process runs the code, then serves calls to its top-level functions;
* the **grader** process runs the trusted tests. It never holds the code, and the code never
  holds the tests: the solution's functions appear to the tests as stubs that send their
  arguments over a socket and get the results back **as plain data** (None, bool, int, float,
  str, bytes, list, tuple, dict, set, frozenset), decoded by the grader. An object with a
  rigged ``__eq__`` cannot cross; ``==`` and ``!=`` in the tests compare exact types and values,
  recursively (``True`` is not ``1``, ``3.0`` is not ``3``). The verdicts travel on the
  grader's stdout, which only this process reads.

Before any user code runs, the solution's bootstrap sets resource limits: address space
(``memory_mb``), CPU seconds, file size, processes, open files, no core dumps; and adds a
:pep:`578` audit hook refusing sockets, process creation, signals to others and ``ctypes``, as
a second layer (the boundary is the OS). At the wall-clock deadline both sandboxes are killed,
and everything in their PID namespaces dies with them. Output is read as it comes: the first
``max_output`` characters of each stream are kept, and a program that writes more than
``_MAX_DRAIN`` bytes is stopped.

Test format: ``tests`` is Python source. Each top-level ``assert`` is one test; each top-level
``def test_*()`` is one test (called after all top-level statements); other statements
(imports, helpers) are setup run in order. Tests see the solution's top-level functions (called
across the boundary with data arguments; mutations of arguments do not come back; a builtin
exception type it raises comes back as that type, others as ``SolutionError``) and its top-level
plain-data values. Names that shadow Python builtins are not handed to the tests.

``isolation="none"`` runs both processes without bubblewrap (audit hook, rlimits, empty
environment and process groups only). It warns every time: use it only where the code is yours.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field

import rollart_nb.sandbox.isolation as iso
import rollart_nb.sandbox.seccomp as seccomp
from rollart_nb.errors import ConfigError
from rollart_nb.sandbox.child import GRADER, SOLUTION, read_verdicts, split_tests

__all__ = ["ISOLATION_MODES", "SandboxResult", "arun_sandboxed", "run_sandboxed"]

log = logging.getLogger(__name__)

ISOLATION_MODES = ("bwrap", "none")
_MAX_OUTPUT = 10_000  # characters of stdout/stderr kept per stream
_MAX_DRAIN = 4 * 1024 * 1024  # bytes of output after which the program is stopped
_GRACE_S = 0.2  # how long the solution may take to exit after the grader is done
MAX_TIMEOUT_S = 86_400  # the longest wall clock one run may get
MIN_MEMORY_MB, MAX_MEMORY_MB = 32, 1 << 20  # the address space one run may get (MiB)


@dataclass
class SandboxResult:
    """What happened to one sandboxed run.

    Attributes:
        passed: tests that passed.
        total: tests in ``tests`` (counted by the parent, not reported by a child).
        stdout: the program's own output, truncated.
        stderr: its error output, truncated.
        timed_out: the wall-clock timeout killed it.
        error: why the run as a whole failed ("" if it ran to the end).
        failures: one "index: reason" line per failed test.
    """

    passed: int
    total: int
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    error: str = ""
    failures: list[str] = field(default_factory=list)

    @property
    def score(self) -> float:
        """Fraction of tests passed (0.0 when there are none)."""
        return self.passed / self.total if self.total else 0.0


def _check_args(timeout_s: float, memory_mb: int, isolation: str) -> None:
    problems = []
    if not (isinstance(timeout_s, int | float) and 0 < timeout_s <= MAX_TIMEOUT_S):
        problems.append(f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S}], got {timeout_s!r}")
    if not (isinstance(memory_mb, int) and MIN_MEMORY_MB <= memory_mb <= MAX_MEMORY_MB):
        problems.append(f"memory_mb must be an int in [{MIN_MEMORY_MB}, {MAX_MEMORY_MB}], got {memory_mb!r}")
    if isolation not in ISOLATION_MODES:
        problems.append(f"isolation must be one of {ISOLATION_MODES}, got {isolation!r}")
    if problems:
        raise ConfigError(problems, where="run_sandboxed")


def _warn_unisolated() -> None:
    msg = (
        "run_sandboxed(isolation='none'): model-written code runs WITHOUT OS isolation (only an "
        "audit hook and rlimits, which hostile code can get around); use it only for code you wrote"
    )
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    log.warning(msg)


def _piped(reader: asyncio.StreamReader | None) -> asyncio.StreamReader:
    """``reader``, which ``_spawn`` always creates (every output of a sandboxed process is a pipe)."""
    if reader is None:
        raise RuntimeError("a sandboxed process was started without an output pipe")
    return reader


class _Stream:
    """Reads one pipe to its end, keeping the first ``keep`` bytes."""

    def __init__(
        self, reader: asyncio.StreamReader, keep: int, budget: list[int], over: asyncio.Event | None = None
    ) -> None:
        self.reader, self.keep, self.budget = reader, keep, budget
        self.data = bytearray()
        self.over = over or asyncio.Event()

    async def pump(self) -> None:
        while chunk := await self.reader.read(65536):
            if len(self.data) < self.keep:
                self.data += chunk[: self.keep - len(self.data)]
            self.budget[0] -= len(chunk)
            if self.budget[0] < 0:
                self.over.set()
                return

    def text(self) -> str:
        return self.data.decode(errors="replace")


async def _spawn(
    isolation: str, boot: str, channel: int, cwd: str, procs: list[asyncio.subprocess.Process]
) -> asyncio.subprocess.Process:
    """Start one sandboxed process (recorded in ``procs`` at once, so a cancelled caller can kill it)."""
    if isolation == "none":
        argv, fds = [sys.executable, "-I", "-S", "-B", "-c", boot], [channel]
    else:
        filt = seccomp.program_fd()
        fds = [channel] + ([filt] if filt is not None else [])
        argv = iso.code_argv([iso.python_runtime().executable, "-I", "-S", "-B", "-c", boot], seccomp_fd=filt)
    try:
        # No secret of ours reaches the child: bubblewrap (and setpriv) need PATH only, and the
        # sandbox itself starts from --clearenv; without bubblewrap the child gets nothing.
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=cwd,
            env={} if isolation == "none" else {"PATH": "/usr/bin:/bin"},
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            pass_fds=fds,
        )
    finally:
        for fd in fds[1:]:
            os.close(fd)
    procs.append(proc)
    return proc


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError):  # it died at once; its exit status says why
        pass
    finally:
        proc.stdin.close()


def _kill(proc: asyncio.subprocess.Process | None) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # it leads its own session, so pgid == pid
    except (ProcessLookupError, PermissionError):
        pass


async def arun_sandboxed(
    code: str,
    tests: str,
    timeout_s: float = 5,
    memory_mb: int = 256,
    *,
    isolation: str = "bwrap",
    audit_hook: bool = True,
    max_output: int = _MAX_OUTPUT,
) -> SandboxResult:
    """:func:`run_sandboxed` for event loops: awaits the sandboxes without blocking the loop.
    Cancelling it kills both sandboxes."""
    _check_args(timeout_s, memory_mb, isolation)
    if isolation == "none":
        _warn_unisolated()
    return await _arun(code, tests, timeout_s, memory_mb, isolation, audit_hook, max_output)


def _streams(sol: asyncio.subprocess.Process, grd: asyncio.subprocess.Process, max_output: int) -> list[_Stream]:
    """The solution's stdout and stderr, then the grader's; the solution's two share one budget."""
    flooded = asyncio.Event()
    budget = [_MAX_DRAIN]
    return [
        _Stream(_piped(reader), keep, share, over)
        for reader, keep, share, over in (
            (sol.stdout, max_output, budget, flooded),
            (sol.stderr, max_output, budget, flooded),
            (grd.stdout, 1 << 20, [1 << 22], None),
            (grd.stderr, max_output, [1 << 22], None),
        )
    ]


async def _await_grader(
    graded: asyncio.Future, flood: asyncio.Future, sol: asyncio.subprocess.Process, deadline: float
) -> tuple[bool, bool]:
    """Wait until the grader is done (then the solution, a grace period), the deadline passes or
    the solution floods its output: ``(timed_out, killed_for_output)``."""
    timed_out = killed_for_output = False
    pending: set[asyncio.Future] = {graded, flood}
    try:
        while not graded.done():  # the solution may end first (e.g. it failed to load)
            done, pending = await asyncio.wait(
                pending, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                timed_out = True
                break
            if flood in done:
                killed_for_output = True
                break
        if graded.done():
            await asyncio.wait_for(sol.wait(), min(_GRACE_S, max(0.0, deadline - time.monotonic())))
    except TimeoutError:
        pass  # the solution outlived the grader: killed by the caller
    return timed_out, killed_for_output


async def _reap(procs: list[asyncio.subprocess.Process], pumps: list[asyncio.Task[None]]) -> None:
    """Kill both sandboxes, then read their pipes to the end."""
    for p in procs:
        _kill(p)
    await asyncio.wait(pumps, timeout=1.0)  # everything in the sandboxes is dead: pipes close
    for p in procs:
        try:
            await asyncio.wait_for(p.wait(), 1.0)
        except TimeoutError:
            pass


def _release(procs: list[asyncio.subprocess.Process], tasks: list[asyncio.Future]) -> None:
    """Nothing of a run outlives it, even a cancelled one: its processes, tasks and pipes."""
    for p in procs:
        _kill(p)
    for t in tasks:
        t.cancel()
    for p in procs:  # close the pipes now, not when the loop is gone
        transport = getattr(p, "_transport", None)
        if transport is not None:
            transport.close()


async def _arun(
    code: str, tests: str, timeout_s: float, memory_mb: int, isolation: str, audit_hook: bool, max_output: int
) -> SandboxResult:
    steps, bound = split_tests(tests)
    if isolation == "bwrap":  # one-time checks before the clock starts
        iso.require_bwrap()
        iso.python_runtime()
    a, b = socket.socketpair()
    fd_a, fd_b = a.fileno(), b.fileno()  # the children see the channel under the same numbers
    limits = {
        "mem": memory_mb * 1024 * 1024,
        "cpu": max(1, math.ceil(timeout_s)) + 1,
        "fsize": 8 * 1024 * 1024,
        "nofile": 32,
        "nproc": 16,
    }
    sol_in = (json.dumps({**limits, "fd": fd_a, "hook": audit_hook}) + "\n" + code).encode("utf-8", "replace")
    grd_in = (json.dumps({**limits, "fd": fd_b, "bound": bound}) + "\n" + json.dumps(steps) + "\n").encode()
    workdir = tempfile.mkdtemp(prefix="rollart_sandbox_") if isolation == "none" else "/"
    procs: list[asyncio.subprocess.Process] = []
    streams: list[_Stream] = []
    tasks: list[asyncio.Future] = []
    deadline = time.monotonic() + timeout_s
    try:
        sol = await _spawn(isolation, SOLUTION, fd_a, workdir, procs)
        grd = await _spawn(isolation, GRADER, fd_b, workdir, procs)
        a.close()
        b.close()
        streams = _streams(sol, grd, max_output)
        pumps = [asyncio.ensure_future(st.pump()) for st in streams]
        flood = asyncio.ensure_future(streams[0].over.wait())
        graded = asyncio.ensure_future(grd.wait())
        tasks += [
            *pumps,
            flood,
            graded,
            asyncio.ensure_future(_feed(sol, sol_in)),
            asyncio.ensure_future(_feed(grd, grd_in)),
        ]
        timed_out, killed_for_output = await _await_grader(graded, flood, sol, deadline)
        await _reap(procs, pumps)
    finally:
        _release(procs, tasks)
        a.close()
        b.close()
        if isolation == "none":
            shutil.rmtree(workdir, ignore_errors=True)
    tested = {i for i, (kind, _) in enumerate(steps) if kind in ("test", "call")}
    return _collect(streams, tested, procs[0], timed_out, killed_for_output, timeout_s)


def _collect(
    streams: list[_Stream],
    tests: set[int],
    sol: asyncio.subprocess.Process | None,
    timed_out: bool,
    killed_for_output: bool,
    timeout_s: float,
) -> SandboxResult:
    passed, failures, error, done = read_verdicts(streams[2].text(), tests)
    if timed_out:
        error = f"timed out after {timeout_s:g}s"
    elif killed_for_output:
        error = f"wrote more than {_MAX_DRAIN // 2**20} MiB of output; stopped"
    elif not done and not error:
        error = "the grader did not finish: " + (streams[3].text().strip()[-300:] or "no output")
    rc = sol.returncode if sol is not None else None
    if rc is not None and not done and not timed_out and rc not in (0, -signal.SIGKILL, 128 + signal.SIGKILL):
        sig = -rc if rc < 0 else rc - 128 if rc > 128 else 0
        if sig:
            try:
                name = signal.Signals(sig).name
            except ValueError:  # a real-time signal, or an exit status that only looks like one
                name = f"signal {sig}"
            error += f" (solution killed by {name}: CPU or memory limit?)"
    return SandboxResult(
        passed=len(passed),
        total=len(tests),
        stdout=streams[0].text(),
        stderr=streams[1].text(),
        timed_out=timed_out,
        error=_clean(error),
        failures=[_clean(f) for f in failures],
    )


def _clean(text: str) -> str:
    """Text from a child, safe to print anywhere (lone surrogates replaced)."""
    return text.encode("utf-8", "replace").decode()


def run_sandboxed(
    code: str,
    tests: str,
    timeout_s: float = 5,
    memory_mb: int = 256,
    *,
    isolation: str = "bwrap",
    audit_hook: bool = True,
    max_output: int = _MAX_OUTPUT,
) -> SandboxResult:
    """Run ``code`` then ``tests`` in two sandboxes; see the module docstring.

    Safe to call from any thread, including one whose event loop is running (a notebook cell):
    the sandboxes are driven on a private loop in a helper thread.

    Args:
        code: the untrusted program (e.g. a model's function definition).
        tests: trusted test source: top-level asserts and/or ``def test_*()`` functions.
        timeout_s: wall-clock limit of the whole run; everything in the sandboxes is killed then.
        memory_mb: address-space limit of each process.
        isolation: ``"bwrap"`` (default; OS isolation) or ``"none"`` (no OS isolation; warns).
        audit_hook: add the in-process audit hook as a second layer (turn off only to test the
            OS boundary alone).
        max_output: characters of the program's stdout and of its stderr kept.

    Returns:
        A :class:`SandboxResult`; it never raises for anything the code does.

    Raises:
        ConfigError: a bad argument.
        SandboxError: bubblewrap cannot run here (the message says how to fix it).

    Example:
        >>> r = run_sandboxed("def add(a, b):\\n    return a + b", "assert add(1, 2) == 3")
        >>> (r.passed, r.total)
        (1, 1)
    """
    _check_args(timeout_s, memory_mb, isolation)
    if isolation == "none":
        _warn_unisolated()
    box: dict[str, object] = {}

    def main() -> None:
        try:
            box["result"] = asyncio.run(_arun(code, tests, timeout_s, memory_mb, isolation, audit_hook, max_output))
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=main, name="rollart-sandbox", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
