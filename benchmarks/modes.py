"""Step time and throughput of the five pipeline modes on one simulated multi-task workload.

Same Session, clusters and scheduler code for every mode; time comes from the sim backends'
roofline models (Qwen3-8B; one H800 and two H20 generation workers; an H800 trainer). By
default on ``rn.Session.sim`` (in-process, virtual clock: simulated seconds, reproducible,
independent of machine load); ``--session local`` runs the same workers as Ray actors on
``rn.Session.local`` in real time scaled by ``--time-scale`` (figures then move with load).
All times printed are modelled seconds. Tasks: FrozenLake-shaped (prefill-heavy, many turns) and GEM-Math-shaped
(decode-heavy, long answers) from :mod:`rollart_nb.sim.workloads`, with their env latencies.
Baselines run without hardware-affinity routing (as in the paper); RollArt routes prefill-heavy
work to the H800 and decode-heavy work to the H20s.

Then RollArt's alpha sweep 1..6: step time and staleness aborts per step.
Paper: RollArt (alpha=1) is 2.05x over Sync+, 1.35x over One-off, 1.31x over AReaL; larger
alpha gains at most 1.22x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import rollart_nb as rn  # noqa: E402
from rollart_nb.bench.harness import waste_share  # noqa: E402
from rollart_nb.control.env_manager import RolloutConfig  # noqa: E402
from rollart_nb.models import spec  # noqa: E402
from rollart_nb.sim import SimEnv, response_tokens_fn, workload  # noqa: E402
from rollart_nb.workers.roles import SimGenerator, SimTrainer  # noqa: E402

PAPER = {"sync+": 2.05, "one-off": 1.35, "areal": 1.31}


def run_mode(
    sess, gen, train, tasks, mode: str, alpha: int, steps: int, batch: int, group: int, affinity: bool, ts: float
) -> dict:
    pipe = sess.pipeline(
        train,
        gen,
        tasks,
        batch_size=batch,
        group_size=group,
        alpha=alpha,
        mode=mode,
        name=f"{mode}-{alpha}",
        hw_affinity=affinity,
        rollout=RolloutConfig(max_turns=32, max_new_tokens=4096, max_context=32768),
    )
    pipe.step()  # warm-up (first iteration has no overlap yet)
    reps = pipe.run(steps, progress=False)
    pipe.close()
    return {
        "step_s": statistics.mean(r.step_s for r in reps) / ts,
        "tok_per_s": statistics.mean(r.throughput for r in reps) * ts,
        "aborted_per_step": statistics.mean(r.counts.get("aborted_stale", 0) for r in reps),
        "aborted_token_frac": waste_share(reps, "aborted_tokens"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--envs-per-task", type=int, default=24)
    ap.add_argument("--session", choices=["sim", "local"], default="sim")
    ap.add_argument("--time-scale", type=float, default=0.02, help="real seconds per modelled second (local)")
    ap.add_argument("--alphas", default="1,2,3,4,5,6")
    a = ap.parse_args()
    m = spec("qwen3-8b")
    wl = {"frozenlake": workload("frozenlake"), "math": workload("gem-math")}
    pools = {"H800": 2, "H20": 2, "cpu": 2}
    if a.session == "sim":
        ts, sess = 1.0, rn.Session.sim(pools)
    else:
        ts, sess = a.time_scale, rn.Session.local(pools, serverless=False)
    try:
        # one H800 + two H20 generation workers in one cluster (the affinity mix)
        gen = sess.cluster(
            "actor_gen",
            SimGenerator,
            pool="H20",
            replicas=3,
            fallback=["H800"],
            model=m,
            time_scale=ts,
            response_tokens=response_tokens_fn(wl),
        )
        train = sess.cluster("actor_train", SimTrainer, pool="H800", model=m, time_scale=ts, gpus=4)
        tasks = sess.tasks({k: SimEnv(w, time_scale=ts) for k, w in wl.items()}, envs_per_task=a.envs_per_task)
        print(
            f"qwen3-8b, generators on {[b.hardware for b in gen.bindings]}, batch {a.batch}, group {a.group}, "
            f"{2 * a.envs_per_task} envs, {a.session} session (time_scale {ts})"
        )
        res = {}
        for mode in ["sync", "sync+", "one-off", "areal", "rollart"]:
            res[mode] = run_mode(
                sess, gen, train, tasks, mode, 1, a.steps, a.batch, a.group, affinity=mode == "rollart", ts=ts
            )
            r = res[mode]
            print(
                f"{mode:>8}: step {r['step_s']:.3f}s  {r['tok_per_s']:.0f} tok/s  "
                f"aborted/step {r['aborted_per_step']:.1f} ({r['aborted_token_frac']:.0%} of generated tokens)",
                flush=True,
            )
        over = {k: round(v["step_s"] / res["rollart"]["step_s"], 3) for k, v in res.items() if k != "rollart"}
        print(
            "rollart speed-up over: " + ", ".join(f"{k} {v:.2f}x (paper {PAPER.get(k, '-')})" for k, v in over.items())
        )
        sweep = {}
        for al in [int(x) for x in a.alphas.split(",")]:
            r = run_mode(sess, gen, train, tasks, "rollart", al, a.steps, a.batch, a.group, affinity=True, ts=ts)
            sweep[str(al)] = {"step_s": round(r["step_s"], 3), "aborted_per_step": round(r["aborted_per_step"], 2)}
            print(f"  alpha={al}: step {r['step_s']:.3f}s  aborted/step {r['aborted_per_step']:.1f}", flush=True)
    finally:
        sess.close()
    print(
        "RESULT "
        + json.dumps(
            {
                "step_time_s": {k: round(v["step_s"], 4) for k, v in res.items()},
                "rollart_over": over,
                "alpha_sweep": sweep,
                "paper_rollart_over": PAPER,
            }
        )
    )


if __name__ == "__main__":
    main()
