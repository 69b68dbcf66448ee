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

import ast
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

__all__ = ["ISOLATION_MODES", "SandboxResult", "arun_sandboxed", "run_sandboxed"]

log = logging.getLogger(__name__)

ISOLATION_MODES = ("bwrap", "none")
_MAX_OUTPUT = 10_000  # characters of stdout/stderr kept per stream
_MAX_DRAIN = 4 * 1024 * 1024  # bytes of output after which the program is stopped
_GRACE_S = 0.2  # how long the solution may take to exit after the grader is done
_TAG = "@@"  # verdict lines of the grader (only the parent reads its stdout)
MAX_TIMEOUT_S = 86_400  # the longest wall clock one run may get
MIN_MEMORY_MB, MAX_MEMORY_MB = 32, 1 << 20  # the address space one run may get (MiB)

# Runs in both processes: limits and a length-prefixed JSON codec of plain data.
_COMMON = r"""
import json, os, resource, struct, sys, base64

_MAX_MSG = 16 << 20

def _limits(cfg):
    for lim, val in ((resource.RLIMIT_AS, cfg["mem"]), (resource.RLIMIT_CPU, cfg["cpu"]),
                     (resource.RLIMIT_FSIZE, cfg["fsize"]), (resource.RLIMIT_NOFILE, cfg["nofile"]),
                     (resource.RLIMIT_NPROC, cfg["nproc"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(lim, (val, val))

def _enc(v, depth=0):
    if depth > 64:
        raise ValueError("value nested too deeply")
    t = type(v)
    if v is None:
        return ["N"]
    if t is bool:
        return ["B", v]
    if t is int:
        return ["I", str(v)]
    if t is float:
        return ["F", repr(v)]
    if t is str:
        return ["S", v]
    if t is bytes:
        return ["Y", base64.b64encode(v).decode()]
    if t in (list, tuple, set, frozenset):
        tag = {list: "L", tuple: "T", set: "E", frozenset: "Z"}[t]
        return [tag, [_enc(x, depth + 1) for x in v]]
    if t is dict:
        return ["D", [[_enc(k, depth + 1), _enc(x, depth + 1)] for k, x in v.items()]]
    raise TypeError(f"returned a {t.__name__}, which is not plain data")

def _dec(m, depth=0, nan=True):
    if depth > 64 or type(m) is not list or not m or type(m[0]) is not str:
        raise ValueError("malformed value")
    tag, rest = m[0], m[1:]
    if tag == "N" and not rest:
        return None
    if len(rest) != 1:
        raise ValueError("malformed value")
    x = rest[0]
    if tag == "B" and type(x) is bool:
        return x
    if tag == "I" and type(x) is str and len(x) < 4300:
        return int(x)
    if tag == "F" and type(x) is str and len(x) < 64:
        f = float(x)
        if f != f and not nan:
            raise ValueError("NaN is not accepted as a result")
        return f
    if tag == "S" and type(x) is str:
        return x
    if tag == "Y" and type(x) is str:
        return base64.b64decode(x, validate=True)
    if tag in "LTEZ" and type(x) is list:
        items = [_dec(y, depth + 1, nan) for y in x]
        return {"L": list, "T": tuple, "E": set, "Z": frozenset}[tag](items)
    if tag == "D" and type(x) is list:
        out = {}
        for pair in x:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("malformed value")
            out[_dec(pair[0], depth + 1, nan)] = _dec(pair[1], depth + 1, nan)
        return out
    raise ValueError("malformed value")

def _send(fd, obj):
    data = json.dumps(obj).encode()
    if len(data) > _MAX_MSG:
        raise ValueError(f"a value of {len(data)} bytes (encoded) is over the {_MAX_MSG}-byte limit")
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]

def _read(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError("channel closed")
        buf += chunk
    return buf

def _recv(fd):
    (n,) = struct.unpack(">I", _read(fd, 4))
    if n > _MAX_MSG:
        raise ValueError(f"message of {n} bytes is over the limit")
    return json.loads(_read(fd, n))
"""

_SOLUTION = (
    _COMMON
    + r"""
def _hook_factory():
    blocked = frozenset(("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
        "socket.sendto", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
        "os.system", "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "ctypes.dlopen",
        "os.chroot", "os.setuid"))
    blocked_imports = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "socket", "_socket",
        "subprocess", "multiprocessing", "ssl", "urllib.request", "http.client"))
    mypid = os.getpid()
    def hook(event, args):
        if event in blocked:
            if event in ("os.kill", "os.killpg") and args[0] in (0, mypid):
                return
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in blocked_imports:
            raise ImportError(f"sandbox: import of {args[0]} is not allowed")
    return hook

def _main():
    cfg = json.loads(sys.stdin.readline())
    code = sys.stdin.read()
    fd = cfg["fd"]
    _limits(cfg)
    if cfg["hook"]:
        sys.addaudithook(_hook_factory())
    ns = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(code, "solution.py", "exec"), ns)
    except BaseException as e:
        _send(fd, {"load_error": f"{type(e).__name__}: {e}"[:500]})
        return
    names = {}
    for k, v in list(ns.items()):
        if k.startswith("__") or not k.isidentifier():
            continue
        try:
            names[k] = ["fn"] if callable(v) else ["val", _enc(v)]
        except BaseException:
            pass
    _send(fd, {"loaded": names})
    while True:
        try:
            req = _recv(fd)
        except EOFError:
            return
        try:
            fn = ns[req["call"]]
            args = [_dec(a) for a in req["args"]]
            out = {"ok": _enc(fn(*args))}
        except BaseException as e:
            out = {"err": f"{type(e).__name__}: {e}"[:500], "type": type(e).__name__}
        try:
            _send(fd, out)
        except ValueError as e:
            _send(fd, {"err": f"ValueError: {e}", "type": "ValueError"})

_main()
"""
)

_GRADER = (
    _COMMON
    + r"""
import builtins

class SolutionError(Exception):
    pass

_PASSED_THROUGH = frozenset(("ValueError", "TypeError", "KeyError", "IndexError", "LookupError",
    "ZeroDivisionError", "ArithmeticError", "OverflowError", "AttributeError", "NotImplementedError",
    "RuntimeError", "RecursionError", "UnicodeError", "OSError", "FileNotFoundError", "NameError"))

def _raised(reply):
    # Common exception types come back as themselves (tests may expect a ValueError); anything
    # else, StopIteration above all (it would silently end a test's loop), is a SolutionError.
    # A lying type name only fails the test.
    name = str(reply.get("type"))
    if name in _PASSED_THROUGH:
        return getattr(builtins, name)(reply["err"][:500])
    return SolutionError(reply["err"][:500])

class _Remote:
    def __init__(self, name, fd):
        self.name, self.fd = name, fd
    def __call__(self, *args):
        try:
            _send(self.fd, {"call": self.name, "args": [_enc(a) for a in args]})
            reply = _recv(self.fd)
        except (EOFError, OSError):
            raise SolutionError(f"the solution's process ended while running {self.name}()") from None
        if type(reply) is dict and "ok" in reply:
            try:
                return _dec(reply["ok"], nan=False)
            except (ValueError, TypeError, RecursionError) as e:
                raise SolutionError(f"{self.name}() returned a malformed value: {e}") from None
        if type(reply) is dict and type(reply.get("err")) is str:
            raise _raised(reply)
        raise SolutionError("the solution sent a malformed reply")
    def __repr__(self):
        return f"<solution function {self.name}>"

def _typed(v):
    # A hashable form that keeps types: True and 1, 2.0 and 2 stay apart inside sets and keys.
    t = type(v)
    if t in (tuple, list):
        return (t.__name__, tuple(_typed(x) for x in v))
    if t in (set, frozenset):
        return (t.__name__, frozenset(_typed(x) for x in v))
    if t is dict:
        return ("dict", frozenset((_typed(k), _typed(x)) for k, x in v.items()))
    return (t.__name__, v)

def _strict_in(x, c):
    if type(c) in (str, bytes):
        return type(x) is type(c) and x in c
    if type(c) is dict:
        return _typed(x) in {_typed(k) for k in c}
    if type(c) is range:
        return type(x) is int and x in c
    return any(_strict_eq(x, y) for y in c)

def _chain(values, ops):
    import operator
    table = {"==": _strict_eq, "!=": lambda a, b: not _strict_eq(a, b), "<": operator.lt, "<=": operator.le,
             ">": operator.gt, ">=": operator.ge, "in": _strict_in, "not in": lambda a, b: not _strict_in(a, b),
             "is": operator.is_, "is not": operator.is_not}
    return all(table[op](values[i], values[i + 1]) for i, op in enumerate(ops))

def _strict_eq(a, b):
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(_strict_eq(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        ka = {_typed(k): k for k in a}
        kb = {_typed(k): k for k in b}
        return ka.keys() == kb.keys() and all(_strict_eq(a[ka[k]], b[kb[k]]) for k in ka)
    if type(a) in (set, frozenset):
        return {_typed(x) for x in a} == {_typed(x) for x in b}
    return a == b

def _main():
    cfg = json.loads(sys.stdin.readline())
    steps = json.loads(sys.stdin.readline())
    fd = cfg["fd"]
    _limits(cfg)
    # Verdicts go to a private copy of stdout, one JSON array a line (no raw text from the
    # solution can start a line); whatever the tests print goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    def report(kind, *parts):
        out.write("@@ " + json.dumps([kind, *[str(p)[:600] for p in parts]], ensure_ascii=True) + "\n")
        out.flush()
    try:
        hello = _recv(fd)
    except BaseException as e:
        report("ERROR", f"the solution's process ended before loading ({type(e).__name__})")
        return
    if type(hello) is dict and type(hello.get("load_error")) is str:
        report("ERROR", "solution failed to load: " + hello["load_error"])
        return
    ns = {"__name__": "tests", "__strict_eq__": _strict_eq, "__strict_in__": _strict_in, "__strict_chain__": _chain}
    bound = set(cfg["bound"])
    loaded = hello.get("loaded") if type(hello) is dict else None
    for name, spec in (loaded.items() if type(loaded) is dict else ()):
        if (type(name) is not str or not name.isidentifier() or name.startswith("__") or type(spec) is not list
                or hasattr(builtins, name) or name in bound):  # the tests' abs() stays the real abs()
            continue
        try:
            if spec == ["fn"]:
                ns[name] = _Remote(name, fd)
            elif len(spec) == 2 and spec[0] == "val":
                ns[name] = _dec(spec[1], nan=False)
        except BaseException:
            pass
    defined = {}  # test functions as their definitions made them (not whatever a name holds later)
    for i, (kind, src) in enumerate(steps):
        try:
            if kind == "call":
                if src not in defined:
                    raise NameError(f"{src} was not defined (its definition failed)")
                defined[src]()
            else:
                exec(compile(src, f"test_{i}", "exec"), ns)
                if kind.startswith("def:"):
                    defined[kind[4:]] = ns[kind[4:]]
            if kind in ("test", "call"):
                report("PASS", i)
        except BaseException as e:
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if kind not in ("test", "call"):  # broken setup: nothing after it can be trusted
                report("ERROR", f"test setup (step {i}) failed: {why}")
                break
            report("FAIL", i, why)
    report("DONE")
    out.close()

_main()
"""
)


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


_OP_NAMES = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Is: "is",
    ast.IsNot: "is not",
}


class _StrictCompare(ast.NodeTransformer):
    """Equality and membership in the tests compare exact types: ``a == b`` ->
    ``__strict_eq__(a, b)``, ``a in b`` -> ``__strict_in__(a, b)`` (and their negations); a
    chain with either, ``a == b == c``, -> ``__strict_chain__([a, b, c], ["==", "=="])``, which
    evaluates every operand (no short-circuit)."""

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if not any(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops):
            return node
        if len(node.ops) > 1:
            ops = ast.List([ast.Constant(_OP_NAMES[type(op)]) for op in node.ops], ast.Load())
            out: ast.AST = ast.Call(
                ast.Name("__strict_chain__", ast.Load()),
                [ast.List([node.left, *node.comparators], ast.Load()), ops],
                [],
            )
            return ast.copy_location(out, node)
        op = node.ops[0]
        fn = "__strict_eq__" if isinstance(op, ast.Eq | ast.NotEq) else "__strict_in__"
        out = ast.Call(ast.Name(fn, ast.Load()), [node.left, node.comparators[0]], [])
        if isinstance(op, ast.NotEq | ast.NotIn):
            out = ast.UnaryOp(ast.Not(), out)
        return ast.copy_location(out, node)


def _strict(node: ast.AST) -> str:
    return ast.unparse(ast.fix_missing_locations(_StrictCompare().visit(node)))


def _asserts(node: ast.AST) -> bool:
    """Whether a top-level statement asserts something itself (not inside a def or class)."""
    if isinstance(node, ast.Assert):
        return True
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
        return False
    return any(_asserts(c) for c in ast.iter_child_nodes(node))


def _bound_names(tree: ast.Module) -> list[str]:
    """Names the tests bind at module level: the solution may not fill them in."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
            for d in node.decorator_list:
                visit(d)
            for stmt in ast.walk(node):  # `global x` inside a def binds x at module level
                if isinstance(stmt, ast.Global):
                    names.update(stmt.names)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.MatchAs | ast.MatchStar) and node.name:
            names.add(node.name)
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.Lambda | ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp):
                visit(child)

    visit(tree)
    return sorted(names)


def _split_tests(tests: str) -> tuple[list[tuple[str, str]], list[str]]:
    """``([(kind, source)], bound names)``; kind is "test" (a statement that asserts), "setup",
    "def:<name>" (a ``test_*`` function's definition) or "call" (calling it; source = name)."""
    tree = ast.parse(tests)  # tests are trusted; a SyntaxError here is the caller's bug
    steps, calls = [], []
    for node in tree.body:
        src = _strict(node)
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            steps.append((f"def:{node.name}", src))
            calls.append(("call", node.name))
        else:
            steps.append(("test" if _asserts(node) else "setup", src))
    return steps + calls, _bound_names(tree)


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


async def _arun(
    code: str, tests: str, timeout_s: float, memory_mb: int, isolation: str, audit_hook: bool, max_output: int
) -> SandboxResult:
    steps, bound = _split_tests(tests)
    if isolation == "bwrap":  # one-time checks before the clock starts
        iso.require_bwrap()
        iso.python_runtime()
    limits = {
        "mem": memory_mb * 1024 * 1024,
        "cpu": max(1, math.ceil(timeout_s)) + 1,
        "fsize": 8 * 1024 * 1024,
        "nofile": 32,
        "nproc": 16,
    }
    a, b = socket.socketpair()
    fd_a, fd_b = a.fileno(), b.fileno()  # the children see the channel under the same numbers
    sol_in = (json.dumps({**limits, "fd": fd_a, "hook": audit_hook}) + "\n" + code).encode("utf-8", "replace")
    grd_in = (json.dumps({**limits, "fd": fd_b, "bound": bound}) + "\n" + json.dumps(steps) + "\n").encode()
    workdir = tempfile.mkdtemp(prefix="rollart_sandbox_") if isolation == "none" else "/"
    procs: list[asyncio.subprocess.Process] = []
    streams: list[_Stream] = []
    tasks: list[asyncio.Future] = []
    deadline = time.monotonic() + timeout_s
    timed_out = killed_for_output = False
    try:
        sol = await _spawn(isolation, _SOLUTION, fd_a, workdir, procs)
        grd = await _spawn(isolation, _GRADER, fd_b, workdir, procs)
        a.close()
        b.close()
        flooded = asyncio.Event()  # the solution's stdout and stderr share one budget
        budget = [_MAX_DRAIN]
        for reader, keep, share, over in (
            (sol.stdout, max_output, budget, flooded),
            (sol.stderr, max_output, budget, flooded),
            (grd.stdout, 1 << 20, [1 << 22], None),
            (grd.stderr, max_output, [1 << 22], None),
        ):
            streams.append(_Stream(_piped(reader), keep, share, over))
        pumps = [asyncio.ensure_future(st.pump()) for st in streams]
        flood, graded = asyncio.ensure_future(flooded.wait()), asyncio.ensure_future(grd.wait())
        tasks += [
            *pumps,
            flood,
            graded,
            asyncio.ensure_future(_feed(sol, sol_in)),
            asyncio.ensure_future(_feed(grd, grd_in)),
        ]
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
            pass  # the solution outlived the grader: killed below
        for p in procs:
            _kill(p)
        await asyncio.wait(pumps, timeout=1.0)  # everything in the sandboxes is dead: pipes close
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), 1.0)
            except TimeoutError:
                pass
    finally:  # also on cancellation: nothing of this run outlives it
        for p in procs:
            _kill(p)
        for t in tasks:
            t.cancel()
        for p in procs:  # close the pipes now, not when the loop is gone
            transport = getattr(p, "_transport", None)
            if transport is not None:
                transport.close()
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
    passed: set[int] = set()
    failures: list[str] = []
    error, done = "", False
    for line in streams[2].text().split("\n"):
        try:
            kind, *rest = json.loads(line.removeprefix(_TAG + " ")) if line.startswith(_TAG + " ") else [""]
        except (ValueError, TypeError):
            continue
        if kind == "PASS" and len(rest) == 1 and rest[0].isdigit() and int(rest[0]) in tests:
            passed.add(int(rest[0]))
        elif kind == "FAIL" and len(rest) == 2:
            failures.append(f"{rest[0]}: {rest[1]}")
        elif kind == "ERROR" and len(rest) == 1:
            error = rest[0]
        elif kind == "DONE":
            done = True
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
