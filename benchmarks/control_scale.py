"""Control plane at engine scale: turns/s, CPU per turn and memory per token as envs grow.

Zero-latency envs that answer every turn with an observation of a chosen length, and a
generator stand-in (``StandInGenerator``) with a fixed per-turn latency and a concurrency limit
(its "engine" serves ``capacity`` sequences at once and keeps each trajectory's history length,
as an engine keeps its KV). Everything else is the product's path: RolloutWorker actors
(``ShardedRollout``, one or more shards) running EnvManagers, the LLMProxy and the scheduler,
generation worker actors, batches taken from the rollout as a pipeline takes them.

Measured, side by side in one run:

1. **Scale**: turns/s and CPU milliseconds per turn (rollout actors, generator actors) at 64,
   256, 1,024 and 4,096 envs, with 0, 500 and 5,000 tokens of observation per turn (one shard,
   zero-latency stand-in); and the largest observation once more as token ids the env made
   itself (``rn.envs.Tokens``: the rollout copies them instead of tokenizing).
2. **Engine full**: 512 envs on one stand-in engine of 0.5 s a turn and room for 512 sequences
   (its limit is 1,024 turns/s).
3. **Shards**: 4,096 envs on 1 and on 4 rollout shards, with no observation and with the
   largest (text).
4. **Memory**: bytes the rollout holds per trajectory token (tracemalloc, in process, 64 envs,
   5,000-token observations), the stand-in's own history excluded (it keeps lengths only).

Last line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import psutil  # noqa: E402

import rollart_nb as rn  # noqa: E402
from rollart_nb import _ray  # noqa: E402
from rollart_nb.backends.history import HistoryStore  # noqa: E402
from rollart_nb.config import PipelineConfig  # noqa: E402
from rollart_nb.control.env_manager import RolloutConfig  # noqa: E402
from rollart_nb.control.local import LocalGenerator, LocalHandle  # noqa: E402
from rollart_nb.control.proxy import GenTarget, LLMProxy  # noqa: E402
from rollart_nb.control.reward import RewardDispatcher  # noqa: E402
from rollart_nb.control.scheduler import RolloutScheduler  # noqa: E402
from rollart_nb.control.shards import ShardedRollout, plan_rollout, plan_shards  # noqa: E402
from rollart_nb.models.spec import spec  # noqa: E402
from rollart_nb.protocols import GenerationResult  # noqa: E402
from rollart_nb.sim.tokenizer import SimTokenizer  # noqa: E402
from rollart_nb.tokens import Tokens  # noqa: E402
from rollart_nb.workers.roles import GeneratorWorker  # noqa: E402

TURNS = 4  # turns per trajectory: a 5,000-token observation makes a 20k-token trajectory


class StandInBackend:
    """Each turn: ``latency_s`` of waiting, at most ``capacity`` turns at once, one token out.

    It keeps each trajectory's history length (``HistoryStore(keep_ids=False)``), so requests
    carry only new tokens and a lost history answers HistoryMiss, as a real engine's would.
    """

    def __init__(self, latency_s: float = 0.0, capacity: int = 4096, name: str = "") -> None:
        self.latency_s, self.capacity, self.version = latency_s, capacity, 0
        self.history = HistoryStore(keep_ids=False, name=name)
        self._sem: asyncio.Semaphore | None = None

    async def generate(self, req):  # noqa: ANN001, ANN201
        n = self.history.full_len(req)
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.capacity)
        async with self._sem:
            if self.latency_s:
                await asyncio.sleep(self.latency_s)
        self.history.keep_length(req.traj_id, n + 1)
        return GenerationResult(req.traj_id, [7], [-0.5], self.version, "length")

    async def abort(self, traj_id: str) -> None:
        self.history.forget(traj_id)

    def forget(self, traj_id: str) -> None:
        self.history.forget(traj_id)

    def load_weights(self, state, version: int) -> None:  # noqa: ANN001
        self.version = version

    def stats(self) -> dict:
        return self.history.stats()


class StandInGenerator(GeneratorWorker):
    """A generation worker over :class:`StandInBackend`."""

    def make_backend(self, model, **kwargs):  # noqa: ANN001, ANN201
        return StandInBackend(name=f"{self.role}/{self.rank}", **kwargs)


class ObsEnv:
    """``turns`` turns, no latency, the same observation of ``obs_tokens`` words every turn;
    ``ids=True``: as token ids the env made itself (``rn.envs.Tokens``), as an env service would."""

    shape = "decode"

    def __init__(self, turns: int = TURNS, obs_tokens: int = 0, ids: bool = False) -> None:
        self.max_turns, self._t = turns, 0
        text = " ".join(f"w{i % 997}" for i in range(obs_tokens)) if obs_tokens else "go"
        self.obs = Tokens(SimTokenizer().encode(text), text=text) if ids else text

    def reset(self, seed=None):  # noqa: ANN001, ANN201
        self._t = 0
        return self.obs, {}

    def step(self, action):  # noqa: ANN001, ANN201
        self._t += 1
        done = self._t >= self.max_turns
        return self.obs, float(done), done, False, {}

    async def areset(self, seed=None):  # noqa: ANN001, ANN201
        return self.reset(seed)

    async def astep(self, action):  # noqa: ANN001, ANN201
        return self.step(action)


def sched_config(envs: int) -> PipelineConfig:
    """A batch of a quarter of the envs (32..256), and a staleness window wide enough that every
    env always has a trajectory to run (nothing here changes the version)."""
    batch = min(256, max(32, envs // 4))
    return PipelineConfig(
        batch_size=batch,
        alpha=math.ceil(envs / batch) + 1,
        mode="rollart",
        rollout=RolloutConfig(max_turns=TURNS, max_new_tokens=1, max_context=10**8),
    )


def pids(workers) -> list[int]:  # noqa: ANN001
    return [_ray.get(h.actor._rn_info.remote(), timeout_s=30, what="info")["pid"] for h in workers]


def cpu_s(procs: list[psutil.Process]) -> float:
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


def run(
    sess,
    *,
    envs: int,
    obs: int,
    ids: bool = False,
    shards: int = 1,
    latency_s: float = 0.0,
    capacity: int = 4096,
    gens: int = 2,
    dispatch: str = "direct",
    seconds: float = 6.0,
) -> dict:
    """Turns/s and CPU per turn of one configuration (built, warmed up, measured, closed)."""
    m = spec("qwen3-0.6b")
    gen = sess.cluster(
        "bench_gen", StandInGenerator, pool="H20", replicas=gens, model=m, latency_s=latency_s, capacity=capacity
    )
    targets = [(h.actor, h.binding.worker, h.binding.hardware, h.binding.pool) for h in gen.workers]
    cfg = sched_config(envs)
    plans = plan_shards(plan_rollout({"t": [ObsEnv(obs_tokens=obs, ids=ids) for _ in range(envs)]}, cfg, 4), shards)
    ro = ShardedRollout(
        sess.runtime, "bench_rollout", plans, model=m, targets=targets, task_affinity={}, dispatch=dispatch
    )
    try:
        ro.start()
        procs = [psutil.Process(p) for p in pids([h for c in ro.clusters for h in c.workers])]
        gprocs = [psutil.Process(p) for p in pids(gen.workers)]
        stop = time.monotonic() + 3.0
        while time.monotonic() < stop:  # warm-up: every env running, batches consumed as they form
            ro.wait_ready(cfg.batch_size)
            ro.take_batch(cfg.batch_size)
        r0, c0, g0, t0 = ro.stats()["proxy"]["requests"], cpu_s(procs), cpu_s(gprocs), time.monotonic()
        while time.monotonic() - t0 < seconds:
            ro.wait_ready(cfg.batch_size)
            ro.take_batch(cfg.batch_size)
        r1, c1, g1, t1 = ro.stats()["proxy"]["requests"], cpu_s(procs), cpu_s(gprocs), time.monotonic()
    finally:
        ro.shutdown()
        ro.close()
        sess.close_cluster("bench_gen")
    turns = max(r1 - r0, 1)
    return {
        "turns_per_s": turns / (t1 - t0),
        "rollout_cpu_ms_per_turn": 1e3 * (c1 - c0) / turns,
        "generator_cpu_ms_per_turn": 1e3 * (g1 - g0) / turns,
    }


def memory_per_token(envs: int = 64, obs: int = 5000, trajectories: int = 256) -> dict:
    """Bytes the rollout holds per token of the trajectories it holds (in process, tracemalloc)."""

    async def main() -> dict:
        backend = StandInBackend()
        proxy = LLMProxy([GenTarget(LocalHandle(LocalGenerator(backend)), "gen/0", "H20", "H20")], {})
        rewards = RewardDispatcher()
        rewards.set("t", lambda traj: 1.0)
        cfg = sched_config(envs)
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        plan = plan_rollout({"t": [ObsEnv(obs_tokens=obs) for _ in range(envs)]}, cfg, 4)
        sched = RolloutScheduler(plan, SimTokenizer(), proxy, rewards)
        sched.schedule()
        while len(sched.ledger.ended) + len(sched.buffer) < trajectories:
            await asyncio.sleep(0.05)
        buffered = [t for g in sched.buffer._groups.values() for t in g]
        running = [t for t, _, _ in sched.running.values()]
        held = list(
            {id(t): t for t in [*sched.ledger.ended, *buffered, *running]}.values()
        )  # a buffered one also ended
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        tokens = sum(len(t.turns[-1].prompt_ids) + len(t.turns[-1].response_ids) for t in held if t.turns)
        await sched.close()
        return {"bytes_per_token": used / max(tokens, 1), "tokens_held": tokens, "trajectories_held": len(held)}

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--obs", type=int, nargs="+", default=[0, 500, 5000])
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--dispatch", default="batched", choices=["direct", "batched"])
    a = ap.parse_args()

    mem = memory_per_token()
    print(
        f"memory: {mem['bytes_per_token']:.1f} bytes per trajectory token held "
        f"({mem['tokens_held']} tokens in {mem['trajectories_held']} trajectories; target < 16)"
    )
    sess = rn.Session.local({"H20": 2, "cpu": 4}, serverless=False)
    scale: dict[str, dict] = {}
    try:
        for envs in a.envs:
            for obs in a.obs:
                r = run(sess, envs=envs, obs=obs, seconds=a.seconds, dispatch=a.dispatch)
                scale[f"{envs}x{obs}"] = r
                print(
                    f"{envs:5d} envs, {obs:5d}-token observations ({a.dispatch}): {r['turns_per_s']:7.0f} turns/s, "
                    f"rollout {r['rollout_cpu_ms_per_turn']:.3f} ms CPU/turn, "
                    f"generators {r['generator_cpu_ms_per_turn']:.3f} ms CPU/turn"
                )
        lo, hi = min(a.envs), max(a.obs)
        as_ids = run(sess, envs=lo, obs=hi, ids=True, seconds=a.seconds, dispatch=a.dispatch)
        print(
            f"{lo:5d} envs, {hi:5d}-token observations as env-made ids: {as_ids['turns_per_s']:7.0f} turns/s, "
            f"rollout {as_ids['rollout_cpu_ms_per_turn']:.3f} ms CPU/turn"
        )
        engine = run(sess, envs=512, obs=0, latency_s=0.5, capacity=512, gens=1, dispatch="batched", seconds=a.seconds)
        print(f"512 envs, one engine of 0.5 s/turn and 512 sequences: {engine['turns_per_s']:.0f} turns/s (limit 1024)")
        sharded = {
            (n, obs): run(sess, envs=4096, obs=obs, shards=n, dispatch="batched", seconds=a.seconds)
            for obs in (0, hi)
            for n in (1, 4)
        }
        for (n, obs), r in sharded.items():
            print(
                f"4096 envs, {obs}-token observations, {n} rollout shard(s) (batched): {r['turns_per_s']:.0f} turns/s, "
                f"rollout {r['rollout_cpu_ms_per_turn']:.3f} ms CPU/turn"
            )
    finally:
        sess.close()
    none = scale[f"{lo}x{min(a.obs)}"]["turns_per_s"]
    ratio_obs, ratio_ids = scale[f"{lo}x{hi}"]["turns_per_s"] / none, as_ids["turns_per_s"] / none
    ratio_shards = {obs: sharded[(4, obs)]["turns_per_s"] / sharded[(1, obs)]["turns_per_s"] for obs in (0, hi)}
    print(
        f"{lo} envs: {hi}-token observations / none = {ratio_obs:.2f} as text, {ratio_ids:.2f} as ids (target >= 0.5)"
    )
    for obs, r in ratio_shards.items():
        print(f"4096 envs, {obs}-token observations: 4 shards / 1 shard = {r:.2f} (target >= 1.5 on 2 cores)")
    print(
        "RESULT "
        + json.dumps(
            {
                "turns_per_s": {k: round(v["turns_per_s"], 1) for k, v in scale.items()},
                "rollout_cpu_ms_per_turn": {k: round(v["rollout_cpu_ms_per_turn"], 4) for k, v in scale.items()},
                "generator_cpu_ms_per_turn": {k: round(v["generator_cpu_ms_per_turn"], 4) for k, v in scale.items()},
                "engine_512_turns_per_s": round(engine["turns_per_s"], 1),
                "obs_max_over_none": round(ratio_obs, 3),
                "obs_max_as_ids_over_none": round(ratio_ids, 3),
                "shards_turns_per_s": {f"{n}x{obs}": round(r["turns_per_s"], 1) for (n, obs), r in sharded.items()},
                "shards_4_over_1": round(ratio_shards[0], 3),
                f"shards_4_over_1_obs{hi}": round(ratio_shards[hi], 3),
                "bytes_per_token": round(mem["bytes_per_token"], 2),
                "dispatch": a.dispatch,
            }
        )
    )


if __name__ == "__main__":
    main()
