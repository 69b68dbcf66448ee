"""How fast the simulator runs and whether its memory stays flat, at 128 and 1,024 GPUs.

Each size is simulated in full (no scaling down): a quarter of the GPUs train (H800), the rest
generate (one worker per H800), Qwen3-14B, SWE-shaped and GEM-math-shaped tasks with 16 envs
per task per 8 GPUs, batch 64, group 8, RollArt mode, on the virtual clock. Each size runs in a
fresh Python process (so one size's memory does not show in the next), for ``--warmup`` steps
and then ``--steps`` measured steps; it reports wall seconds per simulated step and how much the
process's resident memory grew from the end of warm-up to the last step, and over the second half
of the measured steps alone: the bounded stores (ended trajectories kept for the viewer, the
sample buffer, the engines' prefix caches) fill during the first steps, so flat memory shows as a
second half that barely grows.

A notebook sweep of dozens of configurations needs both: seconds per step, and memory that does
not grow with the number of steps.

Usage: ``python benchmarks/sim_speed.py [--sizes 128,1024] [--steps 100] [--warmup 2]``.
The last line is ``RESULT {json}``: per size ``wall_s_per_step``, ``rss_growth_mib`` (over the
measured steps), ``rss_growth_second_half_mib``, ``rss_mib`` (at the end), ``sim_s_per_step``
(simulated seconds a step) and ``steps``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def rss_mib() -> float:
    """Resident memory of this process, MiB (from /proc, else psutil)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def one(gpus: int, steps: int, warmup: int) -> dict:
    """Simulate ``gpus`` GPUs in this process; per-step wall time and memory."""
    from rollart_nb.bench.harness import RunSpec, sim_pipeline

    train = gpus // 4
    spec = RunSpec(
        "qwen3-14b",
        {"H800": gpus - train},
        train_gpus=train,
        tasks={"swe": "swe", "math": "gem-math"},
        hw_affinity=False,
        envs_per_task=16 * gpus // 8,
        batch=64,
        group=8,
        mode="rollart",
    )
    walls, sims, rss = [], [], []
    t0 = time.monotonic()
    with sim_pipeline(spec) as (_, pipe):
        setup_s = time.monotonic() - t0
        for i in range(warmup + steps):
            if i == warmup:
                rss0 = rss_mib()
            w0 = time.monotonic()
            rep = pipe.step()
            if i >= warmup:
                walls.append(time.monotonic() - w0)
                sims.append(rep.step_s)
                rss.append(rss_mib())
                if len(walls) % 10 == 0:
                    print(f"  {gpus} GPUs: step {len(walls)}/{steps}, {statistics.mean(walls):.2f} s/step, "
                          f"rss {rss_mib():.0f} MiB", file=sys.stderr, flush=True)  # fmt: skip
        rss1 = rss_mib()
    return {
        "gpus": gpus,
        "steps": steps,
        "setup_s": round(setup_s, 2),
        "wall_s_per_step": round(statistics.mean(walls), 3),
        "sim_s_per_step": round(statistics.mean(sims), 1),
        "rss_growth_mib": round(rss1 - rss0, 1),
        "rss_growth_second_half_mib": round(rss[-1] - rss[len(rss) // 2 - 1], 1) if len(rss) > 1 else 0.0,
        "rss_mib": round(rss1, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="128,1024", help="GPU counts, comma-separated")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)  # run one size here
    a = ap.parse_args()
    if a.one:
        print("ONE " + json.dumps(one(a.one, a.steps, a.warmup)), flush=True)
        return
    res = {}
    for g in [int(x) for x in a.sizes.split(",")]:
        cmd = [sys.executable, __file__, "--one", str(g), "--steps", str(a.steps), "--warmup", str(a.warmup)]
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        r = json.loads(next(line for line in out.splitlines() if line.startswith("ONE "))[4:])
        res[str(g)] = {k: v for k, v in r.items() if k != "gpus"}
        print(
            f"{g:5d} GPUs: {r['wall_s_per_step']:.2f} s of wall time per simulated step ({r['sim_s_per_step']:.0f} "
            f"simulated s), memory {r['rss_mib']:.0f} MiB, grew {r['rss_growth_mib']:+.0f} MiB over "
            f"{r['steps']} steps, {r['rss_growth_second_half_mib']:+.1f} MiB over the last {r['steps'] - r['steps'] // 2} "
            f"(setup {r['setup_s']:.1f} s)",
            flush=True,
        )
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
