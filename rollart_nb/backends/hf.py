"""Generation with plain ``transformers`` on CPU (or one GPU): the ``hf`` backend.

Concurrent :meth:`HFBackend.generate` calls are gathered for a few milliseconds and run as one
left-padded batch with a KV cache. The torch work runs in a thread (``asyncio.to_thread``), so
the event loop of the actor (or notebook) stays responsive while a batch decodes.

Logprobs are ``log_softmax(logits)`` of the sampled token at temperature 1, whatever the
sampling temperature: the quantity the trainer recomputes, so GRPO's ratio compares like with
like.

KV reuse (``kv_reuse=True``, LRU-bounded by ``kv_cache_tokens``): a trajectory's next prompt
extends its last one, so only the new tokens are prefilled. Each batch row is laid out as
``[pad, cached KV, pad, new tokens]`` with explicit positions, so it computes what a fresh
prefill would (tested). :meth:`load_weights` drops every cached KV, and
:attr:`GenerationResult.recomputed_tokens` counts the re-prefilled history.

A :class:`~rollart_nb.backends.history.HistoryStore` rebuilds whole prompts from requests that
carry only the tokens after ``prefix_len``; an unknown prefix raises
:class:`~rollart_nb.errors.HistoryMiss`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollart_nb.backends.history import DEFAULT_HISTORY_TOKENS, HistoryStore
from rollart_nb.errors import ConfigError, GenerationError, WeightSyncError
from rollart_nb.models.tiny import ModelRef, from_pretrained
from rollart_nb.protocols import GenerationRequest, GenerationResult, ScoreResult

if TYPE_CHECKING:
    import torch

__all__ = ["BATCH_WAIT_S", "HFBackend", "sample_rows"]

log = logging.getLogger(__name__)

SERVE_DTYPES = ("float32", "bfloat16", "float16")
"""The dtypes :class:`HFBackend` serves in; the trainers train in float32."""

BATCH_WAIT_S = 0.005
"""Default seconds a batch waits for requests to join before it runs (a few ms: concurrent turns
of a rollout arrive within about a Ray call of each other)."""


@dataclass
class _KV:
    """A trajectory's cached keys and values: ``layers[l] = (k, v)``, each [kv_heads, len(ids), head_dim]."""

    ids: list[int]
    layers: list[tuple[Any, Any]]


@dataclass
class _Slot:
    """A request waiting for, or inside, a batch."""

    request: GenerationRequest
    future: asyncio.Future[GenerationResult]
    prompt: list[int]  # the whole prompt (the held history + request.prompt_ids)
    aborted: bool = False
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)


def cache_kwarg(lm: torch.nn.Module) -> str:
    """The name under which ``lm.forward`` takes and returns its KV cache: ``"cache"`` in
    transformers >= 5.2x, ``"past_key_values"`` in older releases."""
    return "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"


def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``logits`` [B, V], drawn from ``softmax(logits / temperature)``.

    Inverse-CDF sampling: one uniform per row from that row's own ``torch.Generator`` (so a row's
    sample depends only on its generator and its logits, never on its batch mates), then one
    batched search over the cumulative probabilities: ~10x cheaper than a ``torch.multinomial``
    call per row. A zero-probability token (logit ``-inf``) is never drawn: the first cdf entry
    above the uniform never belongs to a token that adds nothing to it.

    Returns:
        long tensor [B] of token ids.
    """
    import torch

    probs = torch.softmax(logits.float() / temperatures.float().clamp_min(1e-6)[:, None], -1)
    cdf = probs.cumsum(-1)
    u = torch.stack([torch.rand((), generator=g) for g in generators]) * cdf[:, -1]
    picked = torch.searchsorted(cdf, u[:, None], right=True)[:, 0]
    last = cdf.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)  # in case u rounded up to the total
    return torch.minimum(picked, last)


class HFBackend:
    """A :class:`~rollart_nb.protocols.GenerationBackend` on ``transformers``.

    Args:
        model: a :class:`ModelRef` or a path to a Hugging Face model directory.
        device: torch device; default ``cuda`` when available, else ``cpu``.
        name: worker name reported in results.
        max_batch_size: most requests decoded together.
        batch_wait_s: how long the first request of a batch waits for others to join.
        seed: seeds requests that carry no seed of their own.
        kv_reuse: keep each trajectory's KV between requests and prefill only new tokens.
        kv_cache_tokens: most tokens held in that cache over all trajectories.
        history_tokens: most tokens of trajectory histories held (ids, 4 bytes a token).
        dtype: the weights' dtype, one of :data:`SERVE_DTYPES` (default float32, as the trainer);
            a half-precision server samples from a distribution the trainer does not compute,
            which the token frame's importance ratio and the step's ``mismatch_kl`` show.

    Attributes:
        version: policy version of the weights being served.
        stats: counters ``{"batches", "requests", "prefill_tokens", "reused_tokens"}``
            (batching efficiency and KV reuse at a glance).

    Example:
        >>> be = HFBackend(rn.models.tiny_qwen())                    # doctest: +SKIP
        >>> res = await be.generate(GenerationRequest("t0", "math", ids))  # doctest: +SKIP
        >>> res.token_ids, res.logprobs, res.version               # doctest: +SKIP
    """

    def __init__(
        self,
        model: ModelRef | str,
        *,
        device: str | None = None,
        name: str = "hf",
        max_batch_size: int = 32,
        batch_wait_s: float = BATCH_WAIT_S,
        seed: int = 0,
        kv_reuse: bool = True,
        kv_cache_tokens: int = 1 << 16,
        history_tokens: int = DEFAULT_HISTORY_TOKENS,
        dtype: str = "float32",
    ) -> None:
        import torch

        if dtype not in SERVE_DTYPES:
            raise ConfigError(f"dtype must be one of {SERVE_DTYPES}, got {dtype!r}", where=f"HFBackend {name}")
        self.ref = model if isinstance(model, ModelRef) else from_pretrained(model)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = self.ref.load_tokenizer()
        self.dtype = dtype
        self.model = self.ref.load_model(dtype=getattr(torch, dtype), device=self.device)
        self.name, self.max_batch_size, self.batch_wait_s = name, max_batch_size, batch_wait_s
        self.version = 0
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id
        self._cache_kw = cache_kwarg(self.model)
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", 4096))
        # Held for a whole batch and for a weight load: a batch never sees two versions.
        self._weights_lock = threading.Lock()
        self._pending: list[_Slot] = []
        self._running: list[_Slot] = []
        self._batcher: asyncio.Task[None] | None = None
        self._seed_rng = torch.Generator().manual_seed(seed)
        self.stats = {"batches": 0, "requests": 0, "prefill_tokens": 0, "reused_tokens": 0}
        self._served: OrderedDict[str, int] = OrderedDict()  # traj_id -> version last served
        self.kv_reuse, self.kv_cache_tokens = bool(kv_reuse), int(kv_cache_tokens)
        self._kv: OrderedDict[str, _KV] = OrderedDict()  # traj_id -> KV; touched under _weights_lock
        self._kv_held = 0  # tokens in self._kv
        self._kv_drop: set[str] = set()  # aborted trajectories, dropped by the next batch
        #: Each trajectory's ids (prompt + response) for requests that send only new tokens.
        self.history = HistoryStore(history_tokens, name=name)

    # -- GenerationBackend --------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one response; batched with other requests arriving meanwhile.

        Raises:
            HistoryMiss: ``request.prefix_len`` tokens of history are not held here; resend whole.
            GenerationError: empty or too-long prompt, or the model failed.
        """
        prompt = self.history.resolve(request)
        if not prompt:
            raise GenerationError(f"trajectory {request.traj_id}: empty prompt; pass at least one token id")
        if len(prompt) >= self.max_len:
            raise GenerationError(
                f"trajectory {request.traj_id}: prompt of {len(prompt)} tokens does not fit the "
                f"model's {self.max_len} positions; shorten the history or use a longer-context model"
            )
        loop = asyncio.get_running_loop()
        slot = _Slot(request, loop.create_future(), prompt)
        self._pending.append(slot)
        if self._batcher is None or self._batcher.done():
            self._batcher = loop.create_task(self._drain())
        try:
            return await asyncio.shield(slot.future)
        except asyncio.CancelledError:
            slot.aborted = True  # the caller gave up: stop spending compute on it
            raise

    async def abort(self, traj_id: str) -> None:
        """Abort queued and in-flight requests of ``traj_id``; they finish with reason "abort"."""
        for slot in [*self._pending, *self._running]:
            if slot.request.traj_id == traj_id:
                slot.aborted = True
        for slot in [s for s in self._pending if s.aborted]:
            self._pending.remove(slot)
            if not slot.future.done():
                slot.future.set_result(self._result(slot, "abort", 0.0, 0.0, self.version, 0))
        self._served.pop(traj_id, None)
        self._kv_drop.add(traj_id)
        self.history.forget(traj_id)

    def forget(self, traj_id: str) -> None:
        """Drop a finished trajectory's history and cached KV."""
        self.history.forget(traj_id)
        self._served.pop(traj_id, None)
        self._kv_drop.add(traj_id)

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Replace the weights in place, between batches; all-or-nothing.

        Raises:
            WeightSyncError: keys or shapes do not match this model (nothing is changed).
        """
        import torch

        own = self.model.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        shapes = [k for k in own.keys() & state.keys() if tuple(own[k].shape) != tuple(state[k].shape)]
        if missing or unexpected or shapes:
            raise WeightSyncError(
                f"{self.name}: weights for version {version} do not fit this model "
                f"(missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape {shapes[:5]}); "
                "publish a state_dict of the same architecture"
            )
        with self._weights_lock, torch.no_grad():
            for k, v in own.items():
                v.copy_(torch.as_tensor(state[k]).to(dtype=v.dtype, device=v.device))
            self.version = int(version)
            self._kv.clear()  # cached KV came from the old weights: later requests recompute it
            self._kv_held = 0
        log.debug("%s loaded weights version %d", self.name, version)

    async def score(self, rows: Sequence[Sequence[int]]) -> ScoreResult:
        """Logprobs of each sequence's tokens 1.. under the weights served now, every row under
        one version: the quantity the sampler records (``pipe.replay`` compares the two).

        Runs in a thread between batches, like a batch, so the actor's loop keeps serving; it
        neither reads nor fills the KV cache.

        Raises:
            GenerationError: a sequence longer than the model's positions.
        """
        for ids in rows:
            if len(ids) > self.max_len:
                raise GenerationError(
                    f"{self.name}: a sequence of {len(ids)} tokens does not fit the model's {self.max_len} positions"
                )
        return await asyncio.to_thread(self._score, [list(ids) for ids in rows])

    def _score(self, rows: list[list[int]]) -> ScoreResult:
        import torch

        with self._weights_lock, torch.no_grad():
            t0 = time.perf_counter()
            out = [self._logprobs(ids) for ids in rows]
            return ScoreResult(out, self.version, time.perf_counter() - t0)

    def recompute(self, prompt_ids: list[int]) -> list[float]:
        """Prefill ``prompt_ids`` under the current weights; logprobs of tokens 1.., shape [P-1].

        A consistency probe: it neither reads nor fills the KV cache. Recompute in the pipeline
        is lazy: after a weight update, the next request of an in-flight trajectory re-prefills
        its whole history (the module docstring has the details).
        """
        import torch

        with self._weights_lock, torch.no_grad():
            return self._logprobs(list(prompt_ids))

    def _logprobs(self, ids: list[int]) -> list[float]:
        """``log_softmax`` of the logits at temperature 1, of tokens 1.. of ``ids`` (the weights lock held)."""
        import torch

        if len(ids) < 2:
            return []
        x = torch.tensor([ids], device=self.device)
        logits = self.model(input_ids=x).logits.float()
        return torch.log_softmax(logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0].tolist()

    # -- batching -----------------------------------------------------------------------
    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(self.batch_wait_s)
            batch = self._pending[: self.max_batch_size]
            del self._pending[: len(batch)]
            batch = [s for s in batch if not s.future.done()]
            if not batch:
                continue
            self._running = batch
            self.stats["batches"] += 1
            self.stats["requests"] += len(batch)
            try:
                results = await asyncio.to_thread(self._generate_batch, batch)
            except Exception as e:  # surface to every caller, keep serving later batches
                log.exception("%s: batch of %d failed", self.name, len(batch))
                for s in batch:
                    if not s.future.done():
                        s.future.set_exception(GenerationError(f"{self.name}: generation failed: {e}"))
                continue
            finally:
                self._running = []
            for s, r in zip(batch, results, strict=True):
                r.recomputed_tokens = self._note_served(r.traj_id, r.version, len(s.prompt))
                if r.finish_reason == "abort" or s.request.last_turn:
                    self.history.forget(r.traj_id)
                else:
                    self.history.keep(r.traj_id, s.prompt + r.token_ids)
                if not s.future.done():
                    s.future.set_result(r)

    def _note_served(self, traj_id: str, version: int, prompt_len: int) -> int:
        """Record the version that served ``traj_id``; prompt tokens re-prefilled under newer weights."""
        previous = self._served.pop(traj_id, version)
        self._served[traj_id] = version
        while len(self._served) > 100_000:  # bound memory on very long runs
            self._served.popitem(last=False)
        return prompt_len if previous < version else 0

    def _generate_batch(self, slots: list[_Slot]) -> list[GenerationResult]:
        import torch

        with self._weights_lock, torch.no_grad():
            version = self.version
            t0 = time.perf_counter()
            b = len(slots)
            prompts = [s.prompt for s in slots]
            cached = self._take_cached(slots)
            reuse = [len(c.ids) if c is not None else 0 for c in cached]
            p_max = max(reuse)
            s_max = max(len(p) - r for p, r in zip(prompts, reuse, strict=True))
            ids, attn, pos = self._prefill_inputs(prompts, reuse, p_max, s_max)
            self.stats["prefill_tokens"] += sum(len(p) for p in prompts) - sum(reuse)
            self.stats["reused_tokens"] += sum(reuse)
            kw = {self._cache_kw: self._batch_cache(cached, p_max)} if p_max else {}
            ids, attn, pos = ids.to(self.device), attn.to(self.device), pos.to(self.device)
            out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **kw)
            t_prefill = time.perf_counter() - t0
            gens = [self._generator(s.request) for s in slots]
            temps = torch.tensor([max(s.request.temperature, 0.0) for s in slots])
            greedy = [s.request.temperature <= 0 for s in slots]
            budgets = [min(s.request.max_new_tokens, self.max_len - len(s.prompt)) for s in slots]
            reasons: list[str | None] = [None] * b
            forwards = 0  # decode forwards so far: a row's first `forwards` tokens went through the model
            for i, s in enumerate(slots):
                if s.aborted:
                    reasons[i] = "abort"
                elif budgets[i] <= 0:
                    reasons[i] = "length"
            while any(r is None for r in reasons):
                # One op per decode step for the whole batch; only the draw is per row (each request
                # has its own generator, so its samples do not depend on its batch mates).
                logits = out.logits[:, -1].float().cpu()
                logp = torch.log_softmax(logits, -1)
                nxt = torch.argmax(logits, -1)
                draw = [i for i, s in enumerate(slots) if reasons[i] is None and not greedy[i] and not s.aborted]
                if draw:
                    rows = torch.tensor(draw)
                    nxt[rows] = sample_rows(logits[rows], temps[rows], [gens[i] for i in draw])
                toks, lps = nxt.tolist(), logp.gather(-1, nxt[:, None])[:, 0].tolist()
                ents = (-(logp.exp() * logp).sum(-1)).tolist()  # of the same temperature-1 distribution
                self._append_tokens(slots, reasons, budgets, toks, (lps, ents))
                nxt = torch.tensor(toks, dtype=torch.long)
                if all(r is not None for r in reasons):
                    break
                forwards += 1
                # Finished rows keep decoding a pad (cheaper than reshaping the KV cache).
                attn = torch.cat([attn, attn.new_ones((b, 1))], dim=1)
                pos = pos[:, -1:] + 1
                out = self.model(
                    input_ids=nxt[:, None].to(self.device),
                    attention_mask=attn,
                    position_ids=pos,
                    use_cache=True,
                    **{self._cache_kw: getattr(out, self._cache_kw)},
                )
            t_decode = time.perf_counter() - t0 - t_prefill
            self._keep_kv(slots, reuse, forwards, p_max, s_max, getattr(out, self._cache_kw, None))
        return [self._result(s, reasons[i] or "length", t_prefill, t_decode, version, 0) for i, s in enumerate(slots)]

    def _prefill_inputs(
        self, prompts: list[list[int]], reuse: list[int], p_max: int, s_max: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Ids and positions [B, s_max] to prefill, attention mask [B, p_max + s_max]. Row i:
        [pad, cached KV (reuse[i]), pad, new prompt tokens]; both parts left-padded."""
        import torch

        b = len(prompts)
        ids = torch.full((b, s_max), self.pad_id, dtype=torch.long)
        attn = torch.zeros((b, p_max + s_max), dtype=torch.long)
        pos = torch.zeros((b, s_max), dtype=torch.long)
        for i, (p, r) in enumerate(zip(prompts, reuse, strict=True)):
            n = len(p) - r
            ids[i, s_max - n :] = torch.tensor(p[r:])
            pos[i, s_max - n :] = torch.arange(r, len(p))
            attn[i, p_max - r : p_max] = 1
            attn[i, p_max + s_max - n :] = 1
        return ids, attn, pos

    def _append_tokens(
        self,
        slots: list[_Slot],
        reasons: list[str | None],
        budgets: list[int],
        toks: list[int],
        stats: tuple[list[float], list[float]],
    ) -> None:
        """One decode step's token, logprob and entropy (``stats``) onto each running row, setting
        ``reasons[i]`` when the row stops, hits its budget or was aborted; finished rows' ``toks``
        become pads."""
        lps, ents = stats
        for i, s in enumerate(slots):
            if reasons[i] is not None:
                toks[i] = self.pad_id
                continue
            if s.aborted:
                reasons[i] = "abort"
                toks[i] = self.pad_id
                continue
            s.tokens.append(toks[i])
            s.logprobs.append(lps[i])
            s.entropy.append(ents[i])
            if toks[i] == self.eos_id or self._hit_stop(s):
                reasons[i] = "stop"
            elif len(s.tokens) >= budgets[i]:
                reasons[i] = "length"

    # -- KV reuse (called with _weights_lock held) ------------------------------------------
    def _take_cached(self, slots: list[_Slot]) -> list[_KV | None]:
        """Per slot: its trajectory's cached KV, cut to the prefix the prompt shares (None: none)."""
        while self._kv_drop:
            self._forget(self._kv_drop.pop())
        out: list[_KV | None] = []
        for s in slots:
            kv = self._forget(s.request.traj_id) if self.kv_reuse else None
            prompt = s.prompt
            n = 0
            if kv is not None:  # load_weights empties the cache: what is left has this version
                limit = min(len(kv.ids), len(prompt) - 1)  # at least one token left to prefill
                while n < limit and kv.ids[n] == prompt[n]:
                    n += 1
            if kv is None or n == 0:
                out.append(None)
            elif n == len(kv.ids):
                out.append(kv)
            else:
                out.append(_KV(kv.ids[:n], [(k[:, :n], v[:, :n]) for k, v in kv.layers]))
        return out

    def _forget(self, traj_id: str) -> _KV | None:
        kv = self._kv.pop(traj_id, None)
        if kv is not None:
            self._kv_held -= len(kv.ids)
        return kv

    def _batch_cache(self, cached: list[_KV | None], p_max: int) -> Any:
        """A DynamicCache of the rows' cached KV, each left-padded to ``p_max`` positions."""
        from transformers import DynamicCache

        ref = next(c for c in cached if c is not None)
        data = []
        for layer, (k0, v0) in enumerate(ref.layers):
            k = k0.new_zeros((len(cached), k0.shape[0], p_max, k0.shape[-1]))
            v = v0.new_zeros((len(cached), v0.shape[0], p_max, v0.shape[-1]))
            for i, c in enumerate(cached):
                if c is not None:
                    n = len(c.ids)
                    k[i, :, p_max - n :] = c.layers[layer][0]
                    v[i, :, p_max - n :] = c.layers[layer][1]
            data.append((k, v))  # new_zeros: already on the cached tensors' device
        return DynamicCache(data)

    def _keep_kv(self, slots: list[_Slot], reuse: list[int], forwards: int, p_max: int, s_max: int, cache: Any) -> None:
        """Store each finished row's KV (prompt + the generated tokens fed in the ``forwards``
        decode steps) for its next request."""
        import torch

        if not self.kv_reuse or cache is None:
            return
        layers = getattr(cache, "layers", None)
        width = p_max + s_max + forwards
        if not layers or any(getattr(la, "keys", None) is None or la.keys.shape[-2] != width for la in layers):
            self.kv_reuse = False  # a cache layout this code does not know (sliding window, ...)
            log.warning("%s: KV reuse off: the model's cache is not one full-length tensor per layer", self.name)
            return
        # Rows whose kept positions are the same share one gather per layer (a batch of single-turn
        # prompts is a handful of groups, not one gather per row).
        groups: dict[tuple[int, int, int], list[int]] = {}
        for i, s in enumerate(slots):
            if not s.aborted and not s.request.last_turn:
                n, fed = len(s.prompt) - reuse[i], min(len(s.tokens), forwards)  # last token may be unfed
                groups.setdefault((reuse[i], n, fed), []).append(i)
        for (r, n, fed), rows in groups.items():
            idx = torch.cat([torch.arange(p_max - r, p_max), torch.arange(p_max + s_max - n, p_max + s_max + fed)]).to(
                self.device
            )
            sel = torch.tensor(rows, device=self.device)
            kept = [
                (
                    la.keys.index_select(0, sel).index_select(-2, idx),
                    la.values.index_select(0, sel).index_select(-2, idx),
                )
                for la in layers
            ]
            for j, i in enumerate(rows):
                s = slots[i]
                kv = _KV(s.prompt + s.tokens[:fed], [(k[j], v[j]) for k, v in kept])
                self._forget(s.request.traj_id)  # two requests of one trajectory in a batch: keep the last
                self._kv[s.request.traj_id] = kv
                self._kv_held += len(kv.ids)
        while self._kv_held > self.kv_cache_tokens and self._kv:
            self._forget(next(iter(self._kv)))

    # -- helpers ------------------------------------------------------------------------
    def _generator(self, request: GenerationRequest) -> Any:
        import torch

        # One generator per request: its samples do not depend on who shares the batch.
        seed = request.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        return torch.Generator(device="cpu").manual_seed(int(seed))

    def _hit_stop(self, slot: _Slot) -> bool:
        if not slot.request.stop:
            return False
        text = self.tokenizer.decode(slot.tokens, skip_special_tokens=True)
        return any(stop and stop in text for stop in slot.request.stop)

    def _result(
        self, slot: _Slot, reason: str, prefill_s: float, decode_s: float, version: int, recomputed: int
    ) -> GenerationResult:
        return GenerationResult(
            traj_id=slot.request.traj_id,
            token_ids=list(slot.tokens),
            logprobs=list(slot.logprobs),
            entropy=list(slot.entropy),
            version=version,
            finish_reason=reason,
            text=self.tokenizer.decode(slot.tokens, skip_special_tokens=True),
            worker=self.name,
            prefill_s=prefill_s,
            decode_s=decode_s,
            recomputed_tokens=recomputed,
        )
