"""Paper experiment `r1_affinity` on a simulated cluster: see :func:`rollart_nb.bench.r1_affinity`.

Usage: ``python benchmarks/paper/r1_affinity.py [--out DIR] [--quick]`` (same as ``rollart-nb bench r1_affinity``).
Prints our ratios next to the paper's and ends with ``RESULT {json}``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollart_nb.bench import script_main  # noqa: E402

if __name__ == "__main__":
    script_main("r1_affinity", __doc__)
