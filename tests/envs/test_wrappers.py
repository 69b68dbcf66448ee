import asyncio
import copy
import math
import statistics
import threading
import time

import pytest

from rollart_nb.envs import Arithmetic, FrozenLake, WithFailures, WithLatency, env_reset, env_step
from rollart_nb.errors import ConfigError, EnvError


def test_latency_samples_have_requested_mean_and_std_clipped_at_zero():
    env = WithLatency(Arithmetic(), mean_s=0.05, std_s=0.02, seed=0)
    samples = [env.sample_latency() for _ in range(4000)]
    assert statistics.fmean(samples) == pytest.approx(0.05, abs=0.002)
    assert statistics.stdev(samples) == pytest.approx(0.02, abs=0.002)
    wide = WithLatency(Arithmetic(), mean_s=0.01, std_s=0.05, seed=0)
    assert min(wide.sample_latency() for _ in range(1000)) == 0.0


def test_long_tail_scales_a_fraction_of_calls():
    env = WithLatency(Arithmetic(), mean_s=1.0, std_s=0.0, long_tail_p=0.25, long_tail_scale=10.0, seed=1)
    samples = [env.sample_latency() for _ in range(4000)]
    assert set(samples) == {1.0, 10.0}
    assert samples.count(10.0) / len(samples) == pytest.approx(0.25, abs=0.03)


def test_sync_step_sleeps_and_reports_latency():
    env = WithLatency(Arithmetic(), mean_s=0.05, std_s=0.0)
    t0 = time.perf_counter()
    _, info = env.reset(seed=0)
    obs, reward, *_, step_info = env.step(info["answer"])
    elapsed = time.perf_counter() - t0
    assert 0.1 <= elapsed < 0.5
    assert info["latency_s"] == step_info["latency_s"] == 0.05
    assert reward == 1.0 and info["answer"]  # inner env results pass through


def test_64_envs_stepped_concurrently_take_about_one_latency():
    latency = 0.2
    envs = [WithLatency(FrozenLake(), mean_s=latency, std_s=0.0) for _ in range(64)]

    async def episode(env, seed):
        await env_reset(env, seed)
        return await env_step(env, "down")

    async def main():
        t0 = time.perf_counter()
        results = await asyncio.gather(*(episode(e, i) for i, e in enumerate(envs)))
        return time.perf_counter() - t0, results

    before = threading.active_count()  # threads other tests left (idle pool threads leave later)
    elapsed, results = asyncio.run(main())
    assert len(results) == 64 and all(r[4]["latency_s"] == latency for r in results)
    # Two sleeps (reset + step) each; 64 sequential envs would take 25.6 s.
    assert elapsed < 2 * latency + 1.0
    assert threading.active_count() - before < 10  # no thread per env


def test_wrapper_forwards_hints():
    inner = FrozenLake(max_turns=7)
    env = WithFailures(WithLatency(inner, mean_s=0.0, std_s=0.0))
    assert env.vocab == inner.vocab and env.max_turns == 7 and env.shape == "prefill"
    assert env.validation_seeds() == inner.validation_seeds()
    assert env.unwrapped is inner


def test_failures_raise_at_p_raise_one_sync_and_async():
    env = WithFailures(Arithmetic(), p_raise=1.0)
    with pytest.raises(EnvError, match="injected failure in Arithmetic.reset"):
        env.reset(seed=0)
    with pytest.raises(EnvError, match="injected failure"):
        asyncio.run(env_reset(env, 0))


def test_failures_only_where_asked():
    env = WithFailures(Arithmetic(), p_raise=1.0, on=("step",))
    _, info = env.reset(seed=0)
    with pytest.raises(EnvError, match="Arithmetic.step"):
        env.step(info["answer"])


def test_p_raise_zero_never_fails():
    env = WithFailures(Arithmetic(), p_raise=0.0, p_hang=0.0)
    for seed in range(50):
        _, info = env.reset(seed=seed)
        assert env.step(info["answer"])[1] == 1.0


def test_p_raise_fraction():
    env = WithFailures(Arithmetic(), p_raise=0.3, on=("reset",), seed=0)
    failures = 0
    for seed in range(2000):
        try:
            env.reset(seed=seed)
        except EnvError:
            failures += 1
    assert failures / 2000 == pytest.approx(0.3, abs=0.04)


def test_async_hang_is_cut_by_timeout():
    env = WithFailures(Arithmetic(), p_hang=1.0, hang_s=3600)
    t0 = time.perf_counter()
    with pytest.raises(EnvError, match="did not answer reset within 0.2s"):
        asyncio.run(env_reset(env, 0, timeout_s=0.2))
    assert time.perf_counter() - t0 < 1.0


def test_sync_hang_blocks_then_raises():
    env = WithFailures(Arithmetic(), p_hang=1.0, hang_s=0.6)
    errors = []
    thread = threading.Thread(target=lambda: errors.append(pytest.raises(EnvError, env.reset, 0)), daemon=True)
    thread.start()
    thread.join(0.2)
    assert thread.is_alive()  # still hanging
    thread.join(2.0)
    assert not thread.is_alive() and "injected hang" in str(errors[0].value)


def test_config_validation():
    with pytest.raises(ConfigError):
        WithLatency(Arithmetic(), mean_s=-1, std_s=0)
    with pytest.raises(ConfigError) as e:
        WithFailures(Arithmetic(), p_raise=2, hang_s=-1, on=("close",))
    assert len(e.value.problems) == 3


class Endless:
    """A sync env whose episodes never end (so fates can be drawn from many steps)."""

    def reset(self, seed=None):
        return "", {}

    def step(self, action):
        return "", 0.0, False, False, {}


def fates(env, calls):
    """What each of ``calls`` sync steps did: "ok", "raise" or "hang" (hang_s=0: a hang just raises)."""
    out = []
    for _ in range(calls):
        try:
            env.step("1")
            out.append("ok")
        except EnvError as e:
            out.append("hang" if "injected hang" in str(e) else "raise")
    return out


def test_failure_rates_match_nominal_per_instance_and_instances_differ():
    p_raise, p_hang, instances, calls = 0.03, 0.05, 200, 200
    template = WithFailures(Endless(), p_raise=p_raise, p_hang=p_hang, hang_s=0.0, on=("step",), seed=7)
    runs = []
    for _ in range(instances):  # what TaskSet.expand and the EnvManager do: one deep copy per instance
        env = copy.deepcopy(template)
        env.reset(seed=0)
        runs.append(fates(env, calls))
    n = instances * calls
    for fate, p in (("raise", p_raise), ("hang", p_hang)):
        total = sum(r.count(fate) for r in runs)
        assert abs(total / n - p) < 5 * math.sqrt(p * (1 - p) / n), (fate, total / n)
        # per instance: binomial spread, not all-or-nothing (the old shared stream gave 0% or 100%)
        per = [r.count(fate) for r in runs]
        assert statistics.pvariance(per) < 2 * calls * p * (1 - p)
    hung_once = sum("hang" in r for r in runs)
    assert hung_once >= 0.95 * instances  # P(no hang in 200 calls at 5%) is 3.5e-5
    assert len({tuple(r) for r in runs}) == instances  # every instance draws its own sequence


def test_recreated_env_does_not_replay_and_streams_are_reproducible():
    def first_fates(seed, copies):
        template = WithFailures(Endless(), p_raise=0.5, on=("step",), seed=seed)
        return [fates(copy.deepcopy(template), 40) for _ in range(copies)]

    a = first_fates(3, 3)
    assert a[0] != a[1] != a[2] and a[0] != a[2]  # copy k+1 (a recreated env) is not copy k again
    assert first_fates(3, 3) == a  # (seed, k) fixes the stream: the run is reproducible
    assert first_fates(4, 1)[0] != a[0]
    nested = copy.deepcopy(copy.deepcopy(WithFailures(Endless(), p_raise=0.5, on=("step",), seed=3)))
    assert nested.instance == (1, 1) and fates(nested, 40) not in a


def test_latency_streams_differ_per_instance():
    template = WithLatency(Arithmetic(), mean_s=1.0, std_s=0.5, seed=0)
    a, b = copy.deepcopy(template), copy.deepcopy(template)
    assert [a.sample_latency() for _ in range(5)] != [b.sample_latency() for _ in range(5)]
    assert (a.instance, b.instance) == ((1,), (2,))


def test_failure_probabilities_may_not_sum_above_one():
    with pytest.raises(ConfigError, match=r"p_raise \+ p_hang must be <= 1"):
        WithFailures(Arithmetic(), p_raise=0.6, p_hang=0.6)
