"""R3 scaled down: a dedicated reward pool vs serverless reward offloading, in one run.

The paper (16 H800s, 3 math jobs, Qwen2.5-7B reward LLM) reserves 8 GPUs for training and
splits the other 8 either 4 rollout + 4 reward ("local") or 8 rollout + serverless reward:
reward-GPU utilization 6% -> 88%, rollout time per step 158 s -> 77 s, serverless call
overhead mean 0.01 s, max 2.1 s (a cold start).

Here a budget of N worker slots (Ray actors) is split the same two ways:

(a) dedicated: N-K rollout slots + K reward actors reserved for the whole job;
(b) serverless: N rollout slots; reward on a Ray Serve deployment (ServeManager) that starts
    at zero replicas and scales with load.

A rollout slot runs one trajectory at a time for a seeded, long-tailed duration
(``asyncio.sleep``: CPU-light, so 2 cores are not the bottleneck and throughput scales with
slots, as GPUs would). The reward is the same :class:`LLMJudge` (``sim`` backend,
``--reward-s`` of blocking work per call) in both setups, with the same concurrency per
reward actor / replica, overlapped with rollout as trajectories finish. Between steps a training phase
(``--train-s``) leaves reward idle, which is where the dedicated pool's utilization goes.

Last line: ``RESULT {json}``. Usage: ``python benchmarks/serverless_reward.py [--steps 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import threading
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import httpx  # noqa: E402

from rollart_nb.serverless.client import acall  # noqa: E402
from rollart_nb.serverless.judge import LLMJudge  # noqa: E402
from rollart_nb.trajectory import Trajectory, Turn  # noqa: E402


class RolloutSlot:
    """One rollout worker slot: a trajectory at a time (a GPU's worth of generation)."""

    def __init__(self) -> None:
        self.busy_s = 0.0

    async def rollout(self, i: int, duration_s: float) -> dict:
        t0 = time.perf_counter()
        await asyncio.sleep(duration_s)
        self.busy_s += time.perf_counter() - t0
        return Trajectory(
            "math", seed=i, turns=[Turn(f"what is {i} + {i} ?", str(2 * i))], info={"answer": str(2 * i)}
        ).to_dict()

    def busy(self) -> float:
        return self.busy_s


class RewardActor:
    """A reserved reward worker (the paper's local reward GPU) taking ``--reward-concurrency``
    judgements at once, like a Serve replica's ``max_ongoing_requests``."""

    def __init__(self, reward_s: float) -> None:
        self.judge, self.busy_s = LLMJudge(backend="sim", sim_latency_s=reward_s), 0.0
        self.lock, self.ongoing, self.since = threading.Lock(), 0, 0.0

    def score(self, d: dict) -> float:
        # Busy time is the union of call intervals (as in a Serve replica), not their sum.
        with self.lock:
            if self.ongoing == 0:
                self.since = time.perf_counter()
            self.ongoing += 1
        try:
            return self.judge(Trajectory.from_dict(d))
        finally:
            with self.lock:
                self.ongoing -= 1
                if self.ongoing == 0:
                    self.busy_s += time.perf_counter() - self.since

    def busy(self) -> float:
        return self.busy_s


async def run_job(slots: list, reward, durations: list[list[float]], train_s: float) -> dict:
    """Steps of {rollout on all slots, reward as each trajectory finishes}, then a train gap."""
    step_s, calls = [], []

    async def timed_reward(d: dict) -> float:
        t0 = time.perf_counter()
        v = await reward(d)
        calls.append(time.perf_counter() - t0)
        return v

    for durs in durations:
        t0 = time.perf_counter()
        queue: asyncio.Queue[tuple[int, float]] = asyncio.Queue()
        for item in enumerate(durs):
            queue.put_nowait(item)
        rewards: list[asyncio.Task] = []

        async def slot_loop(slot, queue: asyncio.Queue, rewards: list) -> None:
            while not queue.empty():
                i, dur = queue.get_nowait()
                d = await slot.rollout.remote(i, dur)
                rewards.append(asyncio.create_task(timed_reward(d)))  # overlaps the next rollout

        await asyncio.gather(*(slot_loop(s, queue, rewards) for s in slots))
        scores = await asyncio.gather(*rewards)
        assert len(scores) == len(durs) and all(0 <= s <= 1 for s in scores)
        step_s.append(time.perf_counter() - t0)
        await asyncio.sleep(train_s)  # training: rollout and reward both wait
    return {"step_s": step_s, "calls": calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=4, help="N: worker slots in the budget")
    ap.add_argument("--reward-slots", type=int, default=2, help="K: slots the dedicated setup reserves for reward")
    ap.add_argument("--batch", type=int, default=32, help="trajectories per step")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rollout-s", type=float, default=0.5, help="mean rollout seconds per trajectory")
    ap.add_argument("--reward-s", type=float, default=0.05, help="reward compute seconds per call")
    ap.add_argument("--reward-concurrency", type=int, default=4, help="calls one reward actor / replica takes at once")
    ap.add_argument("--train-s", type=float, default=1.5, help="training gap between steps")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n, k = args.slots, args.reward_slots

    import ray

    import rollart_nb as rn
    from rollart_nb.serverless.serve import ServeManager

    rng = random.Random(args.seed)
    # Long-tailed (lognormal) rollout lengths, the same draws for both setups.
    sigma = 0.6
    mu = -0.5 * sigma**2
    durations = [[args.rollout_s * rng.lognormvariate(mu, sigma) for _ in range(args.batch)] for _ in range(args.steps)]

    t_start = time.perf_counter()
    sess = rn.Session.local({"cpu": 2}, serverless=True)
    slot_cls = ray.remote(num_cpus=0, max_concurrency=4)(RolloutSlot)
    reward_cls = ray.remote(num_cpus=0, max_concurrency=args.reward_concurrency)(RewardActor)
    out: dict = {"config": vars(args)}
    try:
        # (a) dedicated reward pool: K actors reserved for the whole job.
        slots = [slot_cls.remote() for _ in range(n - k)]
        pool = [reward_cls.remote(args.reward_s) for _ in range(k)]
        ray.get([s.busy.remote() for s in slots] + [p.busy.remote() for p in pool])  # started: not timed
        outstanding = [0] * k

        async def pool_reward(d: dict) -> float:
            j = min(range(k), key=outstanding.__getitem__)  # least-loaded reward worker
            outstanding[j] += 1
            try:
                return await pool[j].score.remote(d)
            finally:
                outstanding[j] -= 1

        t0 = time.perf_counter()
        ded = asyncio.run(run_job(slots, pool_reward, durations, args.train_s))
        ded_span = time.perf_counter() - t0
        ded_busy = sum(ray.get([p.busy.remote() for p in pool]))
        ded_roll_busy = sum(ray.get([s.busy.remote() for s in slots]))
        for a in slots + pool:
            ray.kill(a)

        # (b) serverless: all N slots roll out; reward scales from zero on Ray Serve.
        mgr = ServeManager()
        mgr.sample_replicas(0.1)
        judge = LLMJudge(backend="sim", sim_latency_s=args.reward_s)
        ep = mgr.deploy(
            "reward",
            judge,
            min_replicas=0,
            max_replicas=k,
            max_ongoing_requests=args.reward_concurrency,
            target_ongoing_requests=args.reward_concurrency,
            upscale_delay_s=1.0,
            downscale_delay_s=args.train_s + 1.5,
            timeout_s=60,
        )
        slots = [slot_cls.remote() for _ in range(n)]
        ray.get([s.busy.remote() for s in slots])
        assert mgr.utilization("reward")["replicas"] == 0

        async def serverless_job() -> dict:
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
                return await run_job(slots, lambda d: acall(ep, [d], {}, client=client), durations, args.train_s)

        t0 = time.perf_counter()
        srv = asyncio.run(serverless_job())
        srv_span = time.perf_counter() - t0
        srv_roll_busy = sum(ray.get([s.busy.remote() for s in slots]))
        t1 = time.perf_counter()
        while mgr.utilization("reward")["replicas"] > 0 and time.perf_counter() - t1 < 60:
            time.sleep(0.2)
        to_zero_s = time.perf_counter() - t1
        u = mgr.utilization("reward")
        peak = max((r for _, r in mgr.timeline("reward")), default=0)
        mgr.shutdown()
    finally:
        sess.close()

    overhead = [c - args.reward_s for c in srv["calls"]]
    warm = overhead[args.batch :]  # after the first step, whose calls queue behind the cold start
    ded_over = [c - args.reward_s for c in ded["calls"]]
    mean = statistics.fmean
    rollout_ded, rollout_srv = mean(ded["step_s"]), mean(srv["step_s"])
    out.update(
        {
            "dedicated": {
                "step_s": [round(s, 2) for s in ded["step_s"]],
                "span_s": round(ded_span, 2),
                "reward_busy_s": round(ded_busy, 2),
                "reserved_s": round(k * ded_span, 2),
                "reward_pool_util": round(ded_busy / (k * ded_span), 4),
                "budget_util": round((ded_busy + ded_roll_busy) / (n * ded_span), 4),
                "call_overhead_mean_s": round(mean(ded_over), 4),
                "call_overhead_max_s": round(max(ded_over), 4),
            },
            "serverless": {
                "step_s": [round(s, 2) for s in srv["step_s"]],
                "span_s": round(srv_span, 2),
                "reward_busy_s": round(u["busy_s"], 2),
                "replica_s": round(u["replica_s"], 2),
                "replica_util": round(u["utilization"] or 0.0, 4),
                "budget_util": round(srv_roll_busy / (n * srv_span), 4),
                "cold_starts": u["cold_starts"],
                "replica_starts": u["replica_starts"],
                "peak_replicas": peak,
                "scaled_to_zero_after_s": round(to_zero_s, 1),
                "requests": u["requests"],
                "call_overhead_mean_s": round(mean(overhead), 4),
                "call_overhead_p50_s": round(statistics.median(overhead), 4),
                "call_overhead_max_s": round(max(overhead), 4),
                "call_overhead_mean_after_step1_s": round(mean(warm), 4) if warm else None,
            },
        }
    )
    for name in ("dedicated", "serverless"):
        print(f"{name:>10}: {json.dumps(out[name])}")
    headline = {
        "rollout_step_s_dedicated": round(rollout_ded, 2),
        "rollout_step_s_serverless": round(rollout_srv, 2),
        "rollout_time_ratio": round(rollout_ded / rollout_srv, 2),
        # Step 1 of (b) waits for the 0 -> 1 cold start; later steps show the slot gain alone.
        "rollout_time_ratio_after_step1": round(mean(ded["step_s"][1:]) / mean(srv["step_s"][1:]), 2)
        if args.steps > 1
        else None,
        "reward_util_dedicated": out["dedicated"]["reward_pool_util"],
        "reward_util_serverless": out["serverless"]["replica_util"],
        "budget_util_dedicated": out["dedicated"]["budget_util"],
        "budget_util_serverless": out["serverless"]["budget_util"],
        "overhead_mean_s": out["serverless"]["call_overhead_mean_s"],
        "overhead_p50_s": out["serverless"]["call_overhead_p50_s"],
        "overhead_max_s": out["serverless"]["call_overhead_max_s"],
        "overhead_mean_after_step1_s": out["serverless"]["call_overhead_mean_after_step1_s"],
        "cold_starts": out["serverless"]["cold_starts"],
        "paper": {"reward_util": [0.06, 0.88], "rollout_s": [158, 77], "overhead_mean_s": 0.01, "overhead_max_s": 2.1},
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print("RESULT " + json.dumps(headline))


if __name__ == "__main__":
    main()
