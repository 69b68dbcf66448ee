"""What every what-if experiment shares: one simulated run, equal-cost pool sizing, the result record.

A run (:func:`simulate`) builds a :class:`~rollart_nb.sim_session.SimSession` with a SimTrainer
cluster, a SimGenerator cluster (one worker per TP group; a mix binds the first pool first), the
tasks as :class:`~rollart_nb.sim.SimEnv` s, and the real Pipeline, and reports the *modelled*
seconds of its measured steps. On the default virtual clock (:mod:`rollart_nb.clock`) a result
does not depend on the machine or its load. ``RunSpec(virtual=False)`` runs in scaled real time,
where the control plane's CPU stretches every sleep: such a run reports ``lag_frac`` (the loop's
lag per probe period); a large value means the ratios are compressed toward 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from rollart_nb.algo.grpo import GRPO
from rollart_nb.control.env_manager import RolloutConfig
from rollart_nb.envs.wrappers import WithLatency
from rollart_nb.models.spec import spec as model_spec
from rollart_nb.resources.profiles import PROFILES
from rollart_nb.sim.workloads import SimEnv, Workload, response_tokens_fn, workload
from rollart_nb.sim_session import SimSession
from rollart_nb.workers.roles import SimGenerator, SimTrainer

__all__ = [
    "RunSpec", "Stragglers", "equal_cost_counts", "pool_cost", "pools_of", "sim_pipeline", "simulate", "waste_share",
]  # fmt: skip

GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Stragglers:
    """Long-tail env latency injected with :class:`~rollart_nb.envs.WithLatency` (modelled seconds).

    Attributes:
        mean_s / std_s: Gaussian latency added to every reset and step.
        p: probability that a call is a straggler.
        scale: a straggler's latency multiplier.
    """

    mean_s: float = 2.0
    std_s: float = 0.5
    p: float = 0.05
    scale: float = 20.0


@dataclass(frozen=True)
class RunSpec:
    """One simulated configuration.

    Attributes:
        rollout: pool -> generation GPUs (e.g. ``{"H800": 64, "H20": 24}``); a mix binds the
            first pool's workers first.
        train_gpus: H800 GPUs of the trainer (one SimTrainer models them all).
        tp: GPUs per generation worker (one TP group; its all-reduces go over NVLink).
        tasks: task name -> workload preset name or :class:`Workload`.
        batch / group: trajectories per step / GRPO group size.
        mode / alpha / staleness / redundancy / pd / hw_affinity: pipeline settings (the
            "correct" staleness policy trains with token-level importance weights).
        stragglers: long-tail env latency (None: the workloads' own latency only).
        steps / warmup: measured and discarded steps.
        virtual: simulated time (default) or scaled real time (see the module docstring).
        time_scale: seconds slept per modelled second (None: 1 on the virtual clock; 0.005 in
            real time).
        train_mfu: achieved MFU of the trainer.
    """

    model: str
    rollout: dict[str, int]
    train_gpus: int = 32
    tp: int = 1
    tasks: dict[str, Any] = field(default_factory=lambda: {"math": "gem-math"})
    envs_per_task: int = 32
    batch: int = 64
    group: int = 8
    mode: str = "rollart"
    alpha: int = 1
    staleness: str = "drop"
    redundancy: int = 0
    pd: bool = False
    hw_affinity: bool = True
    stragglers: Stragglers | None = None
    steps: int = 3
    warmup: int = 1
    time_scale: float | None = None
    virtual: bool = True
    seed: int = 0
    train_mfu: float = 0.4

    def with_(self, **changes: Any) -> RunSpec:
        return replace(self, **changes)

    @property
    def workloads(self) -> dict[str, Workload]:
        return {t: w if isinstance(w, Workload) else workload(w) for t, w in self.tasks.items()}


def pool_cost(gpus: dict[str, int]) -> float:
    """USD per hour of ``gpus`` (pool -> count) at the hardware profiles' prices."""
    return sum(PROFILES[p.upper()].price_per_hour * n for p, n in gpus.items())


def equal_cost_counts(budget_per_hour: float, hardware: str, multiple: int = 1) -> int:
    """How many ``hardware`` devices ``budget_per_hour`` buys, rounded to ``multiple`` (at least one)."""
    n = budget_per_hour / PROFILES[hardware.upper()].price_per_hour
    return max(multiple, int(round(n / multiple)) * multiple)


def _make_env(w: Workload, seed: int, ts: float, stragglers: Stragglers | None) -> Any:
    env = SimEnv(w, seed=seed, time_scale=ts)
    if stragglers is None:
        return env
    # WithLatency's deep copies (one per EnvManager) each draw their own, seeded latencies
    return WithLatency(
        env,
        mean_s=stragglers.mean_s * ts,
        std_s=stragglers.std_s * ts,
        long_tail_p=stragglers.p,
        long_tail_scale=stragglers.scale,
        seed=seed,
    )


async def _lag_probe(period_s: float, out: list[float]) -> None:
    """Record how late each ``period_s`` sleep wakes up (the loop's lag)."""
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(period_s)
        out.append(max(loop.time() - t0 - period_s, 0.0))


@contextlib.contextmanager
def sim_pipeline(s: RunSpec) -> Iterator[tuple[SimSession, Any]]:
    """A fresh SimSession with the trainer, generators, tasks and pipeline of ``s``; yields
    ``(session, pipeline)`` and closes the session after."""
    ts = s.time_scale if s.time_scale is not None else (1.0 if s.virtual else 0.005)
    wls = s.workloads
    m = model_spec(s.model)
    with SimSession(pools_of(s), seed=s.seed, gpus_per_node=GPUS_PER_NODE, virtual=s.virtual) as sess:
        train_slots = min(s.train_gpus, GPUS_PER_NODE)
        # rank 0 models the whole data-parallel group; the other ranks hold its GPUs in the pools
        train = sess.cluster(
            "actor_train",
            SimTrainer,
            pool="H800",
            replicas=max(1, s.train_gpus // train_slots),
            slots=train_slots,
            fallback=[],
            model=m,
            gpus=s.train_gpus,
            time_scale=ts,
            mfu=s.train_mfu,
        )
        gen_pools = {p.upper(): n for p, n in s.rollout.items() if n > 0}
        order = list(gen_pools)
        replicas = sum(n // s.tp for n in gen_pools.values())
        gen = sess.cluster(
            "actor_gen",
            SimGenerator,
            pool=order[0],
            replicas=replicas,
            slots=s.tp,
            fallback=order[1:],
            model=m,
            tp=s.tp,
            time_scale=ts,
            seed=s.seed,
            response_tokens=response_tokens_fn(wls, seed=s.seed),
        )
        envs = {t: _make_env(w, s.seed + i, ts, s.stragglers) for i, (t, w) in enumerate(wls.items())}
        tasks = sess.tasks(envs, envs_per_task=s.envs_per_task)
        rc = RolloutConfig(
            max_turns=max(w.turns[1] for w in wls.values()),
            max_new_tokens=max(w.max_response_tokens for w in wls.values()),
            max_context=32768,
            env_timeout_s=600.0,
        )
        pipe = sess.pipeline(
            train,
            gen,
            tasks,
            batch_size=s.batch,
            group_size=s.group,
            alpha=s.alpha,
            staleness=s.staleness,
            algo=GRPO(group_size=s.group, tis="token") if s.staleness == "correct" else None,
            mode=s.mode,
            redundancy=s.redundancy,
            pd=s.pd,
            hw_affinity=s.hw_affinity,
            rollout=rc,
        )
        yield sess, pipe


def pools_of(s: RunSpec) -> dict[str, int]:
    """The SimSession pools of ``s``: its generation GPUs, the trainer's H800s, two CPU slots."""
    pools = {p.upper(): n for p, n in s.rollout.items() if n > 0}
    pools["H800"] = pools.get("H800", 0) + s.train_gpus
    pools["cpu"] = 2
    return pools


def simulate(s: RunSpec) -> dict[str, float]:
    """Run ``s`` on a fresh SimSession; returns modelled means over the measured steps.

    Returns:
        ``step_s`` (modelled seconds per step), ``rollout_s`` (waiting for the batch),
        ``tokens_per_s`` (modelled), ``aborted_per_step`` (staleness aborts),
        ``redundant_cancelled_per_step``, ``aborted_token_frac`` / ``wasted_token_frac`` (generated
        tokens of the measured steps aborted as stale or renewed by the ``cancel`` policy / those
        and cancelled ones, over all generated tokens), ``waited_s`` (per step, the ``wait``
        policy's hold), ``cost_per_hour`` (all GPUs), ``gpus``,
        ``lag_frac`` (loop lag per probe period; see the module docstring), ``wall_s``.
    """
    ts = s.time_scale if s.time_scale is not None else (1.0 if s.virtual else 0.005)
    pools = pools_of(s)
    t_wall = time.monotonic()
    lags: list[float] = []
    with sim_pipeline(s) as (sess, pipe):
        probe_period = 0.01
        # a virtual clock has no lag to measure (and a probe's timers would only add events)
        probe = None if s.virtual else asyncio.run_coroutine_threadsafe(_lag_probe(probe_period, lags), sess._loop)
        try:
            pipe.run(s.warmup, progress=False)
            reps = pipe.run(s.steps, progress=False)
        finally:
            if probe is not None:
                probe.cancel()
    wall = time.monotonic() - t_wall
    steps = [r.step_s / ts for r in reps]
    tokens = sum(r.tokens for r in reps)
    return {
        "step_s": statistics.mean(steps),
        "rollout_s": statistics.mean(r.phases.get("rollout_wait", 0.0) / ts for r in reps),
        "tokens_per_s": tokens / sum(steps) if steps else math.nan,
        "aborted_per_step": statistics.mean(r.counts.get("aborted_stale", 0) for r in reps),
        "redundant_cancelled_per_step": statistics.mean(r.counts.get("redundant_cancelled", 0) for r in reps),
        "aborted_token_frac": waste_share(reps, "aborted_tokens", "renewed_tokens"),
        "wasted_token_frac": waste_share(reps, "aborted_tokens", "renewed_tokens", "cancelled_tokens"),
        "waited_s": statistics.mean(r.waste.get("waited_s", 0.0) / ts for r in reps),
        "cost_per_hour": pool_cost({p: n for p, n in pools.items() if p != "cpu"}),
        "gpus": float(sum(n for p, n in pools.items() if p != "cpu")),
        "lag_frac": statistics.mean(lags) / probe_period if lags else 0.0,
        "wall_s": wall,
    }


def waste_share(reps: list[Any], *keys: str) -> float:
    """Share of the generated tokens of the StepReports ``reps`` counted under ``keys`` of their
    ``waste`` (e.g. "aborted_tokens"); NaN when they generated none."""
    gen = sum(r.waste.get("generated_tokens", 0) for r in reps)
    return sum(r.waste.get(k, 0) for r in reps for k in keys) / gen if gen else math.nan
