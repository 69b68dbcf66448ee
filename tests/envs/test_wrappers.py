import asyncio
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

    elapsed, results = asyncio.run(main())
    assert len(results) == 64 and all(r[4]["latency_s"] == latency for r in results)
    # Two sleeps (reset + step) each; 64 sequential envs would take 25.6 s.
    assert elapsed < 2 * latency + 1.0
    assert threading.active_count() < 10  # no thread per env


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
    thread = threading.Thread(
        target=lambda: errors.append(pytest.raises(EnvError, env.reset, 0)), daemon=True
    )
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
