"""Trajectory debugger benchmark: a short real run, then what the debugger shows of it.

A tiny Qwen-style model (built locally), the HF generator and the torch trainer run the rollart
mode at α=1 on FrozenLake and Arithmetic: turns in flight at a weight update are stopped and
continued under the new weights, so some trajectories are written by two versions. Then:

* ``token_columns_missing``: the debugger's columns absent from ``token_frame()`` (must be empty);
* ``replay_same_version_max_abs_logprob_diff``: with the pipeline paused, up to 16 trajectories
  with tokens written by the version the generators serve are replayed under it; the largest
  |replayed - sampler| logprob over those tokens;
* ``provenance_matches_events``: every version segment agrees with what the run recorded: its
  versions are ones the run served, rise within a turn and along the trajectory, start no earlier
  than the trajectory, and a turn has at most one more segment than the weight updates that
  stopped it (its ``preempted`` count), which sum to no more than the proxies' preemptions;
* ``mismatch_kl_reported_steps``: steps whose report carries a finite ``mismatch_kl`` (of the
  ``trained_steps`` that trained);
* ``render_s_32k_tokens``: seconds to build the viewer's HTML of a 32k-token trajectory (median of
  3); ``render_s_32k_tokens_chromium``, where Playwright's Chromium is installed: seconds until
  the page has drawn it.

Run: ``python benchmarks/trajectory_debug.py --steps 6`` (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import Any

import rollart_nb as rn
from rollart_nb.config import RolloutConfig
from rollart_nb.trajectory import Trajectory, Turn

REQUIRED = (
    "trajectory_id", "turn", "position", "token_id", "text", "side", "loss_mask", "sampler_logprob",
    "trainer_logprob", "advantage", "loss_weight", "entropy", "version", "importance_ratio",
)  # fmt: skip


def run(steps: int, seed: int) -> tuple[Any, Any, list[Any]]:
    """The short real run: returns the session, the pipeline (paused) and its reports."""
    sess = rn.Session.local({"H800": 1, "H20": 2, "cpu": 4})
    model = rn.models.tiny_qwen(seed=seed)
    gen = sess.cluster("actor_gen", rn.workers.HFGenerator, pool="H20", replicas=2, model=model)
    train = sess.cluster("actor_train", rn.workers.TorchTrainer, pool="H800", model=model)
    tasks = sess.tasks({"frozenlake": rn.envs.FrozenLake(), "math": rn.envs.Arithmetic()}, envs_per_task=8)
    algo = rn.GRPO(group_size=4, skip_zero_advantage=False, entropy_coef=0.01)  # the weights move every step
    rollout = RolloutConfig(max_turns=4, max_new_tokens=24)
    pipe = sess.pipeline(
        train, gen, tasks, algo=algo, batch_size=16, alpha=1, mode="rollart", rollout=rollout, seed=seed
    )
    reports = pipe.run(steps, progress=False)
    return sess, pipe, reports


def provenance_matches(trajs: list[Trajectory], final_version: int, preemptions: int) -> tuple[bool, list[str]]:
    """Whether every version segment agrees with the run's updates and preemptions (see above)."""
    problems = []
    stopped = 0
    for t in trajs:
        last = t.start_version if t.turns else 0
        for k, u in enumerate(t.turns):
            versions = [s.version for s in t.versions if s.turn == k]
            cuts = int(u.timings.get("preempted", 0))
            stopped += cuts
            if any(not 0 <= v <= final_version for v in versions):
                problems.append(f"{t.id} turn {k}: version outside 0..{final_version}: {versions}")
            if versions != sorted(set(versions)) or (versions and versions[0] < last):
                problems.append(f"{t.id} turn {k}: versions {versions} do not rise (previous {last})")
            if len(versions) > cuts + 1:
                problems.append(f"{t.id} turn {k}: {len(versions)} segments but {cuts} preemption(s)")
            last = versions[-1] if versions else last
    if stopped > preemptions:
        problems.append(f"turns record {stopped} preemptions, the proxies {preemptions}")
    return not problems, problems


def long_trajectory(tokens: int, vocab: int = 1000) -> Trajectory:
    """A trajectory of ``tokens`` tokens over 32 turns with every per-token figure set."""
    t = Trajectory("math", id="long", start_version=0)
    per_turn = tokens // 32
    ids: list[int] = []
    for k in range(32):
        prompt = ids + [(k * 7 + i) % vocab for i in range(per_turn // 2)]
        resp = [(k * 13 + i) % vocab for i in range(per_turn - per_turn // 2)]
        lp = [-((i % 17) / 4) for i in range(len(resp))]
        u = Turn(f"obs {k}", "act", prompt, resp, logprobs=lp, loss_mask=[1] * len(resp), version=k // 8)
        u.entropy = [(i % 11) / 5 for i in range(len(resp))]
        if k % 8 == 7:
            u.spans = [(0, k // 8), (len(resp) // 2, k // 8 + 1)]
        t.turns.append(u)
        ids = prompt + resp
    t.train = {
        "step": 0,
        "version": 0,
        "advantage": 0.5,
        "rows": [{"logprob": [x - 0.01 for x in _full(t, "lp")], "entropy": _full(t, "ent"), "loss_weight": []}],
    }
    return t


def _full(t: Trajectory, what: str) -> list[float]:
    out = [math.nan] * (len(t.turns[-1].prompt_ids) + len(t.turns[-1].response_ids))
    for u in t.turns:
        vals = u.logprobs if what == "lp" else u.entropy
        out[len(u.prompt_ids) : len(u.prompt_ids) + len(vals)] = vals
    return out


def render_s(traj: Trajectory) -> float:
    from rollart_nb.nb.overlay import token_html

    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        html = token_html(traj, colour_by="trainer_logprob")
        times.append(time.perf_counter() - t0)
    assert len(html) > 0
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    sess, pipe, reports = run(args.steps, args.seed)
    try:
        pipe.pause()
        trajs = list(pipe.trajectories(last=None))
        trained = [t for t in trajs if t.train is not None]
        frame = pipe.trajectories(last=None).token_frame()
        missing = [c for c in REQUIRED if c not in frame.columns]
        cross = sum(1 for t in trajs if len({s.version for s in t.versions}) > 1)
        print(f"{len(trajs)} trajectories, {len(trained)} trained, {cross} written by two or more versions")

        current: list[Trajectory] = []
        deadline = time.monotonic() + 120  # the rollout goes on after the last step: its first tokens
        while len(current) < 4 and time.monotonic() < deadline:
            time.sleep(0.5)
            live = pipe.trajectories(last=None, include_running=True)
            current = [t for t in live if any(s.version == pipe.version for s in t.versions)]
        diffs, replayed_tokens = [], 0
        for t in current[-16:]:
            df = pipe.replay(t).token_frame()
            same = df[(df.side == "response") & (df.version == df.replay_version)]
            replayed_tokens += len(same)
            if len(same):
                diffs.append(float((same.replay_logprob - same.sampler_logprob).abs().max()))
        print(f"replayed {len(diffs)} trajectories, {replayed_tokens} tokens written by version {pipe.version}")

        proxy = pipe.stats().get("proxy", {})
        proxies = proxy if isinstance(proxy, list) else [proxy]
        preemptions = sum(int(p.get("preemptions", 0)) for p in proxies)
        ok, problems = provenance_matches(trajs, pipe.version, preemptions)
        for p in problems[:10]:
            print("provenance:", p)
        with_train = [r for r in reports if "loss" in r.train]
        kl_steps = [r for r in with_train if math.isfinite(r.train.get("mismatch_kl", math.nan))]
        for r in reports:
            t = r.train
            print(
                f"step {r.step}: v{r.version} mismatch_kl={t.get('mismatch_kl', math.nan):.2e} "
                f"ratio_out={t.get('mismatch_ratio_out', math.nan):.3f} "
                f"cross_version={t.get('cross_version_frac', math.nan):.3f}"
            )
    finally:
        pipe.close()
        sess.close()

    long = long_trajectory(32768)
    render = render_s(long)
    result: dict[str, Any] = {
        "token_columns_missing": missing,
        "replay_same_version_max_abs_logprob_diff": max(diffs) if diffs else None,
        "replayed_trajectories": len(diffs),
        "replayed_tokens": replayed_tokens,
        "provenance_matches_events": ok,
        "cross_version_trajectories": cross,
        "mismatch_kl_reported_steps": len(kl_steps),
        "trained_steps": len(with_train),
        "render_s_32k_tokens": round(render, 4),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
