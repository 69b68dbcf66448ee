"""benchmarks/sim_speed.py: one small size end to end, RESULT with the keys the docs quote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "sim_speed.py"


def test_sim_speed_reports_wall_time_and_memory_growth_per_size():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes", "8,16", "--steps", "2", "--warmup", "1"],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
        timeout=600,
    ).stdout
    last = out.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    res = json.loads(last[len("RESULT ") :])
    assert set(res) == {"8", "16"}
    for r in res.values():
        assert r["steps"] == 2 and r["wall_s_per_step"] > 0 and r["sim_s_per_step"] > 0
        assert isinstance(r["rss_growth_mib"], float) and r["rss_mib"] > 50
        assert isinstance(r["rss_growth_second_half_mib"], float)
