"""rollart_nb: a Jupyter-first API for disaggregated, multi-task, agentic RL training of LLMs.

Importing this package starts nothing (no Ray, no logging setup). Start with
``rn.Session.local()`` or ``rn.Session.attach(address)``.
"""

import importlib as _importlib
from typing import Any as _Any

from rollart_nb import errors
from rollart_nb.algo.grpo import GRPO
from rollart_nb.config import PipelineConfig, RolloutConfig
from rollart_nb.errors import RollartError
from rollart_nb.resources.manager import Binding
from rollart_nb.resources.pools import Pool
from rollart_nb.resources.profiles import PROFILES, HardwareProfile
from rollart_nb.runtime.ray import Cluster
from rollart_nb.session import Session
from rollart_nb.session_base import SessionState
from rollart_nb.trajectory import Status, Trajectory, TrajectoryList, Turn
from rollart_nb.trajectory_groups import TrajectoryGroup
from rollart_nb.workers.decorators import hw_mapping, register, register_serverless
from rollart_nb.workers.worker import Worker

__version__ = "0.1.0"

# Subpackages load on first use (``rn.models.tiny_qwen``, ``rn.envs.FrozenLake``, ...), so
# ``import rollart_nb`` stays cheap and starts nothing.
_LAZY = (
    "algo",
    "backends",
    "control",
    "envs",
    "models",
    "nb",
    "rewards",
    "serverless",
    "sim",
    "trackers",
    "weights",
    "workers",
)
_LAZY_NAMES = {
    "plan": "rollart_nb.planner",  # rn.plan(workload, budget): the what-if advisor
    "PromptCurriculum": "rollart_nb.control.curriculum",
    "Pipeline": "rollart_nb.control.pipeline",
    "PipelineState": "rollart_nb.control.pipeline",
    "StepReport": "rollart_nb.control.report",
    "TaskSet": "rollart_nb.control.tasks",
    "SimSession": "rollart_nb.sim_session",
}


def __getattr__(name: str) -> _Any:
    if name in _LAZY:
        return _importlib.import_module(f"rollart_nb.{name}")
    if name in _LAZY_NAMES:
        return getattr(_importlib.import_module(_LAZY_NAMES[name]), name)
    raise AttributeError(f"module 'rollart_nb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({n for n in globals() if not n.startswith("_")} | set(_LAZY) | set(_LAZY_NAMES))


__all__ = [
    "Binding",
    "Cluster",
    "GRPO",
    "HardwareProfile",
    "PROFILES",
    "Pipeline",
    "PipelineConfig",
    "PipelineState",
    "Pool",
    "PromptCurriculum",
    "RollartError",
    "RolloutConfig",
    "Session",
    "SessionState",
    "SimSession",
    "Status",
    "StepReport",
    "TaskSet",
    "Trajectory",
    "TrajectoryGroup",
    "TrajectoryList",
    "Turn",
    "Worker",
    "errors",
    "hw_mapping",
    "plan",
    "register",
    "register_serverless",
]
