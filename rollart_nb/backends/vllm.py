"""Generation with vLLM's v1 engine (``AsyncLLM``): the ``vllm`` backend, GPU or vLLM's CPU build.

Same contract as :class:`~rollart_nb.backends.hf.HFBackend`:

* Prompts go in as token ids with ``skip_tokenizer_init=True`` (transformers 5 mis-loads our
  word-level vocabularies); responses are decoded and EOS / stop strings applied here.
* Logprobs are vLLM's ``raw_logprobs``: at temperature 1, what the trainer recomputes.
* :meth:`load_weights` drains running requests, reloads weights on every worker and resets the
  prefix cache, so no response mixes two versions (``recomputed_tokens`` counts re-prefills).
* A :class:`~rollart_nb.backends.history.HistoryStore` rebuilds whole prompts from
  ``prefix_len`` requests; an unknown prefix raises :class:`~rollart_nb.errors.HistoryMiss`.

The engine runs on a private event loop in a background thread, so any loop (or sync code)
can call the backend.

Install (CPU): ``.ci/install-vllm.sh`` (a virtualenv over the main env); GPU: ``pip install
rollart_nb[vllm-gpu]``. vLLM is imported only when a backend is constructed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from rollart_nb.backends.history import DEFAULT_HISTORY_TOKENS, HistoryStore
from rollart_nb.errors import ConfigError, GenerationError, StateError, WeightSyncError
from rollart_nb.models.tiny import ModelRef, from_pretrained
from rollart_nb.protocols import GenerationRequest, GenerationResult, ScoreResult

if TYPE_CHECKING:
    import torch

__all__ = ["VLLMBackend"]

log = logging.getLogger(__name__)

ENTROPY_TOP_K = 20
"""Candidates per generated token the engine returns logprobs for; the entropy sums over them."""

T = TypeVar("T")

_INSTALL = (
    "vLLM is not installed; on CPU run .ci/install-vllm.sh and use that virtualenv's python, "
    "on GPU pip install 'rollart_nb[vllm-gpu]'"
)
_CPU_KV_CACHE_GB = 1.0  # vLLM's CPU build needs an explicit KV budget; 1 GiB holds ~400k tiny-model tokens


class _WorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); called via ``collective_rpc``."""

    if TYPE_CHECKING:
        model_runner: Any  # the vLLM worker's, which this class is mixed into

    def rollart_load_weights(self, blob: bytes) -> int:
        """Reload weights in place from a safetensors blob in HF naming; returns tensors read."""
        from safetensors.torch import load

        state = load(blob)
        if hasattr(self, "reload_weights"):
            # Re-runs each layer's weight loader and post-processing (fused qkv, CPU repacking).
            self.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
        else:  # older vLLM without in-place reload
            self.model_runner.model.load_weights(state.items())
        return len(state)


def _kv_cache_gb(
    device: str | None, platform: str, gpu_memory_utilization: float, kv_cache_gb: float | None
) -> float | None:
    """The KV cache budget (GB) of a :class:`VLLMBackend` (on CPU, a default when none is given),
    after checking its arguments: one ConfigError lists every problem."""
    problems = []
    if device is not None and device.split(":")[0] != platform:
        problems.append(f"device {device!r} but the installed vLLM build runs on {platform!r}")
    if not 0 < gpu_memory_utilization <= 1:
        problems.append(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if kv_cache_gb is not None and kv_cache_gb <= 0:
        problems.append(f"kv_cache_gb must be > 0, got {kv_cache_gb}")
    if problems:
        raise ConfigError(problems, where="VLLMBackend")
    return _CPU_KV_CACHE_GB if kv_cache_gb is None and platform == "cpu" else kv_cache_gb


class VLLMBackend:
    """A :class:`~rollart_nb.protocols.GenerationBackend` on vLLM's ``AsyncLLM``.

    Args:
        model: a :class:`ModelRef` or a path to a Hugging Face model directory.
        device: ``"cuda"`` or ``"cpu"``; must match the installed vLLM build (default: its own).
        name: worker name reported in results.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (GPU only).
        kv_cache_gb: KV cache size in GiB; default 1 GiB on CPU, ``gpu_memory_utilization`` on GPU.
        seed: engine seed; also seeds requests that carry no seed of their own.
        enforce_eager: skip CUDA graphs / torch.compile (fast start, what tests want).
        max_model_len: context length; default the model's.
        dtype: weights dtype (``"auto"``: the checkpoint's; ``"float32"`` to match HFBackend).
        history_tokens: most tokens of trajectory histories held (ids, 4 bytes a token).

    Attributes:
        version: policy version of the weights being served.
        stats: counters ``{"requests", "aborted", "weight_loads"}``.

    Example:
        >>> be = VLLMBackend(rn.models.tiny_qwen(), dtype="float32")        # doctest: +SKIP
        >>> res = await be.generate(GenerationRequest("t0", "math", ids))  # doctest: +SKIP
        >>> be.load_weights(trainer.state_dict(), version=1)               # doctest: +SKIP
        >>> be.close()                                                     # doctest: +SKIP
    """

    def __init__(
        self,
        model: ModelRef | str,
        *,
        device: str | None = None,
        name: str = "vllm",
        gpu_memory_utilization: float = 0.9,
        kv_cache_gb: float | None = None,
        seed: int = 0,
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        dtype: str = "auto",
        history_tokens: int = DEFAULT_HISTORY_TOKENS,
    ) -> None:
        try:
            import vllm  # noqa: F401
            from vllm.platforms import current_platform
        except ImportError as e:
            raise ConfigError(f"{_INSTALL} ({e})", where="VLLMBackend") from e
        import torch

        self.ref = model if isinstance(model, ModelRef) else from_pretrained(model)
        platform = str(current_platform.device_type)
        kv_cache_gb = _kv_cache_gb(device, platform, gpu_memory_utilization, kv_cache_gb)
        self.name, self.device, self.version = name, platform, 0
        self.tokenizer = self.ref.load_tokenizer()
        self.eos_id = self.tokenizer.eos_token_id
        self._expected = self._expected_shapes()
        self._seed_rng = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()
        self._served: OrderedDict[str, int] = OrderedDict()  # traj_id -> version last served
        self._inflight: dict[str, set[asyncio.Task[GenerationResult]]] = {}
        self.stats = {"requests": 0, "aborted": 0, "weight_loads": 0}
        self._closed = False
        #: Each trajectory's ids (prompt + response) for requests that send only new tokens.
        self.history = HistoryStore(history_tokens, name=name)

        from vllm.engine.arg_utils import AsyncEngineArgs

        kwargs: dict[str, Any] = dict(
            model=self.ref.path,
            skip_tokenizer_init=True,
            dtype=dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=None if kv_cache_gb is None else int(kv_cache_gb * (1 << 30)),
            logprobs_mode="raw_logprobs",
            enable_prefix_caching=True,
            worker_extension_cls=f"{__name__}._WorkerExtension",
            disable_log_stats=True,
        )
        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        # Older vLLM: no logprobs_mode (its v1 engine returned raw logprobs anyway) and the CPU
        # KV budget only through the environment, which the engine's processes inherit.
        if "kv_cache_memory_bytes" not in known and kv_cache_gb is not None and platform == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(kv_cache_gb))))
        optional = {"logprobs_mode", "kv_cache_memory_bytes"}  # anything else missing must fail loudly
        args = AsyncEngineArgs(**{k: v for k, v in kwargs.items() if k in known or k not in optional})
        # One private loop owns the engine: AsyncLLM binds its output handler to the loop that
        # first uses it, and callers may come from many loops or none.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-loop", daemon=True)
        self._thread.start()
        try:
            self.engine = self._call(self._start(args))
        except Exception:
            self._stop_loop()
            raise
        self.max_len = int(self.engine.model_config.max_model_len)

    # -- GenerationBackend --------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one response (vLLM batches concurrent requests continuously).

        Raises:
            HistoryMiss: ``request.prefix_len`` tokens of history are not held here; resend whole.
            GenerationError: empty or too-long prompt, or the engine failed.
            StateError: the backend is closed.
        """
        self._check_open()
        prompt = self.history.resolve(request)
        if not prompt:
            raise GenerationError(f"trajectory {request.traj_id}: empty prompt; pass at least one token id")
        if len(prompt) >= self.max_len:
            raise GenerationError(
                f"trajectory {request.traj_id}: prompt of {len(prompt)} tokens does not fit the "
                f"model's {self.max_len} positions; shorten the history or use a longer-context model"
            )
        fut = asyncio.run_coroutine_threadsafe(self._generate(request, prompt), self._loop)
        result = await asyncio.wrap_future(fut)
        if result.finish_reason == "abort" or request.last_turn:
            self.history.forget(request.traj_id)
        else:
            self.history.keep(request.traj_id, prompt + result.token_ids)
        return result

    async def abort(self, traj_id: str) -> None:
        """Abort running requests of ``traj_id``; they finish with reason "abort" and partial tokens."""
        self._check_open()
        self.history.forget(traj_id)
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._abort(traj_id), self._loop))

    def forget(self, traj_id: str) -> None:
        """Drop a finished trajectory's history (its KV blocks age out of vLLM's prefix cache)."""
        self.history.forget(traj_id)
        self._served.pop(traj_id, None)

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Reload the weights in place on every worker; all-or-nothing, between requests.

        New requests wait until the load is done; running ones finish under the old version first.

        Raises:
            WeightSyncError: keys or shapes do not match this model (nothing is changed), or a
                worker failed to load them.
        """
        self._check_open()
        import torch
        from safetensors.torch import save

        missing = sorted(set(self._expected) - set(state))
        unexpected = sorted(set(state) - set(self._expected))
        shapes = [k for k in self._expected.keys() & state.keys() if self._expected[k] != tuple(state[k].shape)]
        if missing or unexpected or shapes:
            raise WeightSyncError(
                f"{self.name}: weights for version {version} do not fit this model "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape {shapes[:5]}); "
                "publish a state_dict of the same architecture"
            )
        # Own contiguous copies: safetensors refuses tensors that share storage (tied embeddings).
        blob = save({k: torch.as_tensor(v).detach().to("cpu").contiguous().clone() for k, v in state.items()})
        self._call(self._load(blob, int(version)))

    async def score(self, rows: Sequence[Sequence[int]]) -> ScoreResult:
        """vLLM's prompt logprobs (raw: temperature 1, the quantity it samples with) of each
        sequence's tokens 1.., every row under one version; they bypass the prefix cache.

        Raises:
            GenerationError: a sequence longer than the model's positions.
            StateError: the backend is closed.
        """
        self._check_open()
        for ids in rows:
            if len(ids) > self.max_len:
                raise GenerationError(
                    f"{self.name}: a sequence of {len(ids)} tokens does not fit the model's {self.max_len} positions"
                )
        fut = asyncio.run_coroutine_threadsafe(self._score_rows([list(ids) for ids in rows]), self._loop)
        return await asyncio.wrap_future(fut)

    # -- probes and lifecycle -------------------------------------------------------------
    def recompute(self, prompt_ids: list[int]) -> list[float]:
        """Prefill ``prompt_ids`` under the current weights; logprobs of tokens 1.., shape [P-1].

        Requests with prompt logprobs bypass vLLM's prefix cache, so this is a fresh prefill.
        """
        self._check_open()
        if len(prompt_ids) < 2:
            return []
        return self._call(self._prompt_logprobs(list(prompt_ids)))

    def close(self) -> None:
        """Shut the engine's processes down; idempotent. Later calls raise :class:`StateError`."""
        if self._closed:
            return
        self._closed = True
        try:
            self.engine.shutdown()
        finally:
            self._stop_loop()
            # Drop the engine now: AsyncLLM.__del__ shuts down again, which fails if it only
            # runs at interpreter exit.
            self.engine = None

    def __enter__(self) -> VLLMBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- engine loop (everything below runs on self._loop) --------------------------------
    async def _start(self, args: Any) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        self._ready = asyncio.Event()  # cleared while weights load: new requests wait
        self._ready.set()
        self._idle = asyncio.Condition()
        self._running = 0
        return AsyncLLM.from_engine_args(args)

    @contextlib.asynccontextmanager
    async def _admitted(self) -> AsyncIterator[int]:
        """Wait out a weight load, then count as running (a load waits for running work).

        Yields the version that serves the whole block: no load starts while it runs.
        """
        await self._ready.wait()
        self._running += 1
        try:
            yield self.version
        finally:
            self._running -= 1
            async with self._idle:
                self._idle.notify_all()

    async def _generate(self, request: GenerationRequest, prompt: list[int]) -> GenerationResult:
        task = asyncio.current_task()
        assert task is not None
        # Registered before admission, so abort() also reaches requests held by a weight load.
        self._inflight.setdefault(request.traj_id, set()).add(task)
        tokens: list[int] = []
        logprobs: list[float] = []
        entropy: list[float] = []
        first: list[float] = []  # time of the first output (end of prefill), set by _stream
        reason, version, t0 = "length", self.version, time.perf_counter()
        try:
            async with self._admitted() as version:
                t0 = time.perf_counter()
                budget = min(request.max_new_tokens, self.max_len - len(prompt))
                if budget > 0:
                    reason = await self._stream(request, prompt, budget, tokens, (logprobs, entropy), first)
        except asyncio.CancelledError:
            reason = "abort"  # abort() cancels us; vLLM aborts the engine request on cancel
        except Exception as e:
            log.exception("%s: request of trajectory %s failed", self.name, request.traj_id)
            raise GenerationError(f"{self.name}: generation failed for trajectory {request.traj_id}: {e}") from e
        finally:
            self._inflight.get(request.traj_id, set()).discard(task)
            if not self._inflight.get(request.traj_id, True):
                del self._inflight[request.traj_id]
        t_end = time.perf_counter()
        prefill = (first[0] if first else t_end) - t0
        self.stats["requests"] += 1
        recomputed = 0 if reason == "abort" else self._note_served(request.traj_id, version, len(prompt))
        return GenerationResult(
            traj_id=request.traj_id,
            token_ids=tokens,
            logprobs=logprobs,
            entropy=entropy,
            version=version,
            finish_reason=reason,
            text=self.tokenizer.decode(tokens, skip_special_tokens=True),
            worker=self.name,
            prefill_s=prefill,
            decode_s=t_end - t0 - prefill,
            recomputed_tokens=recomputed,
        )

    async def _stream(
        self,
        request: GenerationRequest,
        prompt_ids: list[int],
        budget: int,
        tokens: list[int],
        stats: tuple[list[float], list[float]],
        first: list[float],
    ) -> str:
        """Run one engine request for the whole prompt ``prompt_ids``, appending to ``tokens`` and
        to ``stats``' logprobs and entropies (over the top :data:`ENTROPY_TOP_K` tokens the
        engine returns, a lower bound of the whole distribution's); returns the finish reason."""
        logprobs, entropy = stats
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        seed = request.seed
        if seed is None:
            import torch

            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        params = SamplingParams(
            temperature=max(float(request.temperature), 0.0),
            max_tokens=budget,
            seed=int(seed),
            logprobs=ENTROPY_TOP_K,  # the sampled token's logprob, and the top-k's for the entropy
            # No tokenizer in the engine: it cannot know EOS or match stop strings itself.
            stop_token_ids=[self.eos_id] if self.eos_id is not None else None,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        rid = f"{request.traj_id}#{next(self._ids)}"
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
        async for out in self.engine.generate(prompt, params, rid):
            if not first:
                first.append(time.perf_counter())
            o = out.outputs[0]
            for tok, lp in zip(o.token_ids, o.logprobs or [], strict=True):
                tokens.append(int(tok))
                logprobs.append(float(lp[tok].logprob))
                entropy.append(-sum(math.exp(x.logprob) * x.logprob for x in lp.values() if math.isfinite(x.logprob)))
                if request.stop and self._hit_stop(tokens, request.stop):
                    await self.engine.abort(rid)
                    return "stop"
            if out.finished:
                return "stop" if o.finish_reason == "stop" else str(o.finish_reason or "length")
        return "length"

    async def _abort(self, traj_id: str) -> None:
        tasks = list(self._inflight.get(traj_id, ()))
        for t in tasks:
            t.cancel()
        if tasks:
            self.stats["aborted"] += len(tasks)
            await asyncio.gather(*tasks, return_exceptions=True)
        self._served.pop(traj_id, None)

    async def _load(self, blob: bytes, version: int) -> None:
        self._ready.clear()
        try:
            async with self._idle:
                await self._idle.wait_for(lambda: self._running == 0)
            try:
                await self.engine.collective_rpc("rollart_load_weights", args=(blob,))
            except Exception as e:
                raise WeightSyncError(
                    f"{self.name}: loading weights version {version} failed on a vLLM worker: {e}; "
                    "the engine may hold a partial update, reload a complete state_dict"
                ) from e
            # KV blocks computed under the old weights must not be reused by later prompts.
            await self.engine.reset_prefix_cache()
            self.version = version
            self.stats["weight_loads"] += 1
            log.debug("%s loaded weights version %d", self.name, version)
        finally:
            self._ready.set()

    async def _prompt_logprobs(self, prompt_ids: list[int]) -> list[float]:
        async with self._admitted():
            return await self._scored(prompt_ids)

    async def _score_rows(self, rows: list[list[int]]) -> ScoreResult:
        t0 = time.perf_counter()
        async with self._admitted() as version:  # a weight load waits: every row has this version
            out = await asyncio.gather(*(self._scored(ids) for ids in rows))
        return ScoreResult(list(out), version, time.perf_counter() - t0)

    async def _scored(self, prompt_ids: list[int]) -> list[float]:
        """vLLM's prompt logprobs of tokens 1.. of ``prompt_ids`` (raw: temperature 1), admitted by the caller."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(prompt_ids) < 2:
            return []
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        final = None
        async for out in self.engine.generate(
            TokensPrompt(prompt_token_ids=prompt_ids), params, f"recompute#{next(self._ids)}"
        ):
            final = out
        assert final is not None and final.prompt_logprobs is not None
        return [float(d[t].logprob) for t, d in zip(prompt_ids[1:], final.prompt_logprobs[1:], strict=True)]

    # -- helpers ------------------------------------------------------------------------
    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the engine loop and wait for it (from any thread but that loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(f"{self.name}: VLLMBackend is closed; create a new one")

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter names and shapes of the HF model (built on the meta device: no memory)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(self.ref.path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return {k: tuple(v.shape) for k, v in model.state_dict().items()}

    def _note_served(self, traj_id: str, version: int, prompt_len: int) -> int:
        """Record the version that served ``traj_id``; prompt tokens re-prefilled under newer weights."""
        previous = self._served.pop(traj_id, version)
        self._served[traj_id] = version
        while len(self._served) > 100_000:  # bound memory on very long runs
            self._served.popitem(last=False)
        return prompt_len if previous < version else 0

    def _hit_stop(self, tokens: list[int], stop: list[str]) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return any(s and s in text for s in stop)
