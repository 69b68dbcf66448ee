"""SimBackend: a generation backend whose time comes from a roofline model of its hardware.

It is a real backend for what-if studies, not a mock: the control plane drives it exactly as
it drives ``hf`` or ``vllm``. Tokens are cheap and content-free (the sim never learns); what
is modelled is *time*, by a discrete-event model of one serving engine (one worker = one
replica on ``tp`` devices) that works as vLLM's V1 scheduler does:

* **Continuous batching in iterations.** Each iteration is one forward pass that decodes one
  token for every running sequence and, with chunked prefill, prefills up to
  ``chunk_tokens`` prompt tokens (counting one per decode) of the oldest admitted requests.
  Its time is :func:`~rollart_nb.sim.roofline.iteration_time`: memory-bound on the weights plus
  every sequence's KV, compute-bound on the FLOPs, so a prefill chunk slows every decode that
  shares its pass (the interference that PD disaggregation and affinity routing remove). Runs
  of pure decode iterations are priced in closed form (:func:`~rollart_nb.sim.roofline.decode_time`)
  until the next sequence ends or a request arrives, so the cost is per event, not per token.
* **KV capacity.** Device memory left after the weights (``KV_MEMORY_FRACTION`` of it) holds
  ``kv_capacity_tokens`` of KV. A request is admitted only when its whole sequence (prompt plus
  the response it will produce) fits beside the running ones and ``max_num_seqs`` allows; it
  waits in FCFS order otherwise. Approximation: vLLM admits optimistically and preempts when it
  runs out; reserving the final length up front never preempts but may admit a little later.
* **Prefix cache** keyed by trajectory (cached length and the policy version it was computed
  under), in the same memory, least recently used evicted first when admissions need room. A
  trajectory's cached prefix is not prefilled again; after a weight change the whole prompt is
  (step 5 of the protocol, KV recompute), counted in ``recomputed_tokens``.
* A request's ``prefill_s`` is from its arrival to the end of its prefill (waiting for memory
  and for earlier prompts included); ``decode_s`` from there to its last token. Results report
  *modelled* seconds; the engine sleeps them times ``time_scale`` on the loop (0: no sleeping,
  the engine's own clock still advances).

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
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollart_nb.backends.history import HistoryStore
from rollart_nb.clock import host_for, resolve_time_scale
from rollart_nb.clock.cores import Host
from rollart_nb.errors import ConfigError
from rollart_nb.models.spec import ModelSpec
from rollart_nb.protocols import GenerationRequest, GenerationResult, Tokenizer
from rollart_nb.resources.profiles import HardwareProfile
from rollart_nb.sim.roofline import decode_steps_within, decode_time, iteration_time
from rollart_nb.sim.tokenizer import SimTokenizer

__all__ = ["SimBackend"]

#: Fraction of the memory left after the weights that holds KV cache (as vLLM's
#: gpu_memory_utilization, default 0.9, leaves headroom for activations).
KV_MEMORY_FRACTION = 0.9

#: Token budget of one iteration (prefill chunk plus one token per decode) and the most sequences
#: served at once: vLLM V1's defaults for the offline ``LLM`` class on devices of 70 GiB or more
#: (``EngineArgs.get_batch_defaults``: max_num_batched_tokens 16384, max_num_seqs 1024).
CHUNK_TOKENS = 16384
MAX_NUM_SEQS = 1024

#: GB/s from host memory to one device: PCIe Gen5 x16, 64 GB/s each way (the H100/H800/H20
#: datasheets list 128 GB/s both ways together). New weights pulled into host memory load this way.
PCIE_GBPS = 64.0


@dataclass
class _Prefix:
    tokens: int  # cached prefix length
    version: int  # policy version its KV was computed under


@dataclass(eq=False)
class _Job:
    """One request inside the engine: waiting for memory, prefilling, then decoding."""

    traj_id: str
    prompt: int  # whole prompt's tokens
    total: int  # tokens to decode (0: prefill only, a P node)
    arrived: float  # modelled time it arrived
    done_fut: asyncio.Future
    version: int = 0
    reuse: int = 0  # prompt tokens whose KV is cached (not prefilled)
    left: int = 0  # prompt tokens still to prefill
    recomputed: int = 0
    decoded: int = 0
    prefill_done: float | None = None
    aborted: bool = False
    reserve: int = 0  # KV tokens held while it runs (prompt + response)
    kv_ready: bool = False  # its prompt's KV arrived with it (a PD decode node): nothing to prefill
    extra_s: float = 0.0  # modelled seconds before it may decode (a PD node's KV transfer)
    ready_at: float = 0.0
    started: bool = False  # its first prefill pass began (the engine's per-row work is paid there)
    parts: dict[str, Any] = field(default_factory=dict)

    @property
    def context(self) -> int:
        return self.prompt + self.decoded


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
        chunk_tokens: token budget of one iteration (chunked prefill); None: a prompt is
            prefilled whole in one pass, stalling every decode on the device meanwhile.
        max_num_seqs: most sequences admitted at once.
        vocab_size: ids are drawn from ``[3, vocab_size)``.
        tokenizer: decodes ``result.text``; a :class:`SimTokenizer` by default.
        name: reported as ``result.worker``.
        batch_wait_s: modelled seconds a request waits before the engine takes it, as a
            batching engine holds a request for batch mates (:data:`~rollart_nb.backends.hf.BATCH_WAIT_S`
            for the ``hf`` backend); paid by :meth:`generate` and by a PD prefill node's
            :meth:`prefill`. 0 (default): a continuous-batching engine such as vLLM, which takes
            a request at its next iteration.
        history_tokens: token budget of the history store (lengths only, so cheap).
        static_batching: run each batch to its end before taking the next, as the ``hf``
            backend does (its requests gathered for ``batch_wait_s`` once the engine is free,
            then prefilled together in one pass and decoded until the last one ends); False
            (default): continuous batching, as vLLM does (a request joins at the next iteration).
        row_overhead_s: modelled seconds of the engine's own work per request, paid in the pass
            where its prefill starts (building its row, copying its cached KV in and out, its
            sampling; measured by :func:`rollart_nb.bench.calibrate.row_overhead`). 0 (default):
            a GPU engine, where that work is negligible beside a pass.
        load_overhead_s: fixed modelled seconds of loading a new weight version besides moving
            its bytes (deserialize, copy into the model; measured by
            :func:`rollart_nb.bench.calibrate.measure_weight_sync`); paid by :meth:`aload_weights`.

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
        chunk_tokens: int | None = CHUNK_TOKENS,
        max_num_seqs: int = MAX_NUM_SEQS,
        vocab_size: int = 32000,
        tokenizer: Tokenizer | None = None,
        name: str = "sim",
        history_tokens: int = 1 << 32,
        batch_wait_s: float = 0.0,
        static_batching: bool = False,
        row_overhead_s: float = 0.0,
        load_overhead_s: float = 0.0,
    ) -> None:
        problems = []
        if not (isinstance(batch_wait_s, int | float) and batch_wait_s >= 0):
            problems.append(f"batch_wait_s must be >= 0 seconds, got {batch_wait_s!r}")
        if not (isinstance(row_overhead_s, int | float) and row_overhead_s >= 0):
            problems.append(f"row_overhead_s must be >= 0 seconds, got {row_overhead_s!r}")
        if not (isinstance(load_overhead_s, int | float) and load_overhead_s >= 0):
            problems.append(f"load_overhead_s must be >= 0 seconds, got {load_overhead_s!r}")
        time_scale = resolve_time_scale(time_scale)
        if time_scale < 0:
            problems.append(f"time_scale must be >= 0, got {time_scale}")
        if tp < 1:
            problems.append(f"tp must be >= 1, got {tp}")
        elif tp > 1 and hardware.nvlink_gbps <= 0:
            problems.append(f"tp={tp} needs a device interconnect; {hardware.name} has none (nvlink_gbps=0)")
        if mean_response_tokens < 1:
            problems.append(f"mean_response_tokens must be >= 1, got {mean_response_tokens}")
        if policy != "hash":
            problems.append(f"policy must be 'hash', got {policy!r}")
        if link_gbps <= 0:
            problems.append(f"link_gbps must be > 0, got {link_gbps}")
        for what, v in (("mfu", mfu), ("mbu", mbu)):
            if not 0 < v <= 1:
                problems.append(f"{what} must be in (0, 1], got {v}")
        if chunk_tokens is not None and chunk_tokens < 1:
            problems.append(f"chunk_tokens must be >= 1 or None, got {chunk_tokens}")
        if max_num_seqs < 1:
            problems.append(f"max_num_seqs must be >= 1, got {max_num_seqs}")
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
        self.chunk_tokens, self.max_num_seqs = chunk_tokens, max_num_seqs
        self.batch_wait_s, self.load_overhead_s = float(batch_wait_s), float(load_overhead_s)
        self.static_batching, self.row_overhead_s = bool(static_batching), float(row_overhead_s)
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else SimTokenizer(vocab_size)
        self._response_tokens = response_tokens
        self.version = 0
        #: Each trajectory's history length (what ``prefix_len`` of its next request must be).
        self.history = HistoryStore(history_tokens, keep_ids=False, name=name)
        #: KV capacity in tokens (memory left after the weights): running sequences and the prefix cache.
        self.kv_capacity_tokens = int(free // spec.kv_bytes_per_token)
        self._cache: OrderedDict[str, _Prefix] = OrderedDict()  # LRU order, oldest first
        self._cached_tokens = 0
        # the engine: FCFS queue waiting for memory, then admitted (prefilling, then decoding)
        self._waiting: deque[_Job] = deque()
        self._prefilling: deque[_Job] = deque()
        self._decoding: list[_Job] = []
        self._kv_used = 0  # KV tokens reserved by admitted jobs
        self._engine: asyncio.Task | None = None
        # new on each start of the engine (an Event belongs to the loop that first waits on it)
        self._wake = asyncio.Event()  # an arrival or an abort
        self._abort_ev = asyncio.Event()  # an abort only
        self._t = 0.0  # modelled seconds, as of the loop time _anchor
        self._anchor = 0.0
        self._lag = 0.0  # modelled seconds the last pass took beyond its work (shared cores)
        self._keys = itertools.count()
        self._stats = {
            "prefill_tokens": 0,
            "decode_tokens": 0,
            "recomputed_tokens": 0,
            "busy_s": 0.0,
            "requests": 0,
            "aborted": 0,
            "kv_transfer_s": 0.0,
            "iterations": 0,
            "kv_waits": 0,
            "weight_load_s": 0.0,
        }

    # -- the GenerationBackend protocol ------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Prefill what is not cached, decode the response, in the engine (modelled time slept).

        Returns ``finish_reason`` "stop" (eos appended, length below the budget), "length"
        or "abort" (with the tokens decoded before :meth:`abort`).

        Raises:
            HistoryMiss: ``request.prefix_len`` is not the history length this backend holds.
        """
        full = self.history.full_len(request)
        self._stats["requests"] += 1
        await self._batch_wait()
        ids, logprobs, finish = self._policy(request, full, self.version)
        job = await self._run_job(request.traj_id, full, len(ids))
        if job.aborted:
            n = job.decoded
            return self._result(request, job, ids[:n], logprobs[:n], "abort")
        self._remember(request.traj_id, full + len(ids), job.version)
        if request.last_turn:
            self.history.forget(request.traj_id)
        else:
            self.history.keep_length(request.traj_id, full + len(ids))
        return self._result(request, job, ids, logprobs, finish)

    async def abort(self, traj_id: str) -> None:
        """End every in-flight call for ``traj_id`` now (they return "abort" with the tokens
        decoded so far) and drop its cache and history."""
        hit = False
        for job in [*self._waiting, *self._prefilling, *self._decoding]:
            if job.traj_id == traj_id and not job.aborted:
                job.aborted, hit = True, True
        if hit:
            self._wake.set()
            self._abort_ev.set()
        self.forget(traj_id)

    def load_weights(self, state: dict[str, Any], version: int) -> None:
        """Serve policy ``version`` from now on. ``state`` is ignored (the sim has no weights);
        cached prefixes are kept and recomputed on their next turn because their version is old."""
        self.version = int(version)

    def weight_pull_s(self) -> tuple[float, float]:
        """Modelled ``(pull_s, load_s)`` of a new version: each of the ``tp`` devices pulls its
        shard of the weights from the store over its own network link (``hardware.net_gbps``,
        else ``link_gbps``), in the background once the trainer published them, then copies it
        from host memory to the device (:data:`PCIE_GBPS`; the rollout waits for this part)::

            pull_s = weight_bytes / (tp * net_gbps * 1e9)
            load_s = weight_bytes / (tp * PCIE_GBPS * 1e9)
        """
        net = self.hardware.net_gbps if self.hardware.net_gbps > 0 else self.link_gbps
        return (
            self.spec.weight_bytes / (self.tp * net * 1e9),
            self.spec.weight_bytes / (self.tp * PCIE_GBPS * 1e9),
        )

    async def aload_weights(self, state: dict[str, Any], version: int) -> float:
        """:meth:`load_weights` after the modelled time a Mooncake-style update exposes: the
        rest of the background pull (it began when the trainer published, ``state["published_at"]``
        in loop time; all of it when unknown) plus the host-to-device copy, then
        ``load_overhead_s`` (on the host's shared cores, if this is one of its CPUs). Returns the
        modelled seconds waited (also summed in ``stats()["weight_load_s"]``)."""
        pull_s, load_s = self.weight_pull_s()
        published = state.get("published_at") if isinstance(state, dict) else None
        wait_s = load_s + pull_s
        if published is not None and self.time_scale > 0:
            left = published + pull_s * self.time_scale - asyncio.get_running_loop().time()
            wait_s = load_s + max(left, 0.0) / self.time_scale
        if self.time_scale > 0:
            await asyncio.sleep(wait_s * self.time_scale)
            if self.load_overhead_s > 0:
                loop = asyncio.get_running_loop()
                t0 = loop.time()
                await host_for(self.hardware).compute(self.load_overhead_s * self.time_scale)
                wait_s += (loop.time() - t0) / self.time_scale  # longer on busy shared cores
        else:
            wait_s += self.load_overhead_s
        self._stats["weight_load_s"] += wait_s
        self.load_weights(state, version)
        return wait_s

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
        self._stats["requests"] += 1
        await self._batch_wait()
        job = await self._run_job(request.traj_id, full, 0)
        if not job.aborted:
            self._remember(request.traj_id, full, job.version)
            self.history.keep_length(request.traj_id, full, response_elsewhere=True)
        return {
            "traj_id": request.traj_id,
            "tokens": full - job.reuse,
            "prompt_tokens": full,
            "version": job.version,
            "prefill_s": job.parts.get("prefill_s", 0.0),
            "recomputed_tokens": job.recomputed,
            "aborted": job.aborted,
        }

    async def decode(self, request: GenerationRequest, prefilled: dict[str, Any]) -> GenerationResult:
        """Decode only (this worker is a D node), after receiving the KV that :meth:`prefill` made.

        Charges the KV transfer of the prompt tokens this node does not hold
        (``kv_bytes_per_token * tokens / link_gbps``: the proxy keeps a trajectory on one decode
        node, which keeps its KV between turns while the weights do not change) plus decode.
        ``result.prefill_s`` echoes the P node's time; ``decode_s`` includes the transfer.
        The result carries the older of the two nodes' versions (conservative for staleness).
        The whole prompt's length comes from ``prefilled["prompt_tokens"]``: ``request`` may
        carry only its tail, and this node keeps no history of its own.
        """
        full = int(prefilled["prompt_tokens"])
        version = min(self.version, int(prefilled["version"]))
        pre_s, recomputed = float(prefilled["prefill_s"]), int(prefilled["recomputed_tokens"])
        if prefilled.get("aborted"):
            return GenerationResult(
                traj_id=request.traj_id,
                token_ids=[],
                logprobs=[],
                version=version,
                finish_reason="abort",
                text="",
                worker=self.name,
                prefill_s=pre_s,
                decode_s=0.0,
                recomputed_tokens=recomputed,
            )
        mine = self._cache.get(request.traj_id)
        held = mine.tokens if mine is not None and mine.version == version and mine.tokens <= full else 0
        moved = max(full - held, int(prefilled["tokens"]))
        transfer_s = self.spec.kv_bytes_per_token * moved / (self.link_gbps * 1e9)
        self._stats["kv_transfer_s"] += transfer_s
        self._stats["requests"] += 1
        ids, logprobs, finish = self._policy(request, full, version)
        job = await self._run_job(request.traj_id, full, len(ids), kv_ready=True, extra_s=transfer_s)
        n = job.decoded if job.aborted else len(ids)
        if not job.aborted:
            self._remember(request.traj_id, full + n, version)
        return GenerationResult(
            traj_id=request.traj_id,
            token_ids=ids[:n],
            logprobs=logprobs[:n],
            version=version,
            finish_reason="abort" if job.aborted else finish,
            text=self.tokenizer.decode(ids[:n]),
            worker=self.name,
            prefill_s=pre_s,
            decode_s=job.parts.get("decode_s", 0.0),
            recomputed_tokens=recomputed,
        )

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
        ``decode_tokens``, ``recomputed_tokens``, ``busy_s`` (modelled seconds the engine ran an
        iteration), ``iterations``, ``requests``, ``aborted``, ``kv_transfer_s``, ``kv_waits``
        (requests that waited for KV memory), ``weight_load_s`` (modelled seconds weight
        updates made the rollout wait); now: ``active`` (admitted requests), ``waiting``
        (queued for memory), ``kv_used_tokens`` (reserved by admitted requests),
        ``cached_tokens`` (prefix cache), and the history store's ``history_tokens`` and
        ``history_misses``."""
        h = self.history.stats()
        return {
            **self._stats,
            "active": len(self._prefilling) + len(self._decoding),
            "waiting": len(self._waiting),
            "kv_used_tokens": self._kv_used,
            "cached_tokens": self._cached_tokens,
            "history_tokens": h["tokens"],
            "history_misses": h["misses"],
        }

    def __repr__(self) -> str:
        return (
            f"SimBackend({self.spec.name} on {self.tp}x{self.hardware.name}, version={self.version}, "
            f"time_scale={self.time_scale:g})"
        )

    # -- the engine ------------------------------------------------------------------------
    def _now(self) -> float:
        """Modelled seconds now (the engine's clock, caught up with the loop while idle)."""
        if self.time_scale > 0:
            loop_now = asyncio.get_running_loop().time()
            return self._t + (loop_now - self._anchor) / self.time_scale
        return self._t

    def _set_now(self, t: float) -> None:
        self._t, self._lag = t + self._lag, 0.0
        if self.time_scale > 0:
            self._anchor = asyncio.get_running_loop().time()

    async def _batch_wait(self) -> None:
        """A batching engine holds each request ``batch_wait_s`` for batch mates (a static
        batcher waits once per batch instead, in the engine loop)."""
        if self.batch_wait_s > 0 and self.time_scale > 0 and not self.static_batching:
            await asyncio.sleep(self.batch_wait_s * self.time_scale)

    async def _run_job(
        self, traj_id: str, prompt: int, total: int, *, kv_ready: bool = False, extra_s: float = 0.0
    ) -> _Job:
        """Queue a job, run the engine until it ends; the job's ``parts`` hold ``prefill_s`` and
        ``decode_s``. ``kv_ready``: its prompt's KV arrived from elsewhere (decode only)."""
        loop = asyncio.get_running_loop()
        if self._engine is None or self._engine.done():
            self._set_now(self._now())
            self._wake, self._abort_ev = asyncio.Event(), asyncio.Event()
        job = _Job(traj_id, prompt, total, self._now(), loop.create_future(), extra_s=extra_s)
        if kv_ready:
            job.kv_ready, job.reuse, job.left = True, prompt, 0
        self._waiting.append(job)
        if self._engine is None or self._engine.done():
            self._engine = loop.create_task(self._loop())
        else:
            self._wake.set()
        try:
            await asyncio.shield(job.done_fut)
        except asyncio.CancelledError:
            job.aborted = True  # the caller gave up: the engine drops it at the next event
            self._wake.set()
            raise
        return job

    def _admit(self, now: float) -> None:
        """Move waiting jobs (FCFS) into the engine while their KV fits and seats are free
        (with static batching: only into an idle engine, as the next batch)."""
        if self.static_batching and (self._prefilling or self._decoding):
            return
        while self._waiting:
            job = self._waiting[0]
            if job.aborted:
                self._waiting.popleft()
                self._end(job, now)
                continue
            if len(self._prefilling) + len(self._decoding) >= self.max_num_seqs:
                return
            mine = self._cache.get(job.traj_id)
            own = mine.tokens if mine is not None else 0
            need = job.prompt + job.total
            busy = self._kv_used > 0
            while not self._fits(need - own) and self._evict_one(job.traj_id):
                pass
            if busy and not self._fits(need - own):
                if not job.parts.get("waited"):
                    job.parts["waited"] = True
                    self._stats["kv_waits"] += 1
                return  # head-of-line: wait for a running sequence to end (an idle device takes anything)
            self._waiting.popleft()
            job.version = self.version
            if not job.kv_ready:  # (a decode-only job's KV came with the request)
                if mine is not None and mine.version != job.version:
                    job.recomputed, job.reuse = job.prompt, 0  # weights changed: the whole history's KV is stale
                elif mine is not None:
                    job.reuse = max(min(mine.tokens, job.prompt - 1), 0)  # the last prompt token runs, for its logits
                else:
                    job.reuse = 0
                job.left = job.prompt - job.reuse
            if mine is not None:  # its cached KV is now the job's own
                self._cache.pop(job.traj_id)
                self._cached_tokens -= mine.tokens
            job.reserve = need
            self._kv_used += need
            self._stats["recomputed_tokens"] += job.recomputed
            if job.left > 0:
                self._prefilling.append(job)
            else:
                self._start_decode(job, now)

    def _fits(self, tokens: int) -> bool:
        """True if ``tokens`` more KV fit beside the admitted jobs and the prefix cache."""
        return self._kv_used + self._cached_tokens + tokens <= self.kv_capacity_tokens

    def _evict_one(self, keep: str) -> bool:
        for tid in self._cache:
            if tid != keep:
                old = self._cache.pop(tid)
                self._cached_tokens -= old.tokens
                return True
        return False

    def _start_decode(self, job: _Job, now: float) -> None:
        job.prefill_done = now
        job.ready_at = now + job.extra_s
        if job.total == 0:
            self._end(job, now)
        else:
            self._decoding.append(job)

    def _end(self, job: _Job, now: float) -> None:
        """Release a job's memory and wake its caller."""
        if job in self._decoding:
            self._decoding.remove(job)
        elif job in self._prefilling:
            self._prefilling.remove(job)
        self._kv_used -= job.reserve
        job.reserve = 0
        pre_end = job.prefill_done if job.prefill_done is not None else now
        job.parts["prefill_s"] = pre_end - job.arrived
        job.parts["decode_s"] = now - pre_end if job.prefill_done is not None else 0.0
        if job.aborted:
            self._stats["aborted"] += 1
        if not job.done_fut.done():
            job.done_fut.set_result(None)

    def _drop_aborted(self, now: float) -> None:
        for q in (self._prefilling, self._decoding):
            for job in [j for j in q if j.aborted]:
                self._end(job, now)

    def _shared_host(self) -> Host | None:
        """The simulation's host when this device is one of its CPUs with shared cores, else None."""
        host = host_for(self.hardware)
        return host if host.cores is not None else None

    async def _pass(self, dt: float, ev: asyncio.Event, work: bool = True) -> float | None:
        """Sleep ``dt`` modelled seconds; returns the modelled seconds elapsed if ``ev`` cut it
        short, else None. On a host's shared cores (:mod:`rollart_nb.clock.cores`) ``dt`` is work,
        which may take longer while other work shares them; the extra time is added to the
        engine's clock at the next ``_set_now``. ``work=False``: a wait, not work (a KV transfer),
        which never takes a core."""
        ev.clear()
        if self.time_scale <= 0:
            await asyncio.sleep(0)
            return None
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        host = self._shared_host() if work else None
        if host is not None:
            done = await host.compute(dt * self.time_scale, ev)
            did = dt if done is None else min(done / self.time_scale, dt)
            self._lag = max((loop.time() - t0) / self.time_scale - did, 0.0)
            return None if done is None else did
        try:
            await asyncio.wait_for(ev.wait(), dt * self.time_scale)
        except TimeoutError:
            return None
        return min((loop.time() - t0) / self.time_scale, dt)

    async def _loop(self) -> None:
        """The engine: iterations until nothing is queued, admitted or decoding."""
        while True:
            now = self._now()
            self._drop_aborted(now)
            if self.static_batching and not self._prefilling and not self._decoding and self.time_scale > 0:
                # batch mates may join a batch of new requests (a PD decode node's arrive with their KV)
                if self.batch_wait_s > 0 and any(not j.aborted and not j.kv_ready for j in self._waiting):
                    await asyncio.sleep(self.batch_wait_s * self.time_scale)
                    now = self._now()
                    self._drop_aborted(now)
            self._admit(now)
            if not self._prefilling and not self._decoding:
                if not self._waiting:
                    return
                continue  # _admit took the head (an idle device takes anything) or dropped it
            if self._prefilling:
                await self._mixed_iteration(now)
            else:
                await self._decode_run(now)

    def _decode_ctx(self, now: float) -> tuple[list[_Job], int]:
        live = [j for j in self._decoding if j.ready_at <= now + 1e-12]
        return live, sum(j.context for j in live)

    async def _mixed_iteration(self, now: float) -> None:
        """One pass: a token for every ready decode plus a chunk of the oldest prompts."""
        live, ctx = self._decode_ctx(now)
        budget = None if self.chunk_tokens is None else max(self.chunk_tokens - len(live), 1)
        chunks: list[tuple[_Job, int]] = []
        if self.static_batching:  # the whole batch's prompts in one pass
            chunks = [(job, job.left) for job in self._prefilling]
        for job in () if self.static_batching else self._prefilling:
            take = job.left if budget is None else min(job.left, budget)
            chunks.append((job, take))
            if budget is not None:
                budget -= take
                if budget <= 0:
                    break
            else:
                break  # unchunked: one whole prompt per pass, decodes stall behind it
        if self.chunk_tokens is None or self.static_batching:
            live, ctx = [], 0  # a prefill-only pass
        prefill = [(n, j.prompt - j.left) for j, n in chunks]
        dt = iteration_time(self.spec, self.hardware, len(live), ctx, prefill, tp=self.tp, mbu=self.mbu, mfu=self.mfu)
        new_rows = [j for j, _ in chunks if not j.started]  # paid again if an abort cuts the pass
        dt += self.row_overhead_s * len(new_rows)
        cut = await self._pass(dt, self._abort_ev)  # arrivals wait for the pass; aborts cut it short
        if cut is not None:  # pro rata prefill progress, no decode token
            self._set_now(now + cut)
            for job, n in chunks:
                part = int(n * cut / dt) if dt > 0 else 0
                job.left -= part
                self._stats["prefill_tokens"] += part
            self._stats["busy_s"] += cut
            return
        self._set_now(now + dt)
        end = self._t  # now + dt, plus any time lost to shared cores
        self._stats["busy_s"] += dt
        self._stats["iterations"] += 1
        for j in new_rows:
            j.started = True
        for job, n in chunks:
            job.left -= n
            self._stats["prefill_tokens"] += n
            if job.left <= 0:
                self._prefilling.remove(job)
                self._start_decode(job, end)
        self._step(live, 1, end)

    async def _decode_run(self, now: float) -> None:
        """Pure decode iterations, priced in closed form, until a sequence ends, a PD decode's
        KV arrives, or a request arrives (then the steps done so far count)."""
        live, ctx = self._decode_ctx(now)
        pending = [j.ready_at for j in self._decoding if j.ready_at > now + 1e-12]
        if not live:  # only KV transfers in flight: wait for the first
            until = min(pending)
            cut = await self._pass(until - now, self._wake, work=False)
            self._set_now(now + (cut if cut is not None else until - now))
            return
        b = len(live)
        k = min(j.total - j.decoded for j in live)
        kw: dict[str, Any] = {"batch": b, "tp": self.tp, "mbu": self.mbu, "mfu": self.mfu}
        dt = decode_time(self.spec, self.hardware, k, ctx / b, **kw)
        if pending and now + dt > min(pending):  # stop when the next transferred KV is ready
            k = max(decode_steps_within(self.spec, self.hardware, min(pending) - now, ctx / b, limit=k, **kw), 1)
            dt = decode_time(self.spec, self.hardware, k, ctx / b, **kw)
        # arrivals cut a decode run short so they can join it; a static batch takes none of them
        cut = await self._pass(dt, self._abort_ev if self.static_batching else self._wake)
        if cut is not None:
            k = decode_steps_within(self.spec, self.hardware, cut, ctx / b, limit=k, **kw)
            dt = cut
        self._set_now(now + dt)  # plus any time lost to shared cores
        self._stats["busy_s"] += dt
        self._stats["iterations"] += k
        self._step(live, k, self._t)

    def _step(self, live: list[_Job], k: int, now: float) -> None:
        """``k`` decode tokens for each job in ``live``; finished ones end."""
        if k <= 0:
            return
        for job in live:
            n = min(k, job.total - job.decoded)
            job.decoded += n
            self._stats["decode_tokens"] += n
            if job.decoded >= job.total:
                self._end(job, now)

    def _remember(self, traj_id: str, tokens: int, version: int) -> None:
        old = self._cache.pop(traj_id, None)
        if old is not None:
            self._cached_tokens -= old.tokens
        if tokens > self.kv_capacity_tokens:
            return
        self._cache[traj_id] = _Prefix(tokens, version)
        self._cached_tokens += tokens
        while self._cached_tokens + self._kv_used > self.kv_capacity_tokens and self._cache:  # LRU eviction
            _, old = self._cache.popitem(last=False)
            self._cached_tokens -= old.tokens

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
        self, request: GenerationRequest, job: _Job, ids: list[int], logprobs: list[float], finish: str
    ) -> GenerationResult:
        return GenerationResult(
            traj_id=request.traj_id,
            token_ids=ids,
            logprobs=logprobs,
            version=job.version,
            finish_reason=finish,
            text=self.tokenizer.decode(ids),
            worker=self.name,
            prefill_s=job.parts.get("prefill_s", 0.0),
            decode_s=job.parts.get("decode_s", 0.0),
            recomputed_tokens=job.recomputed,
        )
