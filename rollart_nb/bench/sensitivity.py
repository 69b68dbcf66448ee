"""Sensitivity: how a headline ratio moves as one workload parameter moves, the others held.

A ratio drawn against one parameter shows where RollArt's design wins and where it does not.
Each point is two simulated runs (the ratio's numerator and denominator), changed in one parameter:

- ``env_latency_spread``: the std of every env call's latency, times the factor (stragglers).
- ``turns``: each task's turn range, times the factor.
- ``prompt_tokens``: each task's prompt and observation lengths, times the factor.
- ``response_tokens``: each task's response lengths, times the factor.
- ``alpha``: RollArt's staleness bound (AReaL's too, which bounds at start).

Ratios: ``rollart_over_areal`` (the throughput ladder's last rung, in tokens per second) and
``mix_over_h20_only`` (R1: the affinity mix over H20 only, at equal cost, in step time).

Example:
    >>> from rollart_nb.bench.sensitivity import sensitivity
    >>> res = sensitivity("rollart_over_areal", "turns", [0.5, 1, 2], quick=True)   # doctest: +SKIP
    >>> res["ratio"]                                                                # doctest: +SKIP
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from rollart_nb.bench.harness import RunSpec, equal_cost_counts, pool_cost, simulate
from rollart_nb.bench.modes import ladder_runs
from rollart_nb.errors import ConfigError
from rollart_nb.sim.workloads import Workload

__all__ = ["PARAMETERS", "RATIOS", "sensitivity", "sensitivity_report"]

PARAMETERS: dict[str, list[float]] = {
    "env_latency_spread": [0.25, 1.0, 4.0],
    "turns": [0.5, 1.0, 2.0],
    "prompt_tokens": [0.5, 1.0, 2.0],
    "response_tokens": [0.5, 1.0, 2.0],
    "alpha": [1, 2, 4],
}
"""Parameter -> the values swept by default (factors on the base workload; alpha itself)."""

_TASKS = {"swe": "swe", "math": "gem-math"}


def _scale(w: Workload, param: str, f: float) -> Workload:
    if param == "turns":
        lo, hi = w.turns
        return replace(w, turns=(max(1, round(lo * f)), max(1, round(lo * f), round(hi * f))))
    if param == "prompt_tokens":
        return replace(
            w, prompt_tokens=max(1, round(w.prompt_tokens * f)), obs_tokens=(w.obs_tokens[0] * f, w.obs_tokens[1] * f)
        )
    if param == "response_tokens":
        mean, std = w.response_tokens
        return replace(
            w, response_tokens=(mean * f, std * f), max_response_tokens=max(1, round(w.max_response_tokens * f))
        )
    if param == "env_latency_spread":
        return replace(w, env_latency_s=(w.env_latency_s[0], w.env_latency_s[1] * f))
    return w


def _pair(ratio: str, quick: bool) -> tuple[RunSpec, RunSpec]:
    """(numerator, denominator) runs of ``ratio`` on its experiment's clusters, 1/8 of the paper's GPUs."""
    steps = 2 if quick else 4
    if ratio == "rollart_over_areal":  # the ladder: AReaL on 4 + 12 H800, RollArt on 83% of that cost
        base, mix = ladder_runs(quick, steps)
        return base.with_(mode="rollart", rollout=mix), base.with_(mode="areal", hw_affinity=False)
    if ratio == "mix_over_h20_only":  # R1: equal cost, training fixed
        budget = pool_cost({"H800": 9})
        base = RunSpec(
            "qwen3-8b",
            {},
            train_gpus=4,
            tasks=_TASKS,
            envs_per_task=16 if quick else 32,
            batch=32 if quick else 64,
            steps=steps,
            warmup=1,
        )
        mix = {"H800": 8, "H20": equal_cost_counts(budget - pool_cost({"H800": 8}), "H20")}
        return base.with_(rollout=mix), base.with_(rollout={"H20": equal_cost_counts(budget, "H20")})
    raise ConfigError(f"unknown ratio {ratio!r}; choose one of {', '.join(RATIOS)}")


RATIOS = ("rollart_over_areal", "mix_over_h20_only")
"""Ratios :func:`sensitivity` can sweep, each measured as its experiment measures it: RollArt over
AReaL in tokens per simulated second (the ladder), the mix over H20 only in step time (R1)."""


def _ratio(ratio: str, num: dict[str, float], den: dict[str, float]) -> float:
    if ratio == "mix_over_h20_only":
        return den["step_s"] / num["step_s"]
    return num["tokens_per_s"] / den["tokens_per_s"]


def sensitivity(
    ratio: str,
    param: str,
    values: Sequence[float] | None = None,
    *,
    quick: bool = False,
    printer: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Sweep one parameter and report ``ratio`` at each value.

    Args:
        ratio: one of :data:`RATIOS`.
        param: one of :data:`PARAMETERS`.
        values: the factors (or alphas) to try; default :data:`PARAMETERS` ``[param]``.
        quick: smaller runs (fewer envs, steps, a smaller batch).
        printer: gets one line per point (None: silent).

    Returns:
        ``{"ratio", "param", "values", "ours": [ratio per value], "wasted": [numerator's
        aborted-token fraction per value], "raw": [(numerator, denominator) simulate() records]}``.

    Raises:
        ConfigError: an unknown ratio or parameter.
    """
    if param not in PARAMETERS:
        raise ConfigError(f"unknown parameter {param!r}; choose one of {', '.join(PARAMETERS)}")
    vals = list(PARAMETERS[param] if values is None else values)
    num, den = _pair(ratio, quick)
    out: dict[str, Any] = {"ratio": ratio, "param": param, "values": vals, "ours": [], "wasted": [], "raw": []}
    for v in vals:
        runs = []
        for s in (num, den):
            if param == "alpha":
                s = s.with_(alpha=int(v))
            else:
                s = s.with_(tasks={t: _scale(w, param, float(v)) for t, w in s.workloads.items()})
            runs.append(simulate(s))
        r = _ratio(ratio, runs[0], runs[1])
        out["ours"].append(round(r, 3))
        out["wasted"].append(round(runs[0]["aborted_token_frac"], 3))
        out["raw"].append(runs)
        if printer is not None:
            printer(f"  {ratio} at {param}={v:g}: {r:.2f}x (aborted {runs[0]['aborted_token_frac']:.0%} of tokens)")
    return out


def sensitivity_report(
    out: str = "rollart_bench",
    quick: bool = False,
    printer: Callable[[str], None] | None = print,
    ratios: Sequence[str] = RATIOS,
    params: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Every ratio against every parameter; one plotly figure per ratio (a panel per parameter,
    the paper's range shaded) in ``out``. Returns ``{"experiment": "sensitivity", "sweeps":
    {ratio: {param: sensitivity(...)}}, "figure": {ratio: path}, "wall_s"}``."""
    t0 = time.monotonic()
    params = list(PARAMETERS if params is None else params)
    sweeps: dict[str, dict[str, Any]] = {}
    figures: dict[str, str] = {}
    for ratio in ratios:
        if printer is not None:
            printer(f"== sensitivity of {ratio}")
        sweeps[ratio] = {p: sensitivity(ratio, p, quick=quick, printer=printer) for p in params}
        figures[ratio] = _figure(ratio, sweeps[ratio], out)
    for by_param in sweeps.values():
        for s in by_param.values():
            s.pop("raw", None)  # the figures and ratios carry the result; raw runs are large
    return {"experiment": "sensitivity", "sweeps": sweeps, "figure": figures, "wall_s": round(time.monotonic() - t0, 1)}


PAPER_RANGE = {"rollart_over_areal": (1.22, 1.36), "mix_over_h20_only": (1.30, 1.68)}


def _figure(ratio: str, by_param: dict[str, Any], out: str) -> str:
    from plotly.subplots import make_subplots

    params = list(by_param)
    fig = make_subplots(rows=1, cols=len(params), subplot_titles=params, shared_yaxes=True)
    lo, hi = PAPER_RANGE[ratio]
    for i, p in enumerate(params, start=1):
        s = by_param[p]
        x = [str(v) for v in s["values"]]
        fig.add_scatter(x=x, y=s["ours"], mode="lines+markers", name=p, row=1, col=i, showlegend=False)
        fig.add_hrect(y0=lo, y1=hi, fillcolor="green", opacity=0.12, line_width=0, row=1, col=i)
        fig.add_hline(y=1.0, line_dash="dot", row=1, col=i)
    fig.update_layout(
        title=f"{ratio}: one parameter at a time (x factor on the base workload; green: the paper's range)",
        template="plotly_white",
        height=360,
    )
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"sensitivity_{ratio}.html")
    fig.write_html(path, include_plotlyjs="cdn")
    return path
