"""Models: tiny real LMs built locally, user HF directories, and specs for the simulator."""

from rollart_nb.models.spec import SPECS, ModelSpec, spec
from rollart_nb.models.tiny import ModelRef, format_history, from_pretrained, tiny_qwen

__all__ = ["SPECS", "ModelRef", "ModelSpec", "format_history", "from_pretrained", "spec", "tiny_qwen"]
