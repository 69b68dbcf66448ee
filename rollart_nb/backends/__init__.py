"""Backends behind the Workers: generation (``hf``) and training (``torch``).

Imported lazily so that ``import rollart_nb`` does not pay for torch and transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["HFBackend", "ReferencePolicy", "TorchTrainBackend"]

if TYPE_CHECKING:
    from rollart_nb.backends.hf import HFBackend
    from rollart_nb.backends.torch_train import ReferencePolicy, TorchTrainBackend


def __getattr__(name: str) -> Any:
    if name == "HFBackend":
        from rollart_nb.backends.hf import HFBackend

        return HFBackend
    if name in ("TorchTrainBackend", "ReferencePolicy"):
        from rollart_nb.backends import torch_train

        return getattr(torch_train, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
