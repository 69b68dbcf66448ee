"""Where user code's output goes, and how its failures read.

:func:`capture_user_output` sends a worker's ``print`` and ``logging`` to its own log file;
:func:`read_logs` (``sess.logs()``) and :class:`LogFollower` (``sess.log_tail()``) read those
files back; :func:`user_traceback` trims a traceback to the user's frames, bounded and redacted.

Example:
    >>> try:
    ...     {}["missing"]
    ... except KeyError as e:
    ...     print(user_traceback(e).splitlines()[0])
    Traceback (user code, most recent call last):
"""

from __future__ import annotations

import io
import logging
import os
import re
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

from rollart_nb.redact import RedactingFilter, redact

__all__ = ["LogFollower", "LogTail", "capture_user_output", "read_logs", "user_traceback"]

TRACEBACK_HEAD = "Traceback (user code, most recent call last):"
"""First line of :func:`user_traceback`'s text (the scheduler recognises user-code failures by it)."""

_PKG_DIR = str(Path(__file__).resolve().parent) + os.sep
_INTERNAL_PARTS = (
    f"{os.sep}ray{os.sep}",
    f"{os.sep}asyncio{os.sep}",
    f"{os.sep}concurrent{os.sep}futures{os.sep}",
    f"{os.sep}threading.py",
)


def _is_internal(filename: str) -> bool:
    if filename.startswith(_PKG_DIR) or filename.startswith("<frozen"):
        return True
    return any(p in filename for p in _INTERNAL_PARTS)


def user_traceback(exc: BaseException, *, limit_chars: int = 1500, max_frames: int = 8) -> str:
    """``exc``'s traceback with only the user's frames (file, line, code), then its type and message.

    Library, Ray, asyncio and thread-pool frames are dropped (the innermost stays if nothing is
    left). The text is at most about ``limit_chars`` long (innermost frames kept) and redacted.
    """
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    mine = [f for f in frames if not _is_internal(f.filename)] or frames[-1:]
    mine = mine[-max_frames:]
    body = "".join(traceback.format_list(mine))
    last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if len(last) > limit_chars // 2:
        last = last[: limit_chars // 2] + " …"
    room = max(limit_chars - len(last) - len(TRACEBACK_HEAD), 200)
    if len(body) > room:
        body = "  …\n" + body[-room:].split("\n", 1)[-1]
    return redact(f"{TRACEBACK_HEAD}\n{body}{last}")


def user_frame(exc: BaseException) -> str:
    """``file:line`` of the innermost user frame of ``exc`` ("" when it has no traceback)."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    mine = [f for f in frames if not _is_internal(f.filename)] or frames[-1:]
    return f"{mine[-1].filename}:{mine[-1].lineno}" if mine else ""


# -- capture (inside a worker actor) ------------------------------------------------------
_STAMP = "%Y-%m-%d %H:%M:%S"


class _Tee(io.TextIOBase):
    """Writes go to the original stream and, line by line with a time stamp, to a log file."""

    def __init__(self, original: TextIO, sink: _Sink, label: str) -> None:
        self.original, self.sink, self.label = original, sink, label
        self._partial = threading.local()

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        try:
            self.original.write(s)
        except Exception:  # the original stream is gone (closed at exit): the file still gets it
            pass
        buf = getattr(self._partial, "text", "") + s
        *lines, rest = buf.split("\n")
        self._partial.text = rest
        for line in lines:
            self.sink.write(f"{time.strftime(_STAMP)},000 {self.label} {line}")
        return len(s)

    def flush(self) -> None:
        try:
            self.original.flush()
        except Exception:  # see write
            pass

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, isatty, ... of the original
        return getattr(self.original, name)


class _Sink:
    """One log file, shared by the tees and the root logger's handler (lines are redacted)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(redact(line) + "\n")


class _NotLibrary(logging.Filter):
    """Records of loggers outside rollart_nb (the library's own already reach the file)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith("rollart_nb")


_captured: str | None = None


def _library_log_file() -> str | None:
    for h in logging.getLogger("rollart_nb").handlers:
        if isinstance(h, logging.FileHandler):
            return h.baseFilename
    return None


def capture_user_output(path: str | None = None) -> str | None:
    """Send this process's ``print`` (stdout/stderr) and every logger's INFO+ records to ``path``.

    ``path`` defaults to the worker's library log file; without one nothing changes and None is
    returned. Idempotent; the original streams still get their output.
    """
    global _captured
    path = path or _library_log_file()
    if not path:
        return None
    if _captured is not None:
        return _captured
    _captured = path
    sink = _Sink(path)
    sys.stdout = _Tee(sys.stdout, sink, "STDOUT")
    sys.stderr = _Tee(sys.stderr, sink, "STDERR")
    h = logging.FileHandler(path, encoding="utf-8")
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    h.addFilter(_NotLibrary())
    h.addFilter(RedactingFilter())
    h.setLevel(logging.INFO)
    root = logging.getLogger()
    root.addHandler(h)
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)  # env/reward code's logging.info reaches the file
    return path


# -- reading -------------------------------------------------------------------------------
_TIME = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")


class LogTail(str):
    """The last lines of a session's logs: a str whose repr is the text itself (a cell shows it
    readably), with ``files`` (the files read)."""

    files: list[str]

    def __new__(cls, text: str, files: list[str]) -> LogTail:
        obj = super().__new__(cls, text)
        obj.files = files
        return obj

    def __repr__(self) -> str:
        return str(self) if self else f"(no log lines in {len(self.files)} file(s))"

    def _repr_html_(self) -> str:
        import html

        return f"<pre style='max-height:30em;overflow:auto'>{html.escape(repr(self))}</pre>"


def _norm(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower()


def worker_matches(worker: str | None, stem: str) -> bool:
    """Whether log file ``stem`` belongs to ``worker`` as :func:`read_logs` filters (a part of
    its name; ``.``, ``/`` and ``_`` alike); every file for no ``worker``."""
    return not worker or _norm(worker) in _norm(stem)


def _records(lines: list[str]) -> list[tuple[str, list[str]]]:
    """Lines grouped into records (a time-stamped line and its continuation lines)."""
    out: list[tuple[str, list[str]]] = []
    for ln in lines:
        m = _TIME.match(ln)
        if m or not out:
            out.append((m.group(0) if m else "", [ln]))
        else:
            out[-1][1].append(ln)
    return out


def read_logs(log_dir: str, worker: str | None = None, last: int = 50) -> LogTail:
    """The last ``last`` lines of the ``*.log`` files in ``log_dir``, merged by time; each line
    says its worker. ``worker`` (e.g. ``"pipeline.rollout"``): only files whose name contains it
    (``.``, ``/`` and ``_`` are alike)."""
    files = sorted(Path(log_dir).glob("*.log")) if log_dir and os.path.isdir(log_dir) else []
    files = [f for f in files if worker_matches(worker, f.stem)]
    merged: list[tuple[str, int, str, list[str]]] = []
    for i, f in enumerate(files):
        try:
            lines = f.read_text(encoding="utf-8", errors="replace").splitlines()[-max(last, 0) :]
        except OSError:
            continue
        merged += [(t, i, f.stem, rec) for t, rec in _records(lines)]
    merged.sort(key=lambda r: (r[0], r[1]))
    out = [f"[{stem}] {ln}" if len(files) > 1 else ln for _, _, stem, rec in merged for ln in rec]
    return LogTail("\n".join(out[-last:] if last > 0 else []), [str(f) for f in files])


class _Offset:
    """Where the reading of one file stands: inode, byte offset, an incomplete last line."""

    def __init__(self, inode: int) -> None:
        self.inode, self.pos, self.partial = inode, 0, b""


class LogFollower:
    """The lines added to the ``*.log`` files of ``log_dir`` since the last :meth:`poll`.

    The first poll gives the last ``last`` lines of each file; later files, and files that shrank
    or were replaced, are read from their start. A line without its newline waits for the next
    poll. At most ``max_bytes`` (the newest) are read per file and poll. Lines are redacted.

    Example:
        >>> f = LogFollower(sess.log_dir)                          # doctest: +SKIP
        >>> f.poll()                                               # doctest: +SKIP
        [('pipeline_rollout', '2025-01-01 12:00:00,000 STDOUT hello')]
    """

    def __init__(self, log_dir: str, last: int = 200, max_bytes: int = 1 << 20) -> None:
        self.log_dir, self.last, self.max_bytes = log_dir, max(int(last), 0), int(max_bytes)
        self._files: dict[str, _Offset] = {}  # stem -> offset
        self._polled = False

    @property
    def workers(self) -> list[str]:
        """The stems of the log files seen so far, sorted."""
        return sorted(self._files)

    def poll(self) -> list[tuple[str, str]]:
        """New complete lines as ``(file stem, line)``, records merged by time across files."""
        paths = sorted(Path(self.log_dir).glob("*.log")) if self.log_dir and os.path.isdir(self.log_dir) else []
        merged: list[tuple[str, int, str, list[str]]] = []
        for i, path in enumerate(paths):
            try:
                lines = self._read_new(path, first=not self._polled)
            except OSError:
                continue
            merged += [(t, i, path.stem, rec) for t, rec in _records(lines)]
        self._polled = True
        merged.sort(key=lambda r: (r[0], r[1]))
        return [(stem, ln) for _, _, stem, rec in merged for ln in rec]

    def _read_new(self, path: Path, first: bool) -> list[str]:
        st = path.stat()
        off = self._files.get(path.stem)
        if off is None or off.inode != st.st_ino or st.st_size < off.pos:  # new, replaced or truncated
            off = self._files[path.stem] = _Offset(st.st_ino)
        if st.st_size <= off.pos:
            return []
        start = max(off.pos, st.st_size - self.max_bytes)
        skipped = start > off.pos  # more than max_bytes came: the oldest of them are dropped
        with open(path, "rb") as f:
            if skipped:  # does the read begin a line? (the byte before it ends one)
                f.seek(start - 1)
                mid_line = f.read(1) != b"\n"
            f.seek(start)
            raw = f.read(st.st_size - start)
        data = raw if skipped else off.partial + raw
        off.pos = start + len(raw)
        body, nl, off.partial = data.rpartition(b"\n")
        if not nl:
            off.partial = data[-self.max_bytes :]
            return []
        lines = [ln.decode("utf-8", errors="replace") for ln in body.split(b"\n")]
        if skipped and mid_line:
            lines = lines[1:]  # the read began inside a line: its end alone is not a line
        if first:  # a file there before the first poll: its tail only
            lines = lines[-self.last :] if self.last else []
        return [redact(ln) for ln in lines]
