"""Workload presets and SimEnv (turns, token lengths, rewards, latency, concurrency)."""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time

import pytest

from rollart_nb.envs.base import AsyncEnv, env_reset, env_step
from rollart_nb.errors import ConfigError, EnvError
from rollart_nb.protocols import Env, GenerationRequest
from rollart_nb.sim import PRESETS, SimEnv, SimTokenizer, Workload, response_tokens_fn, workload

TOK = SimTokenizer()


def episode(env, seed, action_tag="a"):
    """Play one episode with distinct actions; return (turns, obs token counts, rewards)."""
    obs, _ = env.reset(seed)
    counts, rewards, turn = [len(TOK.encode(obs))], [], 0
    while True:
        turn += 1
        obs, reward, terminated, truncated, _ = env.step(f"{action_tag}{turn} go")
        rewards.append(reward)
        if terminated or truncated:
            return turn, counts, rewards
        counts.append(len(TOK.encode(obs)))


# -- workloads ---------------------------------------------------------------------------


def test_presets_have_the_papers_two_shapes():
    prefill = [w for w in PRESETS.values() if w.shape == "prefill"]
    decode = [w for w in PRESETS.values() if w.shape == "decode"]
    assert {w.name for w in prefill} == {"swe", "frozenlake", "webshop"}
    assert {w.name for w in decode} == {"gem-math", "gem-game"}
    assert all(w.turns[1] <= 5 for w in decode)  # few turns ...
    assert all(w.response_tokens[0] >= 1000 for w in decode)  # ... long chains of thought
    assert all(w.turns[0] >= 10 for w in prefill)  # many turns of growing history
    assert min(w.mean_turns for w in prefill) > max(w.mean_turns for w in decode)
    assert workload("GEM-Math") is PRESETS["gem-math"]
    with pytest.raises(ConfigError, match="known"):
        workload("chess")


def test_workload_validation_reports_every_problem():
    with pytest.raises(ConfigError) as e:
        Workload("bad", "both", (3, 1), 0, (1, -1), (1, 1), (0, 0), max_response_tokens=0)
    assert len(e.value.problems) == 5


def test_response_tokens_fn_follows_the_workload():
    fn = response_tokens_fn({"math": PRESETS["gem-math"], "lake": PRESETS["frozenlake"]}, seed=1)
    math_lens = [fn(GenerationRequest(f"t{i}", "math", [1] * 10)) for i in range(400)]
    lake_lens = [fn(GenerationRequest(f"t{i}", "lake", [1] * 10)) for i in range(400)]
    assert statistics.mean(math_lens) == pytest.approx(2500, rel=0.1)
    assert statistics.mean(lake_lens) == pytest.approx(30, rel=0.1)
    assert all(1 <= n <= 8192 for n in math_lens)
    assert fn(GenerationRequest("t0", "math", [1] * 10)) == math_lens[0]  # deterministic
    with pytest.raises(ConfigError, match="no workload for task 'chess'"):
        fn(GenerationRequest("t0", "chess", []))
    assert response_tokens_fn(PRESETS["swe"])(GenerationRequest("t", "anything", [])) >= 1


# -- SimEnv ------------------------------------------------------------------------------


def test_sim_env_exposes_env_hints_and_protocols():
    env = SimEnv("swe", time_scale=0)
    assert isinstance(env, Env) and isinstance(env, AsyncEnv)
    assert env.shape == "prefill" and env.max_turns == 50 and env.vocab == []
    assert SimEnv(PRESETS["gem-math"]).shape == "decode"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_turns_and_token_lengths_follow_the_profile(name):
    w = PRESETS[name]
    env = SimEnv(w, time_scale=0)
    turns, obs_counts = [], []
    for seed in range(60):
        n, counts, rewards = episode(env, seed)
        turns.append(n)
        assert counts[0] == w.prompt_tokens
        obs_counts += counts[1:]
        assert all(r == 0.0 for r in rewards[:-1]) and 0.0 <= rewards[-1] <= 1.0
    lo, hi = w.turns
    assert min(turns) >= lo and max(turns) <= hi
    assert statistics.mean(turns) == pytest.approx(w.mean_turns, abs=3 * ((hi - lo + 1) ** 2 / 12 / 60) ** 0.5 + 0.01)
    if obs_counts:
        mean, std = w.obs_tokens
        assert statistics.mean(obs_counts) == pytest.approx(mean, abs=4 * std / len(obs_counts) ** 0.5 + 1)
        assert min(obs_counts) >= 1


def test_episodes_are_deterministic_given_actions_but_vary_within_a_group():
    a, b = SimEnv("webshop", seed=3, time_scale=0), SimEnv("webshop", seed=3, time_scale=0)
    assert episode(a, 11) == episode(b, 11)
    # Same seed (one GRPO group), different actions: lengths and rewards differ.
    group = [episode(a, 11, action_tag=f"m{k}") for k in range(8)]
    assert len({n for n, _, _ in group}) > 1 and len({r[-1] for _, _, r in group}) > 1


def test_step_after_the_end_raises():
    env = SimEnv(Workload("one", "decode", (1, 1), 5, (1, 0), (1, 0), (0, 0)), time_scale=0)
    env.reset(0)
    assert env.step("x")[2] is True
    with pytest.raises(EnvError, match="reset"):
        env.step("x")


def test_sync_step_sleeps_the_scaled_latency():
    env = SimEnv(Workload("slow", "prefill", (3, 3), 5, (1, 0), (1, 0), (20.0, 0.0)), time_scale=1e-3)
    env.reset(0)
    t0 = time.perf_counter()
    env.step("x")
    assert time.perf_counter() - t0 >= 0.019


def test_500_envs_with_100ms_latency_run_concurrently():
    # 100 modelled seconds per step at time_scale 1e-3 = 100 ms; 3 steps each, 500 envs:
    # serial would take 150 s, one event loop takes ~0.3 s.
    w = Workload("latent", "prefill", (3, 3), 10, (5, 1), (5, 1), (100.0, 10.0))
    envs = [SimEnv(w, seed=i, time_scale=1e-3) for i in range(500)]

    async def play(env, i):
        await env_reset(env, i)
        steps = 0
        while True:
            steps += 1
            _, _, terminated, truncated, _ = await env_step(env, f"act{steps}")
            if terminated or truncated:
                return steps

    async def main():
        return await asyncio.gather(*(play(e, i) for i, e in enumerate(envs)))

    t0 = time.perf_counter()
    steps = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    assert steps == [3] * 500
    assert 0.25 < elapsed < 3.0


def test_turn_weights_give_the_episode_lengths_their_observed_shape():
    # bimodal, as FrozenLake: half end at turn 1 (a hole), half walk to the limit of 10
    w = Workload("fl", "prefill", (1, 10), 30, (20.0, 0.0), (2.0, 0.0), (0.0, 0.0), turn_weights=(1,) + (0,) * 8 + (1,))
    assert w.mean_turns == 5.5 and w.end_hazard(1) == 0.5 and w.end_hazard(5) == 0.0 and w.end_hazard(10) == 1.0
    env = SimEnv(w, time_scale=0)
    turns = [episode(env, seed)[0] for seed in range(200)]
    assert set(turns) == {1, 10}
    assert 0.4 < turns.count(1) / len(turns) < 0.6
    uniform = SimEnv(dataclasses.replace(w, turn_weights=()), time_scale=0)
    assert len({episode(uniform, seed)[0] for seed in range(200)}) > 5  # without weights: every length
    with pytest.raises(ConfigError, match="turn_weights"):
        Workload("x", "prefill", (1, 3), 10, (1.0, 0.0), (1.0, 0.0), (0.0, 0.0), turn_weights=(1.0, 1.0))
