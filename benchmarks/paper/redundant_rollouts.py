"""Paper experiment `redundant_rollouts` on a simulated cluster: see :func:`rollart_nb.bench.redundant_rollouts`.

Usage: ``python benchmarks/paper/redundant_rollouts.py [--out DIR] [--quick]`` (same as ``rollart-nb bench redundant_rollouts``).
Prints our ratios next to the paper's and ends with ``RESULT {json}``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollart_nb.bench import script_main  # noqa: E402

if __name__ == "__main__":
    script_main("redundant_rollouts", __doc__)
