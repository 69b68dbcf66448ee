"""Calibrate the simulator to this machine: a measured CPU profile and the real envs' token shapes.

For a sim-to-real check (``benchmarks/sim_to_real.py``) the profile, model spec and workloads
must describe what ``Session.local()`` really runs:

* :func:`measure_cpu`: matmul FLOP/s, memory bandwidth and the tiny model's fixed cost per pass,
  in float32 (the dtype the ``hf`` and ``torch`` backends run here; the profile's ``bf16_tflops``
  holds it), on ``threads`` torch threads (1: Ray sets ``OMP_NUM_THREADS=1`` in ``num_cpus=0``
  actors).
* :func:`sample_episodes` and :func:`workload_from_stats`: real episodes' token and turn
  statistics as Workloads.
* :func:`calibrate` does all of it with :mod:`rollart_nb.bench.real_costs`' costs;
  :func:`register_profile` makes the profile a pool name a SimSession accepts.

Nothing here is tuned to a result: each number is a measurement or follows from one by a formula.

Example:
    >>> hw = measure_cpu(seconds=0.3)  # doctest: +SKIP
    >>> hw.bf16_tflops > 0 and hw.mem_bw_gbps > 0  # doctest: +SKIP
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from rollart_nb.algo.grpo import GRPO
from rollart_nb.backends.hf import cache_kwarg
from rollart_nb.bench.real_costs import measure_trainer, median_seconds, row_overhead, torch_threads
from rollart_nb.errors import ConfigError
from rollart_nb.models.spec import ModelSpec, hf_spec
from rollart_nb.models.tiny import format_history
from rollart_nb.resources.profiles import PROFILES, HardwareProfile
from rollart_nb.sim.roofline import prefill_flops, weights_read_bytes
from rollart_nb.sim.workloads import Workload

__all__ = [
    "MEASURED_PROFILE", "Calibration", "EpisodeStats", "calibrate", "matmul_efficiency", "matmul_flops", "measure_cpu",
    "memory_bandwidth", "pass_overhead", "register_profile", "sample_episodes", "workload_from_stats",
]  # fmt: skip

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


def matmul_flops(seconds: float = 0.5, threads: int = 1, n: int = MATMUL_N) -> float:
    """Peak float32 FLOP/s of a square matmul: ``2 * n**3 / t`` for the median time ``t`` of one
    ``[n, n] @ [n, n]`` product (one multiply and one add per inner-product term)."""
    import torch

    with torch_threads(threads):
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        t = median_seconds(lambda: torch.matmul(a, b, out=out), seconds)
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
    with torch_threads(threads):
        x, w = torch.randn(tokens, h), torch.randn(h, 3 * h)
        out = torch.empty(tokens, 3 * h)
        t = median_seconds(lambda: torch.matmul(x, w, out=out), seconds)
    return min(1.0, max(2.0 * tokens * h * 3 * h / t / peak_flops, 1e-6))


def memory_bandwidth(seconds: float = 0.5, threads: int = 1, nbytes: int = COPY_BYTES) -> float:
    """Memory bandwidth in bytes/s: ``2 * nbytes / t`` for the median time ``t`` of copying a
    ``nbytes`` float32 tensor into another (each byte is read once and written once)."""
    import torch

    with torch_threads(threads):
        src = torch.ones(nbytes // 4)
        dst = torch.empty_like(src)
        t = median_seconds(lambda: dst.copy_(src), seconds)
    return 2.0 * nbytes / t


def pass_time(model: Any, seconds: float = 0.5, threads: int = 1, context: int = PASS_CONTEXT) -> float:
    """Median wall seconds of one decode forward pass of ``model`` as the ``hf`` backend calls it
    (with an attention mask and explicit positions): batch 1, one new token, a KV cache of
    ``context`` to ``context + PASSES_PER_CACHE`` tokens, float32, no gradients.

    Each run of ``PASSES_PER_CACHE`` passes starts with a fresh cache, whose prefill is inside one
    timed call; the median leaves that call out."""
    import torch

    with torch_threads(threads), torch.no_grad():
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

        return median_seconds(step, seconds, min_reps=2 * PASSES_PER_CACHE)


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
    and sim workers bound there are priced with it (a later call of that name replaces it)."""
    PROFILES[hw.name] = hw
    return hw


@dataclass
class EpisodeStats:
    """Token and turn counts of real episodes of one task (tokens of the real tokenizer).

    Lists per episode (``prompt_tokens``, ``turns``), per turn (``obs_tokens`` of later turns,
    ``response_tokens``) and per call (``env_step_s``, ``env_reset_s``: wall seconds). Observation
    counts are of ``"<|user|> {obs} <|assistant|>"`` less the two tags, as the rollout encodes one.
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

    tok = model.load_tokenizer()
    eos = tok.eos_token_id
    tags = len(tok.encode("<|user|> <|assistant|>"))
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, EpisodeStats] = {}
    with torch_threads(threads), torch.no_grad():
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
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "workloads"}
        return {**out, "profile": asdict(self.profile), "spec": asdict(self.spec), "seconds": round(self.seconds, 2)}


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
    algo = GRPO() if algo is None else algo
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
