"""What the real backends, workers and control plane cost on this machine, each measured alone.

* :func:`row_overhead`: the ``hf`` engine's own seconds per request beyond its forward passes.
* :func:`measure_trainer`: the real trainer's seconds per padded token and per step.
* On a running ``Session.local()``: :func:`call_latency` (one Ray actor call),
  :func:`measure_weight_sync` (a weight update's two halves) and :func:`measure_control_plane`
  (the rollout's CPU seconds per turn), for ``Session.sim(call_latency_s=..., turn_cpu_s=...)``
  and the sim workers' overheads.

:mod:`rollart_nb.bench.calibrate` uses them with its CPU profile; like it, nothing here is tuned
to a result: each number is a measurement or follows from one by the formula in its docstring.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from rollart_nb.algo.grpo import GRPO
from rollart_nb.backends.hf import HFBackend
from rollart_nb.config import RolloutConfig
from rollart_nb.errors import ConfigError, StateError, WeightSyncError
from rollart_nb.models.spec import ModelSpec, hf_spec
from rollart_nb.protocols import GenerationRequest
from rollart_nb.sim.trainer import flops_factor, padded_tokens
from rollart_nb.trajectory import Trajectory, Turn
from rollart_nb.workers.roles import HFGenerator, SimGenerator, SimTrainer, TorchTrainer

__all__ = [
    "TrainerCost", "WeightSyncCost", "call_latency", "measure_control_plane", "measure_trainer", "measure_weight_sync",
    "median_seconds", "row_overhead", "torch_threads",
]  # fmt: skip

log = logging.getLogger(__name__)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch threads (restored after)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def median_seconds(fn: Callable[[], Any], seconds: float, min_reps: int = 3) -> float:
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
    1 and of ``rows`` two-turn trajectories (the second turn reuses cached KV, as a multi-turn
    rollout does). With ``t1``, ``tB`` the median seconds per turn's batch and ``p1``, ``pB``
    the decode passes each ran, the formula is ``max(0, (tB - t1 - (pB - p1) * pass_s) / (rows - 1))``:
    what a row adds to a batch, the passes a longer response adds taken out at ``pass_s``
    (the profile's ``pass_overhead_s``). The tiny model's FLOPs of the extra rows are left in.
    """
    if rows < 2:
        raise ConfigError(f"rows={rows!r} must be >= 2", where="row_overhead")
    with torch_threads(threads):
        backend = HFBackend(model, name="calibrate", batch_wait_s=0.0, seed=0)
        counter = iter(range(1 << 40))
        req = functools.partial(GenerationRequest, task="calibrate", max_new_tokens=max_new_tokens, temperature=1.0)

        async def one(b: int) -> tuple[float, int]:
            tids = [f"row{next(counter)}" for _ in range(b)]
            t0 = time.perf_counter()
            first = await asyncio.gather(*(backend.generate(req(t, prompt_ids=[5] * prompt_tokens)) for t in tids))
            turn2 = [
                req(t, prompt_ids=[6] * obs_tokens, prefix_len=prompt_tokens + len(r.token_ids), last_turn=True)
                for t, r in zip(tids, first, strict=True)
            ]
            second = await asyncio.gather(*(backend.generate(r) for r in turn2))
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

    if getattr(sess, "mode", None) == "sim" or not ray.is_initialized():
        raise ConfigError(
            "measure_weight_sync needs an open rn.Session.local() (real workers to time)", where="measure_weight_sync"
        )
    algo = GRPO() if algo is None else algo
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
        cpu_s, turns = _cpu_and_turns(pipe, gen, steps)
    finally:
        if pipe is not None:
            try:
                pipe.close()
            except Exception as e:  # the clusters below are closed either way
                log.warning("closing the calibration pipeline: %s", e)
        _close_clusters(sess, ("calib_gen", "calib_train"))
    if turns <= 0:
        raise StateError("measure_control_plane: the generator served no turns; nothing to divide by")
    return {"turn_cpu_s": cpu_s / turns, "turns": float(turns), "cpu_s": cpu_s, "steps": float(steps)}


def _cpu_and_turns(pipe: Any, gen: Any, steps: int) -> tuple[float, int]:
    """CPU seconds (user + system) of ``pipe``'s rollout worker processes over ``steps`` more
    steps, and the turns ``gen`` served meanwhile."""
    import psutil

    procs = [psutil.Process(i["pid"]) for c in pipe.rollout.clusters for i in c.info()]

    def sample() -> tuple[float, int]:
        return sum(sum(p.cpu_times()[:2]) for p in procs), sum(int(s.get("requests", 0)) for s in gen.stats())

    c0, n0 = sample()
    pipe.run(steps, progress=False)
    c1, n1 = sample()
    return c1 - c0, n1 - n0


@dataclass(frozen=True)
class TrainerCost:
    """What one real ``torch`` train step costs on this machine: ``fixed_s + per_token_s * padded``
    seconds for ``padded`` tokens (:func:`~rollart_nb.sim.trainer.padded_tokens`)."""

    per_token_s: float
    fixed_s: float

    def mfu(self, spec: ModelSpec, peak_flops: float, algo: Any) -> float:
        """The trainer ``mfu`` that makes the roofline price a padded token at ``per_token_s``:
        ``6 * flops_factor(algo) * active_params / (per_token_s * peak_flops)``, clipped to (0, 1]."""
        flops = 6.0 * flops_factor(algo) * spec.active_params
        return min(1.0, max(flops / (self.per_token_s * peak_flops), 1e-6))


TRAIN_ROWS = ((8, 32), (32, 128))
"""The two synthetic batches :func:`measure_trainer` times, ``(trajectories, tokens each)``:
one small micro-batch (256 padded tokens) and, at the demo's 1024-token micro-batches, four
full ones (4096): a line through the two separates the cost per token from the fixed cost."""


def _synthetic_batch(rows: int, length: int, group_size: int) -> list[Any]:
    """``rows`` scored single-turn trajectories of ``length`` tokens (a quarter of them
    generated), in groups of ``group_size`` with distinct rewards (every row is trained)."""
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

    with torch_threads(threads):
        trainer = TorchTrainBackend(model, algo, seed=0)
        points = []
        for rows, length in TRAIN_ROWS:
            batch = _synthetic_batch(rows, length, int(getattr(algo, "group_size", 8)))
            t = median_seconds(functools.partial(trainer.train_step, batch), seconds / len(TRAIN_ROWS))
            points.append((padded_tokens([length] * rows, algo), t))
    (p1, t1), (p2, t2) = points
    per_token = max((t2 - t1) / (p2 - p1), 1e-12)
    return TrainerCost(per_token_s=per_token, fixed_s=max(0.0, t1 - per_token * p1))
