"""Sensitivity of the headline ratios to one workload parameter at a time: see :mod:`rollart_nb.bench.sensitivity`.

Usage: ``python benchmarks/paper/sensitivity.py [--out DIR] [--quick]`` (same as ``rollart-nb bench sensitivity``).
Prints each point, writes one figure per ratio and ends with ``RESULT {json}``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollart_nb.bench import script_main  # noqa: E402

if __name__ == "__main__":
    script_main("sensitivity", __doc__)
