"""The ``sim`` backends: generation, training, tokenizer and workloads timed by roofline models.

The same control-plane code runs against these as against real backends; time comes from
:mod:`rollart_nb.sim.roofline` applied to a worker's hardware profile. In a
:class:`SimSession` (also ``rn.Session.sim(...)``) that time is simulated on a virtual clock
(:mod:`rollart_nb.clock`); on a real session it is slept, scaled by ``time_scale``
(1e-3 runs a 10 s turn in 10 ms). Tokens and rewards are content-free: the sim answers
"how long, and where is the bottleneck", never "does the policy learn".
"""

from rollart_nb.clock import SimClock
from rollart_nb.clock.cores import Host, SharedCores
from rollart_nb.sim.backend import SimBackend
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
    "PRESETS", "Host", "SimBackend", "SimClock", "SimEnv", "SimTokenizer", "SharedCores", "SimTrainBackend", "Workload",
    "decode_step_time", "decode_time", "prefill_time", "response_tokens_fn", "train_time", "weight_sync_time",
    "workload",
]  # fmt: skip
