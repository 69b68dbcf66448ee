"""Calibrate the simulator to this machine: a measured CPU profile and the real envs' token shapes.

The sim prices work with :mod:`rollart_nb.sim.roofline` from a
:class:`~rollart_nb.resources.profiles.HardwareProfile`, a :class:`~rollart_nb.models.ModelSpec`
and a :class:`~rollart_nb.sim.workloads.Workload` per task. For a sim-to-real check
(``benchmarks/sim_to_real.py``) all three must describe what ``Session.local()`` really runs:

* :func:`measure_cpu`: peak matmul FLOP/s, memory bandwidth and the fixed cost of one forward
  pass of the tiny model, measured with torch on this CPU. The tiny model runs in **float32**
  here (:meth:`~rollart_nb.models.tiny.ModelRef.load_model`'s default, used by the ``hf``
  generator and the ``torch`` trainer), so float32 is what is measured; the profile's
  ``bf16_tflops`` field holds that float32 figure (the field is named for GPUs' usual dtype).
  Every measurement uses ``threads`` torch threads, 1 by default: ``Session.local()`` starts its
  workers as Ray actors with ``num_cpus=0``, and Ray then sets ``OMP_NUM_THREADS=1`` in them.
* :func:`~rollart_nb.models.spec.hf_spec`: the tiny model's :class:`ModelSpec` from its ``config.json``.
* :func:`sample_episodes` and :func:`workload_from_stats`: prompt, observation, response and
  turn statistics of real episodes of the real envs played by the real model, as Workloads.
* :func:`row_overhead`: the ``hf`` engine's own seconds per request beyond its forward passes.
* :func:`measure_trainer`: the real trainer's seconds per padded token and per step.
* :func:`calibrate` does all of the above and :func:`register_profile` makes the profile a pool
  name a :class:`~rollart_nb.SimSession` accepts.
* On a running ``Session.local()``, the control plane alone: :func:`call_latency` (one Ray actor
  call), :func:`measure_weight_sync` (a weight update's two halves) and
  :func:`measure_control_plane` (the rollout's CPU seconds per turn), for
  ``Session.sim(call_latency_s=..., turn_cpu_s=...)`` and the sim workers' overheads.

Nothing here is tuned to a result: each number is a measurement or follows from one by the
formula in its docstring.

Example:
    >>> hw = measure_cpu(seconds=0.3)  # doctest: +SKIP
    >>> hw.bf16_tflops > 0 and hw.mem_bw_gbps > 0  # doctest: +SKIP
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rollart_nb.errors import ConfigError, StateError, WeightSyncError
from rollart_nb.models.spec import ModelSpec, hf_spec
from rollart_nb.resources.profiles import PROFILES, HardwareProfile
from rollart_nb.sim.roofline import prefill_flops, weights_read_bytes
from rollart_nb.sim.workloads import Workload

__all__ = [
    "MEASURED_PROFILE",
    "Calibration",
    "EpisodeStats",
    "TrainerCost",
    "WeightSyncCost",
    "calibrate",
    "call_latency",
    "matmul_efficiency",
    "matmul_flops",
    "measure_control_plane",
    "measure_cpu",
    "measure_trainer",
    "measure_weight_sync",
    "memory_bandwidth",
    "pass_overhead",
    "register_profile",
    "row_overhead",
    "sample_episodes",
    "workload_from_stats",
]

log = logging.getLogger(__name__)

MEASURED_PROFILE = "CPU-MEASURED"
"""Default name of a measured profile (and of the SimSession pool that uses it)."""

MATMUL_N = 512
"""Side of the square float32 matmul timed for peak FLOP/s: 2 * 512^3 = 268 MFLOP per product,
large enough that one product is compute-bound (3 MB of operands per 268 MFLOP) and short enough
(a few ms on one core) to repeat many times within the budget."""

COPY_BYTES = 128 * 2**20
"""Bytes of the source tensor copied to time memory bandwidth: 128 MiB, well past any CPU's
last-level cache, so the copy streams from and to DRAM."""

PASS_CONTEXT = 16
"""Cached tokens before the timed 1-token forward passes (a short prompt, as a decode step of
the tiny tasks sees: FrozenLake's first prompt is ~20 tokens, Arithmetic's ~10)."""

PASSES_PER_CACHE = 32
"""Timed decode passes on one KV cache before a fresh one; the context then stays within
``PASS_CONTEXT + 32`` tokens, still short."""


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _timed(fn: Callable[[], Any], seconds: float, min_reps: int = 3) -> float:
    """Median wall seconds of ``fn()`` over repetitions filling about ``seconds`` (after one
    untimed warm-up call). The median, not the mean: a 2-core machine shared with other work
    has outliers."""
    fn()
    times: list[float] = []
    t_end = time.perf_counter() + seconds
    while len(times) < min_reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops(seconds: float = 0.5, threads: int = 1, n: int = MATMUL_N) -> float:
    """Peak float32 FLOP/s of a square matmul: ``2 * n**3 / t`` for the median time ``t`` of one
    ``[n, n] @ [n, n]`` product (one multiply and one add per inner-product term)."""
    import torch

    with _threads(threads):
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        t = _timed(lambda: torch.matmul(a, b, out=out), seconds)
    return 2.0 * n**3 / t


def matmul_efficiency(
    spec: ModelSpec, peak_flops: float, tokens: int = 1024, seconds: float = 0.3, threads: int = 1
) -> float:
    """Fraction of ``peak_flops`` reached by the model's own widest matmul.

    Formula: ``(2 * tokens * hidden * 3 * hidden / t) / peak_flops`` for the median time ``t`` of
    ``[tokens, hidden] @ [hidden, 3 * hidden]`` (the tiny models' MLP widening is 3x, e.g. 128 ->
    384), clipped to (0, 1]. A model of ``hidden`` 128 multiplies thin matrices, which may run
    below the square matmul's rate (short inner products) or at it (operands that stay in cache:
    then the clip gives 1); this is the ``mfu`` the roofline should use for it. ``tokens``: 1024,
    the demo's ``micro_batch_tokens`` (rows the trainer multiplies at once).
    """
    import torch

    h = spec.hidden
    with _threads(threads):
        x, w = torch.randn(tokens, h), torch.randn(h, 3 * h)
        out = torch.empty(tokens, 3 * h)
        t = _timed(lambda: torch.matmul(x, w, out=out), seconds)
    return min(1.0, max(2.0 * tokens * h * 3 * h / t / peak_flops, 1e-6))


def memory_bandwidth(seconds: float = 0.5, threads: int = 1, nbytes: int = COPY_BYTES) -> float:
    """Memory bandwidth in bytes/s: ``2 * nbytes / t`` for the median time ``t`` of copying a
    ``nbytes`` float32 tensor into another (each byte is read once and written once)."""
    import torch

    with _threads(threads):
        src = torch.ones(nbytes // 4)
        dst = torch.empty_like(src)
        t = _timed(lambda: dst.copy_(src), seconds)
    return 2.0 * nbytes / t


def pass_time(model: Any, seconds: float = 0.5, threads: int = 1, context: int = PASS_CONTEXT) -> float:
    """Median wall seconds of one decode forward pass of ``model`` as the ``hf`` backend calls it
    (with an attention mask and explicit positions): batch 1, one new token, a KV cache of
    ``context`` to ``context + PASSES_PER_CACHE`` tokens, float32, no gradients.

    Each run of ``PASSES_PER_CACHE`` passes starts with a fresh cache, whose prefill is inside one
    timed call; the median leaves that call out."""
    import torch

    from rollart_nb.backends.hf import cache_kwarg

    with _threads(threads), torch.no_grad():
        lm = model.load_model(dtype=torch.float32)
        kw = cache_kwarg(lm)
        prompt = torch.full((1, context), 5, dtype=torch.long)
        state: dict[str, Any] = {"cache": None, "n": PASSES_PER_CACHE}
        one = torch.tensor([[5]])

        def step() -> None:
            if state["n"] >= PASSES_PER_CACHE:
                state["cache"] = getattr(lm(input_ids=prompt, use_cache=True), kw)
                state["n"] = 0
            n = context + state["n"]
            lm(
                input_ids=one,
                attention_mask=torch.ones(1, n + 1, dtype=torch.long),
                position_ids=torch.tensor([[n]]),
                use_cache=True,
                **{kw: state["cache"]},
            )
            state["n"] += 1

        return _timed(step, seconds, min_reps=2 * PASSES_PER_CACHE)


def pass_overhead(
    spec: ModelSpec, t_pass: float, peak_flops: float, mem_bw: float, context: int = PASS_CONTEXT
) -> float:
    """The fixed seconds of a forward pass: its measured time less what the roofline prices.

    Formula: ``max(0, t_pass - max(prefill_flops(spec, 1, context) / peak_flops,
    weights_read_bytes(spec, 1) / mem_bw))`` (the roofline of a 1-token pass at MFU = MBU = 1;
    the rest is framework dispatch, kernel launches and Python, the same for any small pass).
    """
    roofline = max(prefill_flops(spec, 1, context) / peak_flops, weights_read_bytes(spec, 1) / mem_bw)
    return max(0.0, t_pass - roofline)


def measure_cpu(
    model: Any = None, *, seconds: float = 2.0, threads: int = 1, name: str = MEASURED_PROFILE
) -> HardwareProfile:
    """A :class:`HardwareProfile` of this CPU, measured with torch.

    ``bf16_tflops`` = :func:`matmul_flops` / 1e12 (float32: see the module docstring),
    ``mem_bw_gbps`` = :func:`memory_bandwidth` / 1e9, ``pass_overhead_s`` = :func:`pass_overhead`
    of ``model``'s decode pass (0 without a model), ``mem_gb`` the machine's RAM (psutil; 0 if
    unknown), ``price_per_hour`` 0 (not a rented device), ``kind`` "cpu", ``optimized_for``
    "general". ``seconds`` is the whole budget, split evenly over the measurements.
    """
    if seconds <= 0 or threads < 1:
        raise ConfigError(f"seconds={seconds!r} must be > 0 and threads={threads!r} >= 1", where="measure_cpu")
    share = seconds / (3 if model is not None else 2)
    flops = matmul_flops(share, threads)
    bw = memory_bandwidth(share, threads)
    overhead = 0.0
    if model is not None:
        overhead = pass_overhead(hf_spec(model), pass_time(model, share, threads), flops, bw)
    try:
        import psutil

        mem_gb = psutil.virtual_memory().total / 1e9
    except ImportError:  # psutil is a dev dependency; memory only bounds the sim's KV cache
        mem_gb = 16.0
    return HardwareProfile(name, "cpu", flops / 1e12, bw / 1e9, mem_gb, 0.0, "general", pass_overhead_s=overhead)


def register_profile(hw: HardwareProfile) -> HardwareProfile:
    """Make ``hw`` a hardware type by its name, so ``SimSession({hw.name: n})`` builds a pool of it
    and sim workers bound there are priced with it. Returns ``hw``.

    A later call with the same name replaces the profile (a fresh measurement).
    """
    PROFILES[hw.name] = hw
    return hw


ROW_BATCH = 16
"""Rows of the larger batch :func:`row_overhead` times against a batch of one (half the
``hf`` backend's default ``max_batch_size``: the batches a 16-env rollout forms)."""


def row_overhead(
    model: Any,
    *,
    seconds: float = 1.0,
    threads: int = 1,
    prompt_tokens: int = 16,
    obs_tokens: int = 8,
    max_new_tokens: int = 4,
    pass_s: float = 0.0,
    rows: int = ROW_BATCH,
) -> float:
    """Seconds of the ``hf`` engine's own work per request beyond its forward passes.

    Times the real :class:`~rollart_nb.backends.hf.HFBackend` (no batch wait) serving batches of
    1 and of ``rows`` two-turn trajectories (a ``prompt_tokens`` prompt, then the history plus
    ``obs_tokens`` more, so the second turn reuses cached KV as a real multi-turn rollout does;
    sampling at temperature 1 with a budget of ``max_new_tokens``). With ``t1``, ``tB`` the
    median seconds per turn's batch and ``p1``, ``pB`` the decode passes each ran (its longest
    response), the formula is ``max(0, (tB - t1 - (pB - p1) * pass_s) / (rows - 1))``: what a
    row adds to a batch (building its row, copying its cached KV in and out, its sampling), the
    passes a longer response adds taken out at ``pass_s`` seconds each (the profile's time of
    one small pass: its ``pass_overhead_s``). The FLOPs of the extra rows of a tiny model are
    left in (tens of microseconds).
    """
    import asyncio

    from rollart_nb.backends.hf import HFBackend
    from rollart_nb.protocols import GenerationRequest

    if rows < 2:
        raise ConfigError(f"rows={rows!r} must be >= 2", where="row_overhead")
    with _threads(threads):
        backend = HFBackend(model, name="calibrate", batch_wait_s=0.0, seed=0)
        counter = iter(range(1 << 40))

        async def one(b: int) -> tuple[float, int]:
            tids = [f"row{next(counter)}" for _ in range(b)]

            def req(t: str, ids: list[int], prefix: int, last: bool) -> GenerationRequest:
                return GenerationRequest(
                    t,
                    "calibrate",
                    ids,
                    max_new_tokens=max_new_tokens,
                    temperature=1.0,
                    prefix_len=prefix,
                    last_turn=last,
                )

            t0 = time.perf_counter()
            first = await asyncio.gather(*(backend.generate(req(t, [5] * prompt_tokens, 0, False)) for t in tids))
            second = await asyncio.gather(
                *(
                    backend.generate(req(t, [6] * obs_tokens, prompt_tokens + len(r.token_ids), True))
                    for t, r in zip(tids, first, strict=True)
                )
            )
            t2 = time.perf_counter()
            passes = max(len(r.token_ids) for r in first) + max(len(r.token_ids) for r in second)
            return (t2 - t0) / 2, passes

        def timed(b: int) -> tuple[float, float]:
            out: list[tuple[float, int]] = []
            asyncio.run(one(b))  # warm-up
            t_end = time.perf_counter() + seconds / 2
            while len(out) < 5 or time.perf_counter() < t_end:
                out.append(asyncio.run(one(b)))
            return statistics.median(t for t, _ in out), statistics.fmean(p for _, p in out) / 2

        t_1, p_1 = timed(1)
        t_b, p_b = timed(rows)
    return max(0.0, (t_b - t_1 - (p_b - p_1) * pass_s) / (rows - 1))


CALL_PAYLOAD_TOKENS = 64
"""Token ids carried by each timed call of :func:`call_latency` (a turn's prompt is tens to
hundreds of tokens; the payload barely matters at this size)."""


def call_latency(seconds: float = 0.5) -> float:
    """Median seconds of one Ray actor call from one async actor to another and back, carrying
    :data:`CALL_PAYLOAD_TOKENS` token ids: what a turn pays to reach a generator worker and
    return in a real session (``Session.sim(call_latency_s=...)``). Needs a running Ray
    (``rn.Session.local()`` starts one); the two actors take no CPU reservation, as the
    session's own workers.
    """
    import ray

    if not ray.is_initialized():
        raise ConfigError(
            "call_latency needs a running Ray; open rn.Session.local() (or ray.init()) first", where="call_latency"
        )

    @ray.remote(num_cpus=0)
    class _Echo:
        async def echo(self, ids: list[int]) -> int:
            return len(ids)

    @ray.remote(num_cpus=0)
    class _Caller:
        async def time_calls(self, target: Any, seconds: float) -> float:
            ids = list(range(CALL_PAYLOAD_TOKENS))
            times: list[float] = []
            await target.echo.remote(ids)  # warm-up: the first call resolves the actor
            t_end = time.perf_counter() + seconds
            while len(times) < 20 or time.perf_counter() < t_end:
                t0 = time.perf_counter()
                await target.echo.remote(ids)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

    echo, caller = _Echo.remote(), _Caller.remote()  # type: ignore[attr-defined]
    try:
        return float(ray.get(caller.time_calls.remote(echo, seconds), timeout=60 + 2 * seconds))
    finally:
        for a in (echo, caller):
            ray.kill(a)


@dataclass(frozen=True)
class WeightSyncCost:
    """What one real weight update costs on this machine beyond the Ray calls that carry it:
    ``export_s`` for the trainer worker to copy its state_dict out into Ray's object store,
    ``load_s`` for a generator worker to get it from there and copy it into its model."""

    export_s: float
    load_s: float


def measure_weight_sync(
    sess: Any, model: Any, algo: Any = None, *, seconds: float = 1.0, call_latency_s: float = 0.0
) -> WeightSyncCost:
    """Time a direct weight update's two halves with the real workers, as the pipeline does one.

    On the open ``Session.local()`` ``sess``, builds a :class:`~rollart_nb.workers.TorchTrainer`
    and an :class:`~rollart_nb.workers.HFGenerator` of ``model`` (clusters ``calib_wtrain`` and
    ``calib_wgen``, closed again) and repeats, for about ``seconds``: the trainer's
    ``state_dict`` call until its result is in the object store (``export``), then the
    generator's ``load_weights`` of it (``load``). Each half's median less ``call_latency_s``
    (the round trip the sim charges every call separately; :func:`call_latency`), at least 0.
    The sim's trainer and generators take them as ``export_overhead_s`` and ``load_overhead_s``.
    """
    import ray

    from rollart_nb.workers.roles import HFGenerator, TorchTrainer

    if getattr(sess, "mode", None) == "sim" or not ray.is_initialized():
        raise ConfigError(
            "measure_weight_sync needs an open rn.Session.local() (real workers to time)", where="measure_weight_sync"
        )
    if algo is None:
        from rollart_nb.algo.grpo import GRPO

        algo = GRPO()
    export: list[float] = []
    load: list[float] = []
    try:
        train = sess.cluster("calib_wtrain", TorchTrainer, pool="H800", model=model, algo=algo, seed=0)
        gen = sess.cluster("calib_wgen", HFGenerator, pool="H20", model=model, seed=0)
        version = 0
        t_end = time.perf_counter() + seconds
        while len(export) < 6 or time.perf_counter() < t_end:
            version += 1
            t0 = time.perf_counter()
            ref = train.state_dict(blocking=False).refs[0]
            if not ray.wait([ref], timeout=60)[0]:
                raise WeightSyncError("measure_weight_sync: the trainer's state_dict took over 60 s; is it alive?")
            t1 = time.perf_counter()
            gen.load_weights(ref, version)
            t2 = time.perf_counter()
            if version > 1:  # the first pair warms both workers up
                export.append(t1 - t0)
                load.append(t2 - t1)
    finally:
        _close_clusters(sess, ("calib_wgen", "calib_wtrain"))
    return WeightSyncCost(
        export_s=max(0.0, statistics.median(export) - call_latency_s),
        load_s=max(0.0, statistics.median(load) - call_latency_s),
    )


def _close_clusters(sess: Any, names: tuple[str, ...]) -> None:
    """Close the session's clusters of these names that exist (each on its own: one failing
    does not keep the others open)."""
    for name in names:
        if name in sess.clusters:
            try:
                sess.close_cluster(name)
            except Exception as e:  # closing the rest matters more than this one's error
                log.warning("closing calibration cluster %s: %s", name, e)


class _TokenizedSpec(ModelSpec):
    """A real model's shape whose ``load_tokenizer`` is the model's own (the rollout then
    tokenizes as in the real run while a sim generator answers). Build with :func:`_tokenized`."""

    def load_tokenizer(self):  # noqa: ANN201 - the model's tokenizer
        return self.__dict__["ref"].load_tokenizer()


def _tokenized(spec: ModelSpec, ref: Any) -> _TokenizedSpec:
    out = _TokenizedSpec(*(getattr(spec, f.name) for f in dataclasses.fields(spec)))
    object.__setattr__(out, "ref", ref)  # kept by pickling (the instance's __dict__), not a field
    return out


def measure_control_plane(
    sess: Any,
    model: Any,
    envs: Mapping[str, Any],
    *,
    weights: Mapping[str, float] | None = None,
    envs_per_task: int = 8,
    batch: int = 32,
    group: int = 8,
    steps: int = 3,
    max_new_tokens: int = 4,
    response_tokens: Callable[[Any], int] | None = None,
    rewards: Mapping[str, Callable[..., Any]] | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """CPU seconds the real rollout control plane spends per turn on this machine, alone.

    Runs the real pipeline on the open ``Session.local()`` with ``envs`` (the real envs,
    tokenized by ``model``'s tokenizer) in sync mode, with a :class:`~rollart_nb.workers.SimGenerator`
    and a :class:`~rollart_nb.workers.SimTrainer` that cost nothing (``time_scale=0``), one warm-up
    step and ``steps`` more; then divides the CPU time of the rollout worker's process (user +
    system, :mod:`psutil`) over those steps by the turns the generator served. That is the env
    managers' work (tokenizing, history, ``env.step``), the scheduler, the proxy, the client side
    of every Ray call, rewards and the buffer, per turn (per-trajectory work spread over the
    trajectories' turns). The sim generator's tokens are not a policy's (a FrozenLake episode
    plays invalid moves to its turn limit), so only the cost per turn carries over.

    Args:
        sess: an open ``rn.Session.local()`` (its pools ``H20`` and ``H800``); the clusters
            ``calib_gen`` and ``calib_train`` are built on it and closed again.
        model: the real model (its shape and tokenizer).
        envs: task -> env, the real run's envs (copied by the session's tasks).
        weights, envs_per_task, batch, group, max_new_tokens, seed: the real run's settings.
        response_tokens: the sim generator's response length per request (e.g.
            :func:`~rollart_nb.sim.response_tokens_fn` of the calibrated workloads).
        rewards: task -> reward function, the real run's (``sess.reward``; None: the envs' own).
        steps: measured steps (after one warm-up step).

    Returns ``{"turn_cpu_s", "turns", "cpu_s", "steps"}``.
    """
    import psutil

    from rollart_nb.algo.grpo import GRPO
    from rollart_nb.config import RolloutConfig
    from rollart_nb.workers.roles import SimGenerator, SimTrainer

    if getattr(sess, "mode", None) == "sim" or not hasattr(sess, "pipeline"):
        raise ConfigError(
            "measure_control_plane needs an open rn.Session.local() (a real control plane to measure)",
            where="measure_control_plane",
        )
    spec = hf_spec(model)
    tspec = _tokenized(spec, model)
    vocab = len(model.load_tokenizer())
    pipe = None
    try:
        gen = sess.cluster(
            "calib_gen",
            SimGenerator,
            pool="H20",
            model=tspec,
            time_scale=0,
            vocab_size=vocab,
            response_tokens=response_tokens,
            seed=seed,
        )
        train = sess.cluster("calib_train", SimTrainer, pool="H800", model=spec, time_scale=0)
        tasks = sess.tasks(dict(envs), envs_per_task=envs_per_task, weights=dict(weights) if weights else None)
        for task, fn in (rewards or {}).items():
            sess.reward(task, fn)
        pipe = sess.pipeline(
            train,
            gen,
            tasks,
            algo=GRPO(group_size=group),
            name="calib-control",
            batch_size=batch,
            mode="sync",
            rollout=RolloutConfig(max_new_tokens=max_new_tokens, temperature=1.0),
            seed=seed,
        )
        pipe.run(1, progress=False)
        pids = [i["pid"] for c in pipe.rollout.clusters for i in c.info()]
        procs = [psutil.Process(p) for p in pids]

        def cpu() -> float:
            return sum(sum(p.cpu_times()[:2]) for p in procs)

        def served() -> int:
            return sum(int(s.get("requests", 0)) for s in gen.stats())

        c0, n0 = cpu(), served()
        pipe.run(steps, progress=False)
        c1, n1 = cpu(), served()
    finally:
        if pipe is not None:
            try:
                pipe.close()
            except Exception as e:  # the clusters below are closed either way
                log.warning("closing the calibration pipeline: %s", e)
        _close_clusters(sess, ("calib_gen", "calib_train"))
    turns = n1 - n0
    if turns <= 0:
        raise StateError("measure_control_plane: the generator served no turns; nothing to divide by")
    return {"turn_cpu_s": (c1 - c0) / turns, "turns": float(turns), "cpu_s": c1 - c0, "steps": float(steps)}


@dataclass(frozen=True)
class TrainerCost:
    """What one real ``torch`` train step costs on this machine: ``fixed_s + per_token_s * padded``
    seconds for ``padded`` tokens (:func:`~rollart_nb.sim.trainer.padded_tokens`)."""

    per_token_s: float
    fixed_s: float

    def mfu(self, spec: ModelSpec, peak_flops: float, algo: Any) -> float:
        """The trainer ``mfu`` that makes the roofline price a padded token at ``per_token_s``:
        ``6 * flops_factor(algo) * active_params / (per_token_s * peak_flops)``, clipped to (0, 1]."""
        from rollart_nb.sim.trainer import flops_factor

        flops = 6.0 * flops_factor(algo) * spec.active_params
        return min(1.0, max(flops / (self.per_token_s * peak_flops), 1e-6))


TRAIN_ROWS = ((8, 32), (32, 128))
"""The two synthetic batches :func:`measure_trainer` times, ``(trajectories, tokens each)``:
one small micro-batch (256 padded tokens) and, at the demo's 1024-token micro-batches, four
full ones (4096): a line through the two separates the cost per token from the fixed cost."""


def _synthetic_batch(rows: int, length: int, group_size: int) -> list[Any]:
    """``rows`` scored single-turn trajectories of ``length`` tokens (a quarter of them
    generated), in groups of ``group_size`` with distinct rewards (every row is trained)."""
    from rollart_nb.trajectory import Trajectory, Turn

    resp = max(1, length // 4)
    out = []
    for i in range(rows):
        t = Trajectory(task="calibrate", seed=i, group_id=f"g{i // max(1, group_size)}")
        t.turns.append(
            Turn(
                observation="",
                prompt_ids=[5 + (i + j) % 7 for j in range(length - resp)],
                response_ids=[6] * resp,
                logprobs=[-1.0] * resp,
                loss_mask=[1] * resp,
            )
        )
        t.reward = float(i % max(1, group_size))
        out.append(t)
    return out


def measure_trainer(model: Any, algo: Any, seconds: float = 2.0, threads: int = 1) -> TrainerCost:
    """Time the real :class:`~rollart_nb.backends.torch_train.TorchTrainBackend` (``model``,
    ``algo``) on the two synthetic batches of :data:`TRAIN_ROWS` and fit
    ``seconds = fixed_s + per_token_s * padded_tokens`` through their median step times.

    The batches are not the run's: only the trainer's own cost per padded token and per step is
    taken from them; the sim applies it to the padded tokens of the batches it trains
    (:func:`~rollart_nb.sim.trainer.padded_tokens`). ``fixed_s`` is clipped at 0.
    """
    from rollart_nb.backends.torch_train import TorchTrainBackend
    from rollart_nb.sim.trainer import padded_tokens

    with _threads(threads):
        trainer = TorchTrainBackend(model, algo, seed=0)
        points = []
        for rows, length in TRAIN_ROWS:
            batch = _synthetic_batch(rows, length, int(getattr(algo, "group_size", 8)))
            t = _timed(functools.partial(trainer.train_step, batch), seconds / len(TRAIN_ROWS))
            points.append((padded_tokens([length] * rows, algo), t))
    (p1, t1), (p2, t2) = points
    per_token = max((t2 - t1) / (p2 - p1), 1e-12)
    return TrainerCost(per_token_s=per_token, fixed_s=max(0.0, t1 - per_token * p1))


# -- the envs' token profile -----------------------------------------------------------------------
@dataclass
class EpisodeStats:
    """Token and turn counts of real episodes of one task (tokens of the real tokenizer).

    Attributes:
        prompt_tokens: per episode, tokens of the first observation.
        obs_tokens: per later turn, tokens of its observation.
        response_tokens: per turn, tokens the model generated.
        turns: per episode, turns played.
        env_step_s: per ``env.step`` call, wall seconds.
        env_reset_s: per ``env.reset`` call, wall seconds.

    Observation counts are of ``"<|user|> {obs} <|assistant|>"`` less the two tags, as the
    rollout encodes an observation (the sim tokenizer adds the same two tags, one token each).
    """

    prompt_tokens: list[int] = field(default_factory=list)
    obs_tokens: list[int] = field(default_factory=list)
    response_tokens: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    env_step_s: list[float] = field(default_factory=list)
    env_reset_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, float | None]:
        """Means (None where there are no samples) and the turn range."""

        def mean(xs: list[float] | list[int]) -> float | None:
            return statistics.fmean(xs) if xs else None

        def rounded(x: float | None, digits: int) -> float | None:
            return None if x is None else round(x, digits)

        return {
            "episodes": len(self.turns),
            "turns_mean": rounded(mean(self.turns), 2),
            "turns_min": min(self.turns, default=0),
            "turns_max": max(self.turns, default=0),
            "prompt_tokens": rounded(mean(self.prompt_tokens), 1),
            "obs_tokens": rounded(mean(self.obs_tokens), 1),
            "response_tokens": rounded(mean(self.response_tokens), 2),
            "env_step_s": rounded(mean(self.env_step_s), 6),
        }


def _sample(lm: Any, ids: list[int], max_new: int, eos: int, gen: Any) -> list[int]:
    """Sample up to ``max_new`` tokens at temperature 1 (stopping after ``eos``), KV-cached."""
    import torch

    from rollart_nb.backends.hf import cache_kwarg

    out: list[int] = []
    x = torch.tensor([ids])
    kw = cache_kwarg(lm)
    cache = None
    for _ in range(max_new):
        res = lm(input_ids=x, use_cache=True, **({kw: cache} if cache is not None else {}))
        cache = getattr(res, kw)
        probs = torch.softmax(res.logits[0, -1].float(), -1)
        nxt = int(torch.multinomial(probs, 1, generator=gen))
        out.append(nxt)
        if nxt == eos:
            break
        x = torch.tensor([[nxt]])
    return out


def sample_episodes(
    model: Any,
    envs: Mapping[str, Any],
    *,
    episodes: int = 16,
    max_new_tokens: int = 4,
    max_turns: int = 16,
    seed: int = 0,
    threads: int = 1,
) -> dict[str, EpisodeStats]:
    """Play ``episodes`` real episodes of each env with ``model`` (sampling at temperature 1) and
    count their tokens and turns.

    Prompts are built as the rollout builds them (:func:`~rollart_nb.models.tiny.format_history`:
    the history of observations and actions); an episode ends when the env says so or after
    ``min(max_turns, env.max_turns)`` turns, as in the pipeline. Seeds are ``seed, seed + 1, ...``.
    """
    import torch

    from rollart_nb.models.tiny import format_history

    tok = model.load_tokenizer()
    eos = tok.eos_token_id
    tags = len(tok.encode("<|user|> <|assistant|>"))
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, EpisodeStats] = {}
    with _threads(threads), torch.no_grad():
        lm = model.load_model(dtype=torch.float32)
        for task, env in envs.items():
            st = out[task] = EpisodeStats()
            limit = min(max_turns, int(getattr(env, "max_turns", max_turns)))
            for k in range(episodes):
                t0 = time.perf_counter()
                obs, _ = env.reset(seed=seed + k)
                st.env_reset_s.append(time.perf_counter() - t0)
                st.prompt_tokens.append(len(tok.encode(f"<|user|> {obs} <|assistant|>")) - tags)
                history: list[tuple[str, str | None]] = [(obs, None)]
                turns = 0
                while turns < limit:
                    ids = tok.encode(format_history(history))
                    resp = _sample(lm, ids, max_new_tokens, eos, gen)
                    st.response_tokens.append(len(resp))
                    action = tok.decode(resp, skip_special_tokens=True)
                    history[-1] = (history[-1][0], action)
                    t0 = time.perf_counter()
                    obs, _, terminated, truncated, _ = env.step(action)
                    st.env_step_s.append(time.perf_counter() - t0)
                    turns += 1
                    if terminated or truncated or turns >= limit:
                        break
                    st.obs_tokens.append(len(tok.encode(f"<|user|> {obs} <|assistant|>")) - tags)
                    history.append((obs, None))
                st.turns.append(turns)
    return out


def _mean_std(xs: list[float] | list[int]) -> tuple[float, float]:
    if not xs:
        return 0.0, 0.0
    return float(statistics.fmean(xs)), float(statistics.pstdev(xs)) if len(xs) > 1 else 0.0


def workload_from_stats(name: str, stats: EpisodeStats, max_response_tokens: int) -> Workload:
    """A :class:`Workload` with the statistics of ``stats``.

    * ``prompt_tokens``: the mean first-observation length, rounded (at least 1).
    * ``obs_tokens``, ``response_tokens``, ``env_latency_s``, ``reset_latency_s``: (mean,
      population std) of the samples.
    * ``turns``: the fewest and most turns seen, with ``turn_weights`` the count of episodes
      of each length in between: :class:`SimEnv` plays the observed distribution (FrozenLake's
      is bimodal: a hole at turn 1 or a walk to the turn limit), not only its mean.
    * ``shape``: "prefill" when episodes average more than one turn, else "decode".
    """
    if not stats.turns:
        raise ConfigError(f"no episodes of {name!r} to build a workload from", where="workload_from_stats")
    mean_turns = statistics.fmean(stats.turns)
    lo, hi = min(stats.turns), max(stats.turns)
    weights = tuple(float(stats.turns.count(k)) for k in range(lo, hi + 1))
    return Workload(
        name,
        "prefill" if mean_turns > 1 else "decode",
        (lo, hi),
        max(1, round(statistics.fmean(stats.prompt_tokens))),
        _mean_std(stats.obs_tokens),
        _mean_std(stats.response_tokens),
        _mean_std(stats.env_step_s),
        reset_latency_s=_mean_std(stats.env_reset_s),
        max_response_tokens=max_response_tokens,
        turn_weights=weights if hi > lo else (),
    )


# -- everything at once ------------------------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    """What a sim run needs to mirror a real one on this machine.

    Attributes:
        profile: the measured hardware (registered: a SimSession pool may be named after it).
        spec: the model's shape.
        mfu: fraction of the profile's FLOP/s the model's matmuls reach (:func:`matmul_efficiency`);
            the generator's ``mfu``.
        train_mfu: the trainer's ``mfu``, from the real trainer's measured cost per padded token
            (:meth:`TrainerCost.mfu`); the sim trainer gets it with the run's ``algo``.
        train_overhead_s: the real trainer's fixed seconds per step (:func:`measure_trainer`);
            the sim trainer's ``step_overhead_s``.
        mbu: the generator's ``mbu``: 1, since ``mem_bw_gbps`` is itself an achieved bandwidth.
        row_overhead_s: the ``hf`` engine's own seconds per request (:func:`row_overhead`);
            the sim generator's ``row_overhead_s``.
        workloads: task -> Workload from real episodes.
        episodes: task -> the statistics' summary.
        threads: torch threads every measurement used.
        seconds: wall seconds the calibration took.
    """

    profile: HardwareProfile
    spec: ModelSpec
    mfu: float
    train_mfu: float
    train_overhead_s: float
    mbu: float
    row_overhead_s: float
    workloads: dict[str, Workload]
    episodes: dict[str, dict[str, float | None]]
    threads: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the profile, the spec, the efficiencies and the episode statistics."""
        return {
            "profile": asdict(self.profile),
            "spec": asdict(self.spec),
            "mfu": self.mfu,
            "train_mfu": self.train_mfu,
            "train_overhead_s": self.train_overhead_s,
            "mbu": self.mbu,
            "row_overhead_s": self.row_overhead_s,
            "episodes": self.episodes,
            "threads": self.threads,
            "seconds": round(self.seconds, 2),
        }


def calibrate(
    model: Any,
    envs: Mapping[str, Any],
    *,
    algo: Any = None,
    seconds: float = 2.0,
    episodes: int = 16,
    max_new_tokens: int = 4,
    max_turns: int = 16,
    threads: int = 1,
    seed: int = 0,
    name: str = MEASURED_PROFILE,
) -> Calibration:
    """Measure the profile (:func:`measure_cpu`, registered under ``name``), the model's matmul
    efficiency, the real trainer's cost (:func:`measure_trainer`), the envs' workloads
    (:func:`sample_episodes`) and the ``hf`` engine's work per request (:func:`row_overhead`, at
    the episodes' mean prompt and observation lengths) for a sim of ``model`` on ``envs``.

    Args:
        model: the tiny model (a ModelRef) the real run serves and trains.
        envs: task name -> env, the real run's envs (stepped here; pass copies if they matter).
        algo: the real run's GRPO settings (None: ``GRPO()``'s), for the trainer measurement.
        seconds: budget of the hardware measurements (the trainer's takes as long again).
        episodes: real episodes per task for the token statistics.
        max_new_tokens, max_turns: the real run's rollout limits.
        threads: torch threads (1: as in ``Session.local()``'s workers).
        seed: episode seeds start here.
        name: the profile's (and pool's) name.
    """
    t0 = time.perf_counter()
    hw = register_profile(measure_cpu(model, seconds=seconds, threads=threads, name=name))
    spec = hf_spec(model)
    mfu = matmul_efficiency(spec, hw.bf16_tflops * 1e12, seconds=seconds / 6, threads=threads)
    if algo is None:
        from rollart_nb.algo.grpo import GRPO

        algo = GRPO()
    train = measure_trainer(model, algo, seconds=seconds, threads=threads)
    stats = sample_episodes(
        model, envs, episodes=episodes, max_new_tokens=max_new_tokens, max_turns=max_turns, seed=seed, threads=threads
    )
    prompts = [p for s in stats.values() for p in s.prompt_tokens]
    observations = [o for s in stats.values() for o in s.obs_tokens]
    row_s = row_overhead(
        model,
        seconds=seconds,
        threads=threads,
        prompt_tokens=max(1, round(statistics.fmean(prompts))) if prompts else 16,
        obs_tokens=max(1, round(statistics.fmean(observations))) if observations else 8,
        max_new_tokens=max_new_tokens,
        pass_s=hw.pass_overhead_s,
    )
    return Calibration(
        profile=hw,
        spec=spec,
        mfu=mfu,
        train_mfu=train.mfu(spec, hw.bf16_tflops * 1e12, algo),
        train_overhead_s=train.fixed_s,
        mbu=1.0,
        row_overhead_s=row_s,
        workloads={t: workload_from_stats(t, s, max_new_tokens) for t, s in stats.items()},
        episodes={t: s.summary() for t, s in stats.items()},
        threads=threads,
        seconds=time.perf_counter() - t0,
    )
