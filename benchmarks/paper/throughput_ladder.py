"""Paper experiment `throughput_ladder` on a simulated cluster: see :func:`rollart_nb.bench.throughput_ladder`.

Usage: ``python benchmarks/paper/throughput_ladder.py [--out DIR] [--quick]`` (same as ``rollart-nb bench throughput_ladder``).
Prints our ratios next to the paper's and ends with ``RESULT {json}``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollart_nb.bench import script_main  # noqa: E402

if __name__ == "__main__":
    script_main("throughput_ladder", __doc__)
