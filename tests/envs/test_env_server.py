"""The env server (protocol v1) and RemoteEnv, its client: episodes, errors, timeouts, retries, copies."""

import asyncio
import copy
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from rollart_nb.envs import FrozenLake, RemoteEnv
from rollart_nb.envs.server import EnvServer, load_env_factory
from rollart_nb.errors import ConfigError, EnvError


class Exploding:
    """Resets fine; raises in step (the server must answer 500 with the env's exception)."""

    max_turns = 3

    def reset(self, seed=None):
        return "ready", {"seed": seed}

    def step(self, action):
        raise ValueError(f"cannot handle {action!r}")


class Slow:
    """A step that takes ``delay`` seconds; counts the steps it was asked for."""

    calls = 0
    delay = 1.0

    def reset(self, seed=None):
        return "go", {}

    def step(self, action):
        type(self).calls += 1
        time.sleep(self.delay)
        return "done", 1.0, True, False, {}


class AsyncOnly:
    """Only the async protocol works: the server must await areset/astep on its loop."""

    def reset(self, seed=None):
        raise AssertionError("sync reset called")

    def step(self, action):
        raise AssertionError("sync step called")

    async def areset(self, seed=None):
        await asyncio.sleep(0)
        return f"async {seed}", {"thread": threading.current_thread().name}

    async def astep(self, action):
        return action.upper(), 0.5, True, False, {"thread": threading.current_thread().name}


@pytest.fixture(scope="module")
def lake():
    srv = EnvServer(lambda: FrozenLake(size=4), task="lake", replica_id="lake-r0", max_episodes=64)
    url = srv.start_in_thread()
    yield srv, url
    srv.stop()


def _local_run(seed, actions):
    env = FrozenLake(size=4)
    out = [env.reset(seed)[0]]
    for a in actions:
        obs, reward, term, trunc, _ = env.step(a)
        out.append((obs, reward, term, trunc))
        if term or trunc:
            break
    return out


# -- server ---------------------------------------------------------------------------------
def test_fifty_concurrent_episodes_keep_their_own_state(lake):
    srv, url = lake
    moves = ["right", "down", "left", "up"]

    async def episode(client, seed):
        r = await client.post(f"{url}/v1/episodes", json={"seed": seed})
        assert r.status_code == 201
        body = r.json()
        out, eid = [body["obs"]], body["episode_id"]
        for k in range(3):
            await asyncio.sleep(0.001 * (seed % 5))  # interleave the episodes' steps
            s = (await client.post(f"{url}/v1/episodes/{eid}/step", json={"action": moves[(seed + k) % 4]})).json()
            out.append((s["obs"], s["reward"], s["terminated"], s["truncated"]))
            assert s["replica"] == "lake-r0"
            if s["terminated"] or s["truncated"]:
                break
        else:
            assert (await client.delete(f"{url}/v1/episodes/{eid}")).status_code == 204
        return eid, out

    async def main():
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*(episode(client, s) for s in range(50)))

    results = asyncio.run(main())
    assert len({eid for eid, _ in results}) == 50
    for seed, (_, out) in enumerate(results):
        assert out == _local_run(seed, [moves[(seed + k) % 4] for k in range(3)])
    assert len({out[0] for _, out in results}) > 5  # distinct start states, not one shared env
    assert srv.episodes == {}  # finished and deleted episodes are gone


def test_metadata_and_health(lake):
    _, url = lake
    meta = httpx.get(f"{url}/v1/metadata").json()
    local = FrozenLake(size=4)
    assert meta == {
        "protocol": 1,
        "env": "FrozenLake",
        "task": "lake",
        "max_turns": local.max_turns,
        "shape": "prefill",
        "vocab": local.vocab,
        "validation_seeds": local.validation_seeds(),
        "replica": "lake-r0",
    }
    health = httpx.get(f"{url}/v1/health").json()
    assert health["status"] == "ok" and health["capacity"] == 64 and health["protocol"] == 1


def test_protocol_errors_are_json_with_status(lake):
    _, url = lake

    def err(r, status, type_):
        assert r.status_code == status, r.text
        assert r.json()["error"]["type"] == type_
        return r.json()["error"]["message"]

    assert "not JSON" in err(httpx.post(f"{url}/v1/episodes", content=b"{nope"), 400, "BadJSON")
    err(httpx.post(f"{url}/v1/episodes", json=[1, 2]), 400, "BadRequest")
    assert "seed" in err(httpx.post(f"{url}/v1/episodes", json={"seed": "zero"}), 400, "BadRequest")
    assert "unknown" in err(httpx.post(f"{url}/v1/episodes/abc/step", json={"action": "up"}), 404, "UnknownEpisode")
    err(httpx.delete(f"{url}/v1/episodes/abc"), 404, "UnknownEpisode")
    eid = httpx.post(f"{url}/v1/episodes", json={"seed": 0}).json()["episode_id"]
    assert "action" in err(httpx.post(f"{url}/v1/episodes/{eid}/step", json={"action": 3}), 400, "BadRequest")
    assert httpx.delete(f"{url}/v1/episodes/{eid}").status_code == 204
    err(httpx.get(f"{url}/v1/nowhere"), 404, "NotFound")
    err(httpx.put(f"{url}/v1/health"), 405, "MethodNotAllowed")


def test_oversized_body_and_capacity():
    srv = EnvServer(lambda: FrozenLake(size=4), max_episodes=2, max_body_bytes=4096)
    url = srv.start_in_thread()
    try:
        r = httpx.post(f"{url}/v1/episodes", content=b'{"seed": 1, "pad": "' + b"x" * 10_000 + b'"}')
        assert r.status_code == 413 and r.json()["error"]["type"] == "BodyTooLarge"
        ids = [httpx.post(f"{url}/v1/episodes", json={"seed": s}).json()["episode_id"] for s in range(2)]
        r = httpx.post(f"{url}/v1/episodes", json={"seed": 2})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "cap of 2 episodes" in r.json()["error"]["message"]
        httpx.delete(f"{url}/v1/episodes/{ids[0]}")
        assert httpx.post(f"{url}/v1/episodes", json={"seed": 2}).status_code == 201  # a slot freed
    finally:
        srv.stop()


def test_env_exception_is_500_with_type_message_and_line():
    srv = EnvServer(Exploding)
    url = srv.start_in_thread()
    try:
        eid = httpx.post(f"{url}/v1/episodes", json={}).json()["episode_id"]
        r = httpx.post(f"{url}/v1/episodes/{eid}/step", json={"action": "boom"})
        assert r.status_code == 500
        e = r.json()["error"]
        assert e["type"] == "EnvException" and e["env_type"] == "ValueError"
        assert e["env_message"] == "cannot handle 'boom'" and e["call"] == "step"
        assert e["where"].startswith(__file__) and e["where"].split(":")[-1].isdigit()
        # the episode of an env that raised is closed
        assert httpx.post(f"{url}/v1/episodes/{eid}/step", json={"action": "x"}).status_code == 404
        with pytest.raises(EnvError, match=r"failed in step: HTTP 500: EnvException: ValueError: cannot handle"):
            env = RemoteEnv(url)
            env.reset(0)
            env.step("again")
    finally:
        srv.stop()


def test_async_env_methods_run_on_the_loop_and_a_busy_episode_says_409():
    srv = EnvServer(AsyncOnly)
    url = srv.start_in_thread()
    try:
        body = httpx.post(f"{url}/v1/episodes", json={"seed": 7}).json()
        assert body["obs"] == "async 7" and body["info"]["thread"] == "rollart-env-server"
        s = httpx.post(f"{url}/v1/episodes/{body['episode_id']}/step", json={"action": "hi"}).json()
        assert (s["obs"], s["reward"], s["terminated"]) == ("HI", 0.5, True)
    finally:
        srv.stop()
    srv = EnvServer(Slow)
    url = srv.start_in_thread()
    try:
        eid = httpx.post(f"{url}/v1/episodes", json={}).json()["episode_id"]
        first = threading.Thread(
            target=httpx.post, args=(f"{url}/v1/episodes/{eid}/step",), kwargs={"json": {"action": "a"}, "timeout": 10}
        )
        first.start()
        time.sleep(0.3)
        r = httpx.post(f"{url}/v1/episodes/{eid}/step", json={"action": "b"})
        assert r.status_code == 409 and r.json()["error"]["type"] == "EpisodeBusy"
        first.join()
    finally:
        srv.stop()


def test_idle_episodes_expire():
    srv = EnvServer(lambda: FrozenLake(size=4), idle_timeout_s=0.4)
    url = srv.start_in_thread()
    try:
        eid = httpx.post(f"{url}/v1/episodes", json={"seed": 0}).json()["episode_id"]
        assert httpx.post(f"{url}/v1/episodes/{eid}/step", json={"action": "up"}).status_code == 200
        time.sleep(1.0)
        assert httpx.post(f"{url}/v1/episodes/{eid}/step", json={"action": "up"}).status_code == 404
        assert srv.episodes == {}
    finally:
        srv.stop()


def test_env_specs_load_by_name_with_clear_errors():
    assert isinstance(load_env_factory("rollart_nb.envs:FrozenLake", {"size": 5})(), FrozenLake)
    assert load_env_factory("rollart_nb.envs:FrozenLake", {"size": 5})().size == 5
    with pytest.raises(ConfigError, match="is not 'module:Class'"):
        load_env_factory("FrozenLake")
    with pytest.raises(ConfigError, match="cannot load env 'no_such_mod:Env'.*importable"):
        load_env_factory("no_such_mod:Env")
    with pytest.raises(ConfigError, match="cannot load env 'rollart_nb.envs:Nope'"):
        load_env_factory("rollart_nb.envs:Nope")


def _listening_ports(pid):
    """Local (address, port) of the LISTEN sockets of ``pid`` (from /proc: no psutil needed)."""
    inodes = {
        os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1]
        for fd in os.listdir(f"/proc/{pid}/fd")
        if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")
    }
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                addr, port = f[1].split(":")
                out.append((addr, int(port, 16)))
    return out


def test_cli_prints_listening_and_binds_loopback():
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollart_nb.cli",
            "env-server",
            "--env",
            "rollart_nb.envs:FrozenLake",
            "--kwargs",
            '{"size": 5}',
            "--port",
            "0",
            "--task",
            "lake",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = p.stdout.readline().strip()
        assert line.startswith("LISTENING http://127.0.0.1:"), line
        url = line.split()[1]
        port = int(url.rsplit(":", 1)[1])
        assert _listening_ports(p.pid) == [("0100007F", port)]  # 127.0.0.1 only
        meta = httpx.get(f"{url}/v1/metadata").json()
        assert (meta["env"], meta["task"], meta["max_turns"]) == ("FrozenLake", "lake", FrozenLake(size=5).max_turns)
        env = RemoteEnv(url)
        obs, info = env.reset(seed=2)
        assert obs == FrozenLake(size=5).reset(2)[0] and info["replica"] == f"{meta['replica']}"
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollart_nb.cli",
            "env-server",
            "--env",
            "rollart_nb.envs:FrozenLake",
            "--kwargs",
            "{size: 4}",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "--kwargs" in bad.stderr and "is not JSON" in bad.stderr


# -- RemoteEnv ------------------------------------------------------------------------------
def test_remote_env_matches_the_local_env_sync_and_async(lake):
    _, url = lake
    actions = ["right", "down", "down", "left", "right", "down"]
    for seed in (0, 3, 7):
        env = RemoteEnv(url)
        obs, info = env.reset(seed)
        got = [obs]
        assert info["replica"] == "lake-r0"
        for a in actions:
            obs, reward, term, trunc, info = env.step(a)
            got.append((obs, reward, term, trunc))
            assert info["replica"] == "lake-r0" and "position" in info
            if term or trunc:
                break
        assert got == _local_run(seed, actions)

    async def arun(seed):
        env = RemoteEnv(url)
        out = [(await env.areset(seed))[0]]
        for a in actions:
            obs, reward, term, trunc, _ = await env.astep(a)
            out.append((obs, reward, term, trunc))
            if term or trunc:
                break
        await env.aclose()
        return out

    async def both():
        return await asyncio.gather(arun(1), arun(5))

    assert asyncio.run(both()) == [_local_run(1, actions), _local_run(5, actions)]


def test_remote_env_hints_come_from_metadata_once(lake):
    _, url = lake
    srv = EnvServer(lambda: FrozenLake(size=6))
    u = srv.start_in_thread()
    env = RemoteEnv(u)
    try:
        local = FrozenLake(size=6)
        assert (env.max_turns, env.shape, env.vocab, env.validation_seeds()) == (
            local.max_turns,
            "prefill",
            local.vocab,
            local.validation_seeds(),
        )
    finally:
        srv.stop()
    assert env.max_turns == FrozenLake(size=6).max_turns  # cached: the server is gone
    assert copy.deepcopy(env).validation_seeds() == FrozenLake(size=6).validation_seeds()


def test_a_step_that_times_out_fails_and_is_not_resent():
    Slow.calls, Slow.delay = 0, 1.5
    srv = EnvServer(Slow)
    requests, handler = [], srv._step

    async def counting(request):  # counts step requests, even ones the server would refuse
        requests.append(request.path)
        return await handler(request)

    srv._step = counting
    url = srv.start_in_thread()
    try:
        env = RemoteEnv(url, timeout_s=0.3, connect_retries=3)
        env.reset()
        t0 = time.monotonic()
        with pytest.raises(EnvError, match=rf"remote env {url} failed in step: no answer in time"):
            env.step("x")
        assert time.monotonic() - t0 < 1.2
        time.sleep(1.8)  # a resent step would have reached the server by now
        assert Slow.calls == 1 and len(requests) == 1
        with pytest.raises(EnvError, match="call reset"):
            env.step("y")  # the episode of a failed step is forgotten
    finally:
        srv.stop()


def test_connect_errors_are_retried_until_the_server_is_up():
    port = _free_port()
    srv = EnvServer(lambda: FrozenLake(size=4))
    threading.Timer(0.4, srv.start_in_thread, kwargs={"port": port}).start()
    try:
        env = RemoteEnv(f"http://127.0.0.1:{port}", connect_retries=5, retry_backoff_s=0.1)
        obs, _ = env.reset(0)  # attempts at ~0, 0.1, 0.3, 0.7 s: the server starts at 0.4 s
        assert obs == FrozenLake(size=4).reset(0)[0]
    finally:
        time.sleep(0.5)
        srv.stop()
    t0 = time.monotonic()
    with pytest.raises(EnvError, match=rf"127.0.0.1:{port} failed in reset: .*ConnectError"):
        RemoteEnv(f"http://127.0.0.1:{port}", connect_retries=2, retry_backoff_s=0.1).reset(0)
    assert 0.25 < time.monotonic() - t0 < 5  # two pauses (0.1 + 0.2 s) before giving up


def test_copies_share_no_client_and_no_episode(lake):
    _, url = lake
    a = RemoteEnv(url)
    a.reset(0)
    a.step("right")
    b = copy.deepcopy(a)
    c = pickle.loads(pickle.dumps(a))
    for other in (b, c):
        assert other._client is None and other._episode is None
        with pytest.raises(EnvError, match="call reset"):
            other.step("down")
    b.reset(5)
    b_obs = b.step("down")[0]
    assert b_obs == _local_run(5, ["down"])[1][0]
    assert a.step("down")[0] == _local_run(0, ["right", "down"])[2][0]  # a's episode untouched


def test_killed_server_fails_the_episode_with_env_error():
    p = subprocess.Popen(
        [sys.executable, "-m", "rollart_nb.cli", "env-server", "--env", "rollart_nb.envs:FrozenLake", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = p.stdout.readline().split()[1]
        env = RemoteEnv(url, connect_retries=1, retry_backoff_s=0.05)
        env.reset(0)
        p.kill()
        p.wait()
        with pytest.raises(EnvError, match=rf"remote env {url} failed in step"):
            env.step("right")
        with pytest.raises(EnvError, match=rf"remote env {url} failed in reset"):
            env.reset(1)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_remote_env_config_errors():
    with pytest.raises(ConfigError, match="give a url or a launcher"):
        RemoteEnv()
    with pytest.raises(ConfigError, match="timeouts must be > 0"):
        RemoteEnv("http://127.0.0.1:1", timeout_s=0)
    assert repr(RemoteEnv("http://x:1/")) == "RemoteEnv(http://x:1)"
