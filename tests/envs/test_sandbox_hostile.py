"""Hostile tests of the code sandbox (:mod:`rollart_nb.envs.sandbox`).

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
import glob
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
TAMPER = r'''
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
'''

# Defines _host_visible(): whether the code can see the host's canary process (no PID namespace).
GUARD = r'''
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
'''


# ---------------------------------------------------------------------------------- helpers


def _src(template: str, **values: object) -> str:
    """``template`` with each ``@NAME@`` replaced by ``repr(values[NAME])``."""
    out = textwrap.dedent(template)
    for k, v in values.items():
        out = out.replace(f"@{k}@", repr(v))
    left = re.findall(r"@[A-Z_]+@", out)
    assert not left, f"unfilled placeholders {left}"
    return out


def _run(code: str, tests: str = ANSWER_TESTS, *, timeout_s: float = 2.0, memory_mb: int = 256,
         runner: str = "sync") -> tuple[SandboxResult, float]:
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
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", tag],
                         start_new_session=True, env=env, stdin=subprocess.DEVNULL)
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
    code = ("import sys\nprint('to-stdout-ok')\nsys.stderr.write('to-stderr-ok\\n')\n"
            "open('mine.txt', 'w').write('workdir-ok')\nprint(open('mine.txt').read())\n" + ANSWER)
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
    body = f"MARK = {str(mark)!r}\nCMD = 'id > ' + MARK\ntry:\n{textwrap.indent(SHELLS[how], '    ')}\n" \
           "except BaseException as e:\n    print('refused', type(e).__name__, e)\n"
    r, elapsed = _run((TAMPER if tamper else "import os, sys\n") + body + ANSWER)
    _assert_bounded(elapsed, 2.0)
    assert not mark.exists(), f"the shell ran on the host: {mark.read_text()!r}"


def test_code_does_not_run_as_root_even_after_setuid():
    code = TAMPER + textwrap.dedent("""\
        for call in ("os.setuid(0)", "os.setgid(0)", "os.setresuid(0, 0, 0)"):
            try:
                eval(call)
            except BaseException as e:
                print(call, "refused", type(e).__name__)
        caps = [l.split()[1] for l in open("/proc/self/status").read().splitlines() if l.startswith("CapEff")]
        print("UID", os.getuid(), "EUID", os.geteuid(), "CAPEFF", *caps)
        """) + ANSWER
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
    code = (TAMPER if method == "all-tampered" else "import os, sys\n") + _src("""\
        P = @P@
        def show(label, data):
            print("READ", label, data.decode("latin-1") if isinstance(data, bytes) else data, flush=True)
        """, P=path) + body + "print('ATTACK-DONE')\n" + ANSWER
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
    code = (TAMPER if tamper else "import os, sys\n") + _src("""\
        for host in ("127.0.0.1", "localhost"):
            try:
                import socket
                s = socket.create_connection((host, @PORT@), timeout=0.5)
                s.sendall(b"hello from the sandbox")
                print("CONNECTED", host)
            except BaseException as e:
                print("refused", host, type(e).__name__)
        """, PORT=port) + ANSWER
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
    code = (TAMPER if tamper else "import os, sys\n") + _src("""\
        try:
            import socket
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            for _ in range(5):
                s.sendto(b"datagram from the sandbox", ("127.0.0.1", @PORT@))
            print("SENT")
        except BaseException as e:
            print("refused", type(e).__name__)
        """, PORT=port) + ANSWER
    try:
        _run(code)
        time.sleep(0.05)
        with pytest.raises(BlockingIOError):
            rx.recvfrom(1024)  # nothing arrived
    finally:
        rx.close()


@pytest.mark.parametrize(
    ("kind", "tamper"), [("path", False), ("path", True), ("abstract", True)],
    ids=["path-plain", "path-tampered", "abstract-tampered"],
)
def test_unix_socket_of_the_host_reaches_nothing(kind, tamper, tmp_path, token):
    address = str(tmp_path / "s.sock") if kind == "path" else "\0" + token
    server = socket.socket(socket.AF_UNIX)
    server.bind(address)
    server.listen(16)
    server.setblocking(False)
    code = (TAMPER if tamper else "import os, sys\n") + _src("""\
        try:
            import socket
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(0.5)
            s.connect(@ADDR@)
            s.sendall(b"hello")
            print("CONNECTED")
        except BaseException as e:
            print("refused", type(e).__name__)
        """, ADDR=address) + ANSWER
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
    code = TAMPER + _src("""\
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
        """, MARK=str(mark), TOKEN=token) + ANSWER
    r, elapsed = _run(code, runner=runner)
    _assert_bounded(elapsed, 2.0)
    assert _leftovers(token) == [], "a process of the sandbox is still running"
    time.sleep(1.2)
    assert not mark.exists(), "the daemon wrote to the host after the run"


@pytest.mark.parametrize("runner", ["sync", "async"])
def test_child_holding_the_output_pipes_does_not_stall_the_run(runner, token):
    code = TAMPER + _src("""\
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
        """, TOKEN=token) + ANSWER
    r, elapsed = _run(code, timeout_s=2.0, runner=runner)
    _assert_bounded(elapsed, 2.0)
    assert _leftovers(token) == [], "the pipe holder is still running"


HANGS = {
    "busy_loop": "while True:\n    pass\n",
    "sleep": "import time\ntime.sleep(60)\n",
    "select_forever": "import select\nselect.select([], [], [])\n",
    "signals_ignored_busy": "import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n"
                            "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass\n",
    "spinning_threads": "import threading\nfor _ in range(4):\n"
                        "    threading.Thread(target=lambda: [0 for _ in iter(int, 1)], daemon=True).start()\n"
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
    code = TAMPER + _guard(canary) + textwrap.dedent("""\
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
        """) + ANSWER
    r, elapsed = _run(code, timeout_s=1.5)
    _assert_bounded(elapsed, 1.5)
    assert "HOST-PIDS-VISIBLE" not in r.stdout, "the code sees the host's processes (no PID namespace)"
    _assert_running(canary[0])


def test_fork_bomb_is_contained(token):
    """2**10 forks at most (each child setsid()s and names itself), all sleeping past the run."""
    code = TAMPER + _src("""\
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
        """, TAG=_comm_tag(token)) + ANSWER
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
    code = TAMPER + textwrap.dedent("""\
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
        """) + ANSWER
    r, elapsed = _run(code, memory_mb=256)
    _assert_bounded(elapsed, 2.0)
    assert _held_mb(r) <= 256 + 64, f"held {_held_mb(r)} MB of memfd pages with memory_mb=256"


def test_hard_rlimits_cannot_be_raised_and_still_bind():
    code = TAMPER + textwrap.dedent("""\
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
        """) + _src(MEMORY_BOMB, CAP_MB=1536) + "while True:\n    pass\n"
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
    code = TAMPER + _src("""\
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
        """, HOSTDIR=str(hostdir), TOKEN=token) + ANSWER
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
    ("how", "runner"), [(h, "sync") for h in FLOODS] + [("stdout_print", "async")],
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
    code = (TAMPER if tamper else "import os, sys\n") + _guard(canary) + _src("""\
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
        """, PID=sleeper.pid) + ANSWER
    r, _ = _run(code)
    time.sleep(0.1)
    _assert_running(sleeper)
    _assert_running(canary[0])
    assert "HOST-PIDS-VISIBLE" not in r.stdout, "the code sees the host's processes (no PID namespace)"


def test_ctypes_libc_calls_have_no_host_effect(sleeper, victim):
    f, snapshot = victim
    before = snapshot()
    code = TAMPER + _src("""\
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
        """, PID=sleeper.pid, V=str(f)) + ANSWER
    r, _ = _run(code)
    time.sleep(0.1)
    _assert_running(sleeper)
    assert snapshot() == before, "the host file was changed through libc"
    assert not re.search(r"\bUID 0\b", r.stdout), "setuid(0) through libc worked"


def test_ptrace_reaches_no_host_process(sleeper, canary):
    code = TAMPER + _guard(canary) + _src("""\
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
        """, PID=sleeper.pid) + ANSWER
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
    code = TAMPER + _src("""\
        for call in ("os.setpriority(os.PRIO_PROCESS, @PID@, 19)", "os.sched_setaffinity(@PID@, {0})",
                     "os.nice(-5)", "os.nice(5)", "os.sched_setaffinity(0, {0})"):
            try:
                eval(call)
                print("done", call)
            except BaseException as e:
                print("refused", call, type(e).__name__)
        """, PID=sleeper.pid) + ANSWER
    r, _ = _run(code)
    assert r.passed == 1, r  # renicing itself is harmless and must not break the run
    assert settings() == before, "the code changed a host process's priority or CPU affinity"


def _proc_state_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def test_mount_and_unshare_do_not_change_host_mounts(tmp_path):
    target = tmp_path / "mnt"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    code = TAMPER + _src("""\
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
        """, T=str(target)) + ANSWER
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
            code = (TAMPER if tamper else "import os, sys\n") + _src("""\
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
                """, HOST=os.getpid(), HOLDER=holder.pid) + ANSWER
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
    code = TAMPER + textwrap.dedent("""\
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
        """) + ANSWER
    r, _ = _run(code)
    assert "ATTACK-DONE" in r.stdout, r
    _assert_not_leaked(r, needles)


def test_tty_console_kmsg_and_sysrq_writes_have_no_effect(token):
    log_before = _kmsg()
    code = TAMPER + _src("""\
        for path, data in (("/dev/tty", b"sandbox was here\\n"), ("/dev/console", b"sandbox was here\\n"),
                           ("/dev/kmsg", b"<6>" + @TOKEN@.encode() + b"\\n"), ("/proc/sysrq-trigger", b"h")):
            try:
                fd = os.open(path, os.O_WRONLY)
                os.write(fd, data)
                print("WROTE", path)
            except BaseException as e:
                print("refused", path, type(e).__name__)
        """, TOKEN=token) + ANSWER
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
    code = (TAMPER if tamper else "import os, sys\n") + _src("""\
        sys.path[:0] = [@PROJECT@, *@SITES@]
        for name in ("rollart_nb", "ray", "torch", "numpy"):
            try:
                __import__(name)
                print("IMPORTED", name)
            except BaseException as e:
                print("NOIMPORT", name, type(e).__name__)
        """, PROJECT=str(PROJECT), SITES=sites) + ANSWER
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

SCAN = r'''
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
'''


@pytest.mark.parametrize("how", list(HIDDEN_SEARCH))
def test_hidden_tests_cannot_be_found_by_the_solution(how):
    """answer() must return a literal only the tests hold; the solution goes looking for it."""
    hidden = "hidden" + "rollarthostile" + secrets.token_hex(8)
    body = textwrap.indent(textwrap.dedent(HIDDEN_SEARCH[how]), "        ")
    code = TAMPER + SCAN + (
        "def _find():\n    found = set()\n    try:\n" + body + "\n    except BaseException as e:\n"
        "        print('search failed', type(e).__name__)\n    return sorted(found)\n"
        "print('FOUND AT LOAD', _find(), flush=True)\n"
        "def answer():\n    hits = _find()\n    return hits[0] if hits else 'not found'\n"
    )
    tests = f"assert answer() == {hidden!r}\ndef test_again():\n    assert answer() == {hidden!r}\n"
    r, _ = _run(code, tests)
    assert "FOUND AT LOAD" in r.stdout, r
    assert r.passed == 0, f"the solution found the hidden answer: {r}"
    assert hidden not in r.stdout and hidden not in r.stderr


_SEPARATORS = {"lf": "\n", "cr": "\r", "crlf": "\r\n", "vt": "\x0b", "ff": "\x0c", "fs": "\x1c", "gs": "\x1d",
               "rs": "\x1e", "nel": "\x85", "ls": "\u2028", "ps": "\u2029"}
_INJECT_TESTS = "assert answer() == 42\nassert answer() == 43\n"


def _injection(seps: list[str]) -> str:
    return "x" + "".join(s + "@@ PASS 0" + s + "@@ PASS 1" + s + "@@ DONE" + s for s in seps)


@pytest.mark.parametrize(
    ("where", "sep"),
    [("raise_in_call", "all"), ("raise_at_load", "all"), ("assert_message", "all"), ("returned_value", "all"),
     ("printed_by_tests", "lf"), ("printed_by_tests", "all")]
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


RIGGED_EQ = "class E:\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n" \
            "    __hash__ = lambda s: 0\n    __bool__ = lambda s: True\n"
RIGGED = {
    "eq_always_object": (RIGGED_EQ + "def answer():\n    return E()\n", "assert answer() == 42\nassert answer()\n"),
    "int_subclass_eq": ("class I(int):\n    __eq__ = lambda s, o: True\n    __hash__ = int.__hash__\n"
                        "def answer():\n    return I(0)\n", "assert answer() == 42\n"),
    "str_subclass_eq": ("class S(str):\n    __eq__ = lambda s, o: True\n    __hash__ = str.__hash__\n"
                        "def answer():\n    return S('')\n", "assert answer() == 'forty-two'\n"),
    "list_subclass_eq": ("class L(list):\n    __eq__ = lambda s, o: True\ndef answer():\n    return L()\n",
                         "assert answer() == [4, 2]\n"),
    "dict_subclass_eq": ("class D(dict):\n    __eq__ = lambda s, o: True\ndef answer():\n    return D()\n",
                         "assert answer() == {'a': 1}\n"),
    "eq_object_nested_in_list": (RIGGED_EQ + "def answer():\n    return [E(), E()]\n", "assert answer() == [4, 2]\n"),
    "pickle_reduce_gadget": (RIGGED_EQ + "E.__reduce__ = lambda s: (eval, (\"type('E', (), {'__eq__': lambda s, o: "
                             "True, '__hash__': lambda s: 0})()\",))\ndef answer():\n    return E()\n",
                             "assert answer() == 42\n"),
    "bool_for_int": ("def answer():\n    return True\n", "assert answer() == 1\n"),
    "int_for_bool": ("def answer():\n    return 1\n", "assert answer() == True\n"),
    "float_for_int": ("def answer():\n    return 3.0\n", "assert answer() == 3\n"),
    "bools_in_list_for_ints": ("def answer():\n    return [True, False]\n", "assert answer() == [1, 0]\n"),
    "float_in_dict_for_int": ("def answer():\n    return {'n': 2.0}\n", "assert answer() == {'n': 2}\n"),
    "bool_in_set_for_int": ("def answer():\n    return {True, 2}\n", "assert answer() == {1, 2}\n"),
    "bool_in_frozenset_for_int": ("def answer():\n    return frozenset({False, 5})\n",
                                  "assert answer() == frozenset({0, 5})\n"),
    "float_in_set_for_int": ("def answer():\n    return {2.0}\n", "assert answer() == {2}\n"),
    "bool_dict_key_for_int": ("def answer():\n    return {True: 'a'}\n", "assert answer() == {1: 'a'}\n"),
    "replaced_after_first_call": (RIGGED_EQ + "def answer():\n    global answer\n    answer = lambda: E()\n"
                                  "    return 0\n", "assert answer() == 42\nassert answer() == 42\n"),
}


@pytest.mark.parametrize("how", list(RIGGED))
def test_rigged_or_loosely_equal_results_do_not_pass(how):
    code, tests = RIGGED[how]
    r, _ = _run(code, tests)
    assert r.passed == 0, f"a rigged or wrong-typed result passed: {r}"


SHADOWED = {
    "abs_in_tolerance_check": ("def sqrt2():\n    return 0.0\ndef abs(x):\n    return 0.0\n",
                               "assert abs(sqrt2() - 1.41421356) < 1e-6\n"),
    "sorted_on_both_sides": ("def perm():\n    return [9, 9]\ndef sorted(x):\n    return []\n",
                             "assert sorted(perm()) == sorted([3, 1, 2])\n"),
    "sum_on_both_sides": ("def parts():\n    return [0]\ndef sum(x):\n    return 0\n",
                          "assert sum(parts()) == sum([1, 2, 3])\n"),
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
    r, _ = _run(MONKEYPATCH[how] + "def answer():\n    return 41\n",
                "assert answer() == 42\ndef test_two():\n    assert answer() == 42\n")
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
