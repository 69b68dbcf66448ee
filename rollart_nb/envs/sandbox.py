"""Run model-written code against hidden tests in a locked-down subprocess.

Layers, outermost first (each one is cheap and catches a different accident):

* a fresh temporary directory as the working directory, deleted afterwards;
* ``python -I -S``: no user site, no site-packages, no ``PYTHON*`` variables, no script
  directory on ``sys.path``; an **empty environment**, so no secret of the parent leaks;
* its own session / process group, killed as a whole at the wall-clock timeout;
* resource limits (address space, CPU seconds, open files, file size, no core dumps),
  set by the trusted bootstrap before any user code runs. (Not via ``preexec_fn``: that
  is unsafe when the parent has threads, and Ray workers and ``asyncio.to_thread`` do.)
* an audit hook (:pep:`578`, cannot be removed once added) installed by the bootstrap that
  refuses sockets, process creation (fork/exec/spawn/system/Popen), signals to other
  processes, ``ctypes``, and any file outside the temp directory and the standard library.

This is best effort: it keeps honest mistakes and casual escapes (infinite loops, memory
bombs, network calls, reading ``/proc/<parent>/environ``) away from the host, but a
determined adversary inside CPython can tamper with its own interpreter. Untrusted code at
scale belongs in a container or gVisor pod (the k8s env runtime).

Test format: ``tests`` is Python source. Each top-level ``assert`` is one test; each
top-level ``def test_*()`` is one test (called after all top-level statements); other
statements (imports, helpers) are setup run in order. Tests see the solution's globals.
"""

from __future__ import annotations

import ast
import asyncio
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SandboxResult", "arun_sandboxed", "run_sandboxed"]

_MAX_OUTPUT = 10_000  # characters of stdout/stderr kept; model code can print a lot

_BOOTSTRAP = r"""
import os, sys, resource, json

def _limits(mem, cpu, fsize, nofile):
    for lim, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu),
                     (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, nofile),
                     (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(lim, (val, val))

def _hook_factory(cwd, roots):
    blocked = frozenset(("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
        "socket.sendto", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
        "os.system", "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "ctypes.dlopen",
        "os.chroot", "os.setuid"))
    blocked_imports = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "socket", "_socket",
        "subprocess", "multiprocessing", "ssl", "urllib.request", "http.client"))
    mypid = os.getpid()
    def allowed(path, write):
        if isinstance(path, int):
            return True
        path = os.path.realpath(os.fsdecode(path))
        if path == cwd or path.startswith(cwd + os.sep):
            return True
        if write:
            return path == "/dev/null"
        return path in ("/dev/null", "/dev/urandom") or any(
            path == r or path.startswith(r + os.sep) for r in roots)
    def hook(event, args):
        if event in blocked:
            if event in ("os.kill", "os.killpg") and args[0] in (0, mypid):
                return
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and (args[0] in blocked_imports):
            raise ImportError(f"sandbox: import of {args[0]} is not allowed")
        if event == "open":
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            mode = args[1] if isinstance(args[1], str) else ""
            write = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC)) or any(
                c in mode for c in "wax+")
            if not allowed(args[0], write):
                raise PermissionError(f"sandbox: cannot open {args[0]!r}")
        elif event in ("os.listdir", "os.scandir") and args and not allowed(args[0] or ".", False):
            raise PermissionError(f"sandbox: cannot list {args[0]!r}")
    return hook

def _main():
    nonce = sys.stdin.readline().strip()
    cfg = json.loads(sys.stdin.readline())
    _limits(cfg["mem"], cfg["cpu"], cfg["fsize"], cfg["nofile"])
    out = sys.stdout
    def report(*parts):
        out.write(nonce + " " + " ".join(str(p) for p in parts).replace("\n", " ") + "\n")
        out.flush()
    with open("solution.py") as f:
        code = f.read()
    with open("tests.json") as f:
        steps = json.load(f)
    # The hidden tests must not be readable by the code under test.
    for name in ("solution.py", "tests.json", "_bootstrap.py"):
        os.unlink(name)
    roots = tuple(os.path.realpath(p) for p in sys.path if p and os.path.isdir(p))
    sys.addaudithook(_hook_factory(os.path.realpath(os.getcwd()), roots))
    ns = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(code, "solution.py", "exec"), ns)
    except BaseException as e:
        report("ERROR", f"solution failed to load: {type(e).__name__}: {e}")
        return
    for i, (kind, src) in enumerate(steps):
        try:
            exec(compile(src, f"test_{i}", "exec"), ns)
            if kind == "test":
                report("PASS", i)
        except BaseException as e:
            report("FAIL", i, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)

_main()
"""


@dataclass
class SandboxResult:
    """What happened to one sandboxed run.

    Attributes:
        passed: tests that passed.
        total: tests in ``tests`` (counted by the parent, not reported by the child).
        stdout: the program's own output (bootstrap lines removed), truncated.
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


def _split_tests(tests: str) -> list[tuple[str, str]]:
    """``[(kind, source)]`` with kind "setup" or "test"; see the module docstring."""
    tree = ast.parse(tests)  # tests are trusted; a SyntaxError here is the caller's bug
    steps, calls = [], []
    for node in tree.body:
        src = ast.get_source_segment(tests, node) or ast.unparse(node)
        if isinstance(node, ast.Assert):
            steps.append(("test", src))
        else:
            steps.append(("setup", src))
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                calls.append(("test", f"{node.name}()"))
    return steps + calls


def _prepare(code: str, tests: str, timeout_s: float, memory_mb: int) -> tuple[Path, list[str], str, int]:
    steps = _split_tests(tests)
    workdir = Path(tempfile.mkdtemp(prefix="rollart_sandbox_"))
    (workdir / "solution.py").write_text(code)
    (workdir / "tests.json").write_text(json.dumps(steps))
    (workdir / "_bootstrap.py").write_text(_BOOTSTRAP)
    nonce = secrets.token_hex(16)
    cfg = {
        "mem": memory_mb * 1024 * 1024,
        "cpu": max(1, math.ceil(timeout_s)) + 1,  # backstop; the wall clock normally fires first
        "fsize": 16 * 1024 * 1024,
        "nofile": 64,
    }
    stdin = f"{nonce}\n{json.dumps(cfg)}\n"
    argv = [sys.executable, "-I", "-S", "-B", "_bootstrap.py"]
    return workdir, argv, stdin, sum(kind == "test" for kind, _ in steps)


def _collect(
    nonce: str, total: int, out: str, err: str, returncode: int | None, timed_out: bool, timeout_s: float
) -> SandboxResult:
    passed: set[int] = set()
    failures, user_lines, error = [], [], ""
    for line in out.splitlines():
        if not line.startswith(nonce + " "):
            user_lines.append(line)
            continue
        kind, _, rest = line[len(nonce) + 1 :].partition(" ")
        if kind == "PASS" and rest.strip().isdigit():
            passed.add(int(rest))
        elif kind == "FAIL":
            idx, _, why = rest.partition(" ")
            failures.append(f"{idx}: {why}")
        elif kind == "ERROR":
            error = rest
    if timed_out:
        error = f"timed out after {timeout_s:g}s"
    elif not error and returncode not in (0, None):
        if returncode < 0:
            error = f"killed by signal {signal.Signals(-returncode).name} (CPU or memory limit?)"
        else:
            error = f"exited with status {returncode}"
    return SandboxResult(
        passed=min(len(passed), total),
        total=total,
        stdout="\n".join(user_lines)[:_MAX_OUTPUT],
        stderr=err[:_MAX_OUTPUT],
        timed_out=timed_out,
        error=error,
        failures=failures,
    )


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the child leads its own session, so pgid == pid
    except (ProcessLookupError, PermissionError):  # already gone (pid not ours any more)
        pass


def _cleanup(workdir: Path) -> None:
    for p in workdir.iterdir():
        if p.is_file():
            p.unlink()
    try:
        workdir.rmdir()
    except OSError:  # user code made subdirectories; remove them too
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


def run_sandboxed(code: str, tests: str, timeout_s: float = 5, memory_mb: int = 256) -> SandboxResult:
    """Run ``code`` then ``tests`` in a locked-down subprocess; see the module docstring.

    Args:
        code: the untrusted program (e.g. a model's function definition).
        tests: trusted test source: top-level asserts and/or ``def test_*()`` functions.
        timeout_s: wall-clock limit; the whole process group is killed when it passes.
        memory_mb: address-space limit of the child.

    Returns:
        A :class:`SandboxResult`; it never raises for anything the code does.

    Example:
        >>> r = run_sandboxed("def add(a, b):\\n    return a + b", "assert add(1, 2) == 3")
        >>> (r.passed, r.total)
        (1, 1)
    """
    workdir, argv, stdin, total = _prepare(code, tests, timeout_s, memory_mb)
    nonce = stdin.split("\n", 1)[0]
    try:
        proc = subprocess.Popen(
            argv,
            cwd=workdir,
            env={},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            text=True,
            errors="replace",
        )
        timed_out = False
        try:
            out, err = proc.communicate(stdin, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            out, err = proc.communicate()
        _kill_group(proc.pid)  # anything the code left behind in its group goes too
        return _collect(nonce, total, out, err, proc.returncode, timed_out, timeout_s)
    finally:
        _cleanup(workdir)


async def arun_sandboxed(code: str, tests: str, timeout_s: float = 5, memory_mb: int = 256) -> SandboxResult:
    """:func:`run_sandboxed` for event loops: same sandbox, awaits the child without a thread."""
    workdir, argv, stdin, total = _prepare(code, tests, timeout_s, memory_mb)
    nonce = stdin.split("\n", 1)[0]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=workdir,
            env={},
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        timed_out = False
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), timeout_s)
        except TimeoutError:
            timed_out = True
            _kill_group(proc.pid)
            out, err = await proc.communicate()
        finally:
            if proc.returncode is None:  # cancelled from outside: never leave it running
                _kill_group(proc.pid)
        _kill_group(proc.pid)
        return _collect(
            nonce,
            total,
            out.decode(errors="replace"),
            err.decode(errors="replace"),
            proc.returncode,
            timed_out,
            timeout_s,
        )
    finally:
        _cleanup(workdir)
