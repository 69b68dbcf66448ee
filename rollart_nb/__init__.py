"""rollart_nb: a Jupyter-first API for disaggregated, multi-task, agentic RL training of LLMs.

Importing this package starts nothing (no Ray, no logging setup). Start with
``rn.Session.local()`` or ``rn.Session.attach(address)``.
"""

from rollart_nb import errors
from rollart_nb.errors import RollartError
from rollart_nb.resources.manager import Binding
from rollart_nb.resources.pools import Pool
from rollart_nb.resources.profiles import PROFILES, HardwareProfile
from rollart_nb.session import Session
from rollart_nb.trajectory import Status, Trajectory, Turn
from rollart_nb.workers.cluster import Cluster
from rollart_nb.workers.decorators import hw_mapping, register, register_serverless
from rollart_nb.workers.worker import Worker

__version__ = "0.1.0"

__all__ = [
    "Binding",
    "Cluster",
    "HardwareProfile",
    "PROFILES",
    "Pool",
    "RollartError",
    "Session",
    "Status",
    "Trajectory",
    "Turn",
    "Worker",
    "errors",
    "hw_mapping",
    "register",
    "register_serverless",
]
