"""Shared fixtures. One Ray instance per test module (Ray start costs ~10 s and ~1 GB)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:
        cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(skip_gpu)


_EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """Record the final status once every other sessionfinish hook is done. If one of them
    raised, nothing is recorded, and the process exits the normal way with pytest's error."""
    result = yield
    session.config.stash[_EXIT_STATUS] = int(session.exitstatus)
    return result


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After the summary: release what outlived its tests, then leave without interpreter teardown.

    First, while the interpreter is whole: objects in reference cycles are collected (so their
    finalizers run now, not during teardown), a Ray driver a test left connected is shut down,
    a torch.distributed group is destroyed, and the atexit hooks run (Ray's, weakref finalizers,
    the Mooncake clients'). Each step is named on stderr, and PYTHONFAULTHANDLER prints the
    stack of a crash in one. A crash here is ours, and fails the run.

    Then the process ends with pytest's own status, skipping module teardown and the C++ static
    destructors of the native libraries the tests loaded (grpc, torch, Mooncake, megatron). One
    CI run in about ten segfaulted after a green summary, with no traceback. Three of
    LLMJudge's loop threads were still alive then (now stopped), and they are the likely cause.
    A program of ours that crashes at exit is still caught: the demo's test runs it as a
    subprocess and checks its exit status.

    pytest's faulthandler plugin is off by now, so a crash in these steps prints a stack only
    under PYTHONFAULTHANDLER=1 (.ci/run sets it).
    """
    import atexit
    import gc
    import sys
    import threading

    # pytest's unraisable-exception and thread-exception plugins report what they catch in
    # config cleanups, which os._exit skips: print errors from finalizers, atexit hooks and
    # threads directly instead.
    sys.unraisablehook = sys.__unraisablehook__
    threading.excepthook = threading.__excepthook__

    def step(what, fn):
        sys.stderr.write(f"conftest: {what}\n")
        sys.stderr.flush()
        fn()

    step(
        "collecting objects in reference cycles left by the tests",
        lambda: sys.stderr.write(f"conftest: {gc.collect()} collected\n"),
    )
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        step("shutting down the Ray driver a test left connected", ray.shutdown)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        step("destroying the torch.distributed process group a test left", dist.destroy_process_group)
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None:  # no session ran (--help, a usage error): leave the exit to Python
        return
    step("running the atexit hooks", atexit._run_exitfuncs)
    step(f"exiting with pytest's status {status}, without interpreter teardown", lambda: None)
    for f in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        f.flush()
    os._exit(status)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def local_session():
    """A Session.local() shared by one test module."""
    import rollart_nb as rn

    sess = rn.Session.local({"H800": 2, "H20": 2, "cpu": 4})
    yield sess
    sess.close()


@pytest.fixture(scope="session")
def redis_url():
    """A real redis-server on 127.0.0.1 with a random port (skips if the binary is missing)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)
