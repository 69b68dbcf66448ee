"""Env fault soak: training goes on while envs raise, hang and die, and rewards fail.

On ``rn.Session.local()`` with sim generation and training (Ray actors, tiny time scale), the
task's envs are served by ``rollart-nb env-server`` replicas on a :class:`LocalLauncher`
(Arithmetic inside :func:`~rollart_nb.envs.factories.with_failures`): each env step raises with
probability ``--p-raise`` and hangs (an hour) with probability ``--p-hang``; one replica is
SIGKILLed every ``--kill-every`` steps; the reward is a Ray Serve deployment that raises, and so
answers HTTP 500, on ``--p-500`` of its calls.

Checked at the end: every trajectory the scheduler started ended in exactly one recorded status
(completed, aborted stale, cancelled, failed with its reason) or is still in flight
(``unaccounted`` must be 0); the launcher restarted the killed replicas; after ``sess.close()``
no process of ours is left (no child of this process, no env server).

Last line: ``RESULT {json}`` with ``steps``, ``started``, ``completed``, ``aborted``,
``cancelled``, ``failed``, ``in_flight``, ``unaccounted``, ``env_restarts``, ``env_timeouts``,
``reward_failures``, ``leftover_processes``, ``wall_s``.
Usage: ``python benchmarks/env_faults.py [--steps 200]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import rollart_nb as rn  # noqa: E402
from rollart_nb.control.env_manager import RolloutConfig  # noqa: E402
from rollart_nb.envs import LocalLauncher  # noqa: E402
from rollart_nb.workers.roles import SimGenerator, SimTrainer  # noqa: E402


def flaky_reward(trajectory, p_fail: float = 0.2):  # noqa: ANN001, ANN201 (runs on Ray Serve)
    """Exact-answer reward that raises on ``p_fail`` of its calls (Serve answers HTTP 500)."""
    import random

    from rollart_nb.rewards import exact_answer

    if random.random() < p_fail:
        raise RuntimeError("injected reward failure")
    return exact_answer(trajectory)


def descendants(pid: int) -> list[tuple[int, str]]:
    """Live processes below ``pid`` (pid, command line), from /proc."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    cmd: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd[int(d)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if stat.rpartition(")")[2].split()[0] == "Z":
            continue
        children[int(stat.rpartition(")")[2].split()[1])].append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append((c, cmd.get(c, "")))
            todo.append(c)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="pipeline steps (default: %(default)s)")
    ap.add_argument("--replicas", type=int, default=3, help="env-server replicas (default: %(default)s)")
    ap.add_argument(
        "--kill-every", type=int, default=20, help="SIGKILL one replica every N steps (default: %(default)s)"
    )
    ap.add_argument("--p-raise", type=float, default=0.10, help="env steps that raise (default: %(default)s)")
    ap.add_argument("--p-hang", type=float, default=0.05, help="env steps that hang (default: %(default)s)")
    ap.add_argument("--p-500", type=float, default=0.20, help="reward calls answered HTTP 500 (default: %(default)s)")
    ap.add_argument("--env-timeout", type=float, default=5.0, help="env call timeout, s (default: %(default)s)")
    ap.add_argument("--envs", type=int, default=16, help="env instances (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=16, help="trajectories per step (default: %(default)s)")
    ap.add_argument("--group", type=int, default=4, help="GRPO group size (default: %(default)s)")
    ap.add_argument(
        "--sandbox", choices=["on", "off"], default="on", help="replicas under bubblewrap (default: %(default)s)"
    )
    ap.add_argument("--seed", type=int, default=0, help="failure streams' base seed (default: %(default)s)")
    a = ap.parse_args()

    t0 = time.monotonic()
    model = rn.models.spec("qwen3-0.6b")
    sess = rn.Session.local()
    try:
        gen = sess.cluster("actor_gen", SimGenerator, pool="H20", model=model, time_scale=1e-4, mean_response_tokens=8)
        train = sess.cluster("actor_train", SimTrainer, pool="H800", model=model, time_scale=1e-4)
        launcher = LocalLauncher(
            "rollart_nb.envs.factories:with_failures",
            {
                "env": "rollart_nb.envs:Arithmetic",
                "p_raise": a.p_raise,
                "p_hang": a.p_hang,
                "hang_s": 3600.0,
                "on": ["step"],
                "seed": a.seed,
            },
            replicas=a.replicas,
            task="math",
            sandbox=a.sandbox == "on",
        )
        tasks = sess.tasks({"math": launcher}, envs_per_task=a.envs)
        sess.reward("math", lambda t, p=a.p_500: flaky_reward(t, p), serverless=True, retries=1)
        pipe = sess.pipeline(
            train,
            gen,
            tasks,
            algo=rn.GRPO(group_size=a.group),
            batch_size=a.batch,
            name="soak",
            rollout=RolloutConfig(max_turns=2, env_timeout_s=a.env_timeout),
        )
        print(
            f"soak: {a.steps} steps, {a.replicas} replicas ({launcher.urls}), {a.envs} envs, env steps "
            f"raise {a.p_raise:.0%} / hang {a.p_hang:.0%}, a replica killed every {a.kill_every} steps, "
            f"reward HTTP 500 on {a.p_500:.0%}",
            flush=True,
        )
        counts: collections.Counter[str] = collections.Counter()
        kills = 0
        for step in range(a.steps):
            if step and step % a.kill_every == 0:
                launcher.kill(kills % a.replicas)
                kills += 1
            rep = pipe.step()
            counts.update(rep.counts)
            if step % 10 == 0 or step == a.steps - 1:
                acc = pipe.stats()["accounting"]
                print(
                    f"step {step:>4}  {rep.step_s:6.2f}s  reward {rep.mean_reward:.2f}  "
                    f"failed so far {acc.get('failed', 0)}  env restarts {launcher.restarts}",
                    flush=True,
                )
        pipe.pause()
        stats = pipe.stats()
        acc, env = stats["accounting"], stats.get("env", {})
        reasons = collections.Counter(
            r.split(":")[0] for reps in pipe.reports for rs in reps.failures.values() for r in rs
        )
        restarts = launcher.restarts
        pipe.close()
    finally:
        sess.close()
    time.sleep(1.0)
    leftover = [c for c in descendants(os.getpid())]
    result = {
        "steps": len(pipe.reports),
        "started": acc["started"],
        "completed": acc["completed"],
        "aborted": acc["aborted_stale"],
        "cancelled": acc["cancelled"],
        "failed": acc["failed"],
        "in_flight": acc["running"] + acc["scoring"] + acc["pending_reward"],  # rolling out or being scored
        "unaccounted": acc["unaccounted"],
        "env_restarts": restarts,
        "replica_kills": kills,
        "env_timeouts": env.get("timeouts", 0),
        "reward_failures": stats.get("rewards", {}).get("failures", 0),
        "failure_kinds": dict(reasons),
        "leftover_processes": len(leftover),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    for pid, cmd in leftover:
        print(f"left behind: {pid} {cmd[:120]}")
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
