"""Hostile tests of the code sandbox (:mod:`rollart_nb.sandbox.run`).

Each test plays model-written code that attacks the host or its own grader, and asserts that
the *effect* did not happen outside: a marker file is absent, a host file is unchanged, a server
accepted nothing, a process of ours is still alive and running, a secret is in no output
field, ``passed`` stayed 0, the call came back in time. Many attacks first defeat the
in-process audit hook (``TAMPER`` below), since that layer is Python and hostile code can undo
it; the boundary under test is the OS one.

Attack code only aims at things these tests create (a file in ``tmp_path``, a server on
127.0.0.1, a socket in ``tmp_path``, a ``sleep`` process), and its payloads are harmless if they
get through (a marker file, printing a file, sysrq help). Actions that are only harmless inside
a PID namespace (``kill(-1, SIGKILL)``, stopping pid 1) run only if the code cannot see a canary
process of the host; otherwise the code prints ``HOST-PIDS-VISIBLE`` (and the test fails).
"""

from __future__ import annotations

import asyncio
import gc
import glob
import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rollart_nb.envs import SandboxResult, arun_sandboxed, run_sandboxed

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed; the code sandbox needs it"
)

PROJECT = Path(__file__).resolve().parents[2]
# Printed by the read attacks if they get this file; nothing else produces it.
FILE_CANARY = "hostile-file-canary-3f9d0c7be1a24e5b"
SLACK_S = 1.0  # a run must return within timeout_s + SLACK_S
MAX_OUTPUT_CHARS = 1_000_000
MAX_PARENT_GROWTH_MB = 150
ANSWER = "\ndef answer():\n    return 42\n"
ANSWER_TESTS = "assert answer() == 42\n"

# Pass isolation="bwrap" explicitly where the API has it, so a changed default cannot weaken this file.
_SYNC_KW = _ASYNC_KW = {"isolation": "bwrap"}

# Best-effort removal of the in-process second layer: every audit-hook-like function (two
# arguments, "hook"/"audit" in its name, not frozen stdlib) gets a no-op code object with the
# same free variables; os functions are restored from posix, blocked modules un-blocked.
TAMPER = r"""
def _rollart_tamper():
    import builtins, gc, os, posix, sys
    hits = []
    for f in gc.get_objects():
        try:
            if type(f).__name__ != "function":
                continue
            co = f.__code__
            low = co.co_name.lower()
            if co.co_argcount != 2 or co.co_filename.startswith("<frozen") or not ("hook" in low or "audit" in low):
                continue
            names = co.co_freevars
            src = "def _o():\n" + "".join(f"    {v} = None\n" for v in names)
            src += "    def _h(*a, **k):\n" + (f"        ({', '.join(names)},)\n" if names else "")
            src += "        return None\n    return _h\n"
            ns = {}
            exec(src, ns)
            f.__code__ = ns["_o"]().__code__
            hits.append(co.co_filename + ":" + co.co_name)
        except BaseException:
            pass
    for name in ("system", "fork", "execv", "execve", "kill", "killpg", "posix_spawn", "setsid", "setuid"):
        if hasattr(posix, name):
            setattr(os, name, getattr(posix, name))
    for mod in ("ctypes", "_ctypes", "socket", "_socket", "subprocess", "_posixsubprocess"):
        if mod in sys.modules and sys.modules[mod] is None:
            del sys.modules[mod]
    if type(builtins.__import__).__name__ != "builtin_function_or_method":
        import importlib._bootstrap
        builtins.__import__ = importlib._bootstrap.__import__
    print("TAMPER", hits, flush=True)
_rollart_tamper()
import os, sys
"""

# Defines _host_visible(): whether the code can see the host's canary process (no PID namespace).
GUARD = r"""
def _host_visible():
    try:
        with open("/proc/%d/cmdline" % @CANARY_PID@, "rb") as f:
            if @CANARY_TAG@.encode() in f.read():
                return True
    except BaseException:
        pass
    try:
        os.kill(@CANARY_PID@, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError as e:
        return e.errno is not None  # EPERM from the kernel: it exists; an audit hook's has no errno
    except BaseException:
        return False
"""


# ---------------------------------------------------------------------------------- helpers


def _src(template: str, **values: object) -> str:
    """``template`` with each ``@NAME@`` replaced by ``repr(values[NAME])``."""
    out = textwrap.dedent(template)
    for k, v in values.items():
        out = out.replace(f"@{k}@", repr(v))
    left = re.findall(r"@[A-Z_]+@", out)
    assert not left, f"unfilled placeholders {left}"
    return out


def _run(
    code: str, tests: str = ANSWER_TESTS, *, timeout_s: float = 2.0, memory_mb: int = 256, runner: str = "sync"
) -> tuple[SandboxResult, float]:
    t0 = time.monotonic()
    if runner == "async":
        r = asyncio.run(arun_sandboxed(code, tests, timeout_s, memory_mb, **_ASYNC_KW))
    else:
        r = run_sandboxed(code, tests, timeout_s, memory_mb, **_SYNC_KW)
    return r, time.monotonic() - t0


def _fields(r: SandboxResult) -> dict[str, str]:
    return {"stdout": r.stdout, "stderr": r.stderr, "error": r.error, "failures": "\n".join(r.failures)}


def _assert_not_leaked(r: SandboxResult, needles: list[str]) -> None:
    assert needles, "nothing to look for: the test itself is broken"
    leaks = [(name, n[:10] + "...") for n in needles for name, text in _fields(r).items() if n in text]
    assert not leaks, f"host data leaked into the result: {leaks}"


def _assert_bounded(elapsed: float, timeout_s: float) -> None:
    assert elapsed <= timeout_s + SLACK_S, f"returned after {elapsed:.2f}s with timeout_s={timeout_s}"


def _comm_tag(token: str) -> str:
    return "rh" + token[-12:]  # fits /proc/<pid>/comm (15 characters)


def _pids_with(token: str) -> list[int]:
    """Processes whose command line holds ``token`` or whose comm is its tag (not zombies)."""
    me, tag, out = os.getpid(), _comm_tag(token).encode(), []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == me:
            continue
        try:
            cmdline = Path(f"/proc/{d}/cmdline").read_bytes()
            comm = Path(f"/proc/{d}/comm").read_bytes().strip()
        except OSError:
            continue
        if cmdline and (token.encode() in cmdline or comm == tag):
            out.append(int(d))
    return out


def _leftovers(token: str, settle_s: float = 0.5) -> list[int]:
    """``_pids_with(token)`` once killed sandboxes have had ``settle_s`` to disappear."""
    deadline = time.monotonic() + settle_s
    while (pids := _pids_with(token)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def _proc_state(pid: int) -> str:
    stat_line = Path(f"/proc/{pid}/stat").read_text()
    return stat_line.rsplit(")", 1)[1].split()[0]


def _assert_running(p: subprocess.Popen) -> None:
    assert p.poll() is None, f"process {p.pid} of the test was killed (status {p.returncode})"
    state = _proc_state(p.pid)
    assert state not in ("T", "t", "Z", "X"), f"process {p.pid} of the test is in state {state}"
    tracer = re.search(r"TracerPid:\s*(\d+)", Path(f"/proc/{p.pid}/status").read_text())
    assert tracer is None or tracer.group(1) == "0", f"process {p.pid} of the test is being traced"


def _status_kb(field: str) -> int:
    m = re.search(rf"^{field}:\s*(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(m.group(1)) if m else 0


class _ParentGrowth:
    """Peak RSS growth of this (the parent) process over a block, in MB."""

    def __enter__(self) -> _ParentGrowth:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.peak = True
        except OSError:
            self.peak = False
        self.start = _status_kb("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        end = _status_kb("VmHWM") if self.peak else _status_kb("VmRSS")
        self.mb = (end - self.start) / 1024


def _spawn_sleeper(tag: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)", tag],
        start_new_session=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # until its command line shows (exec done)
        try:
            if tag.encode() in Path(f"/proc/{p.pid}/cmdline").read_bytes():
                break
        except OSError:
            pass
        time.sleep(0.01)
    return p


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
    p.wait()


def _kmsg() -> list[str] | None:
    """The kernel log records, or None where this process cannot read them."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    out = []
    try:
        while True:
            try:
                out.append(os.read(fd, 8192).decode(errors="replace"))
            except BlockingIOError:
                return out
            except OSError:  # EPIPE: records overwritten while reading; go on
                continue
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture
def token() -> str:
    return "rollarthostile" + secrets.token_hex(8)


@pytest.fixture(autouse=True)
def _reap(token):
    """Kill, by pid, whatever an attack left running that carries this test's token."""
    yield
    for pid in _pids_with(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.fixture(scope="module")
def canary():
    """A host process that attack code must not be able to see (the PID-namespace check)."""
    tag = "rollartcanary" + secrets.token_hex(8)
    p = _spawn_sleeper(tag)
    yield p, tag
    _stop(p)


@pytest.fixture
def sleeper():
    """A host process attack code tries to kill, stop, trace or renice."""
    p = _spawn_sleeper("rollartvictim" + secrets.token_hex(8))
    yield p
    _stop(p)


@pytest.fixture
def victim(tmp_path, token):
    """A host file with known content and mode, and a snapshot to compare against."""
    d = tmp_path / "host"
    d.mkdir()
    f = d / "victim.txt"
    f.write_text("original-" + token)
    f.chmod(0o640)

    def snapshot() -> tuple:
        if not f.exists():
            return ("missing", sorted(os.listdir(d)))
        st = f.stat()
        return (f.read_text(), stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_ino, sorted(os.listdir(d)))

    return f, snapshot


def _guard(canary_fixture) -> str:
    p, tag = canary_fixture
    return _src(GUARD, CANARY_PID=p.pid, CANARY_TAG=tag)


# ---------------------------------------------------------------------------------- sanity


def test_correct_solution_scores_one():
    tests = "assert add(1, 2) == 3\ndef test_neg():\n    assert add(-1, -1) == -2\n"
    r, _ = _run("def add(a, b):\n    return a + b\n", tests)
    assert (r.passed, r.total, r.score, r.error, r.timed_out) == (2, 2, 1.0, "", False)


def test_wrong_solution_scores_zero():
    r, _ = _run("def add(a, b):\n    return a * b - 1\n", "assert add(1, 2) == 3\nassert add(2, 2) == 4\n")
    assert (r.passed, r.total, r.score) == (0, 2, 0.0)
    assert len(r.failures) == 2


def test_async_runner_scores_like_sync():
    r, _ = _run(ANSWER, "assert answer() == 42\nassert answer() == 41\n", runner="async")
    assert (r.passed, r.total) == (1, 2)


def test_plain_data_results_still_compare_equal():
    """Strict comparison must not break honest answers of every plain-data type."""
    value = {"a": [1, (2, 3.5)], "b": {4, 5}, "c": b"\x00x", "d": None, "e": True, "f": frozenset({"z"})}
    r, _ = _run(f"def answer():\n    return {value!r}\n", f"assert answer() == {value!r}\nassert answer() != 0\n")
    assert (r.passed, r.total) == (2, 2), r


def test_program_output_is_captured():
    """The leak checks below look at stdout/stderr: make sure output does get there."""
    code = (
        "import sys\nprint('to-stdout-ok')\nsys.stderr.write('to-stderr-ok\\n')\n"
        "open('mine.txt', 'w').write('workdir-ok')\nprint(open('mine.txt').read())\n" + ANSWER
    )
    r, _ = _run(code)
    assert "to-stdout-ok" in r.stdout and "workdir-ok" in r.stdout and "to-stderr-ok" in r.stderr
    assert r.passed == 1


# ---------------------------------------------------------------------------------- shells and uid

SHELLS = {
    "os_system": "os.system(CMD)",
    "os_popen": "os.popen(CMD).read()",
    "subprocess_run": "import subprocess\nsubprocess.run(['/bin/sh', '-c', CMD], timeout=5)",
    "fork_execv_bin_sh": textwrap.dedent("""\
        pid = os.fork()
        if pid == 0:
            try:
                os.execv('/bin/sh', ['sh', '-c', CMD])
            finally:
                os._exit(1)
        os.waitpid(pid, 0)"""),
    "posix_spawn_bin_sh": "os.waitpid(os.posix_spawn('/bin/sh', ['sh', '-c', CMD], {}), 0)",
    "posix_spawn_python": textwrap.dedent("""\
        prog = 'import os, sys; open(sys.argv[1], "w").write(str(os.getuid()))'
        os.waitpid(os.posix_spawn(sys.executable, [sys.executable, '-c', prog, MARK], {}), 0)"""),
}


@pytest.mark.parametrize(
    ("how", "tamper"),
    [("os_system", False)] + [(h, True) for h in SHELLS],
    ids=["os_system-plain"] + [f"{h}-tampered" for h in SHELLS],
)
def test_shell_cannot_touch_the_host(how, tamper, tmp_path):
    """A shell (or a child Python) writes ``id`` into a host temp dir: the file must not appear."""
    mark = tmp_path / "shell-marker"
    body = (
        f"MARK = {str(mark)!r}\nCMD = 'id > ' + MARK\ntry:\n{textwrap.indent(SHELLS[how], '    ')}\n"
        "except BaseException as e:\n    print('refused', type(e).__name__, e)\n"
    )
    r, elapsed = _run((TAMPER if tamper else "import os, sys\n") + body + ANSWER)
    _assert_bounded(elapsed, 2.0)
    assert not mark.exists(), f"the shell ran on the host: {mark.read_text()!r}"


def test_code_does_not_run_as_root_even_after_setuid():
    code = (
        TAMPER
        + textwrap.dedent("""\
        for call in ("os.setuid(0)", "os.setgid(0)", "os.setresuid(0, 0, 0)"):
            try:
                eval(call)
            except BaseException as e:
                print(call, "refused", type(e).__name__)
        caps = [l.split()[1] for l in open("/proc/self/status").read().splitlines() if l.startswith("CapEff")]
        print("UID", os.getuid(), "EUID", os.geteuid(), "CAPEFF", *caps)
        """)
        + ANSWER
    )
    r, _ = _run(code)
    m = re.search(r"UID (\d+) EUID (\d+) CAPEFF ([0-9a-f]+)", r.stdout)
    assert m, r.stdout
    assert m.group(1) != "0" and m.group(2) != "0", f"code runs as root: {m.group(0)}"
    assert int(m.group(3), 16) == 0, f"code holds capabilities: {m.group(0)}"


# ---------------------------------------------------------------------------------- reading host files

READ_METHODS = {
    "open": """\
        show("open", open(P, "rb").read())
        import io
        show("open_code", io.open_code(P).read())
        fd = os.open(P, os.O_RDONLY)
        show("os.open", os.read(fd, 1 << 20))""",
    "hardlink_into_workdir": """\
        os.link(P, "hl")
        show("hardlink", open("hl", "rb").read())""",
    "symlink_into_workdir": """\
        os.symlink(P, "sl")
        show("symlink", open("sl", "rb").read())""",
    "proc_root": """\
        for root in (f"/proc/{os.getppid()}/root", "/proc/1/root", "/proc/self/root"):
            try:
                show(root, open(root + P, "rb").read())
            except BaseException as e:
                print("no", root, type(e).__name__)
        os.symlink(f"/proc/{os.getppid()}/root", "pr")
        show("pr", open("pr" + P, "rb").read())""",
}


def _read_targets() -> dict[str, tuple[str, list[str]]]:
    """name -> (path, distinctive lines of it the attack must not get out)."""
    out = {}
    try:
        shadow = [ln for ln in Path("/etc/shadow").read_text().splitlines() if len(ln) >= 16]
        if shadow:
            out["etc_shadow"] = ("/etc/shadow", shadow[:5])
    except OSError:
        pass
    pyproject = [ln for ln in (PROJECT / "pyproject.toml").read_text().splitlines() if len(ln.strip()) >= 20]
    out["pyproject"] = (str(PROJECT / "pyproject.toml"), pyproject[:5])
    out["this_test_file"] = (str(Path(__file__).resolve()), [FILE_CANARY])
    return out


_TARGETS = _read_targets()


@pytest.mark.parametrize("method", [*READ_METHODS, "all-tampered"])
@pytest.mark.parametrize("target", sorted(_TARGETS))
def test_host_files_cannot_be_read(target, method):
    path, needles = _TARGETS[target]
    methods = list(READ_METHODS) if method == "all-tampered" else [method]
    body = "".join(
        f"try:\n{textwrap.indent(textwrap.dedent(READ_METHODS[m]), '    ')}\n"
        f"except BaseException as e:\n    print({m!r}, 'refused', type(e).__name__)\n"
        for m in methods
    )
    code = (
        (TAMPER if method == "all-tampered" else "import os, sys\n")
        + _src(
            """\
        P = @P@
        def show(label, data):
            print("READ", label, data.decode("latin-1") if isinstance(data, bytes) else data, flush=True)
        """,
            P=path,
        )
        + body
        + "print('ATTACK-DONE')\n"
        + ANSWER
    )
    r, _ = _run(code)
    assert "ATTACK-DONE" in r.stdout, r  # it ran to the end, so what it read would be in stdout
    _assert_not_leaked(r, needles)


# ---------------------------------------------------------------------------------- writing host files

WRITE_METHODS = {
    "open_write": "with open(V, 'w') as f:\n    f.write('pwned')",
    "open_append": "with open(V, 'a') as f:\n    f.write('pwned')",
    "os_open_trunc": "os.close(os.open(V, os.O_WRONLY | os.O_TRUNC))",
    "rename_away": "os.rename(V, 'stolen')",
    "replace_onto": "open('evil', 'w').write('pwned')\nos.replace('evil', V)",
    "unlink": "os.unlink(V)",
    "truncate": "os.truncate(V, 0)",
    "chmod": "os.chmod(V, 0o777)",
    "utime": "os.utime(V, (0, 0))",
    "hardlink_then_write": "os.link(V, 'hl')\nwith open('hl', 'w') as f:\n    f.write('pwned')",
    "symlink_then_write": "os.symlink(V, 'sl')\nwith open('sl', 'w') as f:\n    f.write('pwned')",
    "symlink_dir_then_create": "os.symlink(os.path.dirname(V), 'd')\nopen('d/planted', 'w').write('x')",
}


@pytest.mark.parametrize("method", [*WRITE_METHODS, "all-tampered"])
def test_host_file_cannot_be_changed(method, victim):
    f, snapshot = victim
    before = snapshot()
    methods = list(WRITE_METHODS) if method == "all-tampered" else [method]
    body = "".join(
        f"try:\n{textwrap.indent(WRITE_METHODS[m], '    ')}\n    print({m!r}, 'done')\n"
        f"except BaseException as e:\n    print({m!r}, 'refused', type(e).__name__)\n"
        for m in methods
    )
    code = (TAMPER if method == "all-tampered" else "import os, sys\n") + f"V = {str(f)!r}\n" + body + ANSWER
    _run(code)
    assert snapshot() == before, "the host file was changed"


# ---------------------------------------------------------------------------------- network


@pytest.mark.parametrize("tamper", [False, True], ids=["plain", "tampered"])
def test_tcp_to_host_loopback_reaches_nothing(tamper):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    port = server.getsockname()[1]
    code = (
        (TAMPER if tamper else "import os, sys\n")
        + _src(
            """\
        for host in ("127.0.0.1", "localhost"):
            try:
                import socket
                s = socket.create_connection((host, @PORT@), timeout=0.5)
                s.sendall(b"hello from the sandbox")
                print("CONNECTED", host)
            except BaseException as e:
                print("refused", host, type(e).__name__)
        """,
            PORT=port,
        )
        + ANSWER
    )
    try:
        _run(code)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    finally:
        server.close()


@pytest.mark.parametrize("tamper", [False, True], ids=["plain", "tampered"])
def test_udp_to_host_loopback_delivers_nothing(tamper):
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    port = rx.getsockname()[1]
    code = (
        (TAMPER if tamper else "import os, sys\n")
        + _src(
            """\
        try:
            import socket
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            for _ in range(5):
                s.sendto(b"datagram from the sandbox", ("127.0.0.1", @PORT@))
            print("SENT")
        except BaseException as e:
            print("refused", type(e).__name__)
        """,
            PORT=port,
        )
        + ANSWER
    )
    try:
        _run(code)
        time.sleep(0.05)
        with pytest.raises(BlockingIOError):
            rx.recvfrom(1024)  # nothing arrived
    finally:
        rx.close()


@pytest.mark.parametrize(
    ("kind", "tamper"),
    [("path", False), ("path", True), ("abstract", True)],
    ids=["path-plain", "path-tampered", "abstract-tampered"],
)
def test_unix_socket_of_the_host_reaches_nothing(kind, tamper, tmp_path, token):
    address = str(tmp_path / "s.sock") if kind == "path" else "\0" + token
    server = socket.socket(socket.AF_UNIX)
    server.bind(address)
    server.listen(16)
    server.setblocking(False)
    code = (
        (TAMPER if tamper else "import os, sys\n")
        + _src(
            """\
        try:
            import socket
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(0.5)
            s.connect(@ADDR@)
            s.sendall(b"hello")
            print("CONNECTED")
        except BaseException as e:
            print("refused", type(e).__name__)
        """,
            ADDR=address,
        )
        + ANSWER
    )
    try:
        _run(code)
        with pytest.raises(BlockingIOError):
            server.accept()
    finally:
        server.close()


# ---------------------------------------------------------------------------------- processes


@pytest.mark.parametrize("runner", ["sync", "async"])
def test_daemon_does_not_outlive_the_run(runner, tmp_path, token):
    """Double fork + setsid + exec, stdio on /dev/null; it sleeps, then writes a host marker."""
    mark = tmp_path / "daemon-marker"
    code = (
        TAMPER
        + _src(
            """\
        def daemonize():
            pid = os.fork()
            if pid:
                os.waitpid(pid, 0)
                return "parent"
            try:
                os.setsid()
                if os.fork():
                    os._exit(0)
                fd = os.open(os.devnull, os.O_RDWR)
                for i in (0, 1, 2):
                    os.dup2(fd, i)
                prog = "import sys, time; time.sleep(0.7); open(sys.argv[1], 'w').write('escaped')"
                os.execv(sys.executable, [sys.executable, "-c", prog, @MARK@, @TOKEN@])
            finally:
                os._exit(1)
        try:
            print(daemonize())
        except BaseException as e:
            print("refused", type(e).__name__, e)
        """,
            MARK=str(mark),
            TOKEN=token,
        )
        + ANSWER
    )
    r, elapsed = _run(code, runner=runner)
    _assert_bounded(elapsed, 2.0)
    assert _leftovers(token) == [], "a process of the sandbox is still running"
    time.sleep(1.2)
    assert not mark.exists(), "the daemon wrote to the host after the run"


@pytest.mark.parametrize("runner", ["sync", "async"])
def test_child_holding_the_output_pipes_does_not_stall_the_run(runner, token):
    code = (
        TAMPER
        + _src(
            """\
        try:
            pid = os.fork()
            if pid == 0:
                try:
                    os.setsid()
                    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(8)", @TOKEN@])
                finally:
                    os._exit(1)
            print("forked", pid)
        except BaseException as e:
            print("refused", type(e).__name__)
        """,
            TOKEN=token,
        )
        + ANSWER
    )
    r, elapsed = _run(code, timeout_s=2.0, runner=runner)
    _assert_bounded(elapsed, 2.0)
    assert _leftovers(token) == [], "the pipe holder is still running"


HANGS = {
    "busy_loop": "while True:\n    pass\n",
    "sleep": "import time\ntime.sleep(60)\n",
    "select_forever": "import select\nselect.select([], [], [])\n",
    "signals_ignored_busy": "import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n"
    "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass\n",
    # the threads spin without allocating: a growing list would hit the memory limit (a failed load, not a
    # hang) whenever the main thread waits long for the GIL between two starts on a busy machine
    "spinning_threads": "import threading\ndef spin():\n    while True:\n        pass\nfor _ in range(4):\n"
    "    threading.Thread(target=spin, daemon=True).start()\n"
    "threading.Event().wait()\n",
    "stop_self": "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)\nwhile True:\n    pass\n",
    "stop_own_group": "import os, signal\nos.kill(0, signal.SIGSTOP)\nwhile True:\n    pass\n",
    "hang_in_called_function": "def answer():\n    while True:\n        pass\n",
}


@pytest.mark.parametrize("how", list(HANGS))
def test_hanging_code_is_stopped_at_the_wall_clock(how):
    r, elapsed = _run(HANGS[how], timeout_s=1.0)
    _assert_bounded(elapsed, 1.0)
    assert r.timed_out and r.passed == 0, r


def test_stopping_the_parent_or_pid_1_does_not_stall_the_host(canary):
    code = (
        TAMPER
        + _guard(canary)
        + textwrap.dedent("""\
        import signal
        if _host_visible():
            print("HOST-PIDS-VISIBLE")
        else:
            for pid in (os.getppid(), 1):
                try:
                    os.kill(pid, signal.SIGSTOP)
                    print("stopped", pid)
                except BaseException as e:
                    print("refused", pid, type(e).__name__)
        """)
        + ANSWER
    )
    r, elapsed = _run(code, timeout_s=1.5)
    _assert_bounded(elapsed, 1.5)
    assert "HOST-PIDS-VISIBLE" not in r.stdout, "the code sees the host's processes (no PID namespace)"
    _assert_running(canary[0])


def test_fork_bomb_is_contained(token):
    """2**10 forks at most (each child setsid()s and names itself), all sleeping past the run."""
    code = (
        TAMPER
        + _src(
            """\
        n = 0
        for _ in range(10):
            try:
                if os.fork() == 0:
                    try:
                        os.setsid()
                        with open("/proc/self/comm", "w") as f:
                            f.write(@TAG@)
                    except BaseException:
                        pass
            except BaseException:
                break
        import time
        time.sleep(3)
        """,
            TAG=_comm_tag(token),
        )
        + ANSWER
    )
    r, elapsed = _run(code, timeout_s=1.0)
    _assert_bounded(elapsed, 1.0)
    assert _leftovers(token, settle_s=1.0) == [], "forked processes outlived the run"


MEMORY_BOMB = """\
    got = 0
    chunks = []
    try:
        while got < @CAP_MB@:
            chunks.append(b"\\x01" * (64 << 20))
            got += 64
            print("HELD_MB", got, flush=True)
    except BaseException as e:
        print("stopped at", got, type(e).__name__, flush=True)
    """


def _held_mb(r: SandboxResult, key: str = "HELD_MB") -> int:
    return max([int(n) for n in re.findall(rf"{key} (\d+)", r.stdout)] or [0])


def test_memory_bomb_is_bounded():
    with _ParentGrowth() as g:
        r, elapsed = _run("import os\n" + _src(MEMORY_BOMB, CAP_MB=4096) + ANSWER, memory_mb=256)
    _assert_bounded(elapsed, 2.0)
    assert "stopped at" in r.stdout, r  # it ran, and hit the limit
    assert _held_mb(r) <= 256, f"held {_held_mb(r)} MB with memory_mb=256"
    assert g.mb < MAX_PARENT_GROWTH_MB, f"the parent grew by {g.mb:.0f} MB"


def test_memory_outside_the_address_space_is_bounded():
    """memfd pages are not address space: RLIMIT_AS alone does not cap them."""
    code = (
        TAMPER
        + textwrap.dedent("""\
        got, fds = 0, []
        try:
            while got < 2048:
                fd = os.memfd_create("x")
                fds.append(fd)
                for _ in range(4):
                    os.write(fd, b"\\x01" * (4 << 20))
                    got += 4
                    print("HELD_MB", got, flush=True)
        except BaseException as e:
            print("stopped at", got, type(e).__name__, flush=True)
        """)
        + ANSWER
    )
    r, elapsed = _run(code, memory_mb=256)
    _assert_bounded(elapsed, 2.0)
    assert _held_mb(r) <= 256 + 64, f"held {_held_mb(r)} MB of memfd pages with memory_mb=256"


def test_hard_rlimits_cannot_be_raised_and_still_bind():
    code = (
        TAMPER
        + textwrap.dedent("""\
        import resource
        for name in ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_NPROC"):
            lim = getattr(resource, name)
            soft, hard = resource.getrlimit(lim)
            if hard == resource.RLIM_INFINITY:
                print("UNLIMITED", name)
                continue
            try:
                resource.setrlimit(lim, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
                print("RAISED", name)
            except (ValueError, OSError) as e:
                print("KEPT", name, type(e).__name__)
        """)
        + _src(MEMORY_BOMB, CAP_MB=1536)
        + "while True:\n    pass\n"
    )
    r, elapsed = _run(code, timeout_s=1.5, memory_mb=256)
    _assert_bounded(elapsed, 1.5)
    assert r.stdout.count("KEPT") == 5, r.stdout
    assert "RAISED" not in r.stdout and "UNLIMITED" not in r.stdout, r.stdout
    assert _held_mb(r) <= 256, f"held {_held_mb(r)} MB after trying to lift the limit"


def test_disk_fill_is_capped_and_leaves_nothing(tmp_path, token):
    """Files of up to 16 MB each, in every writable place, until an error (1 GB at most in all)."""
    hostdir = tmp_path / "hostdir"
    hostdir.mkdir()
    places = [Path("/"), Path("/tmp"), Path("/dev/shm")]
    free_before = {p: shutil.disk_usage(p).free for p in places if p.exists()}
    code = (
        TAMPER
        + _src(
            """\
        import errno
        total = 0
        for d in (os.getcwd(), "/", "/tmp", "/var/tmp", "/dev/shm", "/dev", @HOSTDIR@):
            wrote, i = 0, 0
            while wrote < 512 and total < 1024:
                path = os.path.join(d, @TOKEN@ + "_" + str(i))
                i += 1
                try:
                    with open(path, "wb") as f:
                        for _ in range(4):
                            f.write(b"\\x01" * (4 << 20))
                            f.flush()
                            wrote += 4
                            total += 4
                except OSError as e:
                    if e.errno != errno.EFBIG:
                        break
                print("WROTE_MB", d, wrote, flush=True)
        print("TOTAL_MB", total, flush=True)
        """,
            HOSTDIR=str(hostdir),
            TOKEN=token,
        )
        + ANSWER
    )
    r, elapsed = _run(code, timeout_s=2.0)
    dirs = ("/tmp", "/tmp/*", "/var/tmp", "/dev/shm", "/dev", str(hostdir))
    left = [p for pat in dirs for p in glob.glob(f"{pat}/{token}*")]
    free_after = {p: shutil.disk_usage(p).free for p in free_before}
    for p in left:  # a broken sandbox's files: measured above, removed before anything can fail
        os.unlink(p)
    _assert_bounded(elapsed, 2.0)
    per_place: dict[str, int] = {}
    for d, mb in re.findall(r"WROTE_MB (\S+) (\d+)", r.stdout):
        per_place[d] = max(per_place.get(d, 0), int(mb))
    assert sum(per_place.values()) <= 64, f"wrote {per_place} MB: the sandbox's writable space is not capped"
    assert left == [], f"files left on the host: {left[:5]}"
    for p, before in free_before.items():
        lost_mb = (before - free_after[p]) / 2**20
        assert lost_mb < 64, f"{p} lost {lost_mb:.0f} MB of free space"


FLOODS = {
    "stdout_print": "import sys\nline = 'x' * (1 << 20)\nfor _ in range(300):\n    print(line)\n",
    "stderr_print": "import sys\nline = 'e' * (1 << 20)\nfor _ in range(300):\n    print(line, file=sys.stderr)\n",
    "one_line_os_write": "import os\nblock = b'y' * (1 << 20)\nfor _ in range(300):\n    os.write(1, block)\n",
}


@pytest.mark.parametrize(
    ("how", "runner"),
    [(h, "sync") for h in FLOODS] + [("stdout_print", "async")],
    ids=[f"{h}-sync" for h in FLOODS] + ["stdout_print-async"],
)
def test_output_flood_is_bounded(how, runner):
    with _ParentGrowth() as g:
        r, elapsed = _run(FLOODS[how] + ANSWER, timeout_s=2.0, runner=runner)
    _assert_bounded(elapsed, 2.0)
    assert len(r.stdout) + len(r.stderr) <= MAX_OUTPUT_CHARS
    assert g.mb < MAX_PARENT_GROWTH_MB, f"the parent grew by {g.mb:.0f} MB reading 300 MB of output"


# ---------------------------------------------------------------------------------- signals, ctypes, ptrace


@pytest.mark.parametrize("tamper", [False, True], ids=["plain", "tampered"])
def test_host_processes_cannot_be_killed(tamper, sleeper, canary):
    code = (
        (TAMPER if tamper else "import os, sys\n")
        + _guard(canary)
        + _src(
            """\
        visible = _host_visible()  # before anything: a kill below could take the canary
        for call in ("os.kill(@PID@, 9)", "os.killpg(@PID@, 9)", "os.kill(-@PID@, 9)"):
            try:
                eval(call)
                print("sent", call)
            except BaseException as e:
                print("refused", call, type(e).__name__)
        if visible:
            print("HOST-PIDS-VISIBLE")
        else:
            try:
                os.kill(-1, 9)  # inside a PID namespace this reaches the sandbox only
            except BaseException as e:
                print("refused kill(-1)", type(e).__name__)
        """,
            PID=sleeper.pid,
        )
        + ANSWER
    )
    r, _ = _run(code)
    time.sleep(0.1)
    _assert_running(sleeper)
    _assert_running(canary[0])
    assert "HOST-PIDS-VISIBLE" not in r.stdout, "the code sees the host's processes (no PID namespace)"


def test_ctypes_libc_calls_have_no_host_effect(sleeper, victim):
    f, snapshot = victim
    before = snapshot()
    code = (
        TAMPER
        + _src(
            """\
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            print("kill", libc.kill(@PID@, 9), ctypes.get_errno())
            print("setuid", libc.setuid(0), ctypes.get_errno())
            print("UID", os.getuid())
            fd = libc.open(@V@.encode(), os.O_WRONLY | os.O_TRUNC)
            print("open", fd, ctypes.get_errno())
            if fd >= 0:
                libc.write(fd, b"pwned", 5)
            print("chmod", libc.chmod(@V@.encode(), 0o777), ctypes.get_errno())
            libc.write(1, b"CTYPES-WRITE-OWN-STDOUT\\n", 24)
        except BaseException as e:
            print("refused", type(e).__name__, e)
        """,
            PID=sleeper.pid,
            V=str(f),
        )
        + ANSWER
    )
    r, _ = _run(code)
    time.sleep(0.1)
    _assert_running(sleeper)
    assert snapshot() == before, "the host file was changed through libc"
    assert not re.search(r"\bUID 0\b", r.stdout), "setuid(0) through libc worked"


def test_ptrace_reaches_no_host_process(sleeper, canary):
    code = (
        TAMPER
        + _guard(canary)
        + _src(
            """\
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
            PTRACE_ATTACH = 16
            print("attach victim", libc.ptrace(PTRACE_ATTACH, @PID@, None, None), ctypes.get_errno())
            if _host_visible():
                print("HOST-PIDS-VISIBLE")
            else:
                print("attach pid 1", libc.ptrace(PTRACE_ATTACH, 1, None, None), ctypes.get_errno())
        except BaseException as e:
            print("refused", type(e).__name__, e)
        """,
            PID=sleeper.pid,
        )
        + ANSWER
    )
    r, _ = _run(code)
    time.sleep(0.1)
    _assert_running(sleeper)
    assert "HOST-PIDS-VISIBLE" not in r.stdout


def test_priority_and_affinity_of_host_processes_unchanged(sleeper):
    def settings() -> tuple[str, str]:
        nice = _proc_state_fields(sleeper.pid)[16]  # field 19 of /proc/<pid>/stat
        cpus = re.search(r"Cpus_allowed_list:\s*(\S+)", Path(f"/proc/{sleeper.pid}/status").read_text())
        return nice, cpus.group(1) if cpus else ""

    before = settings()
    code = (
        TAMPER
        + _src(
            """\
        for call in ("os.setpriority(os.PRIO_PROCESS, @PID@, 19)", "os.sched_setaffinity(@PID@, {0})",
                     "os.nice(-5)", "os.nice(5)", "os.sched_setaffinity(0, {0})"):
            try:
                eval(call)
                print("done", call)
            except BaseException as e:
                print("refused", call, type(e).__name__)
        """,
            PID=sleeper.pid,
        )
        + ANSWER
    )
    r, _ = _run(code)
    assert r.passed == 1, r  # renicing itself is harmless and must not break the run
    assert settings() == before, "the code changed a host process's priority or CPU affinity"


def _proc_state_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def test_mount_and_unshare_do_not_change_host_mounts(tmp_path):
    target = tmp_path / "mnt"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    code = (
        TAMPER
        + _src(
            """\
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            def mount(where):
                print("mount", where, libc.mount(b"none", where.encode(), b"tmpfs", 0, None), ctypes.get_errno())
            mount(@T@)
            print("unshare(NEWNS)", libc.unshare(0x00020000), ctypes.get_errno())
            mount(@T@)
            print("unshare(NEWUSER)", libc.unshare(0x10000000), ctypes.get_errno())
            mount(@T@)
        except BaseException as e:
            print("refused", type(e).__name__, e)
        """,
            T=str(target),
        )
        + ANSWER
    )
    try:
        _run(code)
        assert not os.path.ismount(target), "the code mounted over a host directory"
        assert os.listdir(target) == ["keep.txt"]
    finally:
        for _ in range(5):  # undo what a broken sandbox let through
            if not os.path.ismount(target):
                break
            subprocess.run(["umount", "-l", str(target)], check=False)


# ---------------------------------------------------------------------------------- host secrets


def test_parent_environment_is_not_visible(monkeypatch, canary):
    secret = "rollartsecret" + secrets.token_hex(12)
    monkeypatch.setenv("ROLLART_TEST_SECRET", secret)
    holder = _spawn_sleeper("rollartenv" + secrets.token_hex(4), env=dict(os.environ))  # a host process with it
    try:
        for tamper in (False, True):
            code = (
                (TAMPER if tamper else "import os, sys\n")
                + _src(
                    """\
                print("ENV", dict(os.environ))
                paths = ["/proc/self/environ", "/proc/1/environ", f"/proc/{os.getppid()}/environ",
                         "/proc/@HOST@/environ", "/proc/@HOLDER@/environ"]
                try:
                    paths += [f"/proc/{d}/environ" for d in os.listdir("/proc") if d.isdigit()]
                except BaseException as e:
                    print("no /proc listing", type(e).__name__)
                for p in paths:
                    try:
                        print("READ", p, open(p, "rb").read().decode("latin-1"))
                    except BaseException as e:
                        print("refused", p, type(e).__name__)
                print("ATTACK-DONE")
                """,
                    HOST=os.getpid(),
                    HOLDER=holder.pid,
                )
                + ANSWER
            )
            r, _ = _run(code)
            assert "ATTACK-DONE" in r.stdout, r
            _assert_not_leaked(r, [secret])
    finally:
        _stop(holder)


def _host_identifiers() -> list[str]:
    """Strings that identify this machine and that a sandbox has no reason to know."""
    out = []
    for p in ("/etc/machine-id", "/sys/class/dmi/id/product_uuid"):
        try:
            s = Path(p).read_text().strip()
            if len(s) >= 8:
                out.append(s)
        except OSError:
            pass
    for p in glob.glob("/sys/class/net/*/address"):
        s = Path(p).read_text().strip()
        if s and s != "00:00:00:00:00:00":
            out.append(s)
    pid1 = Path("/proc/1/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    if len(pid1) >= 8:
        out.append(pid1)
    if len(socket.gethostname()) >= 6:
        out.append(socket.gethostname())
    return out


def test_host_identity_is_not_visible():
    needles = _host_identifiers()
    if not needles:
        pytest.skip("this machine exposes no identifier to look for")
    code = (
        TAMPER
        + textwrap.dedent("""\
        import glob, socket
        paths = ["/proc/1/cmdline", "/proc/1/environ", "/etc/machine-id", "/etc/hostname",
                 "/sys/class/dmi/id/product_uuid", *glob.glob("/sys/class/net/*/address")]
        for p in paths:
            try:
                print("READ", p, open(p, "rb").read().replace(b"\\0", b" ").decode("latin-1"))
            except BaseException as e:
                print("refused", p, type(e).__name__)
        print("HOST", socket.gethostname(), os.uname().nodename)
        print("ATTACK-DONE")
        """)
        + ANSWER
    )
    r, _ = _run(code)
    assert "ATTACK-DONE" in r.stdout, r
    _assert_not_leaked(r, needles)


def test_tty_console_kmsg_and_sysrq_writes_have_no_effect(token):
    log_before = _kmsg()
    code = (
        TAMPER
        + _src(
            """\
        for path, data in (("/dev/tty", b"sandbox was here\\n"), ("/dev/console", b"sandbox was here\\n"),
                           ("/dev/kmsg", b"<6>" + @TOKEN@.encode() + b"\\n"), ("/proc/sysrq-trigger", b"h")):
            try:
                fd = os.open(path, os.O_WRONLY)
                os.write(fd, data)
                print("WROTE", path)
            except BaseException as e:
                print("refused", path, type(e).__name__)
        """,
            TOKEN=token,
        )
        + ANSWER
    )
    r, _ = _run(code)
    assert "WROTE" not in r.stdout, r.stdout
    log_after = _kmsg()
    if log_before is not None and log_after is not None:
        assert not any(token in rec for rec in log_after), "the code wrote into the host's kernel log"
        help_lines = [sum("sysrq" in rec.lower() for rec in log) for log in (log_before, log_after)]
        assert help_lines[1] <= help_lines[0], "the code triggered sysrq on the host"


@pytest.mark.parametrize("tamper", [False, True], ids=["plain", "tampered"])
def test_project_and_host_packages_cannot_be_imported(tamper):
    import site

    sites = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
    code = (
        (TAMPER if tamper else "import os, sys\n")
        + _src(
            """\
        sys.path[:0] = [@PROJECT@, *@SITES@]
        for name in ("rollart_nb", "ray", "torch", "numpy"):
            try:
                __import__(name)
                print("IMPORTED", name)
            except BaseException as e:
                print("NOIMPORT", name, type(e).__name__)
        """,
            PROJECT=str(PROJECT),
            SITES=sites,
        )
        + ANSWER
    )
    r, _ = _run(code, timeout_s=4.0)
    assert "IMPORTED" not in r.stdout, r.stdout
    assert r.stdout.count("NOIMPORT") == 4, r  # every attempt ran and failed


# ---------------------------------------------------------------------------------- grader forgeries


def test_printed_verdict_lines_do_not_score():
    code = textwrap.dedent("""\
        import os, sys
        fake = "".join(f"{p}PASS {i}\\n" for i in range(4) for p in ("", "@@ ", "x ", "0" * 32 + " "))
        print(fake + "@@ DONE")
        sys.stdout.flush()
        os.write(1, fake.encode())
        os.write(2, fake.encode())
        for fd in range(3, 64):  # every other descriptor, the grader's channel included
            try:
                os.write(fd, fake.encode())
            except OSError:
                pass
        def answer():
            return 41
        """)
    r, _ = _run(code, "assert answer() == 42\nassert answer() == 43\n")
    assert r.passed == 0, r


HIDDEN_SEARCH = {
    "getframe": """\
        f = sys._getframe()
        while f is not None:
            _scan(f, found, set())
            f = f.f_back""",
    "inspect_stack": """\
        import inspect, linecache
        for fi in inspect.stack(0):
            _scan(fi.frame, found, set())
        _scan(dict(linecache.cache), found, set())""",
    "gc_objects": """\
        import gc
        seen = set()
        for o in gc.get_objects():
            _scan(o, found, seen, 4)""",
    "proc_self_fds": """\
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            try:
                found.update(_PAT.findall(os.readlink(f"/proc/self/fd/{fd}")))
                os.set_blocking(fd, False)
                found.update(_PAT.findall(os.pread(fd, 1 << 20, 0).decode("latin-1")))
            except BaseException:
                pass
            try:
                found.update(_PAT.findall(os.read(fd, 1 << 20).decode("latin-1")))
            except BaseException:
                pass""",
    "stdin": """\
        os.set_blocking(0, False)
        try:
            found.update(_PAT.findall(os.read(0, 1 << 20).decode("latin-1")))
        except BlockingIOError:
            pass""",
    "proc_memory_of_every_process": """\
        budget = [256 << 20]
        for d in [d for d in os.listdir("/proc") if d.isdigit()]:
            for part in ("cmdline", "environ"):
                try:
                    found.update(_PAT.findall(open(f"/proc/{d}/{part}", "rb").read().decode("latin-1")))
                except BaseException:
                    pass
            try:
                maps = open(f"/proc/{d}/maps").read().splitlines()
                mem = open(f"/proc/{d}/mem", "rb", 0)
            except BaseException:
                continue
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if "r" not in line.split()[1] or hi - lo > (64 << 20) or budget[0] <= 0:
                    continue
                try:
                    mem.seek(lo)
                    found.update(_PAT.findall(mem.read(hi - lo).decode("latin-1")))
                    budget[0] -= hi - lo
                except BaseException:
                    pass""",
}

SCAN = r"""
import re
_PAT = re.compile("hidden" + "rollarthostile" + "[0-9a-f]{16}")
def _scan(obj, found, seen, depth=0):
    if depth > 6 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (str, bytes)):
        found.update(_PAT.findall(obj.decode("latin-1") if isinstance(obj, bytes) else obj))
        return
    kind = type(obj).__name__
    if isinstance(obj, dict):
        items = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    elif kind == "code":
        items = list(obj.co_consts)
    elif kind == "function":
        items = [obj.__code__, obj.__defaults__]
    elif kind == "frame":
        items = [obj.f_code, dict(obj.f_locals), obj.f_globals]
    else:
        return
    for x in items:
        _scan(x, found, seen, depth + 1)
"""


@pytest.mark.parametrize("how", list(HIDDEN_SEARCH))
def test_hidden_tests_cannot_be_found_by_the_solution(how):
    """answer() must return a literal only the tests hold; the solution goes looking for it."""
    hidden = "hidden" + "rollarthostile" + secrets.token_hex(8)
    body = textwrap.indent(textwrap.dedent(HIDDEN_SEARCH[how]), "        ")
    code = (
        TAMPER
        + SCAN
        + (
            "def _find():\n    found = set()\n    try:\n" + body + "\n    except BaseException as e:\n"
            "        print('search failed', type(e).__name__)\n    return sorted(found)\n"
            "print('FOUND AT LOAD', _find(), flush=True)\n"
            "def answer():\n    hits = _find()\n    return hits[0] if hits else 'not found'\n"
        )
    )
    tests = f"assert answer() == {hidden!r}\ndef test_again():\n    assert answer() == {hidden!r}\n"
    r, _ = _run(code, tests)
    assert "FOUND AT LOAD" in r.stdout, r
    assert r.passed == 0, f"the solution found the hidden answer: {r}"
    assert hidden not in r.stdout and hidden not in r.stderr


_SEPARATORS = {
    "lf": "\n",
    "cr": "\r",
    "crlf": "\r\n",
    "vt": "\x0b",
    "ff": "\x0c",
    "fs": "\x1c",
    "gs": "\x1d",
    "rs": "\x1e",
    "nel": "\x85",
    "ls": "\u2028",
    "ps": "\u2029",
}
_INJECT_TESTS = "assert answer() == 42\nassert answer() == 43\n"


def _injection(seps: list[str]) -> str:
    return "x" + "".join(s + "@@ PASS 0" + s + "@@ PASS 1" + s + "@@ DONE" + s for s in seps)


@pytest.mark.parametrize(
    ("where", "sep"),
    [
        ("raise_in_call", "all"),
        ("raise_at_load", "all"),
        ("assert_message", "all"),
        ("returned_value", "all"),
        ("printed_by_tests", "lf"),
        ("printed_by_tests", "all"),
    ]
    + [("raise_in_call", s) for s in _SEPARATORS],
)
def test_verdict_lines_cannot_be_injected_through_messages(where, sep):
    """A solution's error text or value ends up in verdict lines: line breaks in it must not forge PASS."""
    msg = _injection(list(_SEPARATORS.values()) if sep == "all" else [_SEPARATORS[sep]])
    tests = _INJECT_TESTS
    if where == "raise_in_call":
        code = f"def answer():\n    raise ValueError({msg!r})\n"
    elif where == "raise_at_load":
        code = f"raise ValueError({msg!r})\n"
    elif where == "assert_message":
        code = f"def answer():\n    return {msg!r}\n"
        tests = "assert answer() == 42, answer()\nassert answer() == 43, answer()\n"
    elif where == "printed_by_tests":  # trusted tests that print a result (debug output) share the verdicts' pipe
        code = f"def answer():\n    return {msg!r}\n"
        tests = "print(answer())\n" + tests
    else:  # a value the grader may echo when a comparison fails
        code = f"def answer():\n    return [{msg!r}]\n"
    r, _ = _run(code, tests)
    assert r.passed == 0, f"forged verdicts counted: {r}"


RIGGED_EQ = (
    "class E:\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n"
    "    __hash__ = lambda s: 0\n    __bool__ = lambda s: True\n"
)
RIGGED = {
    "eq_always_object": (RIGGED_EQ + "def answer():\n    return E()\n", "assert answer() == 42\nassert answer()\n"),
    "int_subclass_eq": (
        "class I(int):\n    __eq__ = lambda s, o: True\n    __hash__ = int.__hash__\ndef answer():\n    return I(0)\n",
        "assert answer() == 42\n",
    ),
    "str_subclass_eq": (
        "class S(str):\n    __eq__ = lambda s, o: True\n    __hash__ = str.__hash__\ndef answer():\n    return S('')\n",
        "assert answer() == 'forty-two'\n",
    ),
    "list_subclass_eq": (
        "class L(list):\n    __eq__ = lambda s, o: True\ndef answer():\n    return L()\n",
        "assert answer() == [4, 2]\n",
    ),
    "dict_subclass_eq": (
        "class D(dict):\n    __eq__ = lambda s, o: True\ndef answer():\n    return D()\n",
        "assert answer() == {'a': 1}\n",
    ),
    "eq_object_nested_in_list": (RIGGED_EQ + "def answer():\n    return [E(), E()]\n", "assert answer() == [4, 2]\n"),
    "pickle_reduce_gadget": (
        RIGGED_EQ + "E.__reduce__ = lambda s: (eval, (\"type('E', (), {'__eq__': lambda s, o: "
        "True, '__hash__': lambda s: 0})()\",))\ndef answer():\n    return E()\n",
        "assert answer() == 42\n",
    ),
    "bool_for_int": ("def answer():\n    return True\n", "assert answer() == 1\n"),
    "int_for_bool": ("def answer():\n    return 1\n", "assert answer() == True\n"),
    "float_for_int": ("def answer():\n    return 3.0\n", "assert answer() == 3\n"),
    "bools_in_list_for_ints": ("def answer():\n    return [True, False]\n", "assert answer() == [1, 0]\n"),
    "float_in_dict_for_int": ("def answer():\n    return {'n': 2.0}\n", "assert answer() == {'n': 2}\n"),
    "bool_in_set_for_int": ("def answer():\n    return {True, 2}\n", "assert answer() == {1, 2}\n"),
    "bool_in_frozenset_for_int": (
        "def answer():\n    return frozenset({False, 5})\n",
        "assert answer() == frozenset({0, 5})\n",
    ),
    "float_in_set_for_int": ("def answer():\n    return {2.0}\n", "assert answer() == {2}\n"),
    "bool_dict_key_for_int": ("def answer():\n    return {True: 'a'}\n", "assert answer() == {1: 'a'}\n"),
    "replaced_after_first_call": (
        RIGGED_EQ + "def answer():\n    global answer\n    answer = lambda: E()\n    return 0\n",
        "assert answer() == 42\nassert answer() == 42\n",
    ),
}


@pytest.mark.parametrize("how", list(RIGGED))
def test_rigged_or_loosely_equal_results_do_not_pass(how):
    code, tests = RIGGED[how]
    r, _ = _run(code, tests)
    assert r.passed == 0, f"a rigged or wrong-typed result passed: {r}"


SHADOWED = {
    "abs_in_tolerance_check": (
        "def sqrt2():\n    return 0.0\ndef abs(x):\n    return 0.0\n",
        "assert abs(sqrt2() - 1.41421356) < 1e-6\n",
    ),
    "sorted_on_both_sides": (
        "def perm():\n    return [9, 9]\ndef sorted(x):\n    return []\n",
        "assert sorted(perm()) == sorted([3, 1, 2])\n",
    ),
    "sum_on_both_sides": (
        "def parts():\n    return [0]\ndef sum(x):\n    return 0\n",
        "assert sum(parts()) == sum([1, 2, 3])\n",
    ),
}


@pytest.mark.parametrize("how", list(SHADOWED))
def test_solution_cannot_shadow_builtins_the_tests_use(how):
    code, tests = SHADOWED[how]
    r, _ = _run(code, tests)
    assert r.passed == 0, f"the tests called the solution's {how.split('_')[0]}(): {r}"


EXITS = {
    "sys_exit_at_load": "import sys\nprint('@@ PASS 0\\nPASS 0')\nsys.exit(0)\n",
    "os_exit_at_load": "import os\nprint('@@ PASS 0\\nPASS 0', flush=True)\nos._exit(0)\n",
    "systemexit_in_call": "def answer():\n    raise SystemExit(0)\n",
    "os_exit_in_call": "import os\ndef answer():\n    os._exit(0)\n",
    "keyboardinterrupt_in_call": "def answer():\n    raise KeyboardInterrupt\n",
    "baseexception_subclass_in_call": "class Out(BaseException):\n    pass\ndef answer():\n    raise Out()\n",
    "generatorexit_in_call": "def answer():\n    raise GeneratorExit\n",
    "sigkill_self_in_call": "import os\ndef answer():\n    os.kill(os.getpid(), 9)\n",
    "recursion_in_call": "def answer():\n    return answer()\n",
}


@pytest.mark.parametrize("how", list(EXITS))
def test_exiting_early_does_not_score(how):
    r, elapsed = _run(EXITS[how], "assert answer() == 42\ndef test_two():\n    assert answer() == 42\n")
    _assert_bounded(elapsed, 2.0)
    assert r.passed == 0, r


MONKEYPATCH = {
    "builtins_exec_noop": "import builtins\nbuiltins.exec = lambda *a, **k: None\n",
    "builtins_compile_to_pass": "import builtins\n_c = compile\n"
    "builtins.compile = lambda *a, **k: _c('pass', 'x', 'exec')\n",
    "assertionerror_swapped": "import builtins\nclass Quiet(Exception):\n    pass\n"
    "builtins.AssertionError = Quiet\n__builtins__ = {'AssertionError': Quiet}\n",
    "type_and_isinstance_rigged": "import builtins\nbuiltins.type = lambda *a: object\n"
    "builtins.isinstance = lambda *a: True\n",
    "json_and_modules_swapped": "import sys, json\njson.loads = lambda *a, **k: {'ok': ['I', '42']}\n"
    "json.dumps = lambda *a, **k: '{}'\nsys.modules['json'] = json\n",
}


@pytest.mark.parametrize("how", list(MONKEYPATCH))
def test_monkeypatching_the_interpreter_does_not_score(how):
    r, _ = _run(
        MONKEYPATCH[how] + "def answer():\n    return 41\n",
        "assert answer() == 42\ndef test_two():\n    assert answer() == 42\n",
    )
    assert r.passed == 0, r


RETURN_BOMBS = {
    "huge_string": "def answer():\n    return 'x' * (64 << 20)\n",
    "deep_nesting": "def answer():\n    x = []\n    for _ in range(100_000):\n        x = [x]\n    return x\n",
    "cycle": "def answer():\n    a = []\n    a.append(a)\n    return a\n",
    "huge_int": "import sys\nsys.set_int_max_str_digits(0)\ndef answer():\n    return 10 ** 200_000\n",
    "many_items": "def answer():\n    return list(range(2_000_000))\n",
}


@pytest.mark.parametrize("how", list(RETURN_BOMBS))
def test_oversized_results_are_refused_quickly(how):
    with _ParentGrowth() as g:
        r, elapsed = _run(RETURN_BOMBS[how])
    _assert_bounded(elapsed, 2.0)
    assert r.passed == 0, r
    assert g.mb < MAX_PARENT_GROWTH_MB, f"the parent grew by {g.mb:.0f} MB"


# ---------------------------------------------------------------------------------- second review: kernel interfaces

# (add_key, keyctl, request_key) of the machines the seccomp filter covers
_KEY_SYSCALLS = {"x86_64": (248, 250, 249), "aarch64": (217, 219, 218)}

# Runs in a child of the test process (so pytest's own keyring stays as it is): joins a fresh
# anonymous session keyring, adds a user key holding the secret, runs the attack in the
# sandbox, then lists what its keyrings hold afterwards.
KEYRING_PARENT = r"""
import ctypes, json, struct, sys
cfg = json.loads(sys.stdin.read())
sys.path.insert(0, cfg["project"])
from rollart_nb.envs import run_sandboxed
ADD_KEY, KEYCTL, _ = cfg["nr"]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L = ctypes.c_long
buf = ctypes.create_string_buffer(1 << 16)
def keyctl(op, arg):  # KEYCTL_READ (11) / KEYCTL_DESCRIBE (6) into buf
    n = libc.syscall(L(KEYCTL), L(op), L(arg), buf, L(len(buf)), L(0))
    return buf.raw[:min(n, len(buf))] if n >= 0 else None
def ids(ring):
    raw = keyctl(11, ring) or b""
    return list(struct.unpack("%di" % (len(raw) // 4), raw[: len(raw) // 4 * 4]))
def describe(k):
    raw = keyctl(6, k)
    return raw.rstrip(b"\0").decode(errors="replace") if raw is not None else "?"
if libc.syscall(L(KEYCTL), L(1), None, L(0), L(0), L(0)) < 0:  # KEYCTL_JOIN_SESSION_KEYRING, anonymous
    print(json.dumps({"skip": "no kernel keyrings for this process (errno %d)" % ctypes.get_errno()}))
    sys.exit()
secret = cfg["secret"].encode()
kid = libc.syscall(L(ADD_KEY), b"user", cfg["desc"].encode(), secret, L(len(secret)), L(-3))  # into @s
if kid < 0:
    print(json.dumps({"skip": "add_key failed here (errno %d)" % ctypes.get_errno()}))
    sys.exit()
r = run_sandboxed(cfg["code"], "assert answer() == 42\n", 3.0, isolation="bwrap")
own = keyctl(11, kid)
print(json.dumps({
    "result": {"stdout": r.stdout, "stderr": r.stderr, "error": r.error, "failures": r.failures},
    "own_payload": own.decode(errors="replace") if own is not None else None,
    "session": [describe(k) for k in ids(-3)], "user": [describe(k) for k in ids(-4)],
    "user_session": [describe(k) for k in ids(-5)], "proc_keys": open("/proc/keys").read(),
}))
"""

KEYRING_ATTACK = r"""
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L = ctypes.c_long
ADD_KEY, KEYCTL, REQUEST_KEY = @NR@
buf = ctypes.create_string_buffer(1 << 16)
def kc(op, arg):
    n = libc.syscall(L(KEYCTL), L(op), L(arg), buf, L(len(buf)), L(0))
    return n, ctypes.get_errno(), buf.raw[:max(0, min(n, len(buf)))]
try:
    print("PROC-KEYS", open("/proc/keys").read())
except BaseException as e:
    print("no /proc/keys", type(e).__name__)
found = []
for ring in (-1, -2, -3, -4, -5):  # thread, process, session, user, user-session keyrings
    n, err, raw = kc(11, ring)  # KEYCTL_READ of a keyring: the ids of its keys
    print("RING", ring, n, err)
    found += struct.unpack("%di" % (len(raw) // 4), raw[: len(raw) // 4 * 4])
k = libc.syscall(L(KEYCTL), L(10), L(-3), b"user", @DESC@.encode(), L(0))  # KEYCTL_SEARCH
print("SEARCH", k, ctypes.get_errno())
k2 = libc.syscall(L(REQUEST_KEY), b"user", @DESC@.encode(), None, L(0))
print("REQUEST", k2, ctypes.get_errno())
for key in found + [k, k2]:
    if key > 0:
        n, err, raw = kc(11, key)
        print("KEY", key, n, err, raw.decode("latin-1"))
        n, err, raw = kc(6, key)  # KEYCTL_DESCRIBE
        print("DESCRIBE", key, n, err, raw.decode("latin-1"))
for ring in (-3, -4, -5):
    print("ADD", ring, libc.syscall(L(ADD_KEY), b"user", @PLANT@.encode(), b"planted", L(7), L(ring)),
          ctypes.get_errno())
print("ATTACK-DONE", flush=True)
"""


def test_session_keyring_of_the_caller_is_unreachable(token):
    """Kernel keyrings are not namespaced and a new session keeps its session keyring: the code
    reads the caller's session keyring (KEYCTL_READ, KEYCTL_SEARCH, request_key) for a secret
    key and plants keys of its own there with add_key."""
    import platform

    nr = _KEY_SYSCALLS.get(platform.machine())
    if nr is None:
        pytest.skip(f"no keyring syscall numbers for {platform.machine()}")
    secret = "rollartkeysecret" + secrets.token_hex(12)
    desc, plant = "rollartkey" + token[-16:], "planted" + token[-16:]
    code = TAMPER + _src(KEYRING_ATTACK, NR=nr, DESC=desc, PLANT=plant) + ANSWER
    cfg = {"project": str(PROJECT), "nr": nr, "secret": secret, "desc": desc, "code": code}
    p = subprocess.run(
        [sys.executable, "-I", "-c", KEYRING_PARENT], input=json.dumps(cfg), capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    res = out["result"]
    assert "ATTACK-DONE" in res["stdout"], res
    leaks = [name for name, text in res.items() if secret in (text if isinstance(text, str) else "\n".join(text))]
    assert not leaks, f"the caller's key leaked into {leaks}: {res['stdout'][-800:]}"
    assert out["own_payload"] == secret, "the check is broken: the parent cannot read its own key back"
    planted = [d for ring in ("session", "user", "user_session") for d in out[ring] if plant in d]
    assert not planted and plant not in out["proc_keys"], f"the code planted a key in the caller's keyrings: {planted}"


def _free_vsock_port() -> int | None:
    """A vsock port nothing on the host holds, or None where this host has no AF_VSOCK."""
    af = getattr(socket, "AF_VSOCK", None)
    if af is None:
        return None
    for _ in range(20):
        port = 20000 + secrets.randbelow(40000)
        try:
            s = socket.socket(af, socket.SOCK_STREAM)
        except OSError:
            return None
        try:
            s.bind((socket.VMADDR_CID_ANY, port))
            return port
        except OSError:
            continue
        finally:
            s.close()
    return None


def test_vsock_is_refused_and_binds_no_host_port():
    """AF_VSOCK is not separated by a network namespace: a port bound inside would be the host's
    (and a connection would reach the hypervisor). The socket must not even be created."""
    port = _free_vsock_port()
    code = (
        TAMPER
        + _src(
            """\
        import socket, time
        try:
            s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
            print("VSOCK-CREATED", flush=True)
            s.bind((socket.VMADDR_CID_ANY, @PORT@))
            s.listen()
            print("VSOCK-BOUND", flush=True)
        except BaseException as e:
            print("VSOCK-REFUSED", type(e).__name__, getattr(e, "errno", None), flush=True)
        time.sleep(1.0)
        """,
            PORT=port or 47000,
        )
        + ANSWER
    )
    busy: list[str] = []
    done = threading.Event()

    def probe() -> None:  # is the port ever taken while the sandbox runs?
        while not done.is_set():
            s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
            try:
                s.bind((socket.VMADDR_CID_ANY, port))
            except OSError as e:
                busy.append(str(e))
            finally:
                s.close()
            done.wait(0.02)

    t = threading.Thread(target=probe, daemon=True) if port is not None else None
    if t is not None:
        t.start()
    try:
        r, _ = _run(code, timeout_s=3.0)
    finally:
        done.set()
        if t is not None:
            t.join()
    assert "VSOCK-REFUSED" in r.stdout and "VSOCK-CREATED" not in r.stdout, r.stdout
    assert not busy, f"binding vsock port {port} inside the sandbox took it on the host: {busy[:1]}"


def _shmem_mb() -> int:
    m = re.search(r"^Shmem:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    return int(m.group(1)) // 1024 if m else 0


class _HostShmemGrowth:
    """Peak growth of the host's shared memory (``Shmem`` in /proc/meminfo) over a block, in MiB."""

    def __enter__(self) -> _HostShmemGrowth:
        self.base, self.mb, self._done = _shmem_mb(), 0, threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()
        return self

    def _watch(self) -> None:
        while not self._done.is_set():
            self.mb = max(self.mb, _shmem_mb() - self.base)
            self._done.wait(0.02)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._t.join()
        self.mb = max(self.mb, _shmem_mb() - self.base)


def test_memfd_is_refused_and_forked_memfds_hold_no_host_memory():
    """memfd pages live outside every process's address space, so RLIMIT_AS does not count them:
    6 forked children each fill memfds (up to 128 MiB each) and sleep past the run."""
    code = (
        TAMPER
        + textwrap.dedent("""\
        import time
        try:
            os.memfd_create("probe")
            print("MEMFD-CREATED", flush=True)
        except OSError as e:
            print("MEMFD-REFUSED", e.errno, flush=True)
        buf = b"\\x01" * (8 << 20)
        kids = 0
        for i in range(6):
            try:
                pid = os.fork()
            except BaseException as e:
                print("fork failed", type(e).__name__, flush=True)
                break
            if pid == 0:
                for _ in range(16):
                    try:
                        os.write(os.memfd_create("x"), buf)
                    except BaseException:
                        break
                time.sleep(30)
                os._exit(0)
            kids += 1
        print("KIDS", kids, flush=True)
        time.sleep(30)
        """)
        + ANSWER
    )
    with _HostShmemGrowth() as g:
        r, elapsed = _run(code, timeout_s=2.0, memory_mb=256)
        time.sleep(0.1)
    _assert_bounded(elapsed, 2.0)
    assert "KIDS 6" in r.stdout, r  # the attack ran: it forked its children
    assert "MEMFD-REFUSED" in r.stdout and "MEMFD-CREATED" not in r.stdout, r.stdout
    assert g.mb <= 64, f"the host's shared memory grew by {g.mb} MiB during the run"


def test_sysv_shared_memory_holds_no_host_memory():
    """SysV shared memory (shmget) is memory outside the address-space limit too: each segment
    counts against RLIMIT_AS only while attached, and lives in host RAM until the sandbox's IPC
    namespace goes away. The code holds 8 x 64 MiB segments, attached one at a time."""
    code = (
        TAMPER
        + textwrap.dedent("""\
        import time
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            libc.shmat.restype = ctypes.c_void_p
            libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
            libc.shmdt.argtypes = [ctypes.c_void_p]
            got = 0
            for _ in range(8):
                sid = libc.shmget(0, 64 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
                if sid < 0:
                    print("shmget refused", ctypes.get_errno())
                    break
                p = libc.shmat(sid, None, 0)
                if p is None or p == ctypes.c_void_p(-1).value:
                    print("shmat refused", ctypes.get_errno())
                    break
                ctypes.memset(p, 1, 64 << 20)
                libc.shmdt(p)
                got += 64
                print("SHM_MB", got, flush=True)
        except BaseException as e:
            print("refused", type(e).__name__, e, flush=True)
        print("ATTACK-DONE", flush=True)
        time.sleep(1.0)
        """)
        + ANSWER
    )
    with _HostShmemGrowth() as g:
        r, elapsed = _run(code, timeout_s=2.5, memory_mb=256)
    _assert_bounded(elapsed, 2.5)
    assert "ATTACK-DONE" in r.stdout, r
    assert g.mb <= 64, f"the host's shared memory grew by {g.mb} MiB (the code held {_held_mb(r, 'SHM_MB')} MiB)"


# ---------------------------------------------------------------------------------- second review: grader logic

STOP_RAISERS = {
    "raise_stopiteration": "def solve(x):\n    raise StopIteration\n",
    "next_of_empty": "def solve(x):\n    return next(iter([]))\n",
    "stopiteration_subclass": "class Done(StopIteration):\n    pass\ndef solve(x):\n    raise Done()\n",
}
STOP_TESTS = {
    "zip_map_in_test_function": "def test_pairs():\n    for got, want in zip(map(solve, [1, 2, 3]), [2, 4, 6]):\n"
    "        assert got == want\n",
    "all_map": "assert all(map(lambda x: solve(x) == 2 * x, [1, 2, 3]))\n",
    "not_any_map": "assert not any(map(lambda x: solve(x) != 2 * x, [1, 2, 3]))\n",
    "filter_mismatches": "assert list(filter(lambda x: solve(x) != 2 * x, [1, 2, 3])) == []\n",
    "top_level_for_over_zip": "for x, got in zip([1, 2, 3], map(solve, [1, 2, 3])):\n    assert got == 2 * x\n",
}


@pytest.mark.parametrize("raiser", list(STOP_RAISERS))
@pytest.mark.parametrize("case", list(STOP_TESTS))
def test_stopiteration_does_not_end_a_test_loop_as_passed(case, raiser):
    """StopIteration raised by the solution inside map/zip/filter silently ends the iteration,
    so a loop of asserts (or all()/any()) over the solution's results checks nothing."""
    r, _ = _run(STOP_RAISERS[raiser], STOP_TESTS[case])
    assert r.total == 1 and r.passed == 0, f"a StopIteration passed the test: {r}"


def test_stopiteration_tests_pass_an_honest_solution():
    r, _ = _run("def solve(x):\n    return 2 * x\n", "".join(STOP_TESTS.values()))
    assert (r.passed, r.total, r.error) == (len(STOP_TESTS), len(STOP_TESTS), ""), r


NAME_SPRAY = """\
def _ok(*a, **k):
    return None
def approx(x, *a, **k):
    return 0
def isclose(*a, **k):
    return True
assert_allclose = _ok
for _n in ["test_solution", "test_basic", "test_edge_cases", "test_x", *[f"test_{i}" for i in range(50)]]:
    globals()[_n] = _ok
def f(x):
    return 0
solve = f
"""
BOUND_NAMES = {  # name -> (tests, whether a setup step fails)
    "from_pytest_import_approx": ("from pytest import approx\nassert f(1.5) == approx(3.0)\n", True),
    "numpy_assert_allclose_in_test_fn": (
        "from numpy.testing import assert_allclose\ndef test_b():\n    assert_allclose(f(2), 4.0)\n",
        True,
    ),
    "pytest_parametrize_guessed_test_names": (
        "import pytest\n\n@pytest.mark.parametrize('x, y', [(1, 2), (2, 4)])\ndef test_basic(x, y):\n"
        "    assert solve(x) == y\n\n@pytest.mark.parametrize('x', [10, 20])\ndef test_edge_cases(x):\n"
        "    assert solve(x) == 2 * x\n",
        True,
    ),
    "failing_decorator_guessed_test_name": (
        "import math\n@math.no_such_decorator\ndef test_x():\n    assert f(1) == 2\n",
        True,
    ),
    "import_in_try_except": (
        "try:\n    from pytest import approx\nexcept ImportError:\n    pass\nassert f(1.5) == approx(3.0)\n",
        False,
    ),
    "global_bound_in_def": (
        "def _load():\n    global approx\n    from pytest import approx\ntry:\n    _load()\n"
        "except ImportError:\n    pass\nassert f(1.5) == approx(3.0)\n",
        False,
    ),
    "successful_import_also_solution_defined": ("from math import isclose\nassert isclose(f(1.5), 3.0)\n", False),
}


@pytest.mark.parametrize("how", list(BOUND_NAMES))
def test_names_the_tests_bind_are_never_filled_from_the_solution(how):
    """A test's import fails in the grader (no pytest, no numpy there), or a test_* definition
    fails: the solution defines the same names (approx, assert_allclose, test_basic...) so the
    tests would call its stubs."""
    tests, setup_fails = BOUND_NAMES[how]
    r, _ = _run(NAME_SPRAY, tests)
    assert r.total >= 1 and r.passed == 0, f"the tests used the solution's names: {r}"
    if setup_fails:
        assert "setup" in r.error and "failed" in r.error, r


BLOCK_TESTS = """\
for x, y in [(1, 2), (2, 4)]:
    assert f(x) == y
with open('/dev/null'):
    assert f(3) == 6
if True:
    assert f(4) == 8
while True:
    assert f(5) == 10
    break
try:
    assert f(6) == 12
finally:
    pass
def test_smoke():
    assert f(1) is not None
"""


def test_asserts_in_top_level_blocks_are_tests():
    """Asserts inside a top-level for/with/if/while/try were setup steps: a wrong solution failed
    none of them, and they were not counted in the total."""
    r, _ = _run("def f(x):\n    return -1\n", BLOCK_TESTS)
    assert (r.passed, r.total) == (1, 6), r  # only test_smoke passes
    assert len(r.failures) == 5, r.failures
    r, _ = _run("def f(x):\n    return 2 * x\n", BLOCK_TESTS)
    assert (r.passed, r.total, r.error) == (6, 6, ""), r


NAN_CASES = {
    "max_of_errors": (
        "def sqrt(x):\n    return 1.0 if x == 1 else float('nan')\n",
        "assert max(abs(sqrt(x) - x ** 0.5) for x in [1, 2, 3, 5]) < 1e-9\n",
    ),
    "negated_tolerance": ("def sqrt(x):\n    return float('nan')\n", "assert not abs(sqrt(2) - 1.41421356) > 1e-6\n"),
    "nan_in_list": (
        "def roots():\n    return [1.0, float('nan')]\n",
        "assert not any(abs(a - b) > 1e-6 for a, b in zip(roots(), [1.0, 1.41421356]))\n",
    ),
    "nan_in_dict": (
        "def stats():\n    return {'mean': float('nan')}\n",
        "assert not abs(stats()['mean'] - 2.5) > 1e-9\n",
    ),
    "nan_top_level_value": ("ROOT2 = float('nan')\n", "assert not abs(ROOT2 - 1.41421356) > 1e-6\n"),
}


@pytest.mark.parametrize("how", list(NAN_CASES))
def test_nan_results_do_not_pass_tolerance_checks(how):
    """Every comparison with NaN is false, so `not abs(x - y) > tol` and max() of errors pass."""
    code, tests = NAN_CASES[how]
    r, _ = _run(code, tests)
    assert r.passed == 0, f"a NaN result passed a tolerance test: {r}"


def test_nan_tolerance_tests_pass_honest_solutions():
    code = (
        "def sqrt(x):\n    return x ** 0.5\ndef roots():\n    return [1.0, 2 ** 0.5]\n"
        "def stats():\n    return {'mean': 2.5}\nROOT2 = 2 ** 0.5\n"
    )
    tests = "".join(t.replace("1e-9\n", "1e-6\n") for _, t in NAN_CASES.values())
    r, _ = _run(code, tests)
    assert (r.passed, r.total) == (len(NAN_CASES), len(NAN_CASES)), r


STRICT_TESTS = """\
assert f(0) in (1, 2)
assert f(0) in [1, 2]
assert f(0) in {1, 2}
assert f(0) in {1: 'one'}
assert f(0) in range(1, 3)
assert 1 == f(0) == 1
assert 0 < f(0) == 1
assert 1 == f(0) in (1, 2)
assert [f(0)] in [[1]]
assert (f(0), 2) in {(1, 2)}
"""


@pytest.mark.parametrize("value", ["True", "1.0", "1"])
def test_membership_and_chained_comparisons_are_strict(value):
    """`True in (1, 2)` and `1 == True == 1` hold in Python: a wrong-typed result passed them."""
    r, _ = _run(f"def f(x):\n    return {value}\n", STRICT_TESTS)
    n = STRICT_TESTS.count("assert")
    if value == "1":  # the honest answer still passes every form
        assert (r.passed, r.total) == (n, n), r
    else:
        assert (r.passed, r.total) == (0, n), f"{value} passed as 1: {r}"


# ---------------------------------------------------------------------------------- second review: the parent


def _assert_clean_result(r: object) -> None:
    assert isinstance(r, SandboxResult), r
    for text in _fields(r).values():
        text.encode("utf-8")  # strict: a lone surrogate would raise here (and in any logger or JSON writer)


PARENT_BREAKERS = {
    "exit_200_at_load": "import os\nos._exit(200)\n",
    "exit_160_at_load": "import os\nos._exit(160)\n",
    "exit_163_at_load": "import os\nos._exit(163)\n",  # 128 + 35: a real-time signal number
    "exit_168_at_load": "import os\nos._exit(168)\n",
    "exit_190_at_load": "import os\nos._exit(190)\n",
    "realtime_signal_at_load": "import os\nos.kill(os.getpid(), 40)\n",
    "exit_168_in_call": "import os\ndef answer():\n    os._exit(168)\n",
    "surrogate_in_code": "X = '\ud800'\ndef answer():\n    return '\udcff'\n",
    "surrogate_in_load_error": "raise ValueError('\\ud800 at load')\n",
    "surrogate_in_exception": "def answer():\n    raise ValueError('\\udcff in call')\n",
    "surrogate_in_exception_type": "E = type('\\ud800', (Exception,), {})\ndef answer():\n    raise E('\\ud800')\n",
    "surrogate_echoed_by_assert": "def answer():\n    return '\\udcff'\n",
    "invalid_utf8_output": "import os\nos.write(1, b'\\xff\\xfe\\xed\\xa0\\x80')\nos.write(2, b'\\xc3')\n",
}


@pytest.mark.parametrize("how", list(PARENT_BREAKERS))
def test_exit_statuses_and_surrogates_do_not_raise_in_the_parent(how):
    """An exit status read as a signal number that is no Signals member, or a lone surrogate in
    the code or in a message, made run_sandboxed raise (or return text that cannot be encoded)."""
    r, _ = _run(PARENT_BREAKERS[how], "assert answer() == 42, answer()\n")
    _assert_clean_result(r)
    assert r.passed == 0, r


BAD_ARGS = [
    ("timeout_s", float("inf")),
    ("timeout_s", "5"),
    ("timeout_s", 0),
    ("timeout_s", -1),
    ("timeout_s", float("nan")),
    ("timeout_s", None),
    ("memory_mb", "256"),
    ("memory_mb", 16),
    ("memory_mb", 256.0),
    ("memory_mb", 0),
]


@pytest.mark.parametrize("runner", ["sync", "async"])
@pytest.mark.parametrize(("arg", "value"), BAD_ARGS, ids=[f"{a}={v!r}" for a, v in BAD_ARGS])
def test_bad_limits_raise_config_error(arg, value, runner):
    """An infinite or non-numeric timeout never fired (or failed deep inside); say so up front."""
    from rollart_nb.errors import ConfigError

    kw = {"timeout_s": 1.0, "memory_mb": 256, arg: value}
    with pytest.raises(ConfigError):
        if runner == "async":
            asyncio.run(arun_sandboxed(ANSWER, ANSWER_TESTS, **kw, **_ASYNC_KW))
        else:
            run_sandboxed(ANSWER, ANSWER_TESTS, **kw, **_SYNC_KW)


def _descendants() -> dict[int, str]:
    """pid -> state of every process below this one."""
    children: dict[int, list[tuple[int, str]]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = _proc_state_fields(int(d))
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append((int(d), fields[0]))
    out, todo = {}, [os.getpid()]
    while todo:
        for pid, state in children.get(todo.pop(), []):
            out[pid] = state
            todo.append(pid)
    return out


def test_cancelled_async_runs_leave_no_process_or_fd(token):
    """wait_for(arun_sandboxed(...), 0.05) (five times, then at other delays) cancels while the
    sandboxes start and the code (over the 64 KiB pipe buffer) is still being fed: nothing may
    keep running, and no fd may leak."""
    run_sandboxed(ANSWER, ANSWER_TESTS, 5, **_SYNC_KW)  # one-time setup done: the cancels hit the runs
    before = set(_descendants())
    code = (
        f"open('/proc/self/comm', 'w').write({_comm_tag(token)!r})\nimport time\ntime.sleep(30)\n#"
        + "x" * 300_000
        + ANSWER
    )  # 30 s: a broken sandbox delays the suite, not forever

    async def main() -> tuple[int, int, dict[int, str]]:
        fds = len(os.listdir("/proc/self/fd"))
        for delay in [0.05] * 5 + [0.01, 0.02, 0.1, 0.2, 0.3]:  # where it lands varies with the machine
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(arun_sandboxed(code, ANSWER_TESTS, 1, **_ASYNC_KW), delay)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            left = {p: s for p, s in _descendants().items() if p not in before}
            if not left and len(os.listdir("/proc/self/fd")) <= fds + 2:
                break
            await asyncio.sleep(0.05)
        return fds, len(os.listdir("/proc/self/fd")), left

    try:
        fds_before, fds_after, left = asyncio.run(main())
        assert not left, f"processes of cancelled runs still exist (pid: state): {left}"
        assert _leftovers(token) == [], "a cancelled run's code is still running"
        assert fds_after <= fds_before + 2, f"cancelled runs leaked fds: {fds_before} -> {fds_after}"
    finally:
        for pid in set(_descendants()) - before:  # what a broken sandbox left: ours, by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        gc.collect()  # finalize abandoned transports now, not while pytest reports a failure


def test_concurrent_cold_runs_return_in_time_with_correct_results():
    """32 runs at once while the one-time setup (bubblewrap probe, runtime scan) is not done:
    each ran it itself, against its own deadline."""
    from concurrent.futures import ThreadPoolExecutor

    from rollart_nb.sandbox import isolation as iso

    for fn in list(vars(iso).values()):  # forget the one-time setup: the runs below start cold
        if callable(getattr(fn, "cache_clear", None)):
            fn.cache_clear()
    codes = [ANSWER, "def answer():\n    return 41\n", "import time\ntime.sleep(100)\n", ANSWER]

    def one(i: int) -> tuple[int, SandboxResult, float]:
        r, elapsed = _run(codes[i % 4], timeout_s=2.0)
        return i % 4, r, elapsed

    with ThreadPoolExecutor(32) as ex:
        results = list(ex.map(one, range(32)))
    slow = [round(e, 2) for _, _, e in results if e > 2.0 + 4.0]
    assert not slow, f"runs returned after {slow}s with timeout_s=2"
    wrong = [
        (kind, r)
        for kind, r, _ in results
        if (kind in (0, 3) and (r.passed, r.timed_out) != (1, False))
        or (kind == 1 and (r.passed, r.timed_out) != (0, False))
        or (kind == 2 and not r.timed_out)
    ]
    assert not wrong, f"{len(wrong)} wrong results, e.g. {wrong[0]}"


def test_large_arguments_reach_an_honest_solution():
    """A list of 100k ints (about 1.5 MB encoded) was over the message limit: honest code failed."""
    code = "def total(xs):\n    return sum(xs)\ndef echo(xs):\n    return list(xs)\n"
    tests = "xs = list(range(100_000))\nassert total(xs) == sum(xs)\nassert echo(xs) == xs\n"
    r, _ = _run(code, tests, timeout_s=5.0)
    assert (r.passed, r.total, r.error) == (2, 2, ""), r
