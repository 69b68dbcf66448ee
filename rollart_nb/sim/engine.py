"""The discrete-event model of one serving engine (one replica on ``tp`` devices), as vLLM's V1
scheduler works; :class:`~rollart_nb.sim.backend.SimBackend` answers requests with it.

* **Continuous batching in iterations.** Each iteration is one forward pass that decodes one
  token for every running sequence and, with chunked prefill, prefills up to
  ``chunk_tokens`` prompt tokens (counting one per decode) of the oldest admitted requests.
  Its time is :func:`~rollart_nb.sim.roofline.iteration_time`: memory-bound on the weights plus
  every sequence's KV, compute-bound on the FLOPs, so a prefill chunk slows every decode that
  shares its pass (the interference that PD disaggregation and affinity routing remove). Runs
  of pure decode iterations are priced in closed form (:func:`~rollart_nb.sim.roofline.decode_time`)
  until the next sequence ends or a request arrives, so the cost is per event, not per token.
* **KV capacity.** ``KV_MEMORY_FRACTION`` of the memory left after the weights holds
  ``kv_capacity_tokens``; a request is admitted (FCFS, within ``max_num_seqs``) only when its
  whole final sequence fits. vLLM admits optimistically and preempts instead: this never
  preempts but may admit a little later.
* **Prefix cache** per trajectory (length and policy version) in the same memory, LRU-evicted;
  after a weight change the whole prompt is prefilled again (``recomputed_tokens``).
* ``prefill_s`` runs from arrival to the end of prefill, ``decode_s`` to the last token
  (modelled seconds, slept times ``time_scale``).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from rollart_nb.clock import host_for
from rollart_nb.models.spec import ModelSpec
from rollart_nb.resources.profiles import HardwareProfile
from rollart_nb.sim.roofline import decode_steps_within, decode_time, iteration_time

__all__ = ["CHUNK_TOKENS", "KV_MEMORY_FRACTION", "MAX_NUM_SEQS", "Engine", "EngineSettings", "kv_free_bytes"]

#: Fraction of the memory left after the weights that holds KV cache (as vLLM's
#: gpu_memory_utilization, default 0.9, leaves headroom for activations).
KV_MEMORY_FRACTION = 0.9

#: Token budget of one iteration (prefill chunk plus one token per decode) and the most sequences
#: served at once: vLLM V1's defaults for the offline ``LLM`` class on devices of 70 GiB or more
#: (``EngineArgs.get_batch_defaults``: max_num_batched_tokens 16384, max_num_seqs 1024).
CHUNK_TOKENS = 16384
MAX_NUM_SEQS = 1024

COUNTERS = (
    "prefill_tokens", "decode_tokens", "recomputed_tokens", "busy_s", "requests", "aborted",
    "kv_transfer_s", "iterations", "kv_waits", "weight_load_s",
)  # fmt: skip
"""The totals a :class:`SimBackend`'s ``stats()`` reports; ``prefill_tokens`` includes recompute,
``busy_s`` is modelled seconds in iterations, ``kv_waits`` counts requests that waited for KV memory,
``weight_load_s`` is modelled seconds weight updates made the rollout wait."""


def kv_free_bytes(spec: ModelSpec, hardware: HardwareProfile, tp: int) -> float:
    """Bytes of KV cache ``tp`` devices hold beside the weights (not positive: it does not fit)."""
    return (hardware.mem_gb * 1e9 * tp - spec.weight_bytes) * KV_MEMORY_FRACTION


@dataclass(frozen=True)
class EngineSettings:
    """How the engine batches and how fast its passes run (documented as SimBackend's arguments)."""

    time_scale: float
    tp: int = 1
    mfu: float = 0.5
    mbu: float = 0.7
    chunk_tokens: int | None = CHUNK_TOKENS
    max_num_seqs: int = MAX_NUM_SEQS
    batch_wait_s: float = 0.0
    static_batching: bool = False
    row_overhead_s: float = 0.0

    def problems(self) -> list[str]:
        """Every bad setting, one sentence each."""
        out = [
            f"{k} must be >= 0 seconds, got {v!r}"
            for k, v in (("batch_wait_s", self.batch_wait_s), ("row_overhead_s", self.row_overhead_s))
            if not (isinstance(v, int | float) and v >= 0)
        ]
        if self.time_scale < 0:
            out.append(f"time_scale must be >= 0, got {self.time_scale}")
        if self.tp < 1:
            out.append(f"tp must be >= 1, got {self.tp}")
        out += [f"{k} must be in (0, 1], got {v}" for k, v in (("mfu", self.mfu), ("mbu", self.mbu)) if not 0 < v <= 1]
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            out.append(f"chunk_tokens must be >= 1 or None, got {self.chunk_tokens}")
        if self.max_num_seqs < 1:
            out.append(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        return out


@dataclass
class Prefix:
    """A trajectory's cached KV."""

    tokens: int  # cached prefix length
    version: int  # policy version its KV was computed under


@dataclass(eq=False)
class Job:
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


class Engine:
    """One serving engine: its queues, KV memory, prefix cache and modelled clock.

    Attributes:
        version: the policy version admitted jobs are computed under.
        kv_capacity_tokens: KV memory in tokens, for running sequences and the prefix cache.
        counters: :data:`COUNTERS` since construction (``requests``, ``kv_transfer_s`` and
            ``weight_load_s`` are the backend's to add to).
    """

    def __init__(self, spec: ModelSpec, hardware: HardwareProfile, settings: EngineSettings) -> None:
        self.spec, self.hardware, self.settings = spec, hardware, settings
        self.version = 0
        self.kv_capacity_tokens = int(kv_free_bytes(spec, hardware, settings.tp) // spec.kv_bytes_per_token)
        self._cache: OrderedDict[str, Prefix] = OrderedDict()  # LRU order, oldest first
        self._cached_tokens = 0
        self._waiting: deque[Job] = deque()  # FCFS, for memory; then admitted (prefilling, decoding)
        self._prefilling: deque[Job] = deque()
        self._decoding: list[Job] = []
        self._kv_used = 0  # KV tokens reserved by admitted jobs
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()  # an arrival or an abort; both events renewed on each start
        self._abort_ev = asyncio.Event()  # an abort only
        self._t = 0.0  # modelled seconds, as of the loop time _anchor
        self._anchor = 0.0
        self._lag = 0.0  # modelled seconds the last pass took beyond its work (shared cores)
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0)

    async def run_job(
        self, traj_id: str, prompt: int, total: int, *, kv_ready: bool = False, extra_s: float = 0.0
    ) -> Job:
        """Queue a job, run the engine until it ends; the job's ``parts`` hold ``prefill_s`` and
        ``decode_s``. ``kv_ready``: its prompt's KV arrived from elsewhere (decode only)."""
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._set_now(self._now())
            self._wake, self._abort_ev = asyncio.Event(), asyncio.Event()
        job = Job(traj_id, prompt, total, self._now(), loop.create_future(), extra_s=extra_s)
        if kv_ready:
            job.kv_ready, job.reuse, job.left = True, prompt, 0
        self._waiting.append(job)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._loop())
        else:
            self._wake.set()
        try:
            await asyncio.shield(job.done_fut)
        except asyncio.CancelledError:
            job.aborted = True  # the caller gave up: the engine drops it at the next event
            self._wake.set()
            raise
        return job

    async def batch_wait(self) -> None:
        """A batching engine holds each request ``batch_wait_s`` for batch mates (a static
        batcher waits once per batch instead, in the engine loop)."""
        s = self.settings
        if s.batch_wait_s > 0 and s.time_scale > 0 and not s.static_batching:
            await asyncio.sleep(s.batch_wait_s * s.time_scale)

    def abort(self, traj_id: str) -> None:
        """Mark every job of ``traj_id`` aborted; the engine ends them at once."""
        hit = False
        for job in [*self._waiting, *self._prefilling, *self._decoding]:
            if job.traj_id == traj_id and not job.aborted:
                job.aborted, hit = True, True
        if hit:
            self._wake.set()
            self._abort_ev.set()

    def cached(self, traj_id: str) -> Prefix | None:
        return self._cache.get(traj_id)

    def remember(self, traj_id: str, tokens: int, version: int) -> None:
        """Cache ``tokens`` of KV for ``traj_id`` (evicting the least recently used for room)."""
        self.drop(traj_id)
        if tokens > self.kv_capacity_tokens:
            return
        self._cache[traj_id] = Prefix(tokens, version)
        self._cached_tokens += tokens
        while self._cached_tokens + self._kv_used > self.kv_capacity_tokens and self._cache:
            _, old = self._cache.popitem(last=False)
            self._cached_tokens -= old.tokens

    def drop(self, traj_id: str) -> None:
        old = self._cache.pop(traj_id, None)
        if old is not None:
            self._cached_tokens -= old.tokens

    def occupancy(self) -> dict[str, int]:
        """Now: ``active`` (admitted jobs), ``waiting`` (queued for memory), ``kv_used_tokens``
        (reserved by admitted jobs), ``cached_tokens`` (prefix cache)."""
        return {
            "active": len(self._prefilling) + len(self._decoding),
            "waiting": len(self._waiting),
            "kv_used_tokens": self._kv_used,
            "cached_tokens": self._cached_tokens,
        }

    def _now(self) -> float:
        """Modelled seconds now (the engine's clock, caught up with the loop while idle)."""
        if self.settings.time_scale > 0:
            loop_now = asyncio.get_running_loop().time()
            return self._t + (loop_now - self._anchor) / self.settings.time_scale
        return self._t

    def _set_now(self, t: float) -> None:
        self._t, self._lag = t + self._lag, 0.0
        if self.settings.time_scale > 0:
            self._anchor = asyncio.get_running_loop().time()

    async def _pass(self, dt: float, ev: asyncio.Event, work: bool = True) -> float | None:
        """Sleep ``dt`` modelled seconds; returns the modelled seconds elapsed if ``ev`` cut it
        short, else None. On a host's shared cores ``dt`` is work, which may take longer; the
        extra time joins the clock at the next ``_set_now``. ``work=False``: a wait (KV transfer)."""
        ev.clear()
        scale = self.settings.time_scale
        if scale <= 0:
            await asyncio.sleep(0)
            return None
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        host = host_for(self.hardware)
        if work and host.cores is not None:  # one of the simulated host's CPUs, its cores shared
            done = await host.compute(dt * scale, ev)
            did = dt if done is None else min(done / scale, dt)
            self._lag = max((loop.time() - t0) / scale - did, 0.0)
            return None if done is None else did
        try:
            await asyncio.wait_for(ev.wait(), dt * scale)
        except TimeoutError:
            return None
        return min((loop.time() - t0) / scale, dt)

    def _admit(self, now: float) -> None:
        """Move waiting jobs (FCFS) into the engine while their KV fits and seats are free
        (with static batching: only into an idle engine, as the next batch)."""
        if self.settings.static_batching and (self._prefilling or self._decoding):
            return
        while self._waiting:
            job = self._waiting[0]
            if job.aborted:
                self._waiting.popleft()
                self._end(job, now)
                continue
            if len(self._prefilling) + len(self._decoding) >= self.settings.max_num_seqs:
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
                    self.counters["kv_waits"] += 1
                return  # head-of-line: wait for a running sequence to end (an idle device takes anything)
            self._waiting.popleft()
            self._take(job, mine, need, now)

    def _take(self, job: Job, mine: Prefix | None, need: int, now: float) -> None:
        """Admit ``job``: what of its prompt its cached KV (``mine``) spares, its memory reserved."""
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
            self.drop(job.traj_id)
        job.reserve = need
        self._kv_used += need
        self.counters["recomputed_tokens"] += job.recomputed
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
                self.drop(tid)
                return True
        return False

    def _start_decode(self, job: Job, now: float) -> None:
        job.prefill_done = now
        job.ready_at = now + job.extra_s
        if job.total == 0:
            self._end(job, now)
        else:
            self._decoding.append(job)

    def _end(self, job: Job, now: float) -> None:
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
            self.counters["aborted"] += 1
        if not job.done_fut.done():
            job.done_fut.set_result(None)

    def _drop_aborted(self, now: float) -> None:
        for q in (self._prefilling, self._decoding):
            for job in [j for j in q if j.aborted]:
                self._end(job, now)

    async def _loop(self) -> None:
        """The engine: iterations until nothing is queued, admitted or decoding."""
        s = self.settings
        while True:
            now = self._now()
            self._drop_aborted(now)
            if s.static_batching and not self._prefilling and not self._decoding and s.time_scale > 0:
                # batch mates may join a batch of new requests (a PD decode node's arrive with their KV)
                if s.batch_wait_s > 0 and any(not j.aborted and not j.kv_ready for j in self._waiting):
                    await asyncio.sleep(s.batch_wait_s * s.time_scale)
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

    def _decode_ctx(self, now: float) -> tuple[list[Job], int]:
        live = [j for j in self._decoding if j.ready_at <= now + 1e-12]
        return live, sum(j.context for j in live)

    def _chunks(self, live: int) -> list[tuple[Job, int]]:
        """The prompt tokens of each job this pass prefills, beside ``live`` decodes."""
        s = self.settings
        if s.static_batching:  # the whole batch's prompts in one pass
            return [(job, job.left) for job in self._prefilling]
        if s.chunk_tokens is None:  # unchunked: one whole prompt per pass, decodes stall behind it
            return [(self._prefilling[0], self._prefilling[0].left)]
        budget = max(s.chunk_tokens - live, 1)
        chunks: list[tuple[Job, int]] = []
        for job in self._prefilling:
            take = min(job.left, budget)
            chunks.append((job, take))
            budget -= take
            if budget <= 0:
                break
        return chunks

    async def _mixed_iteration(self, now: float) -> None:
        """One pass: a token for every ready decode plus a chunk of the oldest prompts."""
        s = self.settings
        live, ctx = self._decode_ctx(now)
        chunks = self._chunks(len(live))
        if s.chunk_tokens is None or s.static_batching:
            live, ctx = [], 0  # a prefill-only pass
        prefill = [(n, j.prompt - j.left) for j, n in chunks]
        dt = iteration_time(self.spec, self.hardware, len(live), ctx, prefill, tp=s.tp, mbu=s.mbu, mfu=s.mfu)
        new_rows = [j for j, _ in chunks if not j.started]  # paid again if an abort cuts the pass
        dt += s.row_overhead_s * len(new_rows)
        cut = await self._pass(dt, self._abort_ev)  # arrivals wait for the pass; aborts cut it short
        if cut is not None:  # pro rata prefill progress, no decode token
            self._set_now(now + cut)
            for job, n in chunks:
                part = int(n * cut / dt) if dt > 0 else 0
                job.left -= part
                self.counters["prefill_tokens"] += part
            self.counters["busy_s"] += cut
            return
        self._set_now(now + dt)
        end = self._t  # now + dt, plus any time lost to shared cores
        self.counters["busy_s"] += dt
        self.counters["iterations"] += 1
        for j in new_rows:
            j.started = True
        for job, n in chunks:
            job.left -= n
            self.counters["prefill_tokens"] += n
            if job.left <= 0:
                self._prefilling.remove(job)
                self._start_decode(job, end)
        self._step(live, 1, end)

    async def _decode_run(self, now: float) -> None:
        """Pure decode iterations, priced in closed form, until a sequence ends, a PD decode's
        KV arrives, or a request arrives (then the steps done so far count)."""
        s = self.settings
        live, ctx = self._decode_ctx(now)
        pending = [j.ready_at for j in self._decoding if j.ready_at > now + 1e-12]
        if not live:  # only KV transfers in flight: wait for the first
            until = min(pending)
            cut = await self._pass(until - now, self._wake, work=False)
            self._set_now(now + (cut if cut is not None else until - now))
            return
        b = len(live)
        k = min(j.total - j.decoded for j in live)
        kw: dict[str, Any] = {"batch": b, "tp": s.tp, "mbu": s.mbu, "mfu": s.mfu}
        dt = decode_time(self.spec, self.hardware, k, ctx / b, **kw)
        if pending and now + dt > min(pending):  # stop when the next transferred KV is ready
            k = max(decode_steps_within(self.spec, self.hardware, min(pending) - now, ctx / b, limit=k, **kw), 1)
            dt = decode_time(self.spec, self.hardware, k, ctx / b, **kw)
        # arrivals cut a decode run short so they can join it; a static batch takes none of them
        cut = await self._pass(dt, self._abort_ev if s.static_batching else self._wake)
        if cut is not None:
            k = decode_steps_within(self.spec, self.hardware, cut, ctx / b, limit=k, **kw)
            dt = cut
        self._set_now(now + dt)  # plus any time lost to shared cores
        self.counters["busy_s"] += dt
        self.counters["iterations"] += k
        self._step(live, k, self._t)

    def _step(self, live: list[Job], k: int, now: float) -> None:
        """``k`` decode tokens for each job in ``live``; finished ones end."""
        if k <= 0:
            return
        for job in live:
            n = min(k, job.total - job.decoded)
            job.decoded += n
            self.counters["decode_tokens"] += n
            if job.decoded >= job.total:
                self._end(job, now)
