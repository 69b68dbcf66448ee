"""Backends behind the Workers: generation (``hf``) and training (``torch``).

Imported lazily so that ``import rollart_nb`` does not pay for torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["HFBackend", "TorchTrainBackend"]

if TYPE_CHECKING:
    from rollart_nb.backends.hf import HFBackend
    from rollart_nb.backends.torch_train import TorchTrainBackend


def __getattr__(name: str) -> Any:
    if name == "HFBackend":
        from rollart_nb.backends.hf import HFBackend

        return HFBackend
    if name == "TorchTrainBackend":
        from rollart_nb.backends.torch_train import TorchTrainBackend

        return TorchTrainBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
