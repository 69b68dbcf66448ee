"""The seams of rollart_nb, as :class:`typing.Protocol` s, plus the request/response types
that cross them.

Seams: :class:`Env`, :class:`RewardFn`, :class:`Tokenizer`, :class:`GenerationBackend`,
:class:`TrainBackend`, :class:`WeightTransport`, :class:`MetadataStore`. Each has a real
implementation and a cheap one (``sim``) that powers what-if studies and fast tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rollart_nb.trajectory import Trajectory

__all__ = [
    "Env",
    "GenerationBackend",
    "GenerationRequest",
    "GenerationResult",
    "MetadataStore",
    "RewardFn",
    "ScoreResult",
    "Tokenizer",
    "TrainBackend",
    "WeightTransport",
]


@runtime_checkable
class Env(Protocol):
    """Gymnasium-style text environment (GEM environments fit as they are).

    ``reset(seed)`` returns ``(observation, info)``; ``info`` may carry ground truth
    (e.g. ``{"answer": "7"}``) that rewards read from ``trajectory.info``.
    ``step(action)`` returns ``(observation, reward, terminated, truncated, info)``.
    """

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]: ...

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]: ...


class RewardFn(Protocol):
    """``fn(trajectory) -> float`` (or ``list[float]`` per turn); may be ``async``."""

    def __call__(self, trajectory: Trajectory) -> Any: ...


@runtime_checkable
class Tokenizer(Protocol):
    """The minimum the control plane needs from a tokenizer."""

    @property
    def eos_token_id(self) -> int | None: ...  # read-only here, so a tokenizer may declare it ``int``

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class GenerationRequest:
    """One turn's generation for one trajectory.

    Each request carries only the tokens after the ``prefix_len`` the generator already holds;
    one that lacks them raises :class:`~rollart_nb.errors.HistoryMiss` and the sender resends
    the whole history with ``prefix_len=0``.

    Attributes:
        traj_id: trajectory id (the LLMProxy keeps a trajectory sticky to one worker).
        task: task name (hardware affinity routing uses it as ``tag_name``).
        prompt_ids: the prompt's token ids after the first ``prefix_len``, shape
            [P - prefix_len]: a list or an ``array('i')`` (read as a sequence).
        max_new_tokens: response budget for this turn.
        temperature: sampling temperature; 0 means greedy.
        seed: per-request sampling seed (reproducible rollouts), or None.
        stop: stop strings (decoded) that end the response.
        last_turn: no request of this trajectory follows, so its KV need not be kept.
        prefix_len: tokens of this trajectory's history the generator already holds.

    Example:
        >>> first = GenerationRequest("t0", "math", [5, 6, 7])
        >>> later = GenerationRequest("t0", "math", [9, 9], prefix_len=5)  # 3 sent + 2 generated
        >>> first.full_len, later.full_len
        (3, 7)
    """

    traj_id: str
    task: str
    prompt_ids: Sequence[int]
    max_new_tokens: int = 32
    temperature: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    last_turn: bool = False
    prefix_len: int = 0

    @property
    def full_len(self) -> int:
        """Length of the whole prompt: the held history plus ``prompt_ids``."""
        return self.prefix_len + len(self.prompt_ids)


@dataclass
class GenerationResult:
    """What a generation backend returns for a :class:`GenerationRequest`.

    Attributes:
        token_ids: generated ids, shape [R].
        logprobs: their log-probabilities under the generating weights, shape [R].
        version: policy version of the weights that produced them.
        finish_reason: "stop", "length" or "abort".
        worker: name of the worker that served it.
        prefill_s / decode_s: time spent (modelled time for the sim backend).
        recomputed_tokens: tokens re-prefilled because the weights changed mid-trajectory.
        entropy: the entropy (nats) of each generated token's distribution, shape [R]: over the
            whole vocabulary (hf), over the top-k the engine returns (vllm), or empty (sim).
    """

    traj_id: str
    token_ids: list[int]
    logprobs: list[float]
    version: int
    finish_reason: str = "stop"
    text: str = ""
    worker: str = ""
    prefill_s: float = 0.0
    decode_s: float = 0.0
    recomputed_tokens: int = 0
    entropy: list[float] = field(default_factory=list)


@dataclass
class ScoreResult:
    """What a generation backend's ``score`` returns: given token sequences scored under one
    policy version, as the sampler scores what it draws (``log_softmax`` of the logits at
    temperature 1).

    Attributes:
        rows: per sequence ``ids`` [L], the logprob of ``ids[i]`` given ``ids[:i]`` for
            i = 1..L-1, shape [L-1]; NaN where the backend does not compute logprobs (``sim``).
        version: policy version of the weights that scored every row.
        score_s: time spent (modelled time for the sim backend).
    """

    rows: list[list[float]]
    version: int
    score_s: float = 0.0


@runtime_checkable
class GenerationBackend(Protocol):
    """Generates responses and scores given tokens; the weights it serves carry a version."""

    version: int

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    async def score(self, rows: Sequence[Sequence[int]]) -> ScoreResult: ...

    async def abort(self, traj_id: str) -> None: ...

    def load_weights(self, state: dict[str, Any], version: int) -> None: ...


@runtime_checkable
class TrainBackend(Protocol):
    """Consumes a batch of scored trajectories and updates the policy."""

    version: int

    def train_step(self, batch: list[Trajectory]) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, Any]: ...


@runtime_checkable
class WeightTransport(Protocol):
    """Moves versioned weights from trainer to generators (object store, Mooncake, NCCL)."""

    def publish(self, version: int, state: dict[str, Any]) -> Any: ...

    def pull(self, version: int) -> dict[str, Any]: ...

    def latest(self) -> int | None: ...

    def gc(self, keep: int = 2) -> None: ...


@runtime_checkable
class MetadataStore(Protocol):
    """A small key-value store shared by the cluster (Ray GCS KV by default, or Redis)."""

    def put(self, key: str, value: dict[str, Any]) -> None: ...

    def put_new(self, key: str, value: dict[str, Any]) -> bool:
        """Write ``key`` only if it is absent, atomically; True if written."""
        ...

    def get(self, key: str) -> dict[str, Any] | None: ...

    def delete(self, key: str) -> None: ...

    def keys(self, prefix: str = "") -> list[str]: ...
