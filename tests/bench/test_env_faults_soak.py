"""The env fault soak, short: envs that raise, hang and die, and a reward answering HTTP 500,
do not stop training, and every trajectory the scheduler started is accounted for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "env_faults.py"


def test_short_soak_loses_no_trajectory_and_leaves_no_process():
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "12", "--kill-every", "4"], capture_output=True, text=True, timeout=900
    )
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    res = json.loads(p.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert res["steps"] == 12  # training went on through every fault
    assert res["unaccounted"] == 0
    ended = res["completed"] + res["aborted"] + res["cancelled"] + res["failed"]
    assert res["started"] == ended + res["in_flight"] and res["completed"] >= 12 * 16
    assert res["replica_kills"] == 2 and res["env_restarts"] >= 2  # the launcher replaced killed replicas
    assert res["failed"] > 0 and res["env_timeouts"] > 0  # raising and hanging steps really happened
    assert res["leftover_processes"] == 0
