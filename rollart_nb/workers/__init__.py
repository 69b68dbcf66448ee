"""Data plane: the Worker base class, its decorators, and Clusters of workers."""

from rollart_nb.workers.decorators import hw_mapping, register, register_serverless
from rollart_nb.workers.roles import (
    GeneratorWorker,
    HFGenerator,
    MegatronTrainer,
    SimGenerator,
    SimTrainer,
    TorchTrainer,
    TrainerWorker,
    VLLMGenerator,
)
from rollart_nb.workers.worker import Worker

__all__ = [
    "GeneratorWorker",
    "HFGenerator",
    "MegatronTrainer",
    "SimGenerator",
    "SimTrainer",
    "TorchTrainer",
    "TrainerWorker",
    "VLLMGenerator",
    "Worker",
    "hw_mapping",
    "register",
    "register_serverless",
]
