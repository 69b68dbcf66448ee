"""SimBackend: a generation backend whose time comes from a roofline model of its hardware.

It is a real backend for what-if studies, not a mock: the control plane drives it exactly as
it drives ``hf`` or ``vllm``. Tokens are cheap and content-free (the sim never learns); what
is modelled is *time*, by :mod:`rollart_nb.sim.engine`, a discrete-event model of one serving
engine (continuous batching in iterations, KV capacity, a prefix cache keyed by trajectory).

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
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rollart_nb.backends.history import HistoryStore
from rollart_nb.clock import host_for, resolve_time_scale
from rollart_nb.errors import ConfigError
from rollart_nb.models.spec import ModelSpec
from rollart_nb.protocols import GenerationRequest, GenerationResult, ScoreResult, Tokenizer
from rollart_nb.resources.profiles import HardwareProfile
from rollart_nb.sim.engine import CHUNK_TOKENS, MAX_NUM_SEQS, Engine, EngineSettings, kv_free_bytes
from rollart_nb.sim.tokenizer import SimTokenizer

__all__ = ["SimBackend"]

_SCORES = itertools.count()  # scoring jobs' engine ids: never a trajectory's, so no prefix is shared

#: GB/s from host memory to one device: PCIe Gen5 x16, 64 GB/s each way (the H100/H800/H20
#: datasheets list 128 GB/s both ways together). New weights pulled into host memory load this way.
PCIE_GBPS = 64.0


class SimBackend:
    """Roofline-timed generation backend (see the module docstring for the model).

    Args:
        time_scale: seconds slept per modelled second (0: account time without sleeping).
            Default: 1 on a SimSession's virtual clock, 1e-3 elsewhere.
        tp: tensor-parallel degree (devices per replica).
        seed: mixed into every request's token stream.
        mean_response_tokens: mean of the geometric response length without ``response_tokens``.
        response_tokens: ``fn(request) -> int``, each response's length (e.g.
            :func:`rollart_nb.sim.workloads.response_tokens_fn`), capped at ``max_new_tokens``.
        policy: how tokens are chosen; only ``"hash"`` (seeded by the request) exists.
        link_gbps: GB/s of the prefill-to-decode link (400 Gbit/s InfiniBand = 50 GB/s).
        mfu, mbu: achieved fractions of peak FLOP/s and memory bandwidth.
        chunk_tokens: token budget of one iteration; None: a prompt is prefilled whole in one
            pass, stalling every decode on the device meanwhile.
        vocab_size: ids are drawn from ``[3, vocab_size)``.
        batch_wait_s: modelled seconds a request waits for batch mates before the engine takes
            it (:data:`~rollart_nb.backends.hf.BATCH_WAIT_S` for ``hf``); 0: vLLM-like.
        history_tokens: token budget of the history store (lengths only, so cheap).
        static_batching: run each batch to its end before taking the next, as ``hf`` does;
            False: continuous batching, as vLLM does.
        row_overhead_s: modelled seconds of the engine's own work per request, paid in the pass
            where its prefill starts (:func:`rollart_nb.bench.real_costs.row_overhead`).
        load_overhead_s: fixed modelled seconds of loading a new weight version besides moving
            its bytes (:func:`rollart_nb.bench.real_costs.measure_weight_sync`).

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
        ts = resolve_time_scale(time_scale)
        settings = EngineSettings(
            ts, tp, mfu, mbu, chunk_tokens, max_num_seqs, batch_wait_s, bool(static_batching), row_overhead_s
        )
        problems = settings.problems() + _problems(spec, hardware, settings, link_gbps, load_overhead_s)
        if mean_response_tokens < 1:
            problems.append(f"mean_response_tokens must be >= 1, got {mean_response_tokens}")
        if policy != "hash":
            problems.append(f"policy must be 'hash', got {policy!r}")
        if vocab_size < 4:
            problems.append(f"vocab_size must be >= 4, got {vocab_size}")
        if problems:
            raise ConfigError(problems, where="SimBackend")
        self.spec, self.hardware, self.name, self.seed = spec, hardware, name, seed
        self.time_scale, self.tp, self.link_gbps = settings.time_scale, tp, link_gbps
        self.mean_response_tokens, self.vocab_size = mean_response_tokens, vocab_size
        self.load_overhead_s = float(load_overhead_s)
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else SimTokenizer(vocab_size)
        self._response_tokens = response_tokens
        #: Each trajectory's history length (what ``prefix_len`` of its next request must be).
        self.history = HistoryStore(history_tokens, keep_ids=False, name=name)
        #: The serving engine: its queues, KV memory (``kv_capacity_tokens``) and prefix cache.
        self.engine = Engine(spec, hardware, settings)

    @property
    def version(self) -> int:
        """The policy version served now."""
        return self.engine.version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Prefill what is not cached, decode the response, in the engine (modelled time slept).

        Returns ``finish_reason`` "stop" (eos appended, length below the budget), "length"
        or "abort" (with the tokens decoded before :meth:`abort`).

        Raises:
            HistoryMiss: ``request.prefix_len`` is not the history length this backend holds.
        """
        full = self.history.full_len(request)
        self.engine.counters["requests"] += 1
        await self.engine.batch_wait()
        ids, logprobs, finish = self._policy(request, full, self.version)
        job = await self.engine.run_job(request.traj_id, full, len(ids))
        n = job.decoded if job.aborted else len(ids)
        if not job.aborted:
            self.engine.remember(request.traj_id, full + n, job.version)
            if request.last_turn:
                self.history.forget(request.traj_id)
            else:
                self.history.keep_length(request.traj_id, full + n)
        finish = "abort" if job.aborted else finish
        times = {"prefill_s": job.parts["prefill_s"], "decode_s": job.parts["decode_s"]}
        return self._result(
            request, ids[:n], logprobs[:n], finish, version=job.version, recomputed_tokens=job.recomputed, **times
        )

    async def score(self, rows: Sequence[Sequence[int]]) -> ScoreResult:
        """Each sequence prefilled in the engine beside what it serves (a fresh prefill: no
        cached prefix is read or kept), as a real backend scores ``pipe.replay``'s rows. The
        sim computes no logprobs: each row's are NaN, shape [L-1]; ``score_s`` is the modelled
        time until the last row is done, ``version`` the oldest that scored a row."""
        rows = [list(ids) for ids in rows]
        self.engine.counters["requests"] += len(rows)
        await self.engine.batch_wait()
        jobs = await asyncio.gather(
            *(self.engine.run_job(f"score#{next(_SCORES)}", len(ids), 0) for ids in rows if len(ids) > 1)
        )
        return ScoreResult(
            [[math.nan] * max(len(ids) - 1, 0) for ids in rows],
            min((j.version for j in jobs), default=self.version),
            max((j.parts["prefill_s"] for j in jobs), default=0.0),
        )

    async def abort(self, traj_id: str) -> None:
        """End every in-flight call for ``traj_id`` now (they return "abort" with the tokens
        decoded so far) and drop its cache and history."""
        self.engine.abort(traj_id)
        self.forget(traj_id)

    def load_weights(self, state: dict[str, Any], version: int) -> None:
        """Serve policy ``version`` from now on. ``state`` is ignored (the sim has no weights);
        cached prefixes are kept and recomputed on their next turn because their version is old."""
        self.engine.version = int(version)

    def weight_pull_s(self) -> tuple[float, float]:
        """Modelled ``(pull_s, load_s)`` of a new version: each of the ``tp`` devices pulls its
        shard over its own network link (``hardware.net_gbps``, else ``link_gbps``) in the
        background, then copies it from host memory to the device (the rollout waits for this)::

            pull_s = weight_bytes / (tp * net_gbps * 1e9)
            load_s = weight_bytes / (tp * PCIE_GBPS * 1e9)
        """
        net = self.hardware.net_gbps if self.hardware.net_gbps > 0 else self.link_gbps
        return (
            self.spec.weight_bytes / (self.tp * net * 1e9),
            self.spec.weight_bytes / (self.tp * PCIE_GBPS * 1e9),
        )

    async def aload_weights(self, state: dict[str, Any], version: int) -> float:
        """:meth:`load_weights` after the modelled time a Mooncake-style update exposes: the rest
        of the pull begun at ``state["published_at"]`` (all of it when unknown), the host-to-device
        copy and ``load_overhead_s``. Returns the modelled seconds waited (``weight_load_s``)."""
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
        self.engine.counters["weight_load_s"] += wait_s
        self.load_weights(state, version)
        return wait_s

    async def prefill(self, request: GenerationRequest) -> dict[str, Any]:
        """Prefill only (this worker is a P node). Returns what the D node needs:

        ``{"traj_id", "tokens" (KV computed now, to transfer), "prompt_tokens" (the whole
        prompt's length), "version", "prefill_s", "recomputed_tokens", "aborted"}``.

        The next request's ``prefix_len`` may exceed the prompt kept here by the decode node's
        response (its tokens are prefilled as new).

        Raises:
            HistoryMiss: this node does not hold the history ``request.prefix_len`` expects.
        """
        full = self.history.full_len(request)
        self.engine.counters["requests"] += 1
        await self.engine.batch_wait()
        job = await self.engine.run_job(request.traj_id, full, 0)
        if not job.aborted:
            self.engine.remember(request.traj_id, full, job.version)
            self.history.keep_length(request.traj_id, full, response_elsewhere=True)
        return {
            "traj_id": request.traj_id,
            "tokens": full - job.reuse,
            "prompt_tokens": full,
            "version": job.version,
            "prefill_s": job.parts["prefill_s"],
            "recomputed_tokens": job.recomputed,
            "aborted": job.aborted,
        }

    async def decode(self, request: GenerationRequest, prefilled: dict[str, Any]) -> GenerationResult:
        """Decode only (this worker is a D node), after receiving the KV that :meth:`prefill` made.

        Charges the KV transfer of the prompt tokens this node does not hold
        (``kv_bytes_per_token * tokens / link_gbps``: the proxy keeps a trajectory on one decode
        node, which keeps its KV between turns while the weights do not change) plus decode.
        ``result.prefill_s`` echoes the P node's time; ``decode_s`` includes the transfer. The
        result carries the older of the two nodes' versions (conservative for staleness).
        """
        full = int(prefilled["prompt_tokens"])
        version = min(self.version, int(prefilled["version"]))
        pre_s, recomputed = float(prefilled["prefill_s"]), int(prefilled["recomputed_tokens"])
        if prefilled.get("aborted"):
            return self._result(
                request, [], [], "abort", version=version, prefill_s=pre_s, recomputed_tokens=recomputed
            )
        mine = self.engine.cached(request.traj_id)
        held = mine.tokens if mine is not None and mine.version == version and mine.tokens <= full else 0
        moved = max(full - held, int(prefilled["tokens"]))
        transfer_s = self.spec.kv_bytes_per_token * moved / (self.link_gbps * 1e9)
        self.engine.counters["kv_transfer_s"] += transfer_s
        self.engine.counters["requests"] += 1
        ids, logprobs, finish = self._policy(request, full, version)
        job = await self.engine.run_job(request.traj_id, full, len(ids), kv_ready=True, extra_s=transfer_s)
        n = job.decoded if job.aborted else len(ids)
        if not job.aborted:
            self.engine.remember(request.traj_id, full + n, version)
        finish = "abort" if job.aborted else finish
        times = {"prefill_s": pre_s, "decode_s": job.parts["decode_s"], "recomputed_tokens": recomputed}
        return self._result(request, ids[:n], logprobs[:n], finish, version=version, **times)

    def forget(self, traj_id: str) -> None:
        """Drop a finished trajectory's cached prefix and history."""
        self.history.forget(traj_id)
        self.engine.drop(traj_id)

    def cached_tokens(self, traj_id: str) -> int:
        """Length of the cached prefix of ``traj_id`` (0 if none)."""
        p = self.engine.cached(traj_id)
        return 0 if p is None else p.tokens

    def stats(self) -> dict[str, float]:
        """The engine's :data:`~rollart_nb.sim.engine.COUNTERS` since construction, its
        ``occupancy()`` now, and the history store's ``history_tokens`` and ``history_misses``."""
        h = self.history.stats()
        return {
            **self.engine.counters,
            **self.engine.occupancy(),
            "history_tokens": h["tokens"],
            "history_misses": h["misses"],
        }

    def __repr__(self) -> str:
        return (
            f"SimBackend({self.spec.name} on {self.tp}x{self.hardware.name}, version={self.version}, "
            f"time_scale={self.time_scale:g})"
        )

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
        self, request: GenerationRequest, ids: list[int], logprobs: list[float], finish: str, **times: Any
    ) -> GenerationResult:
        """``times``: the result's ``version``, ``prefill_s``, ``decode_s`` and ``recomputed_tokens``."""
        text = self.tokenizer.decode(ids)
        return GenerationResult(
            request.traj_id, ids, logprobs, finish_reason=finish, text=text, worker=self.name, **times
        )


def _problems(
    spec: ModelSpec, hardware: HardwareProfile, settings: EngineSettings, link_gbps: float, load_overhead_s: float
) -> list[str]:
    """What keeps ``spec`` from being served on this hardware and these links."""
    out = []
    if not (isinstance(load_overhead_s, int | float) and load_overhead_s >= 0):
        out.append(f"load_overhead_s must be >= 0 seconds, got {load_overhead_s!r}")
    if settings.tp > 1 and hardware.nvlink_gbps <= 0:
        out.append(f"tp={settings.tp} needs a device interconnect; {hardware.name} has none (nvlink_gbps=0)")
    if link_gbps <= 0:
        out.append(f"link_gbps must be > 0, got {link_gbps}")
    if settings.tp >= 1 and kv_free_bytes(spec, hardware, settings.tp) <= 0:
        out.append(
            f"{spec.name} ({spec.weight_bytes / 1e9:.1f} GB of weights) does not fit on "
            f"{settings.tp} x {hardware.name} ({hardware.mem_gb:g} GB each); raise tp"
        )
    return out
