"""The programs run inside the two sandboxes (``python -c``; see :mod:`rollart_nb.sandbox.run`)
and their wire: tests become grader steps (:func:`split_tests`), verdicts come back as
``@@ [kind, ...]`` lines on the grader's stdout (:func:`read_verdicts`).
"""

from __future__ import annotations

import ast
import json

__all__ = ["GRADER", "SOLUTION", "read_verdicts", "split_tests"]

_TAG = "@@"  # verdict lines of the grader (only the parent reads its stdout)

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


SOLUTION = (
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

GRADER = (
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


def split_tests(tests: str) -> tuple[list[tuple[str, str]], list[str]]:
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


def read_verdicts(stdout: str, tests: set[int]) -> tuple[set[int], list[str], str, bool]:
    """``(passed, failures, error, done)`` from the grader's stdout; lines that are not verdicts
    and PASS lines of steps that are not ``tests`` are ignored."""
    passed: set[int] = set()
    failures: list[str] = []
    error, done = "", False
    for line in stdout.split("\n"):
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
    return passed, failures, error, done
