"""Paper experiment `pd_disaggregation` on a simulated cluster: see :func:`rollart_nb.bench.pd_disaggregation`.

Usage: ``python benchmarks/paper/pd_disaggregation.py [--out DIR] [--quick]`` (same as ``rollart-nb bench pd_disaggregation``).
Prints our ratios next to the paper's and ends with ``RESULT {json}``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollart_nb.bench import script_main  # noqa: E402

if __name__ == "__main__":
    script_main("pd_disaggregation", __doc__)
