"""The TRL side-by-side benchmark's own side, run for a few seconds as a user would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "math_vs_trl.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--sides", "ours", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_ours_side_reports_its_settings_and_trained_rows():
    p = _run(
        "--seconds",
        "4",
        "--eval-every",
        "2",
        "--group",
        "4",
        "--prompts",
        "4",
        "--kl",
        "0.05",
        "--skip-flat",
        "--reward",
        "close",
        "--epochs",
        "2",
    )
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert (res["group"], res["prompts"], res["kl"], res["skip_flat"]) == (4, 4, 0.05, True)
    ours = res["ours"]
    assert ours["steps"] > 0 and ours["steps"] % 2 == 0  # two optimizer steps per sampled batch
    assert res["epochs"] == 2 and 1 <= ours["response_tokens"] <= 4
    # 16 completions per step; with --skip-flat a step trains only the rows of groups with a spread
    assert 0 <= ours["trained_rows_per_step"] <= 16
    assert 0.0 <= ours["best"] <= 1.0
    assert "greedy acc" in p.stderr  # evaluations are printed as they happen


def test_bad_settings_are_refused():
    p = _run("--group", "1")
    assert p.returncode == 2
    assert "--group >= 2" in p.stderr


def _module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("math_vs_trl", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_seed_lists_parse_and_bad_ones_are_refused():
    mod = _module()
    assert mod.parse_seeds("0-3") == [0, 1, 2, 3]
    assert mod.parse_seeds("0-2,7") == [0, 1, 2, 7]
    for bad in ("3-1", "a", "1,1", "0-"):
        try:
            mod.parse_seeds(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")
    p = _run("--seeds", "2-1")
    assert p.returncode == 2 and "bad seed list" in p.stderr


def test_across_seeds_counts_a_side_that_never_got_there_as_slowest():
    mod = _module()

    def side(t, best):
        return {"t_to_0.3": t, "best": best, "last": best, "steps": 600}

    runs = [
        {"ours": side(100.0, 0.5), "trl": side(150.0, 0.4)},
        {"ours": side(None, 0.2), "trl": side(120.0, 0.35)},
        {"ours": side(90.0, 0.6), "trl": side(None, 0.25)},
        {"ours": side(None, 0.1), "trl": side(None, 0.2)},
        {"ours": side(80.0, 0.4), "trl": {"error": "rc 1"}},
    ]  # a failed TRL run counts for neither
    s = mod.across_seeds(runs, "t_to_0.3", 300)
    assert s["ours"]["seeds"] == 5 and s["ours"]["reached"] == 3
    assert s["ours"]["median_t_to_0.3"] == 100.0  # 80, 90, 100, never, never
    assert s["trl"]["seeds"] == 4 and s["trl"]["median_t_to_0.3"] is None  # 120, 150, never, never
    assert s["trl"]["median_steps_per_s"] == 2.0
    assert s["first_to_target"] == {"ours": 2, "trl": 1, "tie": 0, "neither": 1}


def test_several_seeds_report_each_and_their_medians():
    p = _run("--seeds", "0,1", "--seconds", "2", "--eval-every", "1", "--group", "4", "--prompts", "4")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert res["seeds"] == [0, 1] and [r["seed"] for r in res["per_seed"]] == [0, 1]
    assert res["summary"]["ours"]["seeds"] == 2 and "trl" not in res["summary"]
    assert all(r["ours"]["steps"] > 0 for r in res["per_seed"])


def test_overlap_samples_one_version_behind_on_a_second_thread():
    p = _run("--seconds", "4", "--eval-every", "2", "--group", "4", "--prompts", "4", "--overlap")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    ours = res["ours"]
    assert res["overlap"] is True and ours["steps"] > 2
    # every batch after the first was sampled while the one before it trained: one version behind
    n = ours["steps"]
    assert abs(ours["behaviour_lag"] - (n - 1) / n) < 1e-3, ours
    # the sampler thread ran the reference pass (the trainer skipped its own), and scoring
    assert ours["ms_per_step"]["sample"] > 0 and ours["ms_per_step"]["ref"] > 0
    assert ours["ms_per_step"]["wait"] >= 0


def test_without_overlap_every_batch_is_sampled_by_the_weights_it_trains():
    p = _run("--seconds", "2", "--eval-every", "1", "--group", "4", "--prompts", "4")
    assert p.returncode == 0, p.stderr[-2000:]
    ours = json.loads(p.stdout.strip().splitlines()[-1].removeprefix("RESULT "))["ours"]
    assert ours["steps"] > 0 and ours["behaviour_lag"] == 0.0


def test_heldout_task_trains_on_training_problems_and_targets_the_base_plus_a_gain():
    """--task heldout: one pretrained base, the target its held-out accuracy plus --gain; the
    prompts both sides train on never hold a held-out problem, and evaluation asks only those."""
    mod = _module()
    mod.TASK = "heldout"
    env = mod.make_env()
    held = set(env.validation_problems())
    drawn = {env.problem(s) for s in __import__("itertools").islice(mod.train_seeds(0, env), 3000)}
    assert len(held) == 200 and len(drawn) > 1000 and not drawn & held
    p = _run(
        "--task",
        "heldout",
        "--base-steps",
        "30",
        "--base-stop-at",
        "1.0",  # all 30 steps (a tiny base, not meant to be right)
        "--gain",
        "0.2",
        "--seconds",
        "3",
        "--eval-every",
        "1",
        "--group",
        "4",
        "--prompts",
        "4",
    )
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert res["task"] == "heldout" and res["base_steps"] == 30 and 0.0 <= res["base"] <= 1.0
    assert res["target"] == round(res["base"] + 0.2, 3) and f"t_to_{res['target']:g}" in res["ours"]
    assert res["ours"]["steps"] > 0 and 1 <= res["ours"]["response_tokens"] <= 6
    p = _run("--gain", "0.2")
    assert p.returncode == 2 and "--gain needs --task heldout" in p.stderr
