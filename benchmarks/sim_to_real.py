"""Sim-to-real check: one small workload run for real and simulated, phase by phase.

The workload is the format-only run's (``rollart_nb/configs/format.yaml``): the tiny Qwen-style
model with its format-only warm start, FrozenLake and Arithmetic (weights 1 : 3, math trained on
``close_answer``), the ``hf`` generator and the ``torch`` GRPO trainer, 4 new tokens per turn. It runs twice per mode (sync,
one-off, rollart):

* **measured**: for real on ``rn.Session.local()`` (wall seconds);
* **predicted**: on ``rn.Session.sim()`` (simulated seconds on a virtual clock) with what
  :mod:`rollart_nb.bench.calibrate` and :mod:`~rollart_nb.bench.real_costs` measure at start, each part alone, never the run itself:
  matmul FLOP/s, memory bandwidth and the fixed cost of one forward pass of the tiny model (the
  generator's roofline); the ``hf`` engine's own work per request beyond its passes
  (``row_overhead``) and its batching (a batch runs to its end; ``static_batching``); the real
  ``torch`` trainer's seconds per padded token and per step on two synthetic batches; the token,
  turn and latency statistics of real episodes of the two envs played by the same model (turn
  counts as observed, not only their mean); and, on a fresh ``Session.local()``: one Ray actor
  call's round trip (every call to a sim worker waits it), the two halves of a weight update
  with the real workers (the trainer's state_dict into the object store, a generator's load),
  and the control plane's CPU seconds per turn, from the real pipeline with a generator and
  trainer that cost nothing.
  The sim's machine is one host of this machine's cores that the generator, the trainer and the
  control plane share (``Session.sim(host_cores=...)``, :mod:`rollart_nb.clock.cores`). Every
  timing is measured before and again after the real run and the two are averaged
  (:func:`bracket`), so a steady drift of the machine's speed over the run cancels.

The real run trains at a learning rate of 1e-9 (``--lr``): every cost of a step is paid, but the
policy, and so the episodes the sim was calibrated on, stay put.

Printed: predicted and measured mean step time and per-phase time per mode (after ``--warmup``
steps), the relative error ``(predicted - measured) / measured`` of each, whether the modes rank the
same, and for every phase off by more than the 25% target the effect the sim leaves out. Nothing
is fitted to the measured run: the sim sees only the calibration.

The last line is ``RESULT {json}``: ``measured`` and ``predicted`` (mode -> ``step_s`` and each
phase, seconds), ``error`` (mode -> phase -> relative error; null where the measured time is 0),
``step_error`` (mode -> relative error of the step time), ``within_target``, ``ranked_same``,
``rank`` (modes fastest first, both sides), ``profile`` and ``calibration`` (what the sim was
given) and ``calibrations`` (the measurements ``before`` and ``after`` the run).

About 2-3 minutes on 2 idle cores (the first run also builds the warm-started model: +90 s);
``--quick`` is a ~1 minute smoke run with tiny settings.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import rollart_nb as rn  # noqa: E402
from rollart_nb.backends.hf import BATCH_WAIT_S, HFBackend  # noqa: E402
from rollart_nb.bench.calibrate import Calibration, calibrate, register_profile  # noqa: E402
from rollart_nb.bench.real_costs import call_latency, measure_control_plane, measure_weight_sync  # noqa: E402
from rollart_nb.config import RolloutConfig, load  # noqa: E402
from rollart_nb.control.report import PHASES  # noqa: E402
from rollart_nb.envs import Arithmetic, FrozenLake  # noqa: E402
from rollart_nb.rewards import close_answer, exact_answer  # noqa: E402
from rollart_nb.sim import SimEnv, response_tokens_fn  # noqa: E402
from rollart_nb.train import FORMAT_YAML, TrainConfig  # noqa: E402
from rollart_nb.workers.roles import HFGenerator, SimGenerator, SimTrainer, TorchTrainer  # noqa: E402

HF_MAX_BATCH = inspect.signature(HFBackend).parameters["max_batch_size"].default
"""The hf engine's batch size (its default, which the real run keeps): the sim engine's seats."""

WEIGHTS = {"frozenlake": 1.0, "math": 3.0}
"""format.yaml's task weights."""

TARGET = 0.25
"""Relative error per phase the issue asks for."""

FROZEN_LR = 1e-9
"""The real run's default learning rate: every cost of a step is paid (forward, backward, the
AdamW update, the weight sync), but the policy does not move, so its episodes keep the token and
turn statistics the sim was calibrated on. At that run's rate the policy changes what it plays
within a few steps (FrozenLake episodes shorten or lengthen), a change in workload that no
timing model predicts; ``--lr 1e-3`` shows it."""

COLUMNS = ("step_s", *PHASES, "train_s")
"""Compared per mode: the step, its phases, and the train step's own duration (overlapped or not)."""

WHY = {
    "rollout_wait": (
        "the control plane's cost per turn and the hf engine's per request are measured once, at "
        "one workload's mix and one batch size (a FrozenLake turn's history grows, so does its cost); "
        "and the OS places work on cores close to, not exactly as, the sim's least-loaded rule"
    ),
    "suspend": (
        "the sim prices one Ray call per worker called and the preempted turns' control work; the "
        "real call also waits for the rollout worker's event loop, busy with turns, and for a core"
    ),
    "update": (
        "the weight handoff is measured alone with the real workers on idle cores; in the run the "
        "rollout worker's busy event loop and the shared cores add to it"
    ),
    "resume": (
        "the sim prices one Ray call per worker called; the real call also waits for the rollout "
        "worker's event loop and for a core, a few milliseconds the sim leaves out"
    ),
    "train": (
        "the train step as exposed after the rollout: in overlapped modes the small difference of two "
        "larger times (the rollout and the train step), so its relative error is large"
    ),
    "train_s": (
        "the trainer's cost per padded token and per step is measured alone on a core; in overlapped "
        "modes the real step sometimes shares its core, where the sim keeps the long step on a core "
        "of its own (as Linux mostly does)"
    ),
    "step_s": "the sum of the phases above",
}
"""For each column that can miss the target, what the sim leaves out (printed for those that do)."""


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="sync,one-off,rollart", help="comma-separated pipeline modes")
    ap.add_argument("--steps", type=int, default=8, help="steps per mode that are compared")
    ap.add_argument("--warmup", type=int, default=2, help="steps per mode run first and not compared")
    ap.add_argument("--batch", type=int, default=32, help="trajectories per step")
    ap.add_argument("--group", type=int, default=8, help="GRPO group size")
    ap.add_argument("--envs-per-task", type=int, default=8)
    ap.add_argument("--alpha", type=int, default=2, help="staleness bound (format.yaml's)")
    ap.add_argument(
        "--lr",
        type=float,
        default=FROZEN_LR,
        help="the real run's learning rate (default: a frozen policy, so the calibrated token statistics hold)",
    )
    ap.add_argument("--warm-steps", type=int, default=60, help="format-only warm start steps (cached)")
    ap.add_argument("--calib-seconds", type=float, default=2.0, help="budget of the hardware microbenchmark")
    ap.add_argument("--episodes", type=int, default=16, help="real episodes per task for the token statistics")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2+1 steps, batch 8, group 4, 4 episodes")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.warmup, a.batch, a.group, a.envs_per_task = 2, 1, 8, 4, 4
        a.episodes, a.calib_seconds = 4, 0.5
    bad = [
        f"--{k.replace('_', '-')} must be >= 1"
        for k in ("steps", "batch", "group", "envs_per_task", "episodes")
        if getattr(a, k) < 1
    ]
    if a.batch % a.group:
        bad.append(f"--batch {a.batch} must be a multiple of --group {a.group}")
    if bad:
        ap.error("; ".join(bad))
    return a


def _envs() -> dict[str, Any]:
    return {"frozenlake": FrozenLake(), "math": Arithmetic()}


def _model(envs: dict[str, Any], warm_steps: int, seed: int) -> Any:
    from rollart_nb.models import tiny_qwen
    from rollart_nb.models.warmstart import format_warm_start

    vocab = sorted({w for e in envs.values() for w in getattr(e, "vocab", ())})
    model = tiny_qwen(task_vocab=vocab, size="s", seed=seed)
    return format_warm_start(model, envs, steps=warm_steps, seed=seed) if warm_steps else model


def _mean_phases(reports: list[Any]) -> dict[str, float]:
    out = {"step_s": statistics.fmean(r.step_s for r in reports)}
    for p in PHASES:
        out[p] = statistics.fmean(r.phases.get(p, 0.0) for r in reports)
    out["train_s"] = statistics.fmean(r.train_s for r in reports)
    return out


def _run_modes(sess: Any, gen: Any, train: Any, tasks: Any, a: argparse.Namespace, algo: Any) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for mode in a.modes.split(","):
        pipe = sess.pipeline(
            train,
            gen,
            tasks,
            algo=algo,
            name=f"s2r-{mode}",
            batch_size=a.batch,
            mode=mode,
            alpha=a.alpha,
            rollout=RolloutConfig(max_new_tokens=4, temperature=1.0),
            seed=a.seed,
        )
        try:
            if a.warmup:
                pipe.run(a.warmup, progress=False)
            reps = pipe.run(a.steps, progress=False)
        finally:
            pipe.close()
        res[mode] = _mean_phases(reps)
        res[mode]["tokens"] = statistics.fmean(r.tokens for r in reps)
        res[mode]["aborted"] = statistics.fmean(r.counts.get("aborted_stale", 0) for r in reps)
        print(f"  {mode:>8}: step {res[mode]['step_s']:.3f} s", flush=True)
    return res


def run_real(model: Any, a: argparse.Namespace, algo: Any) -> dict[str, Any]:
    """The workload on ``Session.local()``: wall seconds."""
    sess = rn.Session.local(seed=a.seed)
    try:
        gen = sess.cluster("actor_gen", HFGenerator, pool="H20", model=model, seed=a.seed)
        train = sess.cluster("actor_train", TorchTrainer, pool="H800", model=model, algo=algo, seed=a.seed)
        tasks = sess.tasks(_envs(), envs_per_task=a.envs_per_task, weights=WEIGHTS)
        sess.reward("math", close_answer, validate_with=exact_answer)
        return _run_modes(sess, gen, train, tasks, a, algo)
    finally:
        sess.close()


def host_cores() -> int:
    """The cores this process may run on (what ``Session.local()``'s workers share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def measure_host(model: Any, cal: Calibration, a: argparse.Namespace, algo: Any) -> dict[str, Any]:
    """On a fresh ``Session.local()``, apart from the real run: one Ray actor call's round trip
    (:func:`call_latency`), a weight update's two halves with the real workers
    (:func:`measure_weight_sync`), and the control plane's CPU seconds per turn with generation
    and training that cost nothing (:func:`measure_control_plane`)."""
    sess = rn.Session.local(seed=a.seed)
    try:
        rtt = call_latency(a.calib_seconds / 4)
        sync = measure_weight_sync(sess, model, algo, seconds=a.calib_seconds / 2, call_latency_s=rtt)
        cp = measure_control_plane(
            sess,
            model,
            _envs(),
            weights=WEIGHTS,
            envs_per_task=a.envs_per_task,
            batch=a.batch,
            group=a.group,
            steps=max(2, a.steps // 2),
            response_tokens=response_tokens_fn(cal.workloads, seed=a.seed),
            rewards={"math": close_answer},
            seed=a.seed,
        )
    finally:
        sess.close()
    return {
        "call_latency_s": rtt,
        "export_overhead_s": sync.export_s,
        "load_overhead_s": sync.load_s,
        "turn_cpu_s": cp["turn_cpu_s"],
        "control_turns": cp["turns"],
        "host_cores": host_cores(),
    }


def run_sim(cal: Calibration, a: argparse.Namespace, algo: Any, host: dict[str, Any]) -> dict[str, Any]:
    """The same workload on ``Session.sim()`` with the measured profile: simulated seconds.

    The machine is one host of ``host_cores`` cores that the generator's and the trainer's
    devices and the control plane share (:mod:`rollart_nb.clock.cores`), as ``Session.local()``'s
    workers share this machine."""
    pool = cal.profile.name
    sess = rn.Session.sim(
        {pool: 2, "cpu": 4},
        seed=a.seed,
        call_latency_s=host["call_latency_s"],
        host_cores=host["host_cores"],
        turn_cpu_s=host["turn_cpu_s"],
    )
    try:
        gen = sess.cluster(
            "actor_gen",
            SimGenerator,
            pool=pool,
            model=cal.spec,
            seed=a.seed,
            mfu=cal.mfu,
            mbu=cal.mbu,
            response_tokens=response_tokens_fn(cal.workloads, seed=a.seed),
            batch_wait_s=BATCH_WAIT_S,
            static_batching=True,  # the hf engine runs a batch to its end before the next
            max_num_seqs=HF_MAX_BATCH,
            row_overhead_s=cal.row_overhead_s,
            load_overhead_s=host["load_overhead_s"],
        )
        train = sess.cluster(
            "actor_train",
            SimTrainer,
            pool=pool,
            model=cal.spec,
            gpus=1,
            mfu=cal.train_mfu,
            algo=algo,
            step_overhead_s=cal.train_overhead_s,
            export_overhead_s=host["export_overhead_s"],
        )
        envs = {t: SimEnv(w, seed=a.seed) for t, w in cal.workloads.items()}
        tasks = sess.tasks(envs, envs_per_task=a.envs_per_task, weights=WEIGHTS)
        return _run_modes(sess, gen, train, tasks, a, algo)
    finally:
        sess.close()


def relative_error(predicted: float, measured: float) -> float | None:
    """``(predicted - measured) / measured``; None when nothing was measured."""
    return None if measured == 0 else (predicted - measured) / measured


def compare(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any]:
    """Errors per mode and column, the step errors, and whether the modes rank the same."""
    error = {
        m: {c: relative_error(predicted[m][c], measured[m][c]) for c in COLUMNS if c != "step_s"} for m in measured
    }
    step_error = {m: relative_error(predicted[m]["step_s"], measured[m]["step_s"]) for m in measured}
    within = {
        m: {c: e is not None and abs(e) <= TARGET for c, e in [("step_s", step_error[m]), *error[m].items()]}
        for m in measured
    }
    rank_m = sorted(measured, key=lambda m: measured[m]["step_s"])
    rank_p = sorted(predicted, key=lambda m: predicted[m]["step_s"])
    return {
        "error": error,
        "step_error": step_error,
        "within_target": within,
        "rank": {"measured": rank_m, "predicted": rank_p},
        "ranked_same": rank_m == rank_p,
    }


def _fmt_err(e: float | None) -> str:
    return "   -" if e is None else f"{e:+.0%}"


def print_table(measured: dict[str, Any], predicted: dict[str, Any], cmp: dict[str, Any]) -> None:
    print(f"\n{'mode':>8} {'column':>13} {'measured':>9} {'predicted':>9} {'error':>7}")
    for m in measured:
        for c in COLUMNS:
            e = cmp["step_error"][m] if c == "step_s" else cmp["error"][m][c]
            flag = "" if cmp["within_target"][m][c] else "  <- off target"
            print(f"{m:>8} {c:>13} {measured[m][c]:>9.4f} {predicted[m][c]:>9.4f} {_fmt_err(e):>7}{flag}")
    print(f"\nrank (fastest first): measured {cmp['rank']['measured']}, predicted {cmp['rank']['predicted']}")
    print(f"ranked the same: {cmp['ranked_same']}")
    off = sorted({c for m in measured for c, ok in cmp["within_target"][m].items() if not ok})
    if off:
        print(f"\noff the {TARGET:.0%} target, and what the sim leaves out:")
        for c in off:
            print(f"  {c}: {WHY[c]}")


def _rounded(d: dict[str, Any], digits: int = 4) -> Any:
    if isinstance(d, dict):
        return {k: _rounded(v, digits) for k, v in d.items()}
    return round(d, digits) if isinstance(d, float) else d


def _calibrate(model: Any, envs: dict[str, Any], a: argparse.Namespace, algo: Any, episodes: int) -> Calibration:
    cal = calibrate(
        model,
        copy.deepcopy(envs),
        algo=algo,
        seconds=a.calib_seconds,
        episodes=episodes,
        max_new_tokens=4,
        max_turns=RolloutConfig().max_turns,
        seed=a.seed,
    )
    hw = cal.profile
    print(
        f"  {hw.name}: {hw.bf16_tflops * 1e3:.1f} GFLOP/s float32 matmul, {hw.mem_bw_gbps:.1f} GB/s copy, "
        f"{hw.pass_overhead_s * 1e3:.2f} ms fixed per forward pass; mfu {cal.mfu:.2f} at the model's shapes, "
        f"trainer mfu {cal.train_mfu:.2f}, {cal.train_overhead_s * 1e3:.1f} ms fixed per step; hf engine "
        f"{cal.row_overhead_s * 1e3:.2f} ms per request beyond its passes ({cal.threads} thread, {cal.seconds:.1f} s)"
    )
    return cal


def _print_host(host: dict[str, Any]) -> None:
    print(
        f"  Ray actor call {host['call_latency_s'] * 1e3:.2f} ms (every worker call), hf batch wait "
        f"{BATCH_WAIT_S * 1e3:.1f} ms (every turn); weights: export {host['export_overhead_s'] * 1e3:.1f} ms, "
        f"load {host['load_overhead_s'] * 1e3:.1f} ms; control plane {host['turn_cpu_s'] * 1e3:.2f} ms of CPU "
        f"per turn ({host['control_turns']:.0f} turns); {host['host_cores']} cores shared"
    )


def _harmonic(x: float, y: float) -> float:
    return 2.0 / (1.0 / x + 1.0 / y)


def bracket(
    before: tuple[Calibration, dict[str, Any]], after: tuple[Calibration, dict[str, Any]]
) -> tuple[Calibration, dict[str, Any]]:
    """One calibration from two taken before and after the real run, so that a drift of the
    machine's speed that is steady over the run cancels (a VM's host lends its cores to others:
    the same step measured 0.71 and 0.90 s a few minutes apart).

    Each measured time is the mean of its two measurements; each rate (FLOP/s, bytes/s, and the
    effective rates ``mfu * FLOP/s``) the harmonic mean, which is the mean of the times it
    implies. The token statistics (which do not drift) are ``before``'s."""
    (c1, h1), (c2, h2) = before, after
    p1, p2 = c1.profile, c2.profile
    peak = _harmonic(p1.bf16_tflops, p2.bf16_tflops)
    profile = register_profile(
        dataclasses.replace(
            p1,
            bf16_tflops=peak,
            mem_bw_gbps=_harmonic(p1.mem_bw_gbps, p2.mem_bw_gbps),
            pass_overhead_s=(p1.pass_overhead_s + p2.pass_overhead_s) / 2,
        )
    )
    cal = dataclasses.replace(
        c1,
        profile=profile,
        mfu=min(1.0, _harmonic(c1.mfu * p1.bf16_tflops, c2.mfu * p2.bf16_tflops) / peak),
        train_mfu=min(1.0, _harmonic(c1.train_mfu * p1.bf16_tflops, c2.train_mfu * p2.bf16_tflops) / peak),
        train_overhead_s=(c1.train_overhead_s + c2.train_overhead_s) / 2,
        row_overhead_s=(c1.row_overhead_s + c2.row_overhead_s) / 2,
        seconds=c1.seconds + c2.seconds,
    )
    host = {k: (v + h2[k]) / 2 if k not in ("host_cores", "control_turns") else v for k, v in h1.items()}
    host["control_turns"] = h1["control_turns"] + h2["control_turns"]
    return cal, host


def main() -> None:
    a = _parse()
    t0 = time.monotonic()
    cfg = load(TrainConfig, FORMAT_YAML)
    algo = dataclasses.replace(cfg.algo, group_size=a.group, lr=a.lr)  # format.yaml's GRPO settings
    envs = _envs()
    print(f"building tiny-qwen-s (+{a.warm_steps} warm-start steps; cached after the first run) ...", flush=True)
    model = _model(envs, a.warm_steps, a.seed)
    print("calibrating before the run: microbenchmarks, real episodes for the token statistics ...", flush=True)
    cal = _calibrate(model, envs, a, algo, a.episodes)
    for t, st in cal.episodes.items():
        print(f"  {t}: {st}")
    print("measuring the control plane alone (Ray calls, weight handoff, CPU per turn) ...", flush=True)
    host = measure_host(model, cal, a, algo)
    _print_host(host)
    print(f"real run on Session.local() ({a.warmup} warm-up + {a.steps} steps per mode, batch {a.batch}) ...")
    measured = run_real(model, a, algo)
    print("calibrating after the run (the same measurements; the sim gets their mean) ...", flush=True)
    after = _calibrate(model, envs, a, algo, a.episodes)  # the same episodes: the same sizes timed
    after_host = measure_host(model, after, a, algo)
    _print_host(after_host)
    calibrations = {"before": (cal, host), "after": (after, after_host)}
    cal, host = bracket((cal, host), (after, after_host))
    print("simulated run on Session.sim() with the measured profile ...")
    predicted = run_sim(cal, a, algo, host)
    cmp = compare(measured, predicted)
    print_table(measured, predicted, cmp)
    print(f"\nwall {time.monotonic() - t0:.0f} s")
    result = {
        "measured": _rounded(measured, 6),
        "predicted": _rounded(predicted, 6),
        **_rounded(cmp),
        "target": TARGET,
        "profile": _rounded(cal.as_dict()["profile"], 6),
        "calibration": _rounded({**{k: v for k, v in cal.as_dict().items() if k != "profile"}, **host}, 6),
        "calibrations": {
            when: _rounded({**{k: v for k, v in c.as_dict().items() if k != "episodes"}, **h}, 6)
            for when, (c, h) in calibrations.items()
        },
        "settings": {
            k: getattr(a, k) for k in ("modes", "steps", "warmup", "batch", "group", "envs_per_task", "alpha", "lr")
        },
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
