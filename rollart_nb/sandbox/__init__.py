"""The hostile-code boundary: model-written code runs here under OS isolation.

:mod:`~rollart_nb.sandbox.run` runs a program or a solution with its tests
(:func:`run_sandboxed`) with the programs of :mod:`~rollart_nb.sandbox.child` inside the
sandboxes, :mod:`~rollart_nb.sandbox.isolation` builds the bubblewrap command line,
:mod:`~rollart_nb.sandbox.seccomp` the syscall filter. This package imports nothing of the RL
stack; the code env, the code reward and the local env launcher import it.
"""

from rollart_nb.sandbox.run import ISOLATION_MODES, SandboxResult, arun_sandboxed, run_sandboxed

__all__ = ["ISOLATION_MODES", "SandboxResult", "arun_sandboxed", "run_sandboxed"]
