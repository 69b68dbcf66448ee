"""Paper experiment `pd_disaggregation` on a simulated cluster: see :func:`rollart_nb.bench.pd_disaggregation`.

Usage: ``python benchmarks/paper/pd_disaggregation.py [--out DIR] [--quick]`` (same as ``rollart-nb bench pd_disaggregation``).
Prints our ratios next to the paper's and ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollart_nb.bench import run_experiments  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="rollart_bench")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    print("RESULT " + json.dumps(run_experiments("pd_disaggregation", out=a.out, quick=a.quick)), flush=True)
