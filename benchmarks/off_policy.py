"""Staleness policies measured on learning: the main job under each, held-out math over wall time.

The workload is the demo's (``rollart_nb/configs/demo.yaml``: the tiny model after its cached
base-model stage, FrozenLake and two-digit addition with held-out problems, ``hf`` generator,
``torch`` GRPO trainer on ``Session.local()``), shortened to ``--minutes`` of RL per run and
validated every ``--validate-every`` steps. Every run shares the base model (built once with
seed 0 and cached); a benchmark seed is the pipeline's seed (env seeds, groups, sampling).

Policies (``PipelineConfig.staleness`` at ``alpha``; see docs/staleness.md):

* ``alpha1_drop``: the paper's rule at alpha=1 (what passes alpha is aborted);
* ``alpha2_wait``: a batch waits (``wait_s`` at most) for what the next bump would abort;
* ``alpha2_pace``: groups open only for the next batch;
* ``alpha2_cancel``: only the turn in flight of what passes alpha is generated again;
* ``alpha2_correct``: nothing is aborted; stale tokens are weighted by a truncated importance
  ratio (token level, cap 2).

For each run: the wall seconds of RL until the greedy held-out math score first reaches the
target, ``base + --gain`` (base: the score before RL; a run that never reaches it counts as its
full length; the seconds are the steps' own, validations left out, as they cost every policy
the same), the final held-out math score, and the share of generated tokens aborted (aborted as
stale, and under ``cancel`` discarded or taken out of the loss).

The last line is ``RESULT {json}``: ``policies``, ``seeds``, ``target_gain``, per policy
``median_time_to_target_s``, ``final_heldout`` (median over seeds), ``aborted_generated_fraction``
(median), ``waited_s`` (total per run, median), and ``runs`` (every run's figures).

Full mode: 5 policies x 3 seeds x (``--minutes`` 1.5 of RL + ~40 s of start, validation and
shutdown) ~ 35 minutes on 2 idle cores (the very first run also builds the base model: +2 min).
``--quick``: one seed, ``alpha1_drop`` and ``alpha2_correct``, 0.5 minute each (~3 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

POLICIES: dict[str, list[str]] = {
    "alpha1_drop": ["pipeline.alpha=1", "pipeline.staleness=drop"],
    "alpha2_wait": ["pipeline.alpha=2", "pipeline.staleness=wait", "pipeline.wait_s=5"],
    "alpha2_pace": ["pipeline.alpha=2", "pipeline.staleness=pace"],
    "alpha2_cancel": ["pipeline.alpha=2", "pipeline.staleness=cancel"],
    "alpha2_correct": ["pipeline.alpha=2", "pipeline.staleness=correct", "algo.tis=token", "algo.tis_cap=2.0"],
}
TASK = "math"


def run_one(policy: str, seed: int, minutes: float, validate_every: int, out: Path) -> dict[str, Any]:
    """One shortened main job under ``policy``; its figures for the RESULT."""
    from rollart_nb.train import demo_config, run_train

    overrides = [
        "seed=0",  # the base model's seed: one cached model for every run
        f"pipeline.seed={seed}",
        f"minutes={minutes}",
        "pass_k=0",
        f"pipeline.validate_every={validate_every}",
        f"out={out}",
        *POLICIES[policy],
    ]
    res = run_train(demo_config(overrides), quiet=True)
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line.strip()]
    t0 = steps[0]["started_at"] if steps else 0.0
    curve = [
        (s["started_at"] + s["step_s"] - t0, s["validation"][TASK])
        for s in steps
        if TASK in (s.get("validation") or {})
    ]
    length = steps[-1]["started_at"] + steps[-1]["step_s"] - t0 if steps else 0.0
    base = float(res["first"].get(TASK) or 0.0)
    final = float(res["last"].get(TASK) or 0.0)
    gen = sum(s["waste"].get("generated_tokens", 0) for s in steps)
    lost = sum(s["waste"].get("aborted_tokens", 0) + s["waste"].get("renewed_tokens", 0) for s in steps)
    return {
        "policy": policy,
        "seed": seed,
        "base": base,
        "final": final,
        "curve": [(round(t, 1), v) for t, v in curve],
        "length_s": round(length, 1),
        "steps": len(steps),
        "aborted_generated_fraction": round(lost / gen, 4) if gen else 0.0,
        "waited_s": round(sum(s["waste"].get("waited_s", 0.0) for s in steps), 2),
    }


def time_to_target(run: dict[str, Any], gain: float) -> float:
    """Seconds of RL until held-out math first reaches ``base + gain`` (the final score, measured
    after the last step, counts at the run's end); the run's length if never."""
    target = run["base"] + gain
    points = [*run["curve"], (run["length_s"], run["final"])]
    return next((t for t, v in points if v >= target), run["length_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one seed, two policies, 0.5 minute each")
    ap.add_argument("--policies", nargs="*", default=None, choices=list(POLICIES))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--minutes", type=float, default=1.5, help="minutes of RL per run")
    ap.add_argument("--validate-every", type=int, default=4)
    ap.add_argument("--gain", type=float, default=0.15, help="target = held-out math before RL + gain")
    args = ap.parse_args()
    policies = args.policies or (["alpha1_drop", "alpha2_correct"] if args.quick else list(POLICIES))
    seeds = list(range(1 if args.quick else args.seeds))
    minutes = 0.5 if args.quick else args.minutes
    runs = []
    with tempfile.TemporaryDirectory(prefix="off_policy_") as tmp:
        for seed in seeds:  # seeds outermost: a slow drift of the machine touches every policy alike
            for policy in policies:
                run = run_one(policy, seed, minutes, args.validate_every, Path(tmp) / f"{policy}_{seed}")
                run["time_to_target_s"] = time_to_target(run, args.gain)
                runs.append(run)
                print(
                    f"{policy:<15} seed {seed}: base {run['base']:.3f} final {run['final']:.3f} "
                    f"to target {run['time_to_target_s']:.1f}s of {run['length_s']:.1f}s, {run['steps']} steps, "
                    f"aborted {run['aborted_generated_fraction']:.3f}, waited {run['waited_s']:.1f}s",
                    flush=True,
                )

    def med(policy: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs if r["policy"] == policy), 4)

    result = {
        "policies": policies,
        "seeds": seeds,
        "target_gain": args.gain,
        "minutes_per_run": minutes,
        "median_time_to_target_s": {p: med(p, "time_to_target_s") for p in policies},
        "final_heldout": {p: med(p, "final") for p in policies},
        "aborted_generated_fraction": {p: med(p, "aborted_generated_fraction") for p in policies},
        "waited_s": {p: med(p, "waited_s") for p in policies},
        "runs": runs,
    }
    print(f"{'policy':<15} {'to target s':>11} {'final':>6} {'aborted':>8}")
    for p in policies:
        print(
            f"{p:<15} {result['median_time_to_target_s'][p]:>11.1f} {result['final_heldout'][p]:>6.3f} "
            f"{result['aborted_generated_fraction'][p]:>8.3f}"
        )
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
