"""The ``sim`` backends: generation, training, tokenizer and workloads timed by roofline models.

The same control-plane code runs against these as against real backends; time comes from
:mod:`rollart_nb.sim.roofline` applied to a worker's hardware profile. In a
:class:`SimSession` (also ``rn.Session.sim(...)``) that time is simulated on a virtual clock
(:mod:`rollart_nb.sim.clock`); on a real session it is slept, scaled by ``time_scale``
(1e-3 runs a 10 s turn in 10 ms). Tokens and rewards are content-free: the sim answers
"how long, and where is the bottleneck", never "does the policy learn".
"""

from typing import Any

from rollart_nb.sim.backend import SimBackend
from rollart_nb.sim.clock import SimClock
from rollart_nb.sim.cores import Host, SharedCores
from rollart_nb.sim.roofline import (
    decode_step_time,
    decode_time,
    prefill_time,
    train_time,
    weight_sync_time,
)
from rollart_nb.sim.tokenizer import SimTokenizer
from rollart_nb.sim.trainer import SimTrainBackend
from rollart_nb.sim.workloads import PRESETS, SimEnv, Workload, response_tokens_fn, workload

__all__ = [
    "DEFAULT_SIM_POOLS",
    "PRESETS",
    "Host",
    "LocalCluster",
    "SimBackend",
    "SimClock",
    "SimSession",
    "SimEnv",
    "SimTokenizer",
    "SharedCores",
    "SimTrainBackend",
    "Workload",
    "decode_step_time",
    "decode_time",
    "prefill_time",
    "response_tokens_fn",
    "train_time",
    "weight_sync_time",
    "workload",
]

_LAZY = {
    "SimSession": "rollart_nb.sim.session",
    "DEFAULT_SIM_POOLS": "rollart_nb.sim.session",
    "LocalCluster": "rollart_nb.sim.cluster",
}


def __getattr__(name: str) -> Any:
    # The session and its clusters pull in the control plane: imported on first use, which also
    # keeps ``rollart_nb.sim.clock`` (used by env wrappers) free of import cycles.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rollart_nb.sim' has no attribute {name!r}")
