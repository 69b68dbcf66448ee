"""The TRL side-by-side benchmark's own side, run for a few seconds as a user would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "math_vs_trl.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--sides", "ours", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_ours_side_reports_its_settings_and_trained_rows():
    p = _run("--seconds", "4", "--eval-every", "2", "--group", "4", "--prompts", "4", "--kl", "0.05",
             "--skip-flat", "--reward", "close")
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert (res["group"], res["prompts"], res["kl"], res["skip_flat"]) == (4, 4, 0.05, True)
    ours = res["ours"]
    assert ours["steps"] > 0
    # 16 completions per step; with --skip-flat a step trains only the rows of groups with a spread
    assert 0 <= ours["trained_rows_per_step"] <= 16
    assert 0.0 <= ours["best"] <= 1.0
    assert "greedy acc" in p.stderr  # evaluations are printed as they happen


def test_bad_settings_are_refused():
    p = _run("--group", "1")
    assert p.returncode == 2
    assert "--group >= 2" in p.stderr
