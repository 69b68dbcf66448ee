"""What-if experiments on a simulated cluster, next to the RollArt paper's numbers.

Each experiment builds :class:`~rollart_nb.sim_session.SimSession` s and runs the real Pipeline
on sim backends, returns a dict of our ratios and the paper's (see
:mod:`rollart_nb.bench.report`), prints a table, and writes a plotly figure into ``out``.
``rollart-nb bench <experiment> [--out DIR] [--quick]`` calls :func:`run_experiments`.

Example:
    >>> from rollart_nb.bench import run_experiments
    >>> res = run_experiments("r1_affinity", out="/tmp/bench", quick=True)   # doctest: +SKIP
    >>> res["r1_affinity"]["ours"]["mix_over_h20_only"]                       # doctest: +SKIP
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rollart_nb.bench.hardware import pd_disaggregation, r1_affinity
from rollart_nb.bench.modes import scaling, throughput_ladder
from rollart_nb.bench.scheduling import alpha_sweep, redundant_rollouts, staleness_policies
from rollart_nb.bench.sensitivity import sensitivity, sensitivity_report
from rollart_nb.errors import ConfigError

__all__ = [
    "EXPERIMENTS", "alpha_sweep", "script_main", "pd_disaggregation", "r1_affinity", "redundant_rollouts",
    "run_experiments", "scaling", "sensitivity", "sensitivity_report", "staleness_policies", "throughput_ladder",
]  # fmt: skip

EXPERIMENTS: dict[str, Callable[..., dict[str, Any]]] = {
    "r1_affinity": r1_affinity,
    "pd_disaggregation": pd_disaggregation,
    "redundant_rollouts": redundant_rollouts,
    "alpha_sweep": alpha_sweep,
    "staleness_policies": staleness_policies,
    "scaling": scaling,
    "throughput_ladder": throughput_ladder,
    "sensitivity": sensitivity_report,
}
"""Experiment name -> function ``(out, quick, printer) -> result dict``."""

_ALIASES = {
    "r1": "r1_affinity",
    "affinity": "r1_affinity",
    "pd": "pd_disaggregation",
    "redundancy": "redundant_rollouts",
    "alpha": "alpha_sweep",
    "r4": "alpha_sweep",
    "staleness": "staleness_policies",
    "policies": "staleness_policies",
    "ladder": "throughput_ladder",
    "throughput": "throughput_ladder",
    "sweep": "sensitivity",
}


def run_experiments(
    name: str = "all", out: str = "rollart_bench", quick: bool = False, printer: Callable[[str], None] | None = print
) -> dict[str, Any]:
    """Run one experiment (or ``"all"``); returns ``{experiment: result}`` plus ``wall_s``.

    Args:
        name: an :data:`EXPERIMENTS` key, a short alias ("r1", "pd", "alpha", ...), or "all"
            (every paper experiment; "sensitivity", some sixty simulated runs, only by name).
        out: directory for the figures (created).
        quick: fewer configurations and steps (a smoke run; ratios are noisier).
        printer: where the tables go (None: silent).
    """
    key = _ALIASES.get(name, name)
    if key != "all" and key not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; choose 'all' or one of {', '.join(EXPERIMENTS)}")
    names = [n for n in EXPERIMENTS if n != "sensitivity"] if key == "all" else [key]
    t0 = time.monotonic()
    res: dict[str, Any] = {n: EXPERIMENTS[n](out=out, quick=quick, printer=printer) for n in names}
    res["wall_s"] = round(time.monotonic() - t0, 1)
    return res


def script_main(name: str, doc: str | None = None) -> None:
    """Entry point of ``benchmarks/paper/<name>.py``: ``[--out DIR] [--quick]``, then ``RESULT {json}``."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--out", default="rollart_bench")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    print("RESULT " + json.dumps(run_experiments(name, out=a.out, quick=a.quick)), flush=True)
