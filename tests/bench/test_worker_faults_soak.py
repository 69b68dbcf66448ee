"""The worker fault soak, short: generators and the trainer killed mid-run do not stop training,
each kill is answered by a replacement or a restore, and every trajectory is accounted for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "worker_faults.py"


def test_short_worker_soak_finishes_and_loses_no_trajectory():
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "20", "--kill-every", "5", "--trainer-kill-at", "12"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    res = json.loads(p.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert res["steps"] == 20  # training went on through every kill
    assert res["generator_kills"] == 3 and res["generator_replacements"] == 3
    assert res["trainer_kills"] == 1 and res["trainer_restores"] == 1
    assert res["unaccounted"] == 0
    assert res["started"] == res["completed"] + res["aborted"] + res["cancelled"] + res["failed"] + res["in_flight"]
    assert res["failed"] == 0  # a dead generator's turns went to a live one instead of failing
