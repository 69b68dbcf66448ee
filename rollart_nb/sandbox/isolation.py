"""Bubblewrap command lines: the OS boundary around model-written code and env services.

Two policies:

* :func:`code_argv` — for hostile code. New user, PID, network, IPC, UTS and cgroup
  namespaces (only a loopback interface inside, nothing outside reachable); an unprivileged
  uid (when the caller is root, the sandbox runs as a fresh uid that owns nothing on the host);
  a root filesystem holding only the Python runtime, its standard library and the shared
  libraries they link, all read-only; a size-capped tmpfs work directory; a minimal, read-only
  ``/dev``; its own ``/proc`` (none inside an env server's sandbox); a seccomp filter
  (:mod:`rollart_nb.sandbox.seccomp`); an empty environment; no further user namespaces; ``--die-with-parent``
  and ``--new-session``. Killing the returned process kills everything in the sandbox: its
  PID namespace dies with bubblewrap's init.
* :func:`service_argv` — for trusted services (an env server running the user's env class):
  own PID, IPC and UTS namespaces, read-only system and Python runtime, a private ``/tmp``,
  the host network (it must serve on 127.0.0.1) and ``--die-with-parent``. It contains
  crashes and leftover processes; it is not a boundary for hostile code (run model-written
  code through :func:`code_argv`, as :class:`~rollart_nb.envs.CodeTask` does).

Nothing here falls back to weaker isolation: if bubblewrap is missing or user namespaces are
off, :func:`require_bwrap` raises :class:`~rollart_nb.errors.SandboxError` saying how to fix it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rollart_nb.errors import SandboxError

__all__ = ["PythonRuntime", "code_argv", "python_runtime", "require_bwrap", "service_argv"]

log = logging.getLogger(__name__)

_INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; Fedora: `dnf install bubblewrap`)"
_USERNS_HINT = (
    "enable unprivileged user namespaces (`sysctl -w kernel.unprivileged_userns_clone=1` on "
    "Debian kernels, `sysctl -w user.max_user_namespaces=15000`, or on Ubuntu 24.04+ "
    "`sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`); in a container, run it with "
    "`--security-opt seccomp=unconfined` or use a VM"
)
# Top-level directories that merged-/usr systems keep as symlinks; recreated as such inside.
_TOP_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Host uids handed to sandboxes when the caller is root: unused by any account (nothing on
# the host belongs to them), one per sandbox so process limits are per sandbox.
_UID_RANGE = (1_200_000_000, 1_300_000_000)


_SETUP = threading.Lock()  # one probe / runtime scan, even when many sandboxes start at once


def require_bwrap() -> str:
    """The path of a working ``bwrap``; raises :class:`SandboxError` with the fix otherwise.

    Checked once per process: bubblewrap is found on PATH and a trivial sandbox with a new
    user namespace runs (as the unprivileged user the code sandbox will use).
    """
    with _SETUP:
        return _probe()[0]


def _mounts_proc() -> bool:
    """Whether code sandboxes get a /proc of their own. Not inside an env server's sandbox:
    the kernel refuses a new /proc where bubblewrap masked parts of the one above, so there the
    code sandbox has none (it needs none; Python runs without it)."""
    with _SETUP:
        return _probe()[1]


@functools.cache
def _probe() -> tuple[str, bool]:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxError(
            f"bubblewrap (bwrap) is not installed, so model-written code cannot be isolated; {_INSTALL_HINT}"
        )
    base = [
        *_drop_privileges(),
        path,
        "--unshare-user",
        "--unshare-pid",
        "--unshare-net",
        "--ro-bind",
        "/",
        "/",
        "--dev",
        "/dev",
    ]
    errors: list[str] = []
    for proc in (["--proc", "/proc"], []):
        try:
            r = subprocess.run([*base, *proc, "true"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SandboxError(f"bubblewrap at {path} could not run a test sandbox ({e}); {_INSTALL_HINT}") from e
        if r.returncode == 0:
            if not proc:
                log.info("code sandboxes get no /proc here (a new one cannot be mounted: %s)", errors[0])
            return path, bool(proc)
        errors.append(r.stderr.strip() or f"exit status {r.returncode}")
    raise SandboxError(f"bubblewrap at {path} cannot create namespaces here: {errors[0]}; {_USERNS_HINT}")


def _drop_privileges(uid: int | None = None) -> list[str]:
    """argv prefix that runs the next command as a fresh unprivileged uid when we are root."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise SandboxError(
            "running as root, the sandbox drops to an unprivileged uid with setpriv; "
            "install util-linux (`apt-get install util-linux`)"
        )
    uid = uid if uid is not None else _UID_RANGE[0] + secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0])
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]


@dataclass(frozen=True)
class PythonRuntime:
    """What a sandboxed interpreter needs: its binary, standard library and library dirs."""

    executable: str
    stdlib: str
    site_dirs: tuple[str, ...]
    lib_dirs: tuple[str, ...]


def _world_readable(path: str) -> bool:
    """Whether a uid that owns nothing can reach and read ``path`` (every parent executable)."""
    p = os.path.realpath(path)
    try:
        if not os.stat(p).st_mode & stat.S_IROTH:
            return False
        while p != "/":
            p = os.path.dirname(p)
            if not os.stat(p).st_mode & stat.S_IXOTH:
                return False
    except OSError:
        return False
    return True


def _candidates() -> list[str]:
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    env = os.environ.get("ROLLART_SANDBOX_PYTHON")
    out = [env] if env else []
    out.append(sys.executable)
    out += [os.path.join(d, ver) for d in ("/usr/bin", "/usr/local/bin")]
    out += [os.path.join(d, "python3") for d in ("/usr/bin", "/usr/local/bin")]
    return [p for p in out if p and os.path.exists(p)]


def python_runtime() -> PythonRuntime:
    """The interpreter sandboxes run (see :func:`_python_runtime`); computed once per process."""
    with _SETUP:
        return _python_runtime()


@functools.cache
def _python_runtime() -> PythonRuntime:
    """The interpreter sandboxes run, and what it needs mounted (computed once per process).

    The caller's own interpreter when the sandbox's uid can read it; otherwise (a root user
    whose Python lives under ``/root``) the system's ``python3.X`` or ``python3``. The
    environment variable ``ROLLART_SANDBOX_PYTHON`` names one explicitly.

    Raises:
        SandboxError: no interpreter the sandbox's uid can read.
    """
    dropped = os.geteuid() == 0
    tried = []
    for exe in _candidates():
        if dropped and not _world_readable(exe):
            tried.append(f"{exe} (not readable by an unprivileged uid)")
            continue
        try:
            info = json.loads(
                subprocess.run(
                    [
                        exe,
                        "-I",
                        "-S",
                        "-c",
                        "import json,sys,sysconfig;print(json.dumps([sys.executable,"
                        "sysconfig.get_path('stdlib'),sysconfig.get_path('purelib'),sysconfig.get_path('platlib')]))",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    env={},
                ).stdout
            )
        except (OSError, ValueError, subprocess.TimeoutExpired) as e:
            tried.append(f"{exe} ({e})")
            continue
        real, stdlib, purelib, platlib = (os.path.realpath(p) for p in info)
        if dropped and not _world_readable(stdlib):
            tried.append(f"{exe} (standard library {stdlib} not readable by an unprivileged uid)")
            continue
        sites = tuple(sorted({p for p in (purelib, platlib) if p.startswith(stdlib + os.sep) and os.path.isdir(p)}))
        return PythonRuntime(real, stdlib, sites, _lib_dirs(real, stdlib))
    raise SandboxError(
        "no Python interpreter the sandbox can run: "
        + "; ".join(tried)
        + ". Install the system python3 package or set ROLLART_SANDBOX_PYTHON to a world-readable one"
    )


def _lib_dirs(exe: str, stdlib: str) -> tuple[str, ...]:
    """Directories of the shared libraries the interpreter and its extension modules link."""
    objs = [exe]
    dyn = os.path.join(stdlib, "lib-dynload")
    if os.path.isdir(dyn):
        objs += [os.path.join(dyn, f) for f in os.listdir(dyn) if f.endswith(".so")]
    out = subprocess.run(["ldd", *objs], capture_output=True, text=True, timeout=60).stdout
    dirs = set()
    for line in out.splitlines():
        if line.rstrip().endswith(":"):  # "<object>:" header lines, not libraries
            continue
        part = line.split("=>")[-1].strip().split(" (")[0].strip()
        if part.startswith("/"):
            dirs.add(os.path.realpath(os.path.dirname(part)))  # where the name lives (may be a link)
            dirs.add(os.path.dirname(os.path.realpath(part)))  # where the file lives
    dirs.discard(os.path.realpath(stdlib))
    return tuple(sorted(d for d in dirs if not d.startswith(os.path.realpath(stdlib) + os.sep)))


def _top_links() -> list[str]:
    args = []
    for p in _TOP_LINKS:
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
    return args


# new namespaces for everything, an unprivileged uid, no capabilities, an empty environment
_NAMESPACES = (
    *("--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup"),
    *("--disable-userns", "--uid", "1000", "--gid", "1000", "--hostname", "sandbox"),
    *("--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"),
)


def code_argv(
    command: Sequence[str], *, work_mb: int = 32, workdir: str = "/work", seccomp_fd: int | None = None
) -> list[str]:
    """argv that runs ``command`` (a command of :func:`python_runtime`'s interpreter) isolated
    as described in the module docstring. Resource limits are the command's own business
    (the sandbox bootstrap sets them before any user code runs).

    Args:
        command: the program and its arguments, e.g. ``[python_runtime().executable, "-c", ...]``.
        work_mb: size cap of the tmpfs work directory (also ``$HOME`` and ``$TMPDIR``).
        workdir: where the work directory is mounted, and the working directory.
        seccomp_fd: an fd holding a seccomp program (:func:`rollart_nb.sandbox.seccomp.program_fd`),
            to be passed to the child; bubblewrap loads it last, right before ``command``.

    Raises:
        SandboxError: bubblewrap is unusable here.
    """
    bwrap, rt = require_bwrap(), python_runtime()
    args = [
        *_drop_privileges(),
        bwrap,
        *_NAMESPACES,
        "--setenv",
        "HOME",
        workdir,
        "--setenv",
        "TMPDIR",
        workdir,
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "LANG",
        "C.UTF-8",
    ]
    # the work dir first: a runtime that lives below it is then bound on top, not hidden
    args += ["--size", str(work_mb * 1024 * 1024), "--perms", "0700", "--tmpfs", workdir]
    for d in rt.lib_dirs:
        args += ["--ro-bind", d, d]
    args += _top_links()
    args += ["--ro-bind", rt.stdlib, rt.stdlib]
    for site in rt.site_dirs:  # third-party packages are not the runtime: hide them
        args += ["--tmpfs", site, "--remount-ro", site]
    args += [
        "--ro-bind",
        rt.executable,
        rt.executable,
        *(["--proc", "/proc"] if _mounts_proc() else []),
        "--dev",
        "/dev",
        # bubblewrap's root and /dev are tmpfs without a size cap: nothing may write there
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/",
        "--chdir",
        workdir,
    ]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    return args + list(command)


def service_argv(
    command: Sequence[str], *, ro_paths: Sequence[str] = (), env: Mapping[str, str] | None = None, tmp_mb: int = 256
) -> list[str]:
    """argv that runs a trusted service ``command`` in its own PID/IPC/UTS namespaces with a
    read-only filesystem (system dirs, the Python runtime and ``ro_paths``), a private ``/tmp``
    and the host network. It dies with its parent, and everything it started dies with it.

    Args:
        command: the service's argv (e.g. ``[sys.executable, "-m", "rollart_nb.cli", "env-server", ...]``).
        ro_paths: extra paths mounted read-only at the same place (e.g. the project's source).
        env: the service's whole environment (None: an empty one plus ``PATH`` and ``HOME``).
        tmp_mb: size cap of its ``/tmp``.

    Raises:
        SandboxError: bubblewrap is unusable here.
    """
    bwrap = require_bwrap()
    # A root caller keeps its uid (the runtime may live under /root) but no user namespace, so
    # code sandboxes inside can still drop to a fresh uid; others get a user namespace too.
    userns = [] if os.geteuid() == 0 else ["--unshare-user"]
    caps = ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if os.geteuid() == 0 else []
    args = [
        bwrap,
        *userns,
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--die-with-parent",
        "--new-session",
        *caps,
        "--clearenv",
    ]
    full_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp"} if env is None else dict(env)
    for k, v in full_env.items():
        args += ["--setenv", k, v]
    # /tmp first: a project or venv under /tmp is then bound on top of it, not hidden by it
    args += ["--size", str(tmp_mb * 1024 * 1024), "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev"]
    binds = {"/usr", "/etc", sys.prefix, sys.base_prefix, os.path.dirname(sys.executable), *ro_paths}
    for p in sorted({os.path.realpath(p) for p in binds if os.path.exists(p)}):
        args += ["--ro-bind", p, p]
    args += _top_links()
    args += ["--chdir", "/tmp", *command]
    return args
