"""R2 scaled down: trajectory-level vs batch-level environment interaction under env-latency variance.

Per-turn env latency is Gaussian with mean mu=100 ms and sigma in {10, 25, 50, 75, 100} ms
(clipped at 0). Each configuration runs the same RolloutScheduler, LLMProxy and sim generation
backend in one event loop (in-process handles; no Ray hop, so the measurement is the
interaction pattern, not Ray's latency), collecting batches of B trajectories of T turns:

- batch-level (``sync``): all envs of an iteration step together, turn by turn;
- iteration-level trajectory rollout (``sync+``): the same quota, each env on its own timeline;
- trajectory-level (``rollart``): RollArt's rollout, envs never idle between iterations.

Printed: mean step time over the iterations, the headline ratio batch/trajectory-level
(paper: 1.23x at sigma = mu/10 rising to 2.27x at sigma = mu), the sync+ ratio, and the
critical-path lower bound of an iteration (its slowest trajectory's own latency sum, reset
included) next to the sync+ step time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollart_nb.config import PipelineConfig  # noqa: E402
from rollart_nb.control.env_manager import RolloutConfig  # noqa: E402
from rollart_nb.control.local import LocalGenerator, LocalHandle  # noqa: E402
from rollart_nb.control.modes import MODES  # noqa: E402
from rollart_nb.control.proxy import GenTarget, LLMProxy  # noqa: E402
from rollart_nb.control.reward import RewardDispatcher  # noqa: E402
from rollart_nb.control.scheduler import RolloutScheduler  # noqa: E402
from rollart_nb.control.shards import plan_rollout  # noqa: E402
from rollart_nb.envs import WithLatency  # noqa: E402
from rollart_nb.models.spec import spec  # noqa: E402
from rollart_nb.resources.profiles import PROFILES  # noqa: E402
from rollart_nb.sim import SimBackend, SimTokenizer  # noqa: E402


class FixedTurns:
    """A T-turn env with no latency of its own (WithLatency adds it); reward 1 at the end."""

    shape = "prefill"
    vocab: list[str] = []

    def __init__(self, turns: int) -> None:
        self.max_turns, self._t = turns, 0

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        self._t = 0
        return "start", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self._t += 1
        done = self._t >= self.max_turns
        return "next", float(done), done, False, {}


async def measure(
    mode: str,
    sigma_s: float,
    *,
    mu_s: float,
    batch: int,
    group: int,
    turns: int,
    iters: int,
    gen_workers: int,
    seed: int,
) -> dict:
    envs = {
        "t": [WithLatency(FixedTurns(turns), mean_s=mu_s, std_s=sigma_s, seed=seed * 1000 + i) for i in range(batch)]
    }
    # qwen3-8b on H20, 4 tokens a turn, time_scale 0.1: ~5 ms of generation per turn (env-dominated,
    # as in the paper's setup where env latency is the variable under study).
    backends = [
        SimBackend(spec("qwen3-8b"), PROFILES["H20"], time_scale=0.1, mean_response_tokens=4, seed=i)
        for i in range(gen_workers)
    ]
    targets = [GenTarget(LocalHandle(LocalGenerator(b)), f"gen/{i}", "H20", "H20") for i, b in enumerate(backends)]
    cfg = PipelineConfig(batch_size=batch, alpha=1, mode=mode, rollout=RolloutConfig(max_turns=turns, max_new_tokens=4))
    plan = plan_rollout(envs, cfg, group, seed=seed)
    sched = RolloutScheduler(plan, SimTokenizer(), LLMProxy(targets), RewardDispatcher())
    steps, bounds = [], []
    await sched.get_batch(batch)  # warm-up iteration (not timed)
    if not MODES[mode].continuous:
        sched.start_iteration()
    for v in range(1, iters + 1):
        t0 = time.monotonic()
        got = await sched.get_batch(batch)
        steps.append(time.monotonic() - t0)
        # the slowest trajectory's own latency sum: no schedule can beat it
        bounds.append(
            max(
                sum(
                    tr.timings.get("reset", 0) + tr.timings.get("generate", 0) + tr.timings.get("env", 0)
                    for tr in t.turns
                )
                for t in got
            )
        )
        for b in backends:
            b.load_weights({}, v)
        await sched.set_version(v)
        if not MODES[mode].continuous:
            sched.start_iteration()
    await sched.close()
    return {"step_s": statistics.mean(steps), "bound_s": statistics.mean(bounds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--sigmas-ms", default="10,25,50,75,100")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    mu = 0.1
    paper = {"10": 1.23, "100": 2.27}
    ratio, traj_bound, it = {}, {}, {}
    print(f"mu=100 ms, B={a.batch}, T={a.turns} turns, {a.iters} iterations per point")
    print(
        f"{'sigma':>6} {'batch s':>8} {'iter s':>8} {'traj s':>8} {'bound s':>8} {'batch/iter':>10} "
        f"{'batch/traj':>10} {'iter/bound':>10} {'paper':>6}"
    )
    for s_ms in [int(x) for x in a.sigmas_ms.split(",")]:
        kw = dict(mu_s=mu, batch=a.batch, group=a.group, turns=a.turns, iters=a.iters, gen_workers=4, seed=a.seed)
        b = asyncio.run(measure("sync", s_ms / 1000, **kw))
        t = asyncio.run(measure("sync+", s_ms / 1000, **kw))
        c = asyncio.run(measure("rollart", s_ms / 1000, **kw))
        ratio[str(s_ms)] = round(b["step_s"] / c["step_s"], 3)
        it[str(s_ms)] = round(b["step_s"] / t["step_s"], 3)
        traj_bound[str(s_ms)] = round(t["step_s"] / t["bound_s"], 3)
        print(
            f"{s_ms:>4}ms {b['step_s']:>8.3f} {t['step_s']:>8.3f} {c['step_s']:>8.3f} {t['bound_s']:>8.3f} "
            f"{it[str(s_ms)]:>10.2f} {ratio[str(s_ms)]:>10.2f} {traj_bound[str(s_ms)]:>10.2f} "
            f"{paper.get(str(s_ms), ''):>6}",
            flush=True,
        )
    print(
        "batch = sync (all envs step together); iter = sync+ (one iteration's quota, envs on their own "
        "timelines); traj = RollArt's continuous trajectory-level rollout (headline ratio); "
        "iter/bound = the sync+ step over its critical path (slowest trajectory's own latency sum)."
    )
    print(
        "RESULT "
        + json.dumps(
            {
                "ratio_by_sigma_ms": ratio,
                "iteration_ratio_by_sigma_ms": it,
                "traj_over_bound_by_sigma_ms": traj_bound,
                "paper": paper,
            }
        )
    )


if __name__ == "__main__":
    main()
