"""Paper experiment `scaling` on a simulated cluster: see :func:`rollart_nb.bench.scaling`.

Usage: ``python benchmarks/paper/scaling.py [--out DIR] [--quick]`` (same as ``rollart-nb bench scaling``).
Prints our ratios next to the paper's and ends with ``RESULT {json}``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rollart_nb.bench import script_main  # noqa: E402

if __name__ == "__main__":
    script_main("scaling", __doc__)
