"""Secrets never reach output: rollart_nb.redact, and a real Session whose URL rewards fail."""

import base64
import io
import itertools
import json
import logging
import os
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

import rollart_nb as rn
from rollart_nb.envs import Arithmetic
from rollart_nb.errors import RollartError, ServerlessError
from rollart_nb.models import spec
from rollart_nb.serverless.client import Endpoint, call
from rollart_nb.workers.roles import SimGenerator, SimTrainer

KEY = "PLANTED_SECRET_abc123"  # a query value
PW = "PLANTED_PW_xyz"  # a password in userinfo
TOKEN = "PLANTED_TOKEN_q9w8e7"  # a bearer token read from $RN_TEST_REWARD_TOKEN
TOKEN_ENV = "RN_TEST_REWARD_TOKEN"
BASIC = base64.b64encode(f"u:{PW}".encode()).decode()  # what httpx sends for the userinfo
PLANTED = (KEY, PW, TOKEN, BASIC)


# -- unit: redact_url / redact ------------------------------------------------------------
def test_redact_url_hides_userinfo_query_values_and_fragment():
    from rollart_nb.redact import redact_url

    assert redact_url("https://user:pass@host.example/x/y") == "https://***@host.example/x/y"
    assert redact_url("https://host/score?api_key=SECRET&x=1") == "https://host/score?api_key=***&x=***"
    assert redact_url("http://u:p@10.0.0.1:8443/a?k=v#frag") == "http://***@10.0.0.1:8443/a?k=***#***"
    assert redact_url("http://[::1]:8080/r?token=abc") == "http://[::1]:8080/r?token=***"
    assert redact_url("http://127.0.0.1:9000/plain") == "http://127.0.0.1:9000/plain"
    assert redact_url("https://host/?lonely") == "https://host/?***"


def test_redact_finds_urls_anywhere_in_text():
    from rollart_nb.redact import redact

    text = (
        f"endpoint 'r' (https://u:{PW}@h:1/x?api_key={KEY}&x=1) answered 500; "
        f"also tried 'http://[::1]:8080/y?sig={KEY}', and <http://a.b/c?d=e>."
    )
    out = redact(text)
    assert KEY not in out and PW not in out
    assert "(https://***@h:1/x?api_key=***&x=***) answered 500;" in out
    assert "'http://[::1]:8080/y?sig=***'," in out and "<http://a.b/c?d=***>." in out
    # a repr of a list of URLs, and a real httpx message
    assert redact(repr([f"http://h/?a={KEY}", "http://h/?b=2"])) == "['http://h/?a=***', 'http://h/?b=***']"
    req = httpx.Request("POST", f"http://127.0.0.1:1/score?api_key={KEY}")
    with pytest.raises(httpx.HTTPStatusError) as ei:
        httpx.Response(500, request=req).raise_for_status()
    assert KEY not in redact(str(ei.value)) and "api_key=***" in redact(str(ei.value))


def test_redact_leaves_plain_text_alone():
    from rollart_nb.redact import redact

    for text in (
        "",
        "reward returned nan, not a finite number",
        "StepReport(step=3, 800 tok, tokens=12)",
        "wants a bearer token in $X, which is unset",
        "max_new_tokens=8 token_env='TOK' ratio 3:1",
        "http://127.0.0.1:8000/reward-math-v0 answered 404",
    ):
        assert redact(text) == text


def test_redact_hides_bearer_tokens_and_key_value_pairs():
    from rollart_nb.redact import redact

    assert redact("Authorization: Bearer abc.DEF-123") == "Authorization: Bearer ***"
    assert redact("{'authorization': 'Basic dTpwdw=='}") == "{'authorization': 'Basic ***'}"
    assert redact("sent Bearer tok-very-secret to it") == "sent Bearer *** to it"
    assert (
        redact('x api_key=abc, password: "hunter22" secret=s3 client_secret=zz access_token=q')
        == 'x api_key=***, password: "***" secret=*** client_secret=*** access_token=***'
    )
    assert redact('{"token": "t0k3n"}') == '{"token": "***"}'


def test_registered_secrets_are_redacted_short_ones_ignored():
    from rollart_nb.redact import redact, register_secret

    register_secret("my-literal-secret-value")
    register_secret("abc")  # too short: would mangle ordinary output
    register_secret("")
    assert redact("got my-literal-secret-value back") == "got *** back"
    assert redact("abc is fine") == "abc is fine"


def test_redacting_filter_formats_args_and_tracebacks():
    from rollart_nb.redact import RedactingFilter

    buf = io.StringIO()
    h = logging.StreamHandler(buf)
    h.addFilter(RedactingFilter())
    log = logging.getLogger("rollart_nb.test_redaction")
    log.addHandler(h)
    log.propagate = False
    try:
        log.warning("calling %s with %d%%", f"http://h/x?api_key={KEY}", 5)
        try:
            raise ValueError(f"for url 'https://u:{PW}@h/x'")
        except ValueError:
            log.exception("failed")
    finally:
        log.removeHandler(h)
        log.propagate = True
    out = buf.getvalue()
    assert KEY not in out and PW not in out
    assert "calling http://h/x?api_key=*** with 5%" in out and "ValueError: for url 'https://***@h/x'" in out


def test_worker_log_file_is_redacted(tmp_path):
    from rollart_nb.workers.worker import _setup_logging

    root = logging.getLogger("rollart_nb")
    before, level = list(root.handlers), root.level
    root.handlers[:] = [h for h in before if not isinstance(h, logging.FileHandler)]
    try:
        _setup_logging(str(tmp_path), "actor/0")
        logging.getLogger("rollart_nb.control.x").warning("reward at %s failed", f"http://h/?api_key={KEY}")
    finally:
        for h in root.handlers:
            if h not in before:
                h.close()
        root.handlers[:] = before
        root.setLevel(level)
    text = (tmp_path / "actor_0.log").read_text()
    assert "reward at http://h/?api_key=*** failed" in text and KEY not in text


def test_errors_and_endpoint_reprs_are_redacted(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    ep = Endpoint("r", f"https://u:{PW}@h.example:8443/score?api_key={KEY}", token_env=TOKEN_ENV)
    for text in (repr(ep), str(ep)):
        assert "https://***@h.example:8443/score?api_key=***" in text and not any(s in text for s in PLANTED)
    e = ServerlessError(f"endpoint 'r' ({ep.url}) said Bearer {TOKEN}", url=ep.url)
    for text in (str(e), repr(e), e.url, "".join(traceback.format_exception(e))):
        assert not any(s in text for s in PLANTED)
    assert str(rn.errors.RewardError(f"boom: api_key={KEY}")) == "boom: api_key=***"


# -- integration: a real Session whose URL rewards fail -----------------------------------
class _Handler(BaseHTTPRequestHandler):
    """Answers 500 (echoing the path and the Authorization header, as careless services do),
    then non-JSON, then a score, in turn. /always500 always fails."""

    counter = itertools.count()

    def log_message(self, *a):  # keep test output clean
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        n = next(self.counter)
        echo = f"no! path={self.path} authorization: {self.headers.get('authorization')}"
        if self.path.startswith("/always500") or n % 3 == 0:
            return self._send(500, "application/json", json.dumps({"error": echo}))
        if n % 3 == 1:
            return self._send(200, "text/html", f"<html>{echo}</html>")
        self._send(200, "application/json", json.dumps({"result": 0.5}))

    def _send(self, code, ctype, text):
        data = text.encode()
        self.send_response(code)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


@pytest.fixture(scope="module")
def sess(tmp_path_factory):
    """One Ray instance for the module; the token is in the environment before Ray starts, so
    the rollout actor (which calls the reward endpoints) reads it too."""
    old = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = TOKEN
    s = rn.Session.local({"H800": 1, "H20": 1, "cpu": 4}, log_dir=str(tmp_path_factory.mktemp("logs")))
    yield s
    s.close()
    if old is None:
        os.environ.pop(TOKEN_ENV, None)
    else:
        os.environ[TOKEN_ENV] = old


def _leaks(text: str) -> list[str]:
    return [s for s in PLANTED if s in text]


class LeakyReward(rn.Worker):
    default_pool = "serverless"

    @rn.register_serverless("leaky", retries=0)
    def leaky(self, text): ...

    @rn.register("one")
    def note(self, url):
        """Logs what it calls, as user workers do (to a file under sess.log_dir)."""
        self.log.warning("calling %s with Authorization: Bearer %s", url, os.environ[TOKEN_ENV])
        try:
            raise ValueError(f"for url {url!r}")
        except ValueError:
            self.log.exception("call failed")


@pytest.mark.timeout(600)
def test_planted_secrets_reach_no_output(sess, server, tmp_path, capfd):
    from rollart_nb.nb.figures import failures_figure
    from rollart_nb.nb.viewer import trajectory_html

    key_url = f"http://127.0.0.1:{server}/score?api_key={KEY}&x=1"
    pw_url = f"http://u:{PW}@127.0.0.1:{server}/score2"
    seen: list[str] = []

    ep = sess.register_endpoint("leaky", key_url, token_env=TOKEN_ENV, retries=0)
    seen += [repr(ep), str(ep), repr(sess), sess._repr_html_()]
    c = sess.cluster("leaky_reward", LeakyReward, endpoints={"other": pw_url})
    with pytest.raises(ServerlessError) as ei:
        for _ in range(3):  # one of three answers is a score
            c.leaky("x")
    assert ei.value.status in (200, 500)
    seen += [str(ei.value), repr(ei.value), ei.value.url, "".join(traceback.format_exception(ei.value))]
    with pytest.raises(ServerlessError) as ei:
        call(Endpoint("dead", f"http://u:{PW}@127.0.0.1:1/x?api_key={KEY}", retries=0), [], {})
    seen += [str(ei.value), repr(ei.value), ei.value.url]
    c.note(pw_url + f"?api_key={KEY}")
    sess.close_cluster("leaky_reward")

    m = spec("qwen3-0.6b")
    gen = sess.cluster("actor_gen", SimGenerator, pool="H20", model=m, time_scale=1e-4, mean_response_tokens=4)
    train = sess.cluster("actor_train", SimTrainer, pool="H800", model=m, time_scale=1e-4)
    tasks = sess.tasks({"math": Arithmetic(), "count": Arithmetic()}, envs_per_task=4)
    sess.reward("math", url=key_url, token_env=TOKEN_ENV, retries=0)
    sess.reward("count", url=pw_url, retries=0)
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, mode="sync", name="leaky")
    reps = pipe.run(2, progress=False)
    failures = [r for rep in reps for rs in rep.failures.values() for r in rs]
    assert any("answered 500" in r for r in failures) and any("non-JSON" in r for r in failures), failures
    failed = pipe.trajectories(status="failed", last=None)
    assert failed
    seen += [repr(r) for r in reps] + [r._repr_html_() for r in reps] + failures
    seen += [json.dumps(pipe.stats(), default=str), json.dumps(pipe.reward_history(), default=str)]
    seen += [t.reason for t in failed] + [trajectory_html(t) for t in failed[:5]]
    seen += [failures_figure(reps).to_json(), pipe._repr_html_()]
    seen.append(json.dumps([r.to_dict() for r in reps], default=str))  # what a steps.jsonl would hold
    # redacted, not dropped: the reason still says which endpoint failed
    assert any("/score?api_key=***&x=***" in r for r in failures + [t.reason for t in failed])
    ckpt = pipe.save(tmp_path / "ckpt")
    saved = [p.read_text(errors="replace") for p in Path(ckpt).rglob("*") if p.is_file()]
    assert any("/score?api_key=***&x=***" in text for text in saved)  # pipeline.json: the reward's source
    seen += saved
    pipe.close()

    # every trajectory of a task fails: the stall error lists the reasons
    sess.reward("math", url=key_url.replace("/score", "/always500"), token_env=TOKEN_ENV, retries=0)
    pipe = sess.pipeline(
        train,
        gen,
        sess.tasks({"math": Arithmetic()}, envs_per_task=4),
        batch_size=8,
        group_size=4,
        mode="sync",
        name="stalled",
    )
    with pytest.raises(RollartError) as ei:
        pipe.step()
    assert "answered 500" in str(ei.value)
    seen += [str(ei.value), repr(ei.value), "".join(traceback.format_exception(ei.value))]
    pipe.close()

    out, err = capfd.readouterr()
    seen += [out, err]
    logs = [p.read_text(errors="replace") for p in Path(sess.log_dir).rglob("*") if p.is_file()]
    assert any(
        "calling http://***@127.0.0.1:" in text
        and "?api_key=*** with Authorization: Bearer ***" in text
        and "ValueError: for url 'http://***@" in text
        for text in logs
    ), logs
    seen += logs
    leaks = {i: _leaks(text) for i, text in enumerate(seen) if _leaks(text)}
    assert not leaks, {i: (leaks[i], seen[i][:300]) for i in leaks}
