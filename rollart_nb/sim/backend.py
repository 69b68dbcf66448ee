"""SimBackend: a generation backend whose time comes from a roofline model of its hardware.

It is a real backend for what-if studies, not a mock: the control plane drives it exactly as
it drives ``hf`` or ``vllm``. Tokens are cheap and content-free (the sim never learns); what
is modelled is *time*:

* **Prefill** of the tokens of a trajectory that are not in this backend's prefix cache
  (keyed by trajectory id: cached length and the policy version it was computed under).
  If the weights changed since the cache was built, the whole prompt is prefilled again
  (step 5 of the protocol, KV recompute) and ``recomputed_tokens`` counts it.
  Approximation: prefills share one device FCFS on FLOPs; the weight-read floor is paid per
  request but not queued, as concurrent short prefills would share one batched pass.
* **Decode** with continuous batching. Approximation: a request's whole decode is priced at
  admission with :func:`~rollart_nb.sim.roofline.decode_time` for the batch active at that
  moment (its size and mean context, contexts as of each sequence's admission); requests
  admitted later do not slow it down, and prefills do not stall decodes.
* The request then sleeps ``modelled_seconds * time_scale`` (cancellable by :meth:`abort`).

Results report *modelled* seconds (``prefill_s``, ``decode_s``), unscaled. The prefix cache
is bounded by the device memory left after the weights (least recently used evicted).

Histories: a request may carry only the tokens after those this backend holds
(``prefix_len``); the backend keeps each trajectory's history length in a lengths-only
:class:`~rollart_nb.backends.history.HistoryStore` (the sim needs no ids) and raises
:class:`~rollart_nb.errors.HistoryMiss` when it does not hold that prefix. Everything (pricing,
the response) depends on the whole prompt's length, so a request sent whole and the same
request sent as prefix + tail get identical results.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollart_nb.backends.history import HistoryStore
from rollart_nb.errors import ConfigError
from rollart_nb.models.spec import ModelSpec
from rollart_nb.protocols import GenerationRequest, GenerationResult, Tokenizer
from rollart_nb.resources.profiles import HardwareProfile
from rollart_nb.sim.clock import resolve_time_scale
from rollart_nb.sim.roofline import decode_time, prefill_flops, weights_read_bytes
from rollart_nb.sim.tokenizer import SimTokenizer

__all__ = ["SimBackend"]

#: Fraction of the memory left after the weights that holds KV cache (as vLLM's
#: gpu_memory_utilization leaves headroom for activations).
KV_MEMORY_FRACTION = 0.9


@dataclass
class _Prefix:
    tokens: int  # cached prefix length
    version: int  # policy version its KV was computed under


@dataclass
class _Prefilled:
    prefill_s: float
    computed: int
    recomputed: int
    aborted: bool


class SimBackend:
    """Roofline-timed generation backend (see the module docstring for the model).

    Args:
        spec: the model being served.
        hardware: the device type of this worker.
        time_scale: seconds slept per modelled second (0: account time without sleeping).
            Default: 1 on a SimSession's virtual clock (simulated seconds), 1e-3 elsewhere
            (a 10 s turn sleeps 10 ms of real time).
        tp: tensor-parallel degree (devices per replica).
        seed: mixed into every request's token stream.
        mean_response_tokens: mean of the geometric response length when
            ``response_tokens`` is not given.
        response_tokens: ``fn(request) -> int`` choosing each response's length (e.g.
            :func:`rollart_nb.sim.workloads.response_tokens_fn`); capped at
            ``request.max_new_tokens``.
        policy: how tokens are chosen; only ``"hash"`` (seeded by the request) exists.
        link_gbps: GB/s of the prefill-to-decode link, for :meth:`decode` after a remote
            :meth:`prefill` (400 Gbit/s InfiniBand = 50 GB/s).
        mfu: achieved fraction of peak FLOP/s.
        mbu: achieved fraction of peak memory bandwidth.
        vocab_size: ids are drawn from ``[3, vocab_size)``.
        tokenizer: decodes ``result.text``; a :class:`SimTokenizer` by default.
        name: reported as ``result.worker``.
        history_tokens: token budget of the history store (lengths only, so cheap).

    Raises:
        ConfigError: a bad argument, or the model does not fit on ``tp`` devices.

    Example:
        >>> import asyncio
        >>> from rollart_nb.models.spec import spec
        >>> from rollart_nb.resources.profiles import PROFILES
        >>> b = SimBackend(spec("qwen3-8b"), PROFILES["H20"], time_scale=0)
        >>> r = asyncio.run(b.generate(GenerationRequest("t0", "math", [5] * 100, max_new_tokens=16)))
        >>> r.version, r.prefill_s > 0, r.decode_s > 0
        (0, True, True)
    """

    def __init__(
        self,
        spec: ModelSpec,
        hardware: HardwareProfile,
        *,
        time_scale: float | None = None,
        tp: int = 1,
        seed: int = 0,
        mean_response_tokens: int = 64,
        response_tokens: Callable[[GenerationRequest], int] | None = None,
        policy: str = "hash",
        link_gbps: float = 50.0,
        mfu: float = 0.5,
        mbu: float = 0.7,
        vocab_size: int = 32000,
        tokenizer: Tokenizer | None = None,
        name: str = "sim",
        history_tokens: int = 1 << 32,
    ) -> None:
        problems = []
        time_scale = resolve_time_scale(time_scale)
        if time_scale < 0:
            problems.append(f"time_scale must be >= 0, got {time_scale}")
        if tp < 1:
            problems.append(f"tp must be >= 1, got {tp}")
        if mean_response_tokens < 1:
            problems.append(f"mean_response_tokens must be >= 1, got {mean_response_tokens}")
        if policy != "hash":
            problems.append(f"policy must be 'hash', got {policy!r}")
        if link_gbps <= 0:
            problems.append(f"link_gbps must be > 0, got {link_gbps}")
        for what, v in (("mfu", mfu), ("mbu", mbu)):
            if not 0 < v <= 1:
                problems.append(f"{what} must be in (0, 1], got {v}")
        if vocab_size < 4:
            problems.append(f"vocab_size must be >= 4, got {vocab_size}")
        free = (hardware.mem_gb * 1e9 * tp - spec.weight_bytes) * KV_MEMORY_FRACTION
        if tp >= 1 and free <= 0:
            problems.append(
                f"{spec.name} ({spec.weight_bytes / 1e9:.1f} GB of weights) does not fit on "
                f"{tp} x {hardware.name} ({hardware.mem_gb:g} GB each); raise tp"
            )
        if problems:
            raise ConfigError(problems, where="SimBackend")
        self.spec, self.hardware, self.name = spec, hardware, name
        self.time_scale, self.tp, self.seed = time_scale, tp, seed
        self.mean_response_tokens, self.link_gbps = mean_response_tokens, link_gbps
        self.mfu, self.mbu, self.vocab_size = mfu, mbu, vocab_size
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else SimTokenizer(vocab_size)
        self._response_tokens = response_tokens
        self.version = 0
        #: Each trajectory's history length (what ``prefix_len`` of its next request must be).
        self.history = HistoryStore(history_tokens, keep_ids=False, name=name)
        #: Prefix-cache capacity in tokens (memory left after the weights).
        self.kv_capacity_tokens = int(free // spec.kv_bytes_per_token)
        self._cache: OrderedDict[str, _Prefix] = OrderedDict()  # LRU order, oldest first
        self._cached_tokens = 0
        self._active: dict[int, int] = {}  # decode key -> context tokens at admission
        self._active_ctx = 0
        self._keys = itertools.count()
        self._aborts: dict[str, set[asyncio.Event]] = {}
        self._prefill_free_at = 0.0  # loop time when queued prefill compute drains
        self._stats = {
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "recomputed_tokens": 0,
            "busy_s": 0.0,
            "requests": 0,
            "aborted": 0,
            "kv_transfer_s": 0.0,
        }

    # -- the GenerationBackend protocol ------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Prefill what is not cached, decode the response, sleep the modelled time.

        Returns ``finish_reason`` "stop" (eos appended, length below the budget), "length"
        or "abort" (with the tokens decoded before :meth:`abort`).

        Raises:
            HistoryMiss: ``request.prefix_len`` is not the history length this backend holds.
        """
        full = self.history.full_len(request)
        version = self.version
        ev = self._register(request.traj_id)
        try:
            self._stats["requests"] += 1
            pf = await self._prefill_phase(request, full, version, ev)
            ids, logprobs, finish = self._policy(request, full, version)
            if pf.aborted:
                return self._result(request, version, [], [], "abort", pf.prefill_s, 0.0, pf.recomputed)
            decode_s, done = await self._decode_phase(full, len(ids), ev)
            if done < len(ids):
                return self._result(
                    request, version, ids[:done], logprobs[:done], "abort", pf.prefill_s, decode_s, pf.recomputed
                )
            self._remember(request.traj_id, full + len(ids), version)
            if request.last_turn:
                self.history.forget(request.traj_id)
            else:
                self.history.keep_length(request.traj_id, full + len(ids))
            return self._result(request, version, ids, logprobs, finish, pf.prefill_s, decode_s, pf.recomputed)
        finally:
            self._unregister(request.traj_id, ev)

    async def abort(self, traj_id: str) -> None:
        """End every in-flight call for ``traj_id`` now (they return "abort") and drop its cache."""
        for ev in self._aborts.get(traj_id, ()):
            ev.set()
        self.forget(traj_id)

    def load_weights(self, state: dict[str, Any], version: int) -> None:
        """Serve policy ``version`` from now on. ``state`` is ignored (the sim has no weights);
        cached prefixes are kept and recomputed on their next turn because their version is old."""
        self.version = int(version)

    # -- prefill/decode disaggregation ---------------------------------------------------
    async def prefill(self, request: GenerationRequest) -> dict[str, Any]:
        """Prefill only (this worker is a P node). Returns what the D node needs:

        ``{"traj_id", "tokens" (KV computed now, to transfer), "prompt_tokens" (the whole
        prompt's length), "version", "prefill_s", "recomputed_tokens", "aborted"}``.

        The history is resolved here: the decode node needs only what this returns. The
        response is generated by the decode node, so the next request's ``prefix_len`` may
        exceed the prompt kept here by that response (its tokens are prefilled as new).

        Raises:
            HistoryMiss: this node does not hold the history ``request.prefix_len`` expects.
        """
        full = self.history.full_len(request)
        version = self.version
        ev = self._register(request.traj_id)
        try:
            self._stats["requests"] += 1
            pf = await self._prefill_phase(request, full, version, ev)
            if not pf.aborted:
                self._remember(request.traj_id, full, version)
                self.history.keep_length(request.traj_id, full, response_elsewhere=True)
            return {
                "traj_id": request.traj_id,
                "tokens": pf.computed,
                "prompt_tokens": full,
                "version": version,
                "prefill_s": pf.prefill_s,
                "recomputed_tokens": pf.recomputed,
                "aborted": pf.aborted,
            }
        finally:
            self._unregister(request.traj_id, ev)

    async def decode(self, request: GenerationRequest, prefilled: dict[str, Any]) -> GenerationResult:
        """Decode only (this worker is a D node), after receiving the KV that :meth:`prefill` made.

        Charges the KV transfer (``kv_bytes_per_token * prefilled["tokens"] / link_gbps``;
        the D node keeps earlier turns' KV, so only newly computed KV moves) plus decode.
        ``result.prefill_s`` echoes the P node's time; ``decode_s`` includes the transfer.
        The result carries the older of the two nodes' versions (conservative for staleness).
        The whole prompt's length comes from ``prefilled["prompt_tokens"]``: ``request`` may
        carry only its tail, and this node keeps no history of its own.
        """
        full = int(prefilled["prompt_tokens"])
        version = min(self.version, int(prefilled["version"]))
        if prefilled.get("aborted"):
            return self._result(
                request,
                version,
                [],
                [],
                "abort",
                float(prefilled["prefill_s"]),
                0.0,
                int(prefilled["recomputed_tokens"]),
            )
        transfer_s = self.spec.kv_bytes_per_token * prefilled["tokens"] / (self.link_gbps * 1e9)
        self._stats["kv_transfer_s"] += transfer_s
        ev = self._register(request.traj_id)
        try:
            self._stats["requests"] += 1
            ids, logprobs, finish = self._policy(request, full, version)
            decode_s, done = await self._decode_phase(full, len(ids), ev, extra_s=transfer_s)
            if done < len(ids):
                ids, logprobs, finish = ids[:done], logprobs[:done], "abort"
            return self._result(
                request,
                version,
                ids,
                logprobs,
                finish,
                float(prefilled["prefill_s"]),
                decode_s,
                int(prefilled["recomputed_tokens"]),
            )
        finally:
            self._unregister(request.traj_id, ev)

    # -- cache and accounting ------------------------------------------------------------
    def forget(self, traj_id: str) -> None:
        """Drop a finished trajectory's cached prefix and history."""
        self.history.forget(traj_id)
        old = self._cache.pop(traj_id, None)
        if old is not None:
            self._cached_tokens -= old.tokens

    def cached_tokens(self, traj_id: str) -> int:
        """Length of the cached prefix of ``traj_id`` (0 if none)."""
        p = self._cache.get(traj_id)
        return 0 if p is None else p.tokens

    def stats(self) -> dict[str, float]:
        """Counters since construction: ``prefill_tokens`` (computed, recompute included),
        ``decode_tokens``, ``recomputed_tokens``, ``busy_s`` (modelled device-seconds: each
        prefill's time plus each decode's share of its batch), ``requests``, ``aborted``,
        ``kv_transfer_s``, the current ``active`` decodes and ``cached_tokens``, and the
        history store's ``history_tokens`` held and ``history_misses``."""
        h = self.history.stats()
        return {
            **self._stats,
            "active": len(self._active),
            "cached_tokens": self._cached_tokens,
            "history_tokens": h["tokens"],
            "history_misses": h["misses"],
        }

    def __repr__(self) -> str:
        return (
            f"SimBackend({self.spec.name} on {self.tp}x{self.hardware.name}, version={self.version}, "
            f"time_scale={self.time_scale:g})"
        )

    # -- internals -------------------------------------------------------------------------
    def _register(self, traj_id: str) -> asyncio.Event:
        ev = asyncio.Event()
        self._aborts.setdefault(traj_id, set()).add(ev)
        return ev

    def _unregister(self, traj_id: str, ev: asyncio.Event) -> None:
        evs = self._aborts.get(traj_id)
        if evs is not None:
            evs.discard(ev)
            if not evs:
                del self._aborts[traj_id]
        if ev.is_set():
            self._stats["aborted"] += 1

    async def _sleep(self, modelled_s: float, ev: asyncio.Event) -> bool:
        """Sleep ``modelled_s * time_scale``; True if aborted first."""
        if ev.is_set() or modelled_s * self.time_scale <= 0:
            return ev.is_set()
        try:
            await asyncio.wait_for(ev.wait(), modelled_s * self.time_scale)
            return True
        except TimeoutError:
            return False

    def _remember(self, traj_id: str, tokens: int, version: int) -> None:
        old = self._cache.pop(traj_id, None)
        if old is not None:
            self._cached_tokens -= old.tokens
        if tokens > self.kv_capacity_tokens:
            return
        self._cache[traj_id] = _Prefix(tokens, version)
        self._cached_tokens += tokens
        while self._cached_tokens > self.kv_capacity_tokens:  # evict least recently used
            _, old = self._cache.popitem(last=False)
            self._cached_tokens -= old.tokens

    async def _prefill_phase(self, request: GenerationRequest, n: int, version: int, ev: asyncio.Event) -> _Prefilled:
        """Prefill of a whole prompt of ``n`` tokens, less what the prefix cache holds."""
        cached = self._cache.get(request.traj_id)
        recomputed = 0
        if cached is not None and cached.version != version:
            recomputed = n  # weights changed mid-trajectory: the whole history's KV is stale
            reuse = 0
        elif cached is not None:
            reuse = max(min(cached.tokens, n - 1), 0)  # the last prompt token always runs, for its logits
        else:
            reuse = 0
        new = max(n - reuse, 0)
        compute_s = prefill_flops(self.spec, new, reuse) / (self.tp * self.hardware.bf16_tflops * 1e12 * self.mfu)
        floor_s = weights_read_bytes(self.spec, new) / (self.tp * self.hardware.mem_bw_gbps * 1e9)
        # FCFS on the device's FLOPs: wait for queued prefill compute, then take our share.
        now = asyncio.get_running_loop().time()  # a SimSession's virtual clock, or monotonic
        wait_s = max(self._prefill_free_at - now, 0.0) / self.time_scale if self.time_scale > 0 else 0.0
        self._prefill_free_at = max(now, self._prefill_free_at) + compute_s * self.time_scale
        prefill_s = max(wait_s + compute_s, floor_s)
        self._stats["prefill_tokens"] += new
        self._stats["recomputed_tokens"] += recomputed
        self._stats["busy_s"] += max(compute_s, floor_s)
        aborted = await self._sleep(prefill_s, ev)
        return _Prefilled(prefill_s, new, recomputed, aborted)

    async def _decode_phase(
        self, context: int, tokens: int, ev: asyncio.Event, extra_s: float = 0.0
    ) -> tuple[float, int]:
        """Decode ``tokens`` after a prompt of ``context`` tokens. Returns (modelled decode
        seconds incl. ``extra_s``, tokens decoded before any abort)."""
        key = next(self._keys)
        self._active[key] = context
        self._active_ctx += context
        try:
            batch = len(self._active)
            decode_s = decode_time(
                self.spec,
                self.hardware,
                tokens,
                self._active_ctx / batch,
                batch=batch,
                tp=self.tp,
                mbu=self.mbu,
                mfu=self.mfu,
            )
            total_s = extra_s + decode_s
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            if not await self._sleep(total_s, ev):
                done = tokens
            else:  # tokens finished before the abort, pro rata over the decode (after any transfer)
                elapsed = (loop.time() - t0) / self.time_scale if self.time_scale > 0 else 0.0
                frac = (elapsed - extra_s) / decode_s if decode_s > 0 else 0.0
                done = min(max(int(tokens * frac), 0), tokens - 1) if tokens else 0
            self._stats["decode_tokens"] += done
            self._stats["busy_s"] += decode_s / batch * (done / tokens if tokens else 0.0)
            return total_s, done
        finally:
            del self._active[key]
            self._active_ctx -= context

    def _policy(self, request: GenerationRequest, full: int, version: int) -> tuple[list[int], list[float], str]:
        """Content-free, deterministic tokens: a function of (seed, trajectory, whole prompt
        length ``full``, version, request seed). Greedy requests ignore the sampling seed, as
        real engines do."""
        budget = request.max_new_tokens
        if budget <= 0:
            return [], [], "length"
        sampling_seed = None if request.temperature == 0 else request.seed
        key = f"{self.seed}|{request.traj_id}|{full}|{version}|{sampling_seed}"
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        if self._response_tokens is not None:
            n = int(self._response_tokens(request))
        else:
            n = int(rng.geometric(1.0 / self.mean_response_tokens))
        n = min(max(n, 1), budget)
        finish = "stop" if n < budget else "length"
        ids = rng.integers(3, self.vocab_size, size=n).tolist()
        if finish == "stop":
            ids[-1] = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 1
        logprobs = np.minimum(-rng.exponential(1.0, size=n), -1e-6).tolist()
        return ids, logprobs, finish

    def _result(
        self,
        request: GenerationRequest,
        version: int,
        ids: list[int],
        logprobs: list[float],
        finish: str,
        prefill_s: float,
        decode_s: float,
        recomputed: int,
    ) -> GenerationResult:
        return GenerationResult(
            traj_id=request.traj_id,
            token_ids=ids,
            logprobs=logprobs,
            version=version,
            finish_reason=finish,
            text=self.tokenizer.decode(ids),
            worker=self.name,
            prefill_s=prefill_s,
            decode_s=decode_s,
            recomputed_tokens=recomputed,
        )
