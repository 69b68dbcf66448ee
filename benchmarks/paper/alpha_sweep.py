"""Paper experiment `alpha_sweep` on a simulated cluster: see :func:`rollart_nb.bench.alpha_sweep`.

Usage: ``python benchmarks/paper/alpha_sweep.py [--out DIR] [--quick]`` (same as ``rollart-nb bench alpha_sweep``).
Prints our ratios next to the paper's and ends with ``RESULT {json}``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollart_nb.bench import script_main  # noqa: E402

if __name__ == "__main__":
    script_main("alpha_sweep", __doc__)
