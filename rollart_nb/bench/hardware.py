"""Hardware experiments: R1 hardware-affinity mapping and PD disaggregation.

Both run at 1/8 of the paper's GPU counts with envs and batch sized to match (the control plane's
CPU time per turn, not the simulated cluster, is what a 2-core machine runs out of); the
comparisons are at equal cost from the hardware profiles' prices, as in the paper.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rollart_nb.bench.harness import RunSpec, equal_cost_counts, pool_cost, simulate
from rollart_nb.bench.report import finish, result
from rollart_nb.resources.profiles import PROFILES

__all__ = ["pd_disaggregation", "r1_affinity"]

SCALE = 1 / 8
"""Fraction of the paper's GPU counts simulated."""

R1_PAPER: dict[str, Any] = {
    "mix_over_h20_only": (1.30, 1.68),
    "mix_over_h800_only": (1.12, 1.37),
    "routing_gain": None,
}
"""The paper's R1 speed-ups (§7.3)."""

R1_WHY = {
    "mix_over_h20_only": {
        "below": "SimBackend keeps each trajectory's KV between turns, so an SWE turn prefills only its new tool "
        "output (and, after each weight update, its whole history once): on H20s the prefill chunks do stall "
        "the decodes they share a pass with, but the stall per turn is short, and H20-only keeps 26 devices' "
        "bandwidth for GEM-math's long decodes.",
        "above": "The H20-only cluster prefills every SWE history recompute (after each weight update) at 148 "
        "TFLOP/s, stalling its decodes meanwhile; the mix does those on H800s.",
    },
    "mix_over_h800_only": {
        "below": "At 1/8 scale the mix is 8 H800 + 3 H20 against 9 H800: it gains what three H20s add for "
        "GEM-math's decodes (1.19x an H800's bandwidth each) less the ninth H800.",
        "above": "Routing GEM-math's long decodes to the H20s frees the H800s' passes from them, so SWE's "
        "prefill chunks on the H800s stall fewer decodes.",
    },
}
"""Why R1's ratios may fall outside the paper's ranges."""

PD_PAPER: dict[str, Any] = {
    "dense_1P3D": 1.03,
    "dense_2P2D": 1.05,
    "moe_1P3D": 1.11,
    "moe_2P2D": 1.21,
    "dense_3P1D": None,
    "moe_3P1D": None,
}
"""The paper's PD speed-ups over colocation (§7.4; 3P1D: "worst", no number)."""

PD_WHY = {
    "*": {
        "below": "The interference PD removes is modelled (a colocated prefill chunk stalls every decode in its "
        "pass), but so are PD's costs: each turn's new KV crosses the 50 GB/s link to the trajectory's decode "
        "node, every weight update makes the P node recompute whole SWE histories and send them again, and "
        "all prefill queues on the P nodes (1P3D: one node).",
        "above": "The colocated baseline places turns by load only, so SWE prefills also run on H20 workers, "
        "where their chunks stall the decodes sharing those passes for 6.7x longer than on an H800.",
    }
}
"""Why PD's ratios may fall outside the paper's."""


def r1_affinity(
    out: str = "rollart_bench", quick: bool = False, printer: Callable[[str], None] | None = print
) -> dict[str, Any]:
    """R1: rollout on H800 only vs H20 only vs an affinity mix, at equal cost; training fixed.

    Paper (§7.3 R1): 32 H800 train; rollout on 72 H800, 208 H20, or 64 H800 + 24 H20 (about
    equal cost); the mix routes decode-heavy tasks (math, games) to H20 and keeps prefill-heavy
    work on H800: 1.30-1.68x over H20-only, 1.12-1.37x over H800-only (step time).
    Here: the same shapes at 1/8 scale, counts re-derived from the profiles' prices, Qwen3-8B,
    a prefill-heavy task (SWE-shaped: long histories, bulky tool output) next to a decode-heavy one
    (GEM-math-shaped).
    """
    t0 = time.monotonic()
    h800 = round(72 * SCALE)
    budget = pool_cost({"H800": h800})
    mix_h800 = round(64 * SCALE)
    configs = {
        "h800_only": {"H800": h800},
        "h20_only": {"H20": equal_cost_counts(budget, "H20")},
        "affinity_mix": {"H800": mix_h800, "H20": equal_cost_counts(budget - pool_cost({"H800": mix_h800}), "H20")},
    }
    base = RunSpec(
        "qwen3-8b",
        {},
        train_gpus=round(32 * SCALE),
        tasks={"swe": "swe", "math": "gem-math"},
        envs_per_task=16 if quick else 32,
        batch=32 if quick else 64,
        steps=1 if quick else 5,
        warmup=1,
    )
    raw: dict[str, dict[str, Any]] = {
        k: {**simulate(base.with_(rollout=v)), "rollout_gpus": v} for k, v in configs.items()
    }
    # the same mix and workload with affinity routing off: least-loaded placement only
    raw["mix_routing_off"] = {
        **simulate(base.with_(rollout=configs["affinity_mix"], hw_affinity=False)),
        "rollout_gpus": configs["affinity_mix"],
    }
    mix = raw["affinity_mix"]["step_s"]
    ours = {
        "mix_over_h20_only": raw["h20_only"]["step_s"] / mix,
        "mix_over_h800_only": raw["h800_only"]["step_s"] / mix,
        "routing_gain": raw["mix_routing_off"]["step_s"] / mix,
    }
    res = result(
        "r1_affinity",
        ours,
        R1_PAPER,
        R1_WHY,
        raw,
        description=f"equal ${budget:.0f}/h rollout: {configs}, train {base.train_gpus} H800, qwen3-8b, swe+gem-math",
    )
    return finish(res, out, printer, "R1 hardware affinity: step-time speed-up of the affinity mix", t0)


def pd_disaggregation(
    out: str = "rollart_bench", quick: bool = False, printer: Callable[[str], None] | None = print
) -> dict[str, Any]:
    """PD disaggregation 1P3D / 2P2D / 3P1D vs colocated prefill+decode on the same nodes.

    Paper (§7.4): SWE tasks, 8-GPU nodes (P nodes H800, D nodes H20). Dense Qwen3-32B:
    1.03x (1P3D) and 1.05x (2P2D) over colocation; MoE Qwen3-30B-A3B: 1.11x and 1.21x; 3P1D was
    the worst configuration for both (one decode node is the bottleneck).
    Here: one TP=8 SimGenerator per node; ``pd=True`` sends each turn's prefill to an H800 worker
    and its decode to an H20 worker (KV moved over a 50 GB/s link); colocated runs both phases
    on whichever worker is least loaded. The whole nodes are simulated (4 nodes, 32 GPUs).
    """
    t0 = time.monotonic()
    splits = {"1P3D": 1, "2P2D": 2} if quick else {"1P3D": 1, "2P2D": 2, "3P1D": 3}
    models = {"dense": "qwen3-32b"} if quick else {"dense": "qwen3-32b", "moe": "qwen3-30b-a3b"}
    base = RunSpec(
        "",
        {},
        train_gpus=8,
        tp=8,
        tasks={"swe": "swe"},
        envs_per_task=16 if quick else 32,
        batch=16 if quick else 32,
        group=8,
        steps=1 if quick else 3,
        warmup=1,
    )
    raw: dict[str, Any] = {}
    ours: dict[str, float] = {}
    for kind, model in models.items():
        for split, p in splits.items():
            gpus = {"H800": 8 * p, "H20": 8 * (4 - p)}
            s = base.with_(model=model, rollout=gpus)
            colo = simulate(s.with_(hw_affinity=False))
            pd = simulate(s.with_(pd=True))
            raw[f"{kind}_{split}"] = {"colocated": colo, "pd": pd, "gpus": gpus}
            ours[f"{kind}_{split}"] = colo["rollout_s"] / pd["rollout_s"] if pd["rollout_s"] > 0 else float("nan")
    paper = {k: v for k, v in PD_PAPER.items() if k in ours}
    res = result(
        "pd_disaggregation",
        ours,
        paper,
        PD_WHY,
        raw,
        description="rollout-time speed-up of PD over colocated on the same 4 nodes (P=H800x8, D=H20x8), "
        f"swe, models {list(models.values())}; 3P1D: paper says worst, no number",
    )
    if "dense_3P1D" in ours:
        for kind in models:
            best = max((k for k in ours if k.startswith(kind)), key=lambda k: ours[k])
            worst = min((k for k in ours if k.startswith(kind)), key=lambda k: ours[k])
            res["notes"].append(
                f"{kind}: best split {best.split('_')[1]}, worst {worst.split('_')[1]} (paper: 3P1D worst)"
            )
    res["prices"] = {h: PROFILES[h].price_per_hour for h in ("H800", "H20")}
    return finish(res, out, printer, "PD disaggregation: rollout speed-up over colocation", t0)
