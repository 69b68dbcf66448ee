"""Model specs: parameter counts and shapes, for the ``sim`` backend's roofline model.

A :class:`ModelSpec` is what the simulator needs to price prefill (compute-bound) and decode
(bandwidth-bound): total and active parameters, layers, hidden size, KV heads, head dim and
bytes per parameter. Real model directories are described by :func:`rollart_nb.models.tiny_qwen`
(or any HF path); specs stand in for models too big to run here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rollart_nb._checks import is_number, is_whole
from rollart_nb.errors import ConfigError

__all__ = ["SPECS", "ModelSpec", "hf_spec", "spec"]


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a (possibly MoE) decoder-only LM.

    Attributes:
        name: e.g. "qwen3-8b".
        params: total parameters.
        active_params: parameters used per token (== params for dense models).
        layers: transformer layers.
        hidden: hidden size.
        kv_heads: key/value heads (GQA).
        head_dim: per-head dimension.
        bytes_per_param: 2 for bf16, 1 for fp8.
    Every size must be positive and ``active_params <= params`` (else :class:`ConfigError`).

    Example:
        >>> ModelSpec("dense-1b", 1e9, 1e9, 16, 2048, 8, 64).kv_bytes_per_token
        32768
    """

    name: str
    params: float
    active_params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    bytes_per_param: int = 2

    def __post_init__(self) -> None:
        p = []
        if not isinstance(self.name, str) or not self.name:
            p.append(f"name={self.name!r} must be a non-empty string, e.g. 'qwen3-8b'")
        for f in fields(self)[1:]:  # every size field
            value = getattr(self, f.name)
            whole = f.name in _WHOLE_FIELDS
            if not _positive(value, whole=whole):
                kind = "a whole number >= 1" if whole else "a finite number > 0"
                p.append(f"{f.name}={value!r} must be {kind}; take it from the model card or config.json")
        if _positive(self.params) and _positive(self.active_params) and self.active_params > self.params:
            p.append(
                f"active_params={self.active_params!r} must be <= params={self.params!r} "
                "(equal for a dense model, the routed share for an MoE model)"
            )
        if p:
            raise ConfigError(p, where=f"ModelSpec {self.name!r}")

    @property
    def moe(self) -> bool:
        return self.active_params < self.params

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V cache one token adds (all layers)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    def load_tokenizer(self):  # noqa: ANN201 - a SimTokenizer
        """The sim backend's tokenizer (deterministic word hashing; specs carry no vocabulary)."""
        from rollart_nb.sim.tokenizer import SimTokenizer

        return SimTokenizer()


_WHOLE_FIELDS = frozenset({"layers", "hidden", "kv_heads", "head_dim", "bytes_per_param"})


def _positive(value: Any, *, whole: bool = False) -> bool:
    """``value`` is a number (not a bool) > 0 and finite; with ``whole``, also an integer."""
    return (is_whole(value) if whole else is_number(value)) and value > 0


# Public configs (Qwen3 technical report / HF config.json of each model).
SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec("qwen3-0.6b", 0.6e9, 0.6e9, 28, 1024, 8, 128),
        ModelSpec("qwen3-1.7b", 1.7e9, 1.7e9, 28, 2048, 8, 128),
        ModelSpec("qwen3-4b", 4.0e9, 4.0e9, 36, 2560, 8, 128),
        ModelSpec("qwen3-8b", 8.2e9, 8.2e9, 36, 4096, 8, 128),
        ModelSpec("qwen3-14b", 14.8e9, 14.8e9, 40, 5120, 8, 128),
        ModelSpec("qwen3-32b", 32.8e9, 32.8e9, 64, 5120, 8, 128),
        ModelSpec("qwen3-30b-a3b", 30.5e9, 3.3e9, 48, 2048, 4, 128),
        ModelSpec("qwen2.5-7b", 7.6e9, 7.6e9, 28, 3584, 4, 128),
    ]
}


def spec(name: str) -> ModelSpec:
    """Look up a model spec by name (case-insensitive).

    Example:
        >>> spec("qwen3-8b").layers
        36
    """
    key = name.lower()
    if key not in SPECS:
        raise ConfigError(f"unknown model spec {name!r}; known: {', '.join(sorted(SPECS))}")
    return SPECS[key]


def hf_spec(model: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a Hugging Face model directory (a ModelRef or a path).

    From its ``config.json``: ``layers = num_hidden_layers``, ``hidden = hidden_size``,
    ``kv_heads = num_key_value_heads``, ``head_dim = head_dim`` or ``hidden_size /
    num_attention_heads``; ``params`` is the ModelRef's count (or counted from the weights);
    ``bytes_per_param`` 4 (float32, as the ``hf`` generator and ``torch`` trainer load a model on
    CPU). Dense: ``active_params == params``. Tied embeddings count once, which matches the
    FLOPs: the input lookup is free and the output projection multiplies by the same matrix.
    """
    path = Path(getattr(model, "path", model))
    cfg = json.loads((path / "config.json").read_text())
    params = float(getattr(model, "params", 0) or 0)
    if not params:
        from transformers import AutoModelForCausalLM

        params = float(sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters()))
    heads = cfg["num_attention_heads"]
    return ModelSpec(
        name=getattr(model, "name", path.name),
        params=params,
        active_params=params,
        layers=cfg["num_hidden_layers"],
        hidden=cfg["hidden_size"],
        kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        bytes_per_param=4,
    )
