"""Secure by default: a local session only this machine can reach, token auth, bounded attach.

The attach tests run first, before this module's own Ray instance starts (a process attaches
to one cluster at a time).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent import futures

import pytest

import rollart_nb as rn
from rollart_nb.errors import ConfigError, ConnectError

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


class SilentServer:
    """Accepts TCP connections and never says a word (a hung proxy, a port that is not Ray's)."""

    def __init__(self, reply: bytes = b"") -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.reply, self.conns = reply, []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            if self.reply:
                try:
                    c.recv(4096)
                    c.sendall(self.reply)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def _bounded_attach(address: str, timeout_s: float, match: str) -> float:
    t = time.monotonic()
    with pytest.raises(ConnectError, match=match):
        rn.Session.attach(address, timeout_s=timeout_s)
    took = time.monotonic() - t
    assert took < timeout_s + 5, f"attach took {took:.1f}s with timeout_s={timeout_s}"
    return took


def test_attach_to_a_silent_tcp_port_stops_within_the_timeout(capfd):
    srv = SilentServer()
    try:
        _bounded_attach(f"127.0.0.1:{srv.port}", 4, "not a Ray GCS port")
    finally:
        srv.close()
    err = capfd.readouterr().err
    assert err.count("\n") < 10, f"attach flooded the cell:\n{err[-2000:]}"


def test_attach_to_an_http_server_says_it_is_not_ray():
    srv = SilentServer(reply=b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    try:
        _bounded_attach(f"127.0.0.1:{srv.port}", 4, "not a Ray GCS port|not as a Ray GCS")
    finally:
        srv.close()


def test_attach_to_a_silent_ray_client_proxy_stops_within_the_timeout():
    srv = SilentServer()
    try:
        _bounded_attach(f"ray://127.0.0.1:{srv.port}", 4, "not a Ray Client server port")
    finally:
        srv.close()


def _fake_gcs(version: str, *, require_token: str | None = None):
    """A gRPC server that answers the GCS's cluster-metadata question as Ray ``version`` would."""
    import grpc
    from ray.core.generated import gcs_service_pb2 as pb

    def kv_get(req, ctx):
        auth = dict(ctx.invocation_metadata()).get("authorization", "")
        if require_token and auth != f"Bearer {require_token}":
            ctx.abort(grpc.StatusCode.UNAUTHENTICATED, "Invalid bearer token")
        meta = {"ray_version": version, "python_version": "3.11.7"}
        return pb.InternalKVGetReply(value=json.dumps(meta).encode())

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "ray.rpc.InternalKVGcsService",
                {
                    "InternalKVGet": grpc.unary_unary_rpc_method_handler(
                        kv_get,
                        request_deserializer=pb.InternalKVGetRequest.FromString,
                        response_serializer=pb.InternalKVGetReply.SerializeToString,
                    )
                },
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_attach_to_a_ray_of_another_version_names_both_versions():
    server, port = _fake_gcs("2.9.3")
    try:
        took = _bounded_attach(f"127.0.0.1:{port}", 5, r"runs Ray 2\.9\.3, this process Ray")
    finally:
        server.stop(0)
    assert took < 5


def test_attach_with_a_wrong_or_missing_token_is_refused_without_echoing_it(monkeypatch):
    server, port = _fake_gcs(__import__("ray").__version__, require_token="the-right-one")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("HOME", "/nonexistent")  # no ~/.ray/auth_token either
    try:
        with pytest.raises(ConnectError, match="requires a token") as e:
            rn.Session.attach(f"127.0.0.1:{port}", timeout_s=5)
        assert "ray get-auth-token" in str(e.value)
        monkeypatch.setenv("MY_CLUSTER_TOKEN", "wrong-token-value-123")
        with pytest.raises(ConnectError, match="refused the token") as e:
            rn.Session.attach(f"127.0.0.1:{port}", timeout_s=5, token_env="MY_CLUSTER_TOKEN")
        assert "wrong-token-value-123" not in str(e.value) and "the-right-one" not in str(e.value)
    finally:
        server.stop(0)
    assert not os.environ.get("RAY_AUTH_TOKEN_PATH", "").startswith("/tmp/rollart_auth_")


def test_expose_is_validated():
    for bad in ("127.0.0.1", "localhost", "0.0.0.0.0", ""):
        with pytest.raises(ConfigError, match="expose"):
            rn.Session.local({"cpu": 1}, expose=bad)


# -- a real local session ------------------------------------------------------------------
def _reward(t) -> float:
    return 1.0


_BEFORE: set[tuple[str, int]] = set()


@pytest.fixture(scope="module")
def sess():
    # What this (pytest) process already listened on before the session: earlier test modules'
    # leftovers are not the session's sockets.
    _BEFORE.update((ip, port) for ip, port, _ in _listening(os.getpid(), children=False))
    s = rn.Session.local({"cpu": 2}, serverless=True)
    yield s
    s.close()


def _listening(root_pid: int, *, children: bool = True) -> list[tuple[str, int, str]]:
    import psutil

    root = psutil.Process(root_pid)
    out = []
    for p in [root, *(root.children(recursive=True) if children else [])]:
        try:
            cmd = p.cmdline()
            name = " ".join([os.path.basename(cmd[0]), *cmd[1:]])[:100] if cmd else p.name()
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.append((c.laddr.ip, c.laddr.port, name))
        except psutil.Error:
            continue
    return out


def test_every_socket_of_a_local_session_is_on_loopback(sess):
    import httpx

    from rollart_nb.serverless.client import call
    from rollart_nb.serverless.serve import ServeManager
    from rollart_nb.trajectory import Trajectory, Turn

    ep = ServeManager().deploy("sec-reward", _reward)  # brings up Serve's controller and proxy
    assert call(ep, [Trajectory("math", seed=0, turns=[Turn("q", "a")], info={}).to_dict()], {}) == 1.0
    assert httpx.URL(ep.url).host == "127.0.0.1"
    socks = [s for s in _listening(os.getpid()) if s[:2] not in _BEFORE]
    names = " ".join(n for _, _, n in socks)
    assert "gcs_server" in names and "raylet" in names and "ServeReplica" in names  # we really looked
    wide = [s for s in socks if s[0] not in LOOPBACK]
    assert not wide, f"listening beyond loopback: {wide}"


def test_token_file_is_private_and_unlike_anything_printed(sess, capfd):
    path = sess.token_path
    assert path and oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    token = open(path).read()
    assert len(token) >= 32
    print(repr(sess), sess.ray_env())
    sess._repr_html_()
    out = capfd.readouterr()
    assert token not in out.out + out.err
    for root, _, files in os.walk(sess.log_dir):
        for f in files:
            with open(os.path.join(root, f), errors="replace") as fh:
                assert token not in fh.read(), f"token in {f}"


def _second_process(code: str, env: dict[str, str], timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_a_process_without_the_token_cannot_run_a_task_and_one_with_it_can(sess):
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    base["HOME"] = "/nonexistent"  # no ~/.ray/auth_token to fall back on
    # Ray's own client, token auth off on its side: the cluster refuses it.
    raw = _second_process(
        f"""
        import ray
        ray.init(address="{sess.address}", log_to_driver=False)
        print("RAN", ray.get(ray.remote(lambda: 41 + 1).remote()))
    """,
        {**base, "RAY_AUTH_MODE": "disabled"},
    )
    assert raw.returncode != 0 and "RAN" not in raw.stdout
    # Our attach without a token: a clear, quick refusal.
    ours = _second_process(
        f"""
        import time, rollart_nb as rn
        t = time.monotonic()
        try:
            rn.Session.attach("{sess.address}", timeout_s=20)
        except rn.errors.ConnectError as e:
            print("REFUSED", round(time.monotonic() - t, 1), e)
    """,
        base,
    )
    assert "REFUSED" in ours.stdout and "requires a token" in ours.stdout, ours.stderr[-2000:]
    assert float(ours.stdout.split()[1]) < 20
    # With the token (from an environment variable of the user's choosing): it runs.
    token = open(sess.token_path).read()
    ok = _second_process(
        f"""
        import ray, rollart_nb as rn
        s = rn.Session.attach("{sess.address}", timeout_s=60, token_env="TEAM_RAY_TOKEN")
        print("RAN", ray.get(ray.remote(lambda: 41 + 1).remote()))
        s.close()
    """,
        {**base, "TEAM_RAY_TOKEN": token},
    )
    assert ok.returncode == 0 and "RAN 42" in ok.stdout, ok.stderr[-3000:]
    assert token not in ok.stdout + ok.stderr


def test_expose_listens_wider_and_keeps_authentication_on():
    """`expose="auto"`: Ray's ports answer beyond loopback, and still only with the token."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    base["HOME"] = "/nonexistent"
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import json, os, sys, psutil, rollart_nb as rn
        s = rn.Session.local({"cpu": 1}, serverless=False, expose="auto")
        me = psutil.Process()
        wide = sorted({c.laddr.ip for p in [me, *me.children(recursive=True)]
                       for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
                      - {"127.0.0.1", "::ffff:127.0.0.1", "::1"})
        print(json.dumps({"address": s.address, "wide": wide}), flush=True)
        sys.stdin.readline()
        s.close()
    """),
        ],
        env=base,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        info = json.loads(host.stdout.readline())
        assert info["wide"], "expose='auto' should listen beyond loopback"
        assert not info["address"].startswith("127.")  # others are given the node's address
        raw = _second_process(
            f"""
            import ray
            ray.init(address="{info["address"]}", log_to_driver=False)
            print("RAN", ray.get(ray.remote(lambda: 1).remote()))
        """,
            {**base, "RAY_AUTH_MODE": "disabled"},
        )
        assert raw.returncode != 0 and "RAN" not in raw.stdout
    finally:
        host.stdin.write("\n")
        host.stdin.flush()
        host.wait(timeout=120)
