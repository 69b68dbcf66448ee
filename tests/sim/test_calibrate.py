"""The simulator's calibration to this machine, and the sim-to-real benchmark's RESULT."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollart_nb.algo.grpo import GRPO
from rollart_nb.bench.calibrate import (
    EpisodeStats,
    measure_cpu,
    pass_overhead,
    register_profile,
    sample_episodes,
    workload_from_stats,
)
from rollart_nb.bench.real_costs import measure_trainer, row_overhead
from rollart_nb.envs import Arithmetic, FrozenLake
from rollart_nb.errors import ConfigError
from rollart_nb.models.spec import ModelSpec, hf_spec
from rollart_nb.protocols import GenerationRequest
from rollart_nb.resources import profiles
from rollart_nb.resources.profiles import PROFILES, HardwareProfile
from rollart_nb.sim.backend import SimBackend
from rollart_nb.sim.roofline import decode_time, prefill_flops, weights_read_bytes

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_to_real.py"
TEST_PROFILE = "CPU-TEST-CALIBRATE"


@pytest.fixture(scope="module")
def model():
    from rollart_nb.models import tiny_qwen

    envs = [FrozenLake(), Arithmetic()]
    return tiny_qwen(task_vocab=sorted({w for e in envs for w in e.vocab}), size="s", seed=0)


@pytest.fixture
def registered():
    yield TEST_PROFILE
    PROFILES.pop(TEST_PROFILE, None)


def test_hf_spec_reads_the_model_config(model):
    cfg = json.loads((Path(model.path) / "config.json").read_text())
    s = hf_spec(model)
    assert (s.layers, s.hidden, s.kv_heads) == (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_key_value_heads"],
    )
    assert s.head_dim == cfg["hidden_size"] // cfg["num_attention_heads"]
    assert s.params == s.active_params == model.params and s.bytes_per_param == 4  # dense, float32


def test_measured_profile_is_plausible_and_prices_sim_work(model, registered):
    hw = register_profile(measure_cpu(model, seconds=0.6, name=registered))
    # One core of any CPU this runs on: 0.1 GFLOP/s .. 10 TFLOP/s float32, 0.1 .. 1000 GB/s.
    assert 1e-4 < hw.bf16_tflops < 10 and 0.1 < hw.mem_bw_gbps < 1000
    assert 0 <= hw.pass_overhead_s < 0.5 and hw.kind == "cpu"
    assert profiles.profile(registered.lower()) is hw  # a pool of that name resolves to it
    spec = hf_spec(model)
    b = SimBackend(spec, hw, time_scale=0, response_tokens=lambda r: 3)
    r = asyncio.run(b.generate(GenerationRequest("t0", "math", [5] * 10, max_new_tokens=4)))
    mfu, mbu = b.engine.settings.mfu, b.engine.settings.mbu
    flops_s = prefill_flops(spec, 10) / (hw.bf16_tflops * 1e12 * mfu)
    mem_s = weights_read_bytes(spec, 10) / (hw.mem_bw_gbps * 1e9 * mbu)
    assert r.prefill_s == pytest.approx(max(flops_s, mem_s) + hw.pass_overhead_s)
    assert r.decode_s == pytest.approx(decode_time(spec, hw, 3, 10, mbu=mbu, mfu=mfu))
    assert r.decode_s >= 3 * hw.pass_overhead_s  # each decoded token pays one pass


def test_pass_overhead_is_the_time_beyond_the_roofline():
    spec = ModelSpec("m", 1e6, 1e6, 4, 128, 2, 32, 4)
    flops, bw = 1e11, 1e10
    roofline = max(prefill_flops(spec, 1, 16) / flops, 4e6 / bw)  # 4 MB of float32 weights
    assert pass_overhead(spec, 0.003, flops, bw) == pytest.approx(0.003 - roofline)
    assert pass_overhead(spec, roofline / 2, flops, bw) == 0.0  # never negative


def test_workload_matches_the_episode_statistics():
    st = EpisodeStats(
        prompt_tokens=[30, 34],
        obs_tokens=[18, 20, 19, 19],
        response_tokens=[2, 2, 4, 2, 2, 3],
        turns=[1, 5],
        env_step_s=[0.001] * 6,
        env_reset_s=[0.002, 0.004],
    )
    w = workload_from_stats("fl", st, max_response_tokens=4)
    assert w.prompt_tokens == 32 and w.shape == "prefill" and w.max_response_tokens == 4
    assert w.turns == (1, 5) and w.mean_turns == 3  # the observed lengths, 1 and 5, and nothing between
    assert w.turn_weights == (1.0, 0.0, 0.0, 0.0, 1.0)
    assert w.obs_tokens == pytest.approx((19.0, (0.5) ** 0.5))
    assert w.response_tokens[0] == pytest.approx(15 / 6)
    assert w.env_latency_s == pytest.approx((0.001, 0.0)) and w.reset_latency_s == pytest.approx((0.003, 0.001))
    single = workload_from_stats("math", EpisodeStats([7], [], [3], [1], [1e-5], [1e-5]), 4)
    assert single.shape == "decode" and single.turns == (1, 1) and single.obs_tokens == (0.0, 0.0)


def test_real_episodes_are_counted_with_the_real_tokenizer(model):
    envs = {"math": Arithmetic(), "frozenlake": FrozenLake()}
    stats = sample_episodes(model, envs, episodes=3, max_new_tokens=4, max_turns=16, seed=0)
    tok = model.load_tokenizer()
    math_st, fl = stats["math"], stats["frozenlake"]
    assert math_st.turns == [1, 1, 1] and math_st.obs_tokens == []  # single-turn task
    question, _ = Arithmetic().reset(seed=0)
    assert math_st.prompt_tokens[0] == len(tok.encode(question))
    assert all(1 <= n <= 4 for n in math_st.response_tokens + fl.response_tokens)
    assert all(1 <= t <= FrozenLake().max_turns for t in fl.turns)
    assert len(fl.response_tokens) == sum(fl.turns) and len(fl.obs_tokens) == sum(t - 1 for t in fl.turns)
    assert len(fl.env_step_s) == sum(fl.turns) and all(s >= 0 for s in fl.env_step_s)


def test_trainer_cost_is_a_line_through_two_real_train_steps(model):
    algo = GRPO(group_size=8, micro_batch_tokens=1024, kl_coef=0.1)
    cost = measure_trainer(model, algo, seconds=0.6)
    assert 0 < cost.per_token_s < 0.01 and 0 <= cost.fixed_s < 1.0
    # a real step on a batch unlike the two it was measured on is predicted to within a factor 2
    from rollart_nb.backends.torch_train import TorchTrainBackend
    from rollart_nb.bench.real_costs import _synthetic_batch, torch_threads
    from rollart_nb.sim.trainer import flops_factor, padded_tokens

    batch = _synthetic_batch(16, 64, 8)
    with torch_threads(1):  # as measured (and as Session.local()'s workers run)
        trainer = TorchTrainBackend(model, algo, seed=0)
        trainer.train_step(batch)  # warm-up
        t0 = time.perf_counter()
        trainer.train_step(batch)
        real = time.perf_counter() - t0
    predicted = cost.fixed_s + cost.per_token_s * padded_tokens([64] * 16, algo)
    assert real / 2 < predicted < real * 2
    # the mfu that makes the roofline charge per_token_s per padded token, reference pass included
    hw = measure_cpu(seconds=0.2)
    mfu = cost.mfu(hf_spec(model), hw.bf16_tflops * 1e12, algo)
    assert 0 < mfu <= 1
    if mfu < 1:
        flops = 6 * flops_factor(algo) * model.params  # per padded token, the reference pass included
        assert flops / (mfu * hw.bf16_tflops * 1e12) == pytest.approx(cost.per_token_s)


def test_the_hf_engine_costs_something_per_request_beyond_its_passes(model):
    """A batch of 8 two-turn rows costs more than a batch of one beyond its passes: building the
    rows, copying their cached KV, sampling each (about a millisecond a row on a CPU core)."""
    row = row_overhead(model, seconds=0.6, rows=8, pass_s=0.002)
    assert 1e-5 < row < 0.05
    with pytest.raises(ConfigError, match="rows"):
        row_overhead(model, rows=1)


def test_a_registered_profile_is_a_sim_pool(registered):
    import rollart_nb as rn

    register_profile(HardwareProfile(registered, "cpu", 0.05, 20.0, 16.0, 0.0, "general", pass_overhead_s=0.002))
    with rn.Session.sim({registered: 2, "cpu": 2}) as sess:
        assert sess.pools[registered].hardware.pass_overhead_s == 0.002


@pytest.mark.slow
def test_quick_benchmark_reports_errors_computed_from_its_numbers():
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--warm-steps", "0"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    res = json.loads(last.removeprefix("RESULT "))
    modes = ["sync", "one-off", "rollart"]
    assert list(res["measured"]) == list(res["predicted"]) == modes
    for m in modes:
        meas, pred = res["measured"][m], res["predicted"][m]
        assert meas["step_s"] > 0 and pred["step_s"] > 0
        for c, e in res["error"][m].items():
            if e is None:
                assert meas[c] == 0
            else:  # errors are rounded to 4 places, seconds to 6 (off by up to 5e-7 each)
                assert e == pytest.approx((pred[c] - meas[c]) / meas[c], abs=1e-4 + 1e-6 * (2 + abs(e)) / meas[c])
        assert set(res["error"][m]) >= {"rollout_wait", "suspend", "update", "resume", "train"}
        assert res["step_error"][m] == pytest.approx((pred["step_s"] - meas["step_s"]) / meas["step_s"], abs=1e-3)
        ok = res["within_target"][m]
        assert ok["step_s"] == (abs(res["step_error"][m]) <= res["target"])
    rank = res["rank"]
    assert rank["measured"] == sorted(modes, key=lambda m: res["measured"][m]["step_s"])
    assert res["ranked_same"] == (rank["measured"] == rank["predicted"])
    assert res["profile"]["name"] == "CPU-MEASURED" and res["profile"]["bf16_tflops"] > 0
    cal = res["calibration"]  # the control plane, measured alone before the real run
    assert cal["turn_cpu_s"] > 0 and cal["control_turns"] > 0 and cal["host_cores"] >= 1
    assert cal["export_overhead_s"] > 0 and cal["load_overhead_s"] > 0 and cal["row_overhead_s"] >= 0
    before, after = res["calibrations"]["before"], res["calibrations"]["after"]
    for k in ("turn_cpu_s", "call_latency_s", "export_overhead_s", "load_overhead_s", "row_overhead_s"):
        assert cal[k] == pytest.approx((before[k] + after[k]) / 2, abs=2e-6)  # times: their mean
    rates = [c["profile"]["bf16_tflops"] for c in (before, after)]
    harmonic = 2 / (1 / rates[0] + 1 / rates[1])  # rates: the mean of the times they imply
    assert res["profile"]["bf16_tflops"] == pytest.approx(harmonic, rel=1e-4)
