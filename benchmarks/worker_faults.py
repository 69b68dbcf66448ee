"""Worker fault soak: training goes on while generation workers and the trainer are killed.

On ``rn.Session.local()`` with sim generation and training (real Ray actors, tiny time scale),
a pipeline in ``rollart`` mode runs ``--steps`` steps in the background with an autosave every
``--autosave-every`` steps. Every ``--kill-every`` steps one generation worker (in turn) is
killed with ``ray.kill`` while a step is in progress, and at step ``--trainer-kill-at`` the
trainer is killed too. The pipeline replaces each dead generator on a compatible slot (it
loads the served weights first) and restores the trainer from its newest autosave.

Checked at the end: the run reached its last step; every trajectory the scheduler started
ended in exactly one recorded status or is still in flight (``unaccounted`` must be 0); each
kill was answered by a replacement or a restore.

Last line: ``RESULT {json}`` with ``steps``, ``generator_kills``, ``generator_replacements``,
``trainer_restores``, ``failed``, ``unaccounted``, ``wall_s`` (and ``started``, ``completed``,
``aborted``, ``cancelled``, ``in_flight``, ``versions_lost``, ``replacement_s``: the slowest
replacement).
Usage: ``python benchmarks/worker_faults.py [--steps 100]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import rollart_nb as rn  # noqa: E402
from rollart_nb import _ray  # noqa: E402
from rollart_nb.envs import Arithmetic  # noqa: E402
from rollart_nb.workers.roles import SimGenerator, SimTrainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100, help="pipeline steps (default: %(default)s)")
    ap.add_argument("--generators", type=int, default=2, help="generation workers (default: %(default)s)")
    ap.add_argument("--kill-every", type=int, default=10, help="kill a generator every N steps (default: %(default)s)")
    ap.add_argument(
        "--trainer-kill-at",
        type=int,
        default=55,
        help="kill the trainer at this step; -1: never (default: %(default)s)",
    )
    ap.add_argument("--autosave-every", type=int, default=5, help="autosave every N steps (default: %(default)s)")
    ap.add_argument("--envs", type=int, default=16, help="env instances (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=16, help="trajectories per step (default: %(default)s)")
    ap.add_argument("--group", type=int, default=4, help="GRPO group size (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill timing (default: %(default)s)")
    a = ap.parse_args()

    rng = random.Random(a.seed)
    t0 = time.monotonic()
    spec = rn.models.spec("qwen3-0.6b")
    sess = rn.Session.local({"H800": 2, "H20": a.generators + 1, "cpu": 2}, serverless=False)
    run_dir = tempfile.mkdtemp(prefix="rollart_worker_faults_")
    gen_kills = trainer_kills = 0
    try:
        gen = sess.cluster(
            "actor_gen",
            SimGenerator,
            pool="H20",
            replicas=a.generators,
            model=spec,
            time_scale=2e-3,
            mean_response_tokens=16,
        )
        train = sess.cluster("actor_train", SimTrainer, pool="H800", model=spec, time_scale=1e-4)
        tasks = sess.tasks({"math": Arithmetic()}, envs_per_task=a.envs)
        pipe = sess.pipeline(
            train,
            gen,
            tasks,
            algo=rn.GRPO(group_size=a.group),
            batch_size=a.batch,
            mode="rollart",
            name="worker_faults",
            run_dir=run_dir,
            autosave_every=a.autosave_every,
            max_worker_restarts=a.steps,
        )
        print(
            f"worker fault soak: {a.steps} steps, {a.generators} generators (one killed every {a.kill_every} steps), "
            f"trainer killed at step {a.trainer_kill_at}, autosave every {a.autosave_every}",
            flush=True,
        )
        pipe.run(a.steps, background=True, progress=False)
        done_kills: set[int] = set()
        printed: set[int] = set()
        while pipe._thread is not None and pipe._thread.is_alive():
            step = len(pipe.reports)
            due = step % a.kill_every == 0 or step == a.trainer_kill_at
            if 0 < step < a.steps and step not in done_kills and due:
                done_kills.add(step)
                time.sleep(rng.uniform(0.0, 0.05))  # land inside the step that just began
                if step % a.kill_every == 0:
                    _ray.kill(gen.workers[gen_kills % a.generators].actor)
                    gen_kills += 1
                if step == a.trainer_kill_at:
                    _ray.kill(train.workers[0].actor)
                    trainer_kills += 1
            if step % 10 == 0 and step and step not in printed:
                printed.add(step)
                acc = pipe.stats()["accounting"]
                print(
                    f"step {step:>4}  version {pipe.version:>4}  failed so far {acc['failed']}  "
                    f"replacements {sum(e['kind'] == 'generator_replaced' for e in pipe.events)}  "
                    f"restores {sum(e['kind'] == 'trainer_restored' for e in pipe.events)}",
                    flush=True,
                )
            time.sleep(0.005)
        pipe.wait()
        stats = pipe.stats()
        acc = stats["accounting"]
        events = list(pipe.events)
        steps = len(pipe.reports)
        pipe.close()
    finally:
        sess.close()
    replaced = [e for e in events if e["kind"] == "generator_replaced"]
    restored = [e for e in events if e["kind"] == "trainer_restored"]
    result = {
        "steps": steps,
        "generator_kills": gen_kills,
        "generator_replacements": len(replaced),
        "trainer_kills": trainer_kills,
        "trainer_restores": len(restored),
        "started": acc["started"],
        "completed": acc["completed"],
        "aborted": acc["aborted_stale"],
        "cancelled": acc["cancelled"],
        "failed": acc["failed"],
        "in_flight": acc["running"] + acc["scoring"] + acc["pending_reward"],
        "unaccounted": acc["unaccounted"],
        "versions_lost": sum(e["versions_lost"] for e in restored),
        "replacement_s": max((e["seconds"] for e in replaced), default=0.0),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
