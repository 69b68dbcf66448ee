"""Control-plane overhead: turns per second through EnvManager -> LLMProxy -> generation worker.

Zero env latency, zero generation time (sim backend with ``time_scale=0``, one token per turn),
64 concurrent envs in one rollout actor, two generation worker actors: every turn is a real
actor hop from the rollout actor to a generation worker and back, plus the EnvManager's and
proxy's own Python. Next to it, in the same run, raw Ray: an async actor driving 64 concurrent
loops of one-hop calls to another actor (the floor the control plane builds on), and the
driver-to-actor round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import rollart_nb as rn  # noqa: E402
from rollart_nb.config import PipelineConfig  # noqa: E402
from rollart_nb.control.env_manager import RolloutConfig  # noqa: E402
from rollart_nb.control.rollout_worker import RolloutWorker  # noqa: E402
from rollart_nb.control.shards import plan_rollout  # noqa: E402
from rollart_nb.models.spec import spec  # noqa: E402
from rollart_nb.workers.roles import SimGenerator  # noqa: E402


class InstantEnv:
    """T turns, no latency, async methods (no thread hop)."""

    shape = "decode"
    vocab: list[str] = []

    def __init__(self, turns: int = 20) -> None:
        self.max_turns, self._t = turns, 0

    def reset(self, seed=None):
        self._t = 0
        return "go", {}

    def step(self, action):
        self._t += 1
        done = self._t >= self.max_turns
        return "go", float(done), done, False, {}

    async def areset(self, seed=None):
        return self.reset(seed)

    async def astep(self, action):
        return self.step(action)


def raw_ray(envs: int, seconds: float) -> dict:
    import ray

    @ray.remote(num_cpus=0)
    class Server:
        async def step(self, x):
            return x

    @ray.remote(num_cpus=0)
    class Client:
        def __init__(self, server):
            self.server = server

        async def run(self, loops: int, seconds: float) -> int:
            stop = time.monotonic() + seconds
            count = 0

            async def loop():
                nonlocal count
                while time.monotonic() < stop:
                    await self.server.step.remote(count)
                    count += 1

            await asyncio.gather(*(loop() for _ in range(loops)))
            return count

    s = Server.remote()
    c = Client.remote(s)
    ray.get(c.run.remote(envs, 1.0))  # warm-up
    n = ray.get(c.run.remote(envs, seconds))
    t0 = time.monotonic()
    for _ in range(200):
        ray.get(s.step.remote(0))
    rtt = (time.monotonic() - t0) / 200
    return {"calls_per_s": n / seconds, "rtt_ms": rtt * 1e3}


def full_path(sess, envs: int, seconds: float, dispatch: str) -> dict:
    m = spec("qwen3-0.6b")
    gen = sess.cluster(
        "actor_gen", SimGenerator, pool="H20", replicas=2, model=m, time_scale=0.0, mean_response_tokens=1
    )
    targets = [(h.actor, h.binding.worker, h.binding.hardware, h.binding.pool) for h in gen.workers]
    batch = 32
    cfg = PipelineConfig(
        batch_size=batch,
        alpha=1,
        mode="rollart",
        rollout=RolloutConfig(max_turns=20, max_new_tokens=1, max_context=10**6),
    )
    ro = sess.cluster(
        "rollout",
        RolloutWorker,
        pool="cpu",
        plan=plan_rollout({"t": [InstantEnv() for _ in range(envs)]}, cfg, 4),
        model=m,
        targets=targets,
        task_affinity={},
        dispatch=dispatch,
    )
    ro.start()
    stop = time.monotonic() + 2.0
    while time.monotonic() < stop:  # warm-up; batches are consumed so envs never idle
        ro.wait_ready(batch)
        ro.take_batch(batch)
    r0, t0 = ro.stats()["proxy"]["requests"], time.monotonic()
    while time.monotonic() - t0 < seconds:
        ro.wait_ready(batch)
        ro.take_batch(batch)
    st, t1 = ro.stats()["proxy"], time.monotonic()
    ro.shutdown()
    sess.close_cluster("rollout")
    sess.close_cluster("actor_gen")
    return {"turns_per_s": (st["requests"] - r0) / (t1 - t0), "calls": st["batches"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--envs", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=10.0)
    a = ap.parse_args()
    sess = rn.Session.local({"H20": 2, "cpu": 2}, serverless=False)
    try:
        direct = full_path(sess, a.envs, a.seconds, "direct")
        batched = full_path(sess, a.envs, a.seconds, "batched")
        raw = raw_ray(a.envs, a.seconds)
    finally:
        sess.close()
    print(f"full path, direct dispatch (one actor hop per turn), {a.envs} envs: {direct['turns_per_s']:.0f} turns/s")
    print(f"full path, batched dispatch (queued turns share a hop):  {batched['turns_per_s']:.0f} turns/s")
    print(f"raw Ray, one async hop per call, {a.envs} loops:            {raw['calls_per_s']:.0f} calls/s")
    print(
        f"direct / raw Ray: {direct['turns_per_s'] / raw['calls_per_s']:.2f}; batched / raw Ray: "
        f"{batched['turns_per_s'] / raw['calls_per_s']:.2f}; driver->actor RTT {raw['rtt_ms']:.2f} ms; "
        "target >= 1000 turns/s"
    )
    print(
        "RESULT "
        + json.dumps(
            {
                "turns_per_s": round(max(direct["turns_per_s"], batched["turns_per_s"]), 1),
                "turns_per_s_direct": round(direct["turns_per_s"], 1),
                "turns_per_s_batched": round(batched["turns_per_s"], 1),
                "raw_ray_calls_per_s": round(raw["calls_per_s"], 1),
                "ray_rtt_ms": round(raw["rtt_ms"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
