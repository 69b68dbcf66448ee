"""Bench experiments in quick mode: the expected keys, the paper's numbers, a figure, one direction each."""

from __future__ import annotations

import math
import os

import pytest

from rollart_nb.bench import EXPERIMENTS, run_experiments
from rollart_nb.bench.harness import RunSpec, equal_cost_counts, pool_cost, simulate
from rollart_nb.bench.report import deviation, format_table, result
from rollart_nb.errors import ConfigError
from rollart_nb.sim.workloads import Workload


def test_report_notes_only_large_gaps():
    r = result(
        "x",
        {"a": 1.0, "b": 2.0, "c": 1.5},
        {"a": (1.1, 1.3), "b": 1.0, "c": None},
        {"b": "because of B"},
        {},
        description="d",
    )
    assert r["deviation"] == {"a": pytest.approx(0.0909, abs=1e-3), "b": 1.0, "c": None}
    assert len(r["notes"]) == 1 and "because of B" in r["notes"][0]
    assert "in range" not in format_table(r) and "b" in format_table(r)
    assert deviation(1.2, (1.1, 1.3)) == 0 and math.isnan(deviation(1.0, None))


def test_equal_cost_sizing_uses_profile_prices():
    budget = pool_cost({"H800": 9})
    n20 = equal_cost_counts(budget, "H20")
    assert abs(pool_cost({"H20": n20}) - budget) <= pool_cost({"H20": 1})


def test_unknown_experiment():
    with pytest.raises(ConfigError, match="unknown experiment"):
        run_experiments("nope")


def test_simulation_is_reproducible_and_load_independent():
    """The virtual clock: a seed gives the same modelled numbers, whatever the machine does meanwhile."""
    s = RunSpec(
        "qwen3-8b",
        {"H20": 4},
        train_gpus=4,
        tasks={"math": "gem-math"},
        envs_per_task=8,
        batch=16,
        group=4,
        steps=2,
        warmup=1,
        seed=3,
    )
    a = simulate(s)
    stop = False

    def burn():  # a CPU hog in this process: with a wall clock it would stretch every sleep
        x = 0
        while not stop:
            x += 1

    import threading

    hog = threading.Thread(target=burn, daemon=True)
    hog.start()
    try:
        b = simulate(s)
    finally:
        stop = True
        hog.join()
    keys = ("step_s", "rollout_s", "tokens_per_s", "aborted_per_step")
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    assert a["step_s"] > 0 and a["lag_frac"] == 0.0
    c = simulate(s.with_(seed=4))
    assert c["step_s"] != a["step_s"]  # the seed matters


def test_prefill_heavy_work_prefers_h800_over_h20_at_equal_cost():
    """Long prompts, short answers (prefill-bound in the roofline): the affinity mix, which routes
    prefill-shaped work to H800, beats H20-only at equal cost (the direction R1 reports).
    Sync mode, so each step's rollout_s is one batch's rollout from scratch."""
    docs = Workload("docs", "prefill", (1, 1), 8000, (10.0, 0.0), (16.0, 0.0), (0.0, 0.0), max_response_tokens=32)
    base = RunSpec(
        "qwen3-8b",
        {},
        train_gpus=1,
        tasks={"docs": docs},
        envs_per_task=16,
        batch=16,
        group=4,
        steps=1,
        warmup=1,
        mode="sync",
    )
    budget = pool_cost({"H800": 4})
    h20 = simulate(base.with_(rollout={"H20": equal_cost_counts(budget, "H20")}))
    mix = simulate(base.with_(rollout={"H800": 3, "H20": equal_cost_counts(budget - pool_cost({"H800": 3}), "H20")}))
    assert 0 < mix["rollout_s"] < h20["rollout_s"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bench"))
    return out, run_experiments("all", out=out, quick=True, printer=None)


EXPECTED = {
    "r1_affinity": {"mix_over_h20_only", "mix_over_h800_only", "routing_gain"},
    "pd_disaggregation": {"dense_1P3D", "dense_2P2D"},
    "redundant_rollouts": {"group4_r2", "max_speedup"},
    "alpha_sweep": {"alpha2_over_alpha1", "alpha4_over_alpha1", "best_over_alpha1"},
    "staleness_policies": {"alpha2_drop_over_alpha1_drop", "alpha2_correct_over_alpha1_drop"},
    "scaling": {"rollart_over_syncplus@128"},
    "throughput_ladder": {"syncplus_over_sync", "rollart_over_sync"},
}


@pytest.mark.parametrize("name", [n for n in EXPERIMENTS if n != "sensitivity"])
def test_quick_experiment_shape(quick, name):
    out, res = quick
    r = res[name]
    assert set(r["ours"]) == EXPECTED[name]
    assert all(v > 0 and math.isfinite(v) for v in r["ours"].values())
    assert set(r["paper"]) <= set(r["ours"]) and any(v is not None for v in r["paper"].values())
    assert r["figure"] and os.path.exists(r["figure"])
    for k, d in r["deviation"].items():  # every > 25% gap is explained
        if d is not None and d > 0.25:
            assert any(n.startswith(k + ":") for n in r["notes"])


def test_quick_directions(quick):
    _, res = quick
    # redundancy masks stragglers: the best r > 0 is not slower than none
    assert res["redundant_rollouts"]["ours"]["max_speedup"] >= 1.0
    # overlapping training with rollout raises throughput over Sync
    assert res["throughput_ladder"]["ours"]["rollart_over_sync"] > 1.0
    # the correct staleness policy aborts nothing; alpha=1 drop aborts at least as much as alpha=2 drop
    aborted = res["staleness_policies"]["aborted_token_frac"]
    assert aborted["alpha2_correct"] == 0 and aborted["alpha1_drop"] >= aborted["alpha2_drop"]
    # a larger cluster does not lower RollArt's throughput
    norm = res["scaling"]["normalised"]
    assert norm["rollart@128"] > norm["rollart@64"] * 0.9


def test_sensitivity_sweeps_one_parameter_and_draws_it(tmp_path):
    from rollart_nb.bench.sensitivity import sensitivity_report

    res = sensitivity_report(
        out=str(tmp_path), quick=True, printer=None, ratios=["rollart_over_areal"], params=["turns"]
    )
    s = res["sweeps"]["rollart_over_areal"]["turns"]
    assert s["values"] == [0.5, 1.0, 2.0] and len(s["ours"]) == 3 and all(v > 0 for v in s["ours"])
    # longer trajectories outlive the staleness window more often: RollArt aborts more of its work
    assert s["wasted"][-1] > s["wasted"][0]
    assert os.path.exists(res["figure"]["rollart_over_areal"])
