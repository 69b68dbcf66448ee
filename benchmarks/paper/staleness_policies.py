"""What-if experiment `staleness_policies` on a simulated cluster: see :func:`rollart_nb.bench.staleness_policies`.

Usage: ``python benchmarks/paper/staleness_policies.py [--out DIR] [--quick]`` (same as ``rollart-nb bench staleness_policies``).
Prints each policy's throughput over alpha=1 drop and ends with ``RESULT {json}``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollart_nb.bench import script_main  # noqa: E402

if __name__ == "__main__":
    script_main("staleness_policies", __doc__)
