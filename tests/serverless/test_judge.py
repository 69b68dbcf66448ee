"""LLMJudge: deterministic greedy judging, clear parse failures, end to end through Ray Serve."""

from __future__ import annotations

import asyncio
import functools
import gc
import pickle
import threading

import pytest

from rollart_nb.errors import ConfigError, RewardError, ServerlessError
from rollart_nb.serverless.client import call
from rollart_nb.serverless.judge import LLMJudge, parse_score, parse_yes_no
from rollart_nb.trajectory import Trajectory, Turn


def traj(action: str = "7", answer: str = "7") -> Trajectory:
    return Trajectory("math", turns=[Turn("what is 3 + 4 ?", action)], info={"answer": answer})


def digest_parse(text: str) -> float:
    """A random-init judge says nothing meaningful; map its greedy text to [0, 1] stably."""
    return (sum(map(ord, text)) % 101) / 100


@pytest.fixture(scope="module")
def tiny():
    from rollart_nb.models import tiny_qwen

    return tiny_qwen(seed=0)


@pytest.fixture(scope="module")
def mgr():
    import rollart_nb as rn
    from rollart_nb.serverless.serve import ServeManager

    sess = rn.Session.local({"cpu": 2}, serverless=True)
    m = ServeManager()
    yield m
    m.shutdown()
    sess.close()


def test_parsers():
    assert parse_score("Score: 0.75 because") == 0.75
    assert parse_score("8/10", scale=10) == 0.8
    assert parse_yes_no(" Yes, it is right") == 1.0 and parse_yes_no("no.") == 0.0
    with pytest.raises(RewardError, match="holds no number"):
        parse_score("excellent")
    with pytest.raises(RewardError, match=r"outside \[0, 1\]"):
        parse_score("7")
    with pytest.raises(RewardError, match="neither yes nor no"):
        parse_yes_no("maybe")


def test_sim_judge_is_deterministic_and_bounded():
    judge = LLMJudge()
    assert judge.backend == "sim"
    scores = [judge(traj(str(a))) for a in range(20)]
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert scores == [LLMJudge()(traj(str(a))) for a in range(20)]  # a fresh judge agrees
    assert len(set(scores)) > 5  # it does look at the trajectory
    assert "7" in judge.render(traj()) and "what is 3 + 4 ?" in judge.render(traj())


def test_parse_failures_are_clear():
    with pytest.raises(RewardError, match="starts with neither yes nor no"):
        LLMJudge(parse=parse_yes_no)(traj())
    with pytest.raises(RewardError, match=r"into 1\.5, outside \[0, 1\]"):
        LLMJudge(parse=lambda text: 1.5)(traj())
    with pytest.raises(RewardError, match="parse failed on judge answer .*ZeroDivisionError"):
        LLMJudge(parse=lambda text: 1 / 0)(traj())


def test_bad_config_reports_every_problem():
    with pytest.raises(ConfigError) as ei:
        LLMJudge(backend="hf", prompt_template="{question}", max_new_tokens=0, parse="x")
    msg = str(ei.value)
    assert "needs a model" in msg and "KeyError: 'question'" in msg
    assert "max_new_tokens=0" in msg and "parse must be callable" in msg
    with pytest.raises(ConfigError, match="must be 'hf' or 'sim'"):
        LLMJudge(backend="vllm")


def test_hf_judge_greedy_is_deterministic_and_loads_once(tiny):
    judge = LLMJudge(tiny, parse=digest_parse)
    assert judge.backend == "hf"
    a = judge(traj("7"))
    engine = judge._engine
    assert judge(traj("7")) == a and 0.0 <= a <= 1.0
    assert judge._engine is engine  # loaded once, reused
    assert isinstance(judge.answer(traj("7")), str)
    clone = pickle.loads(pickle.dumps(judge))  # what Serve ships: the recipe, not the weights
    with clone:
        assert clone._engine is None and clone(traj("7")) == a
    judge.close()
    assert not judge_threads() and judge._engine is None
    assert judge(traj("7")) == a  # a closed judge loads again on its next call
    del judge, clone, engine
    gc.collect()
    assert not judge_threads()  # dropped without close(): its thread stopped all the same


def test_closing_a_judge_mid_request_fails_the_caller_clearly(tiny):
    judge = LLMJudge(tiny, parse=digest_parse)
    engine, _ = judge._started()
    started = threading.Event()

    async def never_done(request):  # a generation still running when close() comes
        started.set()
        await asyncio.sleep(3600)

    engine.generate = never_done
    errors: list[Exception] = []

    def score():
        try:
            judge(traj())
        except Exception as e:  # noqa: BLE001 - the test looks at what came out
            errors.append(e)

    caller = threading.Thread(target=score)
    caller.start()
    assert started.wait(30)
    judge.close()
    caller.join(30)
    assert not caller.is_alive()  # not left waiting on a loop that is gone
    assert len(errors) == 1 and isinstance(errors[0], RewardError)
    assert "closed while scoring" in str(errors[0])
    assert not judge_threads()


def judge_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rollart-judge-loop"]


def test_hf_judge_through_serve_matches_local(mgr, tiny):
    judge = LLMJudge(tiny, parse=digest_parse)
    ep = mgr.deploy("judge", judge, num_cpus=0.5, timeout_s=180, retries=0, downscale_delay_s=5)
    t = traj("7")
    served = [call(ep, [t.to_dict()], {}) for _ in range(3)]
    with judge:
        assert served[0] == served[1] == served[2] == judge(t)  # same frozen model, greedy: same score
    u = mgr.utilization("judge")
    assert u["replica_starts"] == 1 and u["init_s_mean"] > 0.05  # the model loaded in setup(), once
    mgr.delete("judge")


def test_judge_parse_failure_through_serve(mgr):
    ep = mgr.deploy("strict", LLMJudge(parse=functools.partial(parse_score, scale=0.01)), min_replicas=1, retries=0)
    with pytest.raises(ServerlessError, match=r"RewardError: judge answered .* outside \[0, 0\.01\]") as ei:
        call(ep, [traj().to_dict()], {})
    assert ei.value.status == 500
    mgr.delete("strict")
