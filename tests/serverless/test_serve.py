"""ServeManager against real Ray Serve on 127.0.0.1: scale to zero, hot swap, errors, tokens."""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from rollart_nb.control.reward import RewardDispatcher
from rollart_nb.errors import ConfigError, RewardError, ServerlessError, StateError
from rollart_nb.serverless.client import Endpoint, acall, call
from rollart_nb.serverless.serve import ServeManager
from rollart_nb.trajectory import Trajectory, Turn

TOKEN = "tok-3f9a0c77-never-log-me"


@pytest.fixture(scope="module")
def mgr():
    import rollart_nb as rn

    sess = rn.Session.local({"cpu": 2}, serverless=True)
    m = ServeManager()
    m.sample_replicas(0.2)
    yield m
    m.shutdown()
    sess.close()


def traj(n_turns: int = 2, answer: str = "7") -> Trajectory:
    return Trajectory("math", seed=1, turns=[Turn(f"q{i}", f"a{i}") for i in range(n_turns)], info={"answer": answer})


# Reward functions live in this (test) module, which Serve replicas cannot import: they must
# ship by value.
def _turns_bonus(t: Trajectory) -> float:
    return 0.5 * len(t.turns)


def count_turns(t: Trajectory) -> float:
    return _turns_bonus(t) + 1.0


async def per_turn(t: Trajectory) -> list[float]:
    await asyncio.sleep(0)
    return [float(i) for i in range(len(t.turns))]


def version_one(t: Trajectory) -> float:
    time.sleep(0.01)
    return 1.0


def version_two(t: Trajectory) -> float:
    time.sleep(0.01)
    return 2.0


def raises(t: Trajectory) -> float:
    raise ValueError(f"bad reward for {t.task}")


def not_a_number(t: Trajectory) -> float:
    return math.nan


def batch_sizes(ts: list[Trajectory]) -> list[float]:
    time.sleep(0.05)
    return [float(len(ts))] * len(ts)


def wait_for(pred, timeout_s: float, every_s: float = 0.25):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every_s)
    return False


def test_scale_from_zero_and_back_to_zero(mgr):
    ep = mgr.deploy("zero", count_turns, downscale_delay_s=2)
    assert ep.url == f"{mgr.url}/zero" and ep.url.startswith("http://127.0.0.1:")
    assert mgr.replicas("zero")["zero"].get("RUNNING", 0) == 0  # min_replicas=0: nothing until a call

    t0 = time.perf_counter()
    assert call(ep, [traj(2).to_dict()], {}) == 2.0
    cold = time.perf_counter() - t0
    assert mgr.utilization("zero")["replicas"] >= 1
    t0 = time.perf_counter()
    assert call(ep, [traj(4).to_dict()], {}) == 3.0
    warm = time.perf_counter() - t0
    assert warm < cold  # the first call paid for starting a replica

    assert wait_for(lambda: mgr.utilization("zero")["replicas"] == 0, timeout_s=45), "never scaled back to zero"
    u = mgr.utilization("zero")
    assert u["cold_starts"] == 1 and u["requests"] == 2 and u["errors"] == 0
    assert u["replica_starts"] == 1 and u["busy_s"] > 0 and 0 < u["utilization"] < 1
    assert u["status"] in ("HEALTHY", "DOWNSCALING")  # the last replica may still be stopping
    tl = mgr.timeline("zero")
    assert max(r for _, r in tl) >= 1 and tl[-1][1] == 0
    assert all(a[0] <= b[0] for a, b in zip(tl, tl[1:], strict=False))

    # Scale from zero again: a second cold start, counted.
    assert call(ep, [traj(0).to_dict()], {}) == 1.0
    assert mgr.utilization("zero")["cold_starts"] == 2
    mgr.delete("zero")
    with pytest.raises(ConfigError, match="no reward deployment 'zero'"):
        mgr.utilization("zero")


def test_async_per_turn_reward_and_acall(mgr):
    ep = mgr.deploy("turns", per_turn, min_replicas=1)
    assert mgr.utilization("turns")["replicas"] == 1  # min_replicas=1: warm before any call
    assert asyncio.run(acall(ep, [traj(3).to_dict()], {})) == [0.0, 1.0, 2.0]
    mgr.delete("turns")


def test_hot_swap_under_load_loses_no_request(mgr):
    ep = mgr.deploy("swap", version_one, min_replicas=1, max_replicas=2, downscale_delay_s=5)
    assert call(ep, [traj().to_dict()], {}) == 1.0
    answered: list[tuple[float, float]] = []  # (time answered, value)
    failures: list[BaseException] = []
    local = threading.local()

    def one() -> None:
        try:
            if not hasattr(local, "client"):
                local.client = httpx.Client()
            answered.append((time.monotonic(), call(ep, [traj().to_dict()], {}, client=local.client)))
        except BaseException as e:
            failures.append(e)

    def load() -> None:
        # 100 requests at ~10/s from 8 threads, so they straddle the swap.
        with ThreadPoolExecutor(8) as ex:
            for _ in range(100):
                ex.submit(one)
                time.sleep(0.1)

    th = threading.Thread(target=load)
    th.start()
    assert wait_for(lambda: len(answered) >= 15, timeout_s=60)
    started = time.monotonic()
    ep2 = mgr.deploy("swap", version_two, min_replicas=1, max_replicas=2, downscale_delay_s=5)
    swapped = time.monotonic()
    th.join(timeout=120)
    assert not failures, failures[:3]
    values = [v for _, v in answered]
    assert len(values) == 100 and set(values) <= {1.0, 2.0} and 1.0 in values
    assert any(started < t < swapped for t, _ in answered)  # served while the swap was in progress
    # deploy() returns once the new version runs; the proxy stops routing to the old one
    # within about a second.
    late = [v for t, v in answered if t > swapped + 1.0]
    time.sleep(max(0.0, swapped + 1.0 - time.monotonic()))
    late += [call(ep, [traj().to_dict()], {}) for _ in range(10)]
    assert set(late) == {2.0}
    assert ep2 == ep and mgr.version("swap") == 1
    resp = httpx.post(ep.url, json={"args": [traj().to_dict()], "kwargs": {}}, timeout=30).json()
    assert resp == {"result": 2.0, "version": 1}
    mgr.delete("swap")


def test_raising_reward_is_a_500_with_its_message(mgr):
    ep = mgr.deploy("boom", raises, min_replicas=1)
    with pytest.raises(ServerlessError, match="ValueError: bad reward for math") as ei:
        call(Endpoint("boom", ep.url, retries=0), [traj().to_dict()], {})
    assert ei.value.status == 500
    # A malformed body is the caller's fault: 400, not retried as a server error.
    r = httpx.post(ep.url, json={"nope": 1}, timeout=30)
    assert r.status_code == 400 and "args" in r.json()["error"]
    # Counters are reported off the request path: give them a moment.
    assert wait_for(lambda: mgr.utilization("boom")["errors"] == 1, timeout_s=10)
    # Through the reward dispatcher: retried, then a RewardError naming the cause.
    rd = RewardDispatcher()
    rd.set("math", endpoint=Endpoint("boom", ep.url, retries=0), retries=1)
    with pytest.raises(RewardError, match=r"failed after 2 attempt.*ValueError: bad reward"):
        asyncio.run(rd.score(traj()))
    mgr.delete("boom")


def test_nan_reward_becomes_reward_error_after_retries(mgr):
    ep = mgr.deploy("nan", not_a_number, min_replicas=1)
    assert math.isnan(call(ep, [traj().to_dict()], {}))  # sent as JSON NaN, read back as nan
    rd = RewardDispatcher()
    rd.set("math", endpoint=ep, retries=2)
    t = traj()
    with pytest.raises(RewardError, match=r"failed after 3 attempt.*not a finite number"):
        asyncio.run(rd.score(t))
    assert not t.scored and rd.failures == 1
    assert wait_for(lambda: mgr.utilization("nan")["requests"] == 4, timeout_s=10)
    mgr.delete("nan")


def test_dispatcher_scores_through_endpoint(mgr):
    ep = mgr.deploy("disp", count_turns, min_replicas=1)
    rd = RewardDispatcher()
    rd.set("math", endpoint=ep)
    t = traj(2)
    asyncio.run(rd.score(t))
    assert t.reward == 2.0 and t.reward_version == 0
    mgr.delete("disp")


def test_batched_deployment_groups_concurrent_calls(mgr):
    ep = mgr.deploy(
        "batch",
        batch_sizes,
        batched=True,
        max_batch_size=8,
        batch_wait_s=0.1,
        min_replicas=1,
        max_replicas=1,
        max_ongoing_requests=32,
    )
    with ThreadPoolExecutor(8) as ex:
        sizes = list(ex.map(lambda _: call(ep, [traj().to_dict()], {}), range(16)))
    assert len(sizes) == 16 and max(sizes) > 1  # some calls shared one fn invocation
    assert sum(1 / s for s in sizes) < 16
    mgr.delete("batch")


def test_bearer_token_required_and_never_shown(mgr, monkeypatch):
    monkeypatch.setenv("ROLLART_TEST_REWARD_TOKEN", TOKEN)
    ep = mgr.deploy("secure", count_turns, min_replicas=1, token_env="ROLLART_TEST_REWARD_TOKEN")
    assert call(ep, [traj(2).to_dict()], {}) == 2.0
    with pytest.raises(ServerlessError, match="401") as ei:
        call(Endpoint("anon", ep.url), [traj().to_dict()], {})
    assert ei.value.status == 401
    monkeypatch.setenv("ROLLART_TEST_WRONG", "not-the-token")
    with pytest.raises(ServerlessError, match="401"):
        call(Endpoint("wrong", ep.url, token_env="ROLLART_TEST_WRONG"), [traj().to_dict()], {})

    from ray import serve

    from rollart_nb import _ray

    shown = [
        repr(ep),
        str(ep),
        repr(mgr),
        str(mgr.utilization("secure")),
        str(serve.status()),
        str(mgr.deployments["secure"]),
    ]
    assert not [s for s in shown if TOKEN in s]
    logs = Path(_ray.ray()._private.worker._global_node.get_logs_dir_path())
    leaked = [p for p in logs.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert not leaked, leaked
    mgr.delete("secure")


def test_deploy_validates_everything_at_once(mgr, monkeypatch):
    monkeypatch.delenv("ROLLART_UNSET_TOKEN", raising=False)
    with pytest.raises(ConfigError) as ei:
        mgr.deploy("bad name!", 3, max_replicas=0, target_ongoing_requests=0, token_env="ROLLART_UNSET_TOKEN")
    msg = str(ei.value)
    for part in (
        "name 'bad name!'",
        "fn must be callable",
        "max_replicas=0",
        "target_ongoing_requests=0",
        "ROLLART_UNSET_TOKEN",
    ):
        assert part in msg
    assert "bad name!" not in mgr.deployments


def test_fn_that_cannot_reach_replicas_is_refused_at_deploy(mgr):
    # A module without a file (nothing to ship by value) that workers cannot import: with
    # min_replicas=0 the failure would otherwise wait for the first request to time out.
    mod = types.ModuleType("rollart_ghost_module")
    exec("def ghost(t):\n    return 1.0\n", mod.__dict__)
    sys.modules[mod.__name__] = mod
    try:
        with pytest.raises(ConfigError, match="does not unpickle in a Ray worker.*rollart_ghost_module"):
            mgr.deploy("ghost", mod.ghost)
    finally:
        del sys.modules[mod.__name__]
    assert "ghost" not in mgr.deployments


def test_shutdown_is_final(mgr):
    ep = mgr.deploy("last", count_turns, min_replicas=1)
    assert call(ep, [traj().to_dict()], {}) == 2.0
    mgr.shutdown()
    mgr.shutdown()  # idempotent
    assert "closed" in repr(mgr)
    with pytest.raises(StateError, match="ServeManager is shut down"):
        mgr.deploy("again", count_turns)
    with pytest.raises(ServerlessError):
        call(Endpoint("last", ep.url, retries=0, timeout_s=5), [traj().to_dict()], {})
