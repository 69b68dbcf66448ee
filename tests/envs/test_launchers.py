"""LocalLauncher: replicas as processes, health monitor and restarts, scaling, cleanup, sandbox."""

import copy
import gc
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest

from rollart_nb.envs import CodeTask, FrozenLake, LocalLauncher, RemoteEnv
from rollart_nb.errors import ConfigError, ConnectError, EnvError, StateError


def _alive(pid):
    """True while ``pid`` runs (a zombie waiting for its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _descendants(pid):
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            if ppid == pid:
                kids += [int(entry), *_descendants(int(entry))]
    return kids


def _wait(cond, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def lake2():
    lau = LocalLauncher(
        "rollart_nb.envs:FrozenLake", {"size": 4}, replicas=2, task="lake", sandbox=False, health_interval_s=0.3
    ).start()
    yield lau
    lau.close()


def test_two_replicas_serve_round_robin_and_a_killed_one_is_replaced(lake2):
    lau = lake2
    assert [r.state for r in lau.replicas] == ["up", "up"] and len(set(lau.urls)) == 2
    assert all(u.startswith("http://127.0.0.1:") for u in lau.urls)
    envs = [RemoteEnv(launcher=lau) for _ in range(4)]
    served = [e.reset(seed=i)[1]["replica"] for i, e in enumerate(envs)]
    assert sorted(served) == ["lake-0", "lake-0", "lake-1", "lake-1"]  # least loaded, then round-robin
    on_dead = [e for e, r in zip(envs, served, strict=True) if r == "lake-0"]
    old = lau.replicas[0]
    lau.kill(0)
    with pytest.raises(EnvError, match=rf"remote env {old.url} failed in step"):
        on_dead[0].step("right")
    assert _wait(lambda: lau.restarts == 1 and lau.replicas[0].state == "up")
    new = lau.replicas[0]
    assert new.pid != old.pid and new.restarts == 1 and "SIGKILL" in new.last_error
    assert not _alive(old.pid)
    # the other replica's episodes go on; new episodes go to live replicas
    on_live = [e for e, r in zip(envs, served, strict=True) if r == "lake-1"]
    assert on_live[0].step("right")[4]["replica"] == "lake-1"
    assert {RemoteEnv(launcher=lau).reset(seed=s)[1]["replica"] for s in range(4)} == {"lake-0", "lake-1"}
    assert on_dead[1].reset(seed=3)[0] == FrozenLake(size=4).reset(3)[0]
    html = lau._repr_html_()
    assert new.url in html and str(new.pid) in html and "SIGKILL" in html
    assert "restarts=1" in repr(lau)


def test_scale_up_and_down(lake2):
    lau = lake2
    lau.scale(3)
    assert [r.id for r in lau.replicas] == ["lake-0", "lake-1", "lake-2"] and len(lau.urls) == 3
    gone = [r.pid for r in lau.replicas[1:]]
    lau.scale(1)
    assert [r.id for r in lau.replicas] == ["lake-0"] and len(lau.urls) == 1
    assert not any(_alive(p) for p in gone)
    assert {RemoteEnv(launcher=lau).reset(s)[1]["replica"] for s in range(3)} == {"lake-0"}
    with pytest.raises(ConfigError, match="n must be an int >= 0"):
        lau.scale(-1)


def test_close_leaves_no_process_and_later_calls_say_what_to_do():
    lau = LocalLauncher("rollart_nb.envs:FrozenLake", replicas=2, sandbox=False).start()
    pids = [r.pid for r in lau.replicas]
    assert all(_alive(p) for p in pids)
    log_dir = lau._dir
    lau.close()
    assert not any(_alive(p) for p in pids) and not os.path.exists(log_dir)
    assert not os.path.exists(lau._state_path)
    assert all(r.state == "stopped" for r in lau.replicas)
    lau.close()  # idempotent
    with pytest.raises(StateError, match="LocalLauncher is closed; create a new one"):
        lau.scale(2)
    with pytest.raises(StateError, match="closed"):
        lau.start()


def test_a_launcher_nobody_closes_stops_its_replicas_when_collected():
    lau = LocalLauncher("rollart_nb.envs:FrozenLake", replicas=1, sandbox=False).start()
    pid = lau.replicas[0].pid
    del lau
    gc.collect()
    assert _wait(lambda: not _alive(pid), 10)


def test_a_replica_that_cannot_start_reports_its_log():
    lau = LocalLauncher("rollart_nb.envs:FrozenLake", {"size": 1}, replicas=1, sandbox=False)
    with pytest.raises(ConnectError, match=r"(?s)lake-0: exited with code 2.*size must be >= 2"):
        lau.start()
    assert lau.state == "closed" and not _alive(lau.replicas[0].pid)
    with pytest.raises(ConfigError, match="not importable here"):
        LocalLauncher("no_such_module:Env", replicas=1, sandbox=False).start()
    with pytest.raises(ConfigError, match="kwargs must be JSON-able"):
        LocalLauncher("rollart_nb.envs:FrozenLake", {"map": object()})


def test_restarts_back_off_and_give_up_after_max_restarts(tmp_path, monkeypatch):
    lau = LocalLauncher(
        "rollart_nb.envs:FrozenLake", replicas=1, sandbox=False, health_interval_s=0.1, max_restarts=2, backoff_s=0.2
    ).start()
    try:
        # every later start of this replica fails: its module is made unimportable
        monkeypatch.setattr(lau, "env", "rollart_nb.envs:NoSuchEnv")
        t0 = time.monotonic()
        lau.kill(0)
        assert _wait(lambda: lau.replicas[0].state == "failed", 30)
        # three failed attempts: at once, after 0.2 s, after 0.4 s more
        assert time.monotonic() - t0 > 0.6
        assert lau.restarts == 0 and lau.urls == [] and "exited with code" in lau.replicas[0].last_error
        with pytest.raises(EnvError, match="no healthy replica"):
            RemoteEnv(launcher=lau).reset(0)
    finally:
        lau.close()


def test_remote_env_copies_in_another_process_find_the_replicas(lake2):
    lau = lake2
    blob = pickle.dumps(RemoteEnv(launcher=lau))
    code = (
        "import pickle, sys; env = pickle.loads(sys.stdin.buffer.read()); "
        "obs, info = env.reset(seed=4); print(info['replica'], obs.splitlines()[1])"
    )
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    replica, row = out.stdout.decode().split()
    assert replica in ("lake-0", "lake-1") and row == FrozenLake(size=4).reset(4)[0].splitlines()[1]
    lau.close()  # the state file goes with the launcher: copies elsewhere see no replica
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=60)
    assert out.returncode != 0 and b"no healthy replica" in out.stderr


def test_env_classes_and_notebook_classes():
    assert LocalLauncher(FrozenLake, sandbox=False).env == "rollart_nb.envs.frozenlake:FrozenLake"

    class Local:
        pass

    with pytest.raises(ConfigError, match="defined in a notebook or function"):
        LocalLauncher(Local)
    early = RemoteEnv(launcher=LocalLauncher(FrozenLake, sandbox=False))
    with pytest.raises(EnvError, match=r"no healthy replica of LocalLauncher 'frozenlake'.*launcher.start\(\)"):
        copy.deepcopy(early).reset(0)  # copies can be made before the launcher starts


def _bwrap_ok():
    from rollart_nb.errors import SandboxError
    from rollart_nb.sandbox import isolation

    try:
        isolation.require_bwrap()
    except SandboxError:
        return False
    return True


needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None or not _bwrap_ok(), reason="bubblewrap unusable here")


@needs_bwrap
def test_sandboxed_replicas_run_under_bubblewrap_and_restart():
    lau = LocalLauncher(
        "rollart_nb.envs:FrozenLake", {"size": 4}, replicas=2, sandbox=True, health_interval_s=0.3
    ).start()
    try:
        rep = lau.replicas[0]
        with open(f"/proc/{rep.pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert os.path.basename(argv[0]) == b"bwrap" and b"--unshare-pid" in argv and b"--die-with-parent" in argv
        server = [p for p in _descendants(rep.pid) if b"env-server" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert server, "the env server runs inside the sandbox"
        # its own PID namespace: the server sees itself as a low pid, not its host pid
        nspid = [ln for ln in open(f"/proc/{server[-1]}/status").read().splitlines() if ln.startswith("NSpid:")]
        assert len(nspid[0].split()) == 3  # host pid and namespace pid
        env = RemoteEnv(launcher=lau)
        assert env.reset(seed=1)[0] == FrozenLake(size=4).reset(1)[0]
        lau.kill(0)
        assert _wait(lambda: lau.restarts == 1 and lau.replicas[0].state == "up")
        assert not _alive(server[-1])  # killing bwrap took the server with it
    finally:
        lau.close()
    assert not _alive(rep.pid)


@needs_bwrap
def test_code_task_grades_inside_a_sandboxed_replica():
    with LocalLauncher(CodeTask, replicas=1, sandbox=True) as lau:
        env = RemoteEnv(launcher=lau)
        env.reset(seed=0)
        assert env.step("```python\ndef add(a, b):\n    return a + b\n```")[1] == 1.0


def test_a_sim_session_stops_its_launchers_on_close():
    import rollart_nb as rn

    sess = rn.Session.sim({"cpu": 2})
    lau = LocalLauncher("rollart_nb.envs:FrozenLake", replicas=1, sandbox=False)
    sess.tasks({"lake": lau}, envs_per_task=2)
    pid = lau.replicas[0].pid
    assert lau.started and os.path.exists(f"/proc/{pid}")
    sess.close()
    assert lau.state == "closed" and not os.path.exists(f"/proc/{pid}")


def test_a_hung_replica_fails_its_health_checks_and_is_replaced():
    lau = LocalLauncher(
        "rollart_nb.envs:FrozenLake", replicas=1, sandbox=False, health_interval_s=0.2, unhealthy_after=2
    ).start()
    try:
        old = lau.replicas[0].pid
        os.kill(old, signal.SIGSTOP)  # alive but answering nothing, like a replica stuck in a sync env
        deadline = time.monotonic() + 30
        while not (lau.restarts == 1 and lau.replicas[0].state == "up") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lau.restarts == 1 and lau.replicas[0].state == "up" and lau.replicas[0].pid != old
        assert (
            not os.path.exists(f"/proc/{old}") or open(f"/proc/{old}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        )
        env = RemoteEnv(launcher=lau)
        assert env.reset(seed=0)[1]["replica"] == lau.replicas[0].id  # the new one serves
    finally:
        lau.close()


def test_a_sandboxed_replica_imports_a_users_env_from_under_tmp(tmp_path, monkeypatch):
    """A project (or a CI checkout) below /tmp stays visible inside the replica's private /tmp."""
    assert str(tmp_path).startswith("/tmp/")
    (tmp_path / "my_lake_env.py").write_text(
        "from rollart_nb.envs import FrozenLake\n\nclass MyLake(FrozenLake):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with LocalLauncher("my_lake_env:MyLake", replicas=1, sandbox=True) as lau:
        obs, info = RemoteEnv(launcher=lau).reset(seed=0)
        assert info["replica"] == lau.replicas[0].id and obs
