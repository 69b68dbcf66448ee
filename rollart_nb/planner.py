"""plan(): suggest a pool mix, alpha, redundancy and PD split for a workload within a $/hour budget.

The planner searches with the simulator: it sizes a few candidate configurations from the
hardware profiles' prices, runs each for a couple of pipeline steps on a
:class:`~rollart_nb.sim_session.SimSession` (the same Pipeline and scheduler as a real run), and
keeps the fastest per dollar. It is a small, greedy search (pool mix first, then alpha, then
redundancy, then PD), not an optimiser: a handful of short sim runs, each explained in the
returned :class:`Plan`'s table.

Example:
    >>> from rollart_nb.planner import plan
    >>> p = plan({"webshop": "webshop", "math": "gem-math"}, budget=40.0, quick=True)   # doctest: +SKIP
    >>> p.choice                                                                      # doctest: +SKIP
    {'rollout': {'H800': 4, 'H20': 8}, 'alpha': 1, 'redundancy': 0, 'pd': False, ...}
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from rollart_nb.bench.harness import RunSpec, Stragglers, pool_cost, simulate
from rollart_nb.errors import ConfigError
from rollart_nb.resources.profiles import PROFILES
from rollart_nb.sim.workloads import Workload, workload

__all__ = ["Plan", "Trial", "plan"]


@dataclass
class Trial:
    """One simulated configuration the planner tried.

    Attributes:
        stage: which knob this trial varied ("pool mix", "alpha", "redundancy", "pd").
        config: the configuration (rollout pools, alpha, redundancy, pd).
        step_s: predicted (modelled) seconds per training step.
        cost_per_hour: USD per hour of all its GPUs (training included).
    """

    stage: str
    config: dict[str, Any]
    step_s: float
    cost_per_hour: float

    @property
    def cost_per_step(self) -> float:
        return self.step_s * self.cost_per_hour / 3600.0


@dataclass
class Plan:
    """The planner's suggestion and its reasoning.

    Attributes:
        choice: the chosen configuration (``rollout`` pool -> GPUs, ``train_gpus``, ``alpha``,
            ``redundancy``, ``pd``, ``model``).
        trials: everything tried, in order.
        reasoning: one line per decision.
    """

    choice: dict[str, Any]
    step_s: float
    cost_per_hour: float
    trials: list[Trial] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)

    def table(self) -> list[dict[str, Any]]:
        """The trials as rows (for a DataFrame or printing)."""
        return [
            {
                "stage": t.stage,
                **{k: _short(v) for k, v in t.config.items()},
                "step_s": round(t.step_s, 1),
                "$/h": round(t.cost_per_hour, 2),
                "$/step": round(t.cost_per_step, 4),
            }
            for t in self.trials
        ]

    def __repr__(self) -> str:
        rows = self.table()
        cols = list(rows[0]) if rows else []
        w = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
        lines = [f"Plan: {_short(self.choice)} -> {self.step_s:.1f} s/step at ${self.cost_per_hour:.2f}/h"]
        lines += ["  " + "  ".join(c.ljust(w[c]) for c in cols)]
        lines += ["  " + "  ".join(str(r[c]).ljust(w[c]) for c in cols) for r in rows]
        lines += [f"  - {r}" for r in self.reasoning]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = self.table()
        cols = list(rows[0]) if rows else []
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in cols) + "</tr>" for r in rows)
        why = "".join(f"<li>{html.escape(r)}</li>" for r in self.reasoning)
        return (
            f"<div><b>Plan</b>: <code>{html.escape(_short(self.choice))}</code> &rarr; {self.step_s:.1f} s/step "
            f"at ${self.cost_per_hour:.2f}/h<table><tr>{head}</tr>{body}</table><ul>{why}</ul></div>"
        )


def plan(
    workload_: dict[str, str | Workload] | str | Workload,
    budget: float,
    *,
    model: str = "qwen3-8b",
    train_gpus: int = 4,
    batch: int = 32,
    group: int = 8,
    envs_per_task: int = 24,
    alphas: tuple[int, ...] = (1, 2),
    redundancies: tuple[int, ...] = (0, 2),
    try_pd: bool = True,
    stragglers: Stragglers | None = None,
    steps: int = 2,
    quick: bool = False,
) -> Plan:
    """Search a few configurations with the simulator and suggest one.

    Args:
        workload_: the tasks: a preset name, a :class:`Workload`, or task name -> either.
        budget: USD per hour for all GPUs (training included), at the hardware profiles' prices.
        train_gpus: H800 GPUs for training (fixed; the search is over rollout).
        batch / group: trajectories per step / GRPO group size.
        envs_per_task: env instances per task.
        alphas / redundancies: values tried for the staleness bound and redundant members.
        try_pd: also try PD disaggregation when the chosen mix has both H800 and H20.
        stragglers: long-tail env latency to plan for (None: the workloads' own latency).
        steps: measured steps per trial (one warm-up step besides), on the virtual clock.
        quick: one mix fewer and no redundancy / PD stage (a smoke run).

    Raises:
        ConfigError: the budget does not cover the training GPUs plus one rollout GPU.
    """
    tasks = _tasks(workload_)
    train_cost = pool_cost({"H800": train_gpus})
    left = budget - train_cost
    if left < PROFILES["H20"].price_per_hour:
        raise ConfigError(
            f"budget ${budget:.2f}/h does not cover {train_gpus} training H800 (${train_cost:.2f}/h) "
            "plus one rollout GPU; raise the budget or lower train_gpus",
            where="plan",
        )
    base = RunSpec(
        model,
        {},
        train_gpus=train_gpus,
        tasks=tasks,
        envs_per_task=envs_per_task,
        batch=batch,
        group=group,
        stragglers=stragglers,
        steps=1 if quick else steps,
        warmup=1,
    )
    trials: list[Trial] = []
    why: list[str] = []

    def run(stage: str, s: RunSpec) -> Trial:
        r = simulate(s)
        t = Trial(
            stage,
            {"rollout": dict(s.rollout), "alpha": s.alpha, "redundancy": s.redundancy, "pd": s.pd},
            r["step_s"],
            r["cost_per_hour"],
        )
        trials.append(t)
        return t

    mixes = _mixes(left, quick)
    best = min((run("pool mix", base.with_(rollout=m)) for m in mixes), key=lambda t: t.cost_per_step)
    why.append(f"pool mix: {_short(best.config['rollout'])} has the lowest $/step of {len(mixes)} equal-budget mixes")
    spec = base.with_(rollout=best.config["rollout"])

    def consider(stage: str, s: RunSpec) -> None:
        nonlocal best, spec
        t = run(stage, s)
        if t.step_s < best.step_s * 0.95:  # each knob costs convergence or GPUs: only take a clear gain
            best, spec = t, s

    for a in alphas:
        if a != spec.alpha:
            consider("alpha", spec.with_(alpha=a))
    why.append(f"alpha={spec.alpha}: larger bounds trade convergence for throughput, kept only for a >5% faster step")
    if not quick:
        for r in redundancies:
            if r != spec.redundancy:
                consider("redundancy", spec.with_(redundancy=r, envs_per_task=envs_per_task + r * len(tasks)))
        why.append(f"redundancy={spec.redundancy}: extra members per group, kept only for a >5% faster step")
        if try_pd and set(spec.rollout) >= {"H800", "H20"}:
            consider("pd", spec.with_(pd=True))
            why.append(f"pd={spec.pd}: prefill on H800, decode on H20, kept only for a >5% faster step")
    choice = {"model": model, "train_gpus": train_gpus, **best.config}
    return Plan(choice, best.step_s, best.cost_per_hour, trials, why)


def _tasks(w: dict[str, str | Workload] | str | Workload) -> dict[str, Workload]:
    if isinstance(w, Workload):
        return {w.name: w}
    if isinstance(w, str):
        return {w: workload(w)}
    return {t: v if isinstance(v, Workload) else workload(v) for t, v in w.items()}


def _mixes(budget: float, quick: bool) -> list[dict[str, int]]:
    """Equal-budget rollout pools: all H800, all H20, and H800/H20 splits spending 2/3 (and 1/3) on H800."""
    p800, p20 = PROFILES["H800"].price_per_hour, PROFILES["H20"].price_per_hour
    fractions = [1.0, 2 / 3, 0.0] if quick else [1.0, 2 / 3, 1 / 3, 0.0]
    out = []
    for f in fractions:
        n800 = int(budget * f // p800)
        n20 = int((budget - n800 * p800) // p20)
        mix = {k: v for k, v in (("H800", n800), ("H20", n20)) if v > 0}
        if mix and mix not in out:
            out.append(mix)
    return out


def _short(v: Any) -> str:
    if isinstance(v, dict):
        return ",".join(f"{k}={_short(x)}" for k, x in v.items())
    return str(v)
