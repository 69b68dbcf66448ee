"""Models: tiny real LMs built locally, their base-model stage (:func:`pretrain`), user HF directories,
and specs for the simulator."""

from rollart_nb.models.pretraining import Example, corpus, pretrain
from rollart_nb.models.spec import SPECS, ModelSpec, spec
from rollart_nb.models.tiny import ModelRef, format_history, from_pretrained, tiny_qwen

__all__ = [
    "SPECS",
    "Example",
    "ModelRef",
    "ModelSpec",
    "corpus",
    "format_history",
    "from_pretrained",
    "pretrain",
    "spec",
    "tiny_qwen",
]
