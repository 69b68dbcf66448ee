"""Control plane: LLMProxy, EnvManager, RolloutScheduler, SampleBuffer and the Pipeline."""

from rollart_nb.control.buffer import SampleBuffer
from rollart_nb.control.checkpoint import PipelineCheckpoint, read_checkpoint
from rollart_nb.control.env_manager import EnvManager, RolloutConfig, TurnBarrier
from rollart_nb.control.modes import MODES, Mode
from rollart_nb.control.pipeline import Pipeline, PipelineState
from rollart_nb.control.proxy import GenTarget, LLMProxy
from rollart_nb.control.report import PHASES, StepReport
from rollart_nb.control.reward import RewardDispatcher, RewardSpec
from rollart_nb.control.scheduler import RolloutScheduler
from rollart_nb.control.shards import ShardPlan, plan_rollout
from rollart_nb.control.tasks import TaskSet

__all__ = [
    "MODES",
    "PHASES",
    "EnvManager",
    "GenTarget",
    "LLMProxy",
    "Mode",
    "Pipeline",
    "PipelineCheckpoint",
    "PipelineState",
    "RewardDispatcher",
    "RewardSpec",
    "RolloutConfig",
    "RolloutScheduler",
    "SampleBuffer",
    "ShardPlan",
    "StepReport",
    "TaskSet",
    "TurnBarrier",
    "plan_rollout",
    "read_checkpoint",
]
