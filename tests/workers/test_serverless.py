"""register_serverless against a real HTTP server on 127.0.0.1 (stdlib http.server in a thread)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import rollart_nb as rn
from rollart_nb.errors import ConfigError, ServerlessError
from rollart_nb.serverless.client import Endpoint, acall, call

SEEN: list[dict] = []


class Handler(BaseHTTPRequestHandler):
    fail_next = 0

    def log_message(self, *a):  # keep test output clean
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        SEEN.append({"path": self.path, "auth": self.headers.get("authorization"), "body": body})
        if self.path == "/boom":
            return self._send(500, {"error": "reward exploded"})
        if self.path == "/flaky" and Handler.fail_next > 0:
            Handler.fail_next -= 1
            return self._send(503, {"error": "warming up"})
        if self.path == "/slow":
            import time

            time.sleep(2)
        x = body["args"][0]
        self._send(200, {"result": {"score": len(x) if isinstance(x, str) else x * 2}})

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


class Reward(rn.Worker):
    default_pool = "serverless"

    @rn.register_serverless("score", timeout_s=5, retries=2)
    def score(self, text):
        """Score a response (served by the 'score' endpoint)."""
        raise AssertionError("the cluster must call the endpoint, not the worker")

    @rn.register_serverless("boom", retries=1)
    def boom(self, text): ...

    @rn.register_serverless("slow", timeout_s=0.5, retries=0)
    def slow(self, text): ...

    @rn.register_serverless("missing")
    def missing(self, text): ...


def test_cluster_method_calls_the_endpoint(local_session, server, monkeypatch):
    monkeypatch.setenv("REWARD_TOKEN", "tok-very-secret")
    local_session.register_endpoint("score", server + "/score", token_env="REWARD_TOKEN")
    c = local_session.cluster("reward", Reward, endpoints={"boom": server + "/boom", "slow": server + "/slow"})
    assert c.bindings[0].pool == "serverless"
    SEEN.clear()
    assert c.score("hello") == {"score": 5}
    assert SEEN[-1]["auth"] == "Bearer tok-very-secret" and SEEN[-1]["body"] == {"args": ["hello"], "kwargs": {}}
    assert "Score a response" in c.score.__doc__
    # the token never shows in reprs of the endpoint, session or cluster
    for r in (repr(local_session.endpoints["score"]), repr(local_session), local_session._repr_html_(), repr(c)):
        assert "tok-very-secret" not in r

    with pytest.raises(ServerlessError, match=r"answered 500: .*reward exploded") as ei:
        c.boom("x")
    assert ei.value.status == 500
    assert sum(1 for s in SEEN if s["path"] == "/boom") == 2  # first try + 1 retry
    with pytest.raises(ServerlessError, match="failed after 1 attempt"):
        c.slow("x")
    with pytest.raises(ConfigError, match="no serverless endpoint 'missing'"):
        c.missing("x")
    local_session.close_cluster("reward")


def test_retries_recover_from_transient_5xx(server):
    Handler.fail_next = 2
    ep = Endpoint("flaky", server + "/flaky", retries=2, backoff_s=0.01)
    assert call(ep, [21], {}) == {"score": 42}


def test_async_call_and_missing_token(server, monkeypatch):
    import asyncio

    ep = Endpoint("s", server + "/score")
    assert asyncio.run(acall(ep, ["abc"], {})) == {"score": 3}
    monkeypatch.delenv("NOPE_TOKEN", raising=False)
    with pytest.raises(ConfigError, match=r"\$NOPE_TOKEN, which is unset"):
        call(Endpoint("s", server + "/score", token_env="NOPE_TOKEN"), ["a"], {})
    with pytest.raises(ConfigError, match="must start with http"):
        Endpoint("s", "ftp://x")
