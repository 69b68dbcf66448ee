"""StepReport: what one pipeline iteration did, and how long each phase took; where it goes."""

from __future__ import annotations

import collections
import html
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rollart_nb.algo.grpo import TRAIN_METRICS
from rollart_nb.config import portable
from rollart_nb.trackers import sample_rows

__all__ = [
    "ENGINE_REPORTS",
    "ENV_FAULTS",
    "PHASES",
    "StepReport",
    "StepTally",
    "TrackerFanout",
    "count_deltas",
    "env_fault_deltas",
    "mean_occupancy",
    "run_config",
    "waste",
]

PHASES = ("rollout_wait", "suspend", "update", "resume", "train")
"""Step-time phases, in protocol order (train is the part not hidden behind rollout)."""

ENV_FAULTS = ("restarts", "timeouts", "abandoned_threads")
"""Env fault counters of :attr:`StepReport.env` (per step; cumulative ones in ``pipe.stats()["env"]``)."""


def env_fault_deltas(now: dict[str, Any], before: dict[str, Any]) -> dict[str, int]:
    """This step's env faults: cumulative ``stats()["env"]`` counters now minus at the last step."""
    return {k: int(now.get(k, 0)) - int(before.get(k, 0)) for k in ENV_FAULTS}


def count_deltas(now: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """This step's endings: cumulative counters now minus at the last step, zeros left out."""
    return {k: n - before.get(k, 0) for k, n in now.items() if n - before.get(k, 0)}


def waste(token_deltas: dict[str, int], aborted: int, waited_s: float = 0.0) -> dict[str, float]:
    """A step's wasted work from its :func:`count_deltas` of the rollout's ``token_events``
    (``ended``, ``aborted_stale``, ``cancelled``, ``renewed``: what the ``cancel`` staleness
    policy discarded or took out of the loss), its number of stale aborts and the seconds the
    ``wait`` policy held its batch.

    Example:
        >>> waste({"ended": 1000, "aborted_stale": 250, "cancelled": 50}, aborted=3)["wasted_frac"]
        0.3
    """
    gen = int(token_deltas.get("ended", 0))
    ab, ca = int(token_deltas.get("aborted_stale", 0)), int(token_deltas.get("cancelled", 0))
    rn = int(token_deltas.get("renewed", 0))
    return {
        "generated_tokens": gen,
        "aborted_tokens": ab,
        "cancelled_tokens": ca,
        "renewed_tokens": rn,
        "aborted": aborted,
        "aborted_frac": (ab + rn) / gen if gen else math.nan,
        "wasted_frac": (ab + rn + ca) / gen if gen else math.nan,
        "waited_s": waited_s,
    }


log = logging.getLogger(__name__)

ENGINE_REPORTS = 8
"""Reports of a pipeline, newest first, that keep their per-engine snapshot (``engines``)."""


def mean_occupancy(engines: list[dict[str, Any]]) -> float | None:
    """Mean ``occupancy`` of the engines that know theirs (None when none does)."""
    occupied = [e["occupancy"] for e in engines if e.get("occupancy") is not None]
    return sum(occupied) / len(occupied) if occupied else None


@dataclass
class StepReport:
    """One iteration of the pipeline.

    Attributes:
        step: iteration index (0-based).
        version: policy version after this step's weight update.
        mode: pipeline mode name.
        step_s: wall time of the whole step.
        phases: seconds per phase (see :data:`PHASES`); ``train`` counts only the time the
            step waited for training (0 when fully overlapped). A step that validated also has
            ``validation``: seconds of the validation run after the step (not in ``step_s``).
        train_s: how long the train step itself ran (overlapped or not).
        batch_size: trajectories trained on.
        tokens: prompt + response tokens in the batch.
        throughput: tokens / step_s (the paper's metric). A validation holds the rollout while
            it runs, so its seconds (outside ``step_s``) made no batch tokens.
        reward: mean reward per task in the batch.
        validation: validation score per task, when a validation ran this step.
        pass_k: sampled validation per task, when a validation ran this step and the pipeline's
            ``validate_pass_k`` is set: ``{"math": {"pass@1": 0.2, "pass@8": 0.6}}``.
        staleness: version gap (policy version - trajectory start version) -> count, for the batch.
        counts: trajectories that ended during the step, by status (completed, aborted_stale,
            failed, cancelled) plus "redundant_cancelled" and "penalized" (failed trajectories
            trained on with ``failure_reward``, also counted completed). Never negative: a sample
            that completed in an earlier step and is evicted as stale in this one counts as
            aborted_stale here.
        task_counts: the same per task (task -> kind -> count; kinds with 0 left out).
        waste: generated work this step lost, as :func:`waste` returns it: ``generated_tokens``
            (response tokens of every trajectory that ended this step), ``aborted_tokens`` (of
            those aborted as stale, evictions from the buffer included), ``cancelled_tokens``
            (redundant members and closed groups), ``renewed_tokens`` (turns the ``cancel``
            staleness policy discarded, finished turns it took out of the loss), ``aborted``
            (trajectories aborted as stale), ``aborted_frac`` / ``wasted_frac`` (aborted and
            renewed, and those plus cancelled, tokens over generated tokens; NaN when nothing
            ended) and ``waited_s`` (seconds the ``wait`` policy held the batch).
        failures: a few failure reasons seen during the step (task -> reasons).
        env: env faults during the step (see :data:`ENV_FAULTS`): ``restarts`` (envs replaced by
            a fresh copy after a failure), ``timeouts`` (env calls past ``env_timeout_s``) and
            ``abandoned_threads`` (sync env calls given up while running).
        weights: weight-sync metrics (push_s, pull_s, exposed_pull_s, bytes, gbps).
        train: metrics from the train step (loss, grad norm, ...); per task also
            ``"<metric>/<task>"`` for :data:`~rollart_nb.algo.grpo.TASK_METRICS`.
        started_at: unix time the step began (for timelines).
        events: failover during the step, oldest first: ``{"kind": "generator_replaced" |
            "trainer_restored", "worker", "pool", "reason", "version", "at", ...}`` (a replaced
            generator also records its node, whether it fell back and why; a restored trainer
            its checkpoint and ``versions_lost``).
        engines: the generation engines at the end of the step, one dict each: ``name``,
            ``inflight`` (turns on it), ``queued`` (waiting in the proxy, batched dispatch),
            ``capacity`` (sequences it serves at once; None: unknown) and ``occupancy``
            (inflight / capacity; None: unknown). Kept on the newest
            :data:`ENGINE_REPORTS` reports of a pipeline only (a thousand-engine simulation would
            otherwise grow by a dict per engine every step); ``engine_occupancy`` stays on all.
        engine_occupancy: the engines' mean ``occupancy`` at the end of the step (None: unknown).
    """

    step: int
    version: int
    mode: str
    step_s: float = 0.0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    train_s: float = 0.0
    batch_size: int = 0
    tokens: int = 0
    throughput: float = 0.0
    reward: dict[str, float] = field(default_factory=dict)
    validation: dict[str, float] = field(default_factory=dict)
    pass_k: dict[str, dict[str, float]] = field(default_factory=dict)
    staleness: dict[int, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    task_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    waste: dict[str, float] = field(default_factory=dict)
    failures: dict[str, list[str]] = field(default_factory=dict)
    env: dict[str, int] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    train: dict[str, float] = field(default_factory=dict)
    started_at: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)
    engines: list[dict[str, Any]] = field(default_factory=list)
    engine_occupancy: float | None = None

    @property
    def mean_reward(self) -> float:
        vals = [v for v in self.reward.values() if not math.isnan(v)]
        return sum(vals) / len(vals) if vals else math.nan

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepReport:
        """Inverse of :meth:`to_dict`, also for a line of a run's ``steps.jsonl`` (whose JSON
        keys are strings), e.g. to redraw a finished run's curves."""
        d = dict(d)
        d["staleness"] = {int(k): v for k, v in d.get("staleness", {}).items()}
        return cls(**d)

    def row(self) -> dict[str, Any]:
        """A flat dict for tables / DataFrames."""
        r: dict[str, Any] = {"step": self.step, "version": self.version, "step_s": round(self.step_s, 3)}
        r.update({f"{k}_s": round(v, 3) for k, v in self.phases.items()})
        r["tokens/s"] = round(self.throughput, 1)
        r.update({f"reward/{k}": round(v, 3) for k, v in self.reward.items()})
        r.update({f"val/{k}": round(v, 3) for k, v in self.validation.items()})
        r.update({f"val/{t}/{k}": round(v, 3) for t, ks in self.pass_k.items() for k, v in ks.items()})
        r["aborted"] = self.counts.get("aborted_stale", 0)
        frac = self.waste.get("aborted_frac")
        if isinstance(frac, int | float) and not math.isnan(frac):
            r["aborted_frac"] = round(float(frac), 3)
        for key, n in (("renewed", self.counts.get("renewed", 0)), ("waited_s", self.waste.get("waited_s", 0.0))):
            if n:
                r[key] = round(n, 3)
        for key in ("corrected_frac", "tis_clip_frac"):  # the correct staleness policy's weights
            if isinstance(self.train.get(key), float) and not math.isnan(self.train[key]):
                r[key] = round(self.train[key], 3)
        r["failed"] = self.counts.get("failed", 0)
        if self.counts.get("penalized"):
            r["penalized"] = self.counts["penalized"]
        for task, c in sorted(self.task_counts.items()):
            for kind in ("aborted_stale", "failed"):
                if c.get(kind):
                    r[f"{'aborted' if kind == 'aborted_stale' else kind}/{task}"] = c[kind]
        r["env_restarts"] = self.env.get("restarts", 0)
        r["env_timeouts"] = self.env.get("timeouts", 0)
        r["replaced"] = sum(e["kind"] == "generator_replaced" for e in self.events)
        r["restored"] = sum(e["kind"] == "trainer_restored" for e in self.events)
        occupancy = self.engine_occupancy if self.engine_occupancy is not None else mean_occupancy(self.engines)
        if occupancy is not None:
            r["engine_occupancy"] = round(occupancy, 3)
        for k in TRAIN_METRICS:  # what the train step measured (absent ones are left out)
            v = self.train.get(k)
            if isinstance(v, int | float):
                r[k] = round(float(v), 4)
        return r

    def __repr__(self) -> str:
        rw = ", ".join(f"{k}={v:.3f}" for k, v in self.reward.items())
        ph = " ".join(f"{k}={v:.2f}s" for k, v in self.phases.items() if v)
        return (
            f"StepReport(step={self.step}, v{self.version}, {self.mode}, {self.step_s:.2f}s [{ph}], "
            f"{self.tokens} tok, {self.throughput:.0f} tok/s, reward: {rw or '-'}, counts={self.counts})"
        )

    def _repr_html_(self) -> str:
        total = sum(self.phases.values()) or 1.0
        colors = {
            "rollout_wait": "#4c78a8",
            "suspend": "#f58518",
            "update": "#e45756",
            "resume": "#72b7b2",
            "train": "#54a24b",
            "validation": "#bab0ac",
        }
        bar = "".join(
            f'<div title="{k}: {v:.3f}s" style="display:inline-block;height:14px;width:{300 * v / total:.1f}px;'
            f'background:{colors.get(k, "#999")}"></div>'
            for k, v in self.phases.items()
            if v > 0
        )
        legend = " ".join(
            f'<span style="color:{colors.get(k, "#999")}">&#9632;</span> {k} {v:.2f}s' for k, v in self.phases.items()
        )
        rows = "".join(
            f"<tr><td>{html.escape(k)}</td><td>{v:.3f}</td><td>{self.validation.get(k, float('nan')):.3f}</td></tr>"
            for k, v in self.reward.items()
        )
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items()))
        faults = ", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in self.env.items() if v)
        events = "".join(
            f"<div style='color:#b00'>&#9888; {html.escape(e['kind'].replace('_', ' '))}: "
            f"{html.escape(str(e.get('worker', '')))} on {html.escape(str(e.get('pool', '')))} "
            f"(version {e.get('version')}; {html.escape(str(e.get('reason', ''))[:200])})</div>"
            for e in self.events
        )
        return (
            f"<div><b>Step {self.step}</b> &middot; version {self.version} &middot; {self.mode} &middot; "
            f"{self.step_s:.2f}s &middot; {self.tokens} tokens &middot; {self.throughput:.0f} tok/s"
            f"<div>{bar}</div><small>{legend}</small>"
            f"<table><tr><th>task</th><th>reward</th><th>validation</th></tr>{rows}</table>"
            f"<small>{html.escape(counts)}{' &middot; env ' + html.escape(faults) if faults else ''}</small>"
            f"{events}</div>"
        )


def run_config(pipe: Any) -> dict[str, Any]:
    """What a tracker records as a pipeline's run parameters: mode, alpha, sizes, tasks, algorithm."""
    algo = pipe.algo
    return {
        "pipeline": pipe.name,
        **portable(pipe.config),
        "rollout_shards": pipe.rollout.shards,
        "group_size": pipe.cfg.group_size,
        "seed": pipe.cfg.seed,
        "tasks": sorted(pipe.tasks.envs),
        "generators": len(pipe.gen.workers),
        "trainers": len(pipe.train.workers),
        "algo": type(algo).__name__ if algo is not None else None,
        **(
            {f"algo.{k}": v for k, v in vars(algo).items() if isinstance(v, int | float | str | bool)}
            if algo is not None and hasattr(algo, "__dict__")
            else {}
        ),
    }


def render_pipeline_html(pipe: Any) -> str:
    """HTML summary of a Pipeline (mode, alpha, version, state, last step)."""
    last = pipe.reports[-1]._repr_html_() if pipe.reports else "<p>no steps yet: call pipe.step()</p>"
    return (
        f"<div><b>Pipeline</b> <code>{html.escape(pipe.name)}</code> &middot; mode <b>{pipe.mode.name}</b> "
        f"&middot; &alpha;={pipe.cfg.alpha} &middot; version {pipe.version} &middot; {pipe.state} &middot; "
        f"{len(pipe.reports)} step(s) &middot; {pipe.E} envs, batch {pipe.cfg.batch_size}, "
        f"group {pipe.cfg.group_size}{last}</div>"
    )


class StepTally:
    """A pipeline's cumulative rollout counters as of its last step, to report each step's own."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}  # endings by kind
        self._tokens: dict[str, int] = {}  # generated / wasted tokens
        self._waited = 0.0  # the wait staleness policy's holds
        self._tasks: dict[str, dict[str, int]] = {}  # task -> kind -> endings
        self._env: dict[str, int] = {}  # env fault counters

    def fill(self, rep: StepReport, batch: list[Any], stats: dict[str, Any]) -> None:
        """Fill ``rep`` (its ``version`` and ``step_s`` set) from the ``batch`` it trained on
        and the rollout's ``stats()`` at its end."""
        rep.batch_size = len(batch)
        rep.tokens = sum(t.num_tokens for t in batch)
        # a validation holds the rollout, so its seconds, outside step_s, made none of these tokens
        rep.throughput = rep.tokens / rep.step_s if rep.step_s > 0 else 0.0
        by_task: dict[str, list[float]] = collections.defaultdict(list)
        for t in batch:
            by_task[t.task].append(t.reward)
            gap = rep.version - t.min_version
            rep.staleness[gap] = rep.staleness.get(gap, 0) + 1
        rep.reward = {k: sum(v) / len(v) for k, v in sorted(by_task.items())}
        rep.engines = list(stats.get("proxy", {}).get("engines", []))
        rep.engine_occupancy = mean_occupancy(rep.engines)
        # endings during this step (events only grow; "counts" moves evicted samples between statuses)
        rep.counts, self._counts = count_deltas(stats["events"], self._counts), stats["events"]
        tokens = stats.get("token_events", {})
        waited, self._waited = float(stats.get("waited_s", 0.0)) - self._waited, float(stats.get("waited_s", 0.0))
        rep.waste = waste(count_deltas(tokens, self._tokens), rep.counts.get("aborted_stale", 0), waited)
        self._tokens = tokens
        per_task = stats.get("task_events", {})
        for task, kinds in per_task.items():
            if delta := count_deltas(kinds, self._tasks.get(task, {})):
                rep.task_counts[task] = delta
        self._tasks = per_task
        rep.env, self._env = env_fault_deltas(stats.get("env", {}), self._env), stats.get("env", {})
        # the rollout keeps its last few failure reasons: this step's are the newest of them
        new_failed = rep.counts.get("failed", 0) + rep.counts.get("penalized", 0)
        for task, reason in stats.get("failures", [])[-new_failed:] if new_failed else []:
            rep.failures.setdefault(task, []).append(reason)


class TrackerFanout:
    """Sends each StepReport (and, every ``sample_every`` steps, ``sample_size`` rows of its
    batch) to every tracker, ``run_config()`` before the first; a tracker that fails is
    reported once and dropped, never fatal."""

    def __init__(
        self, trackers: list[Any], name: str, *, sample_every: int, sample_size: int, run_config: Callable[[], Any]
    ) -> None:
        self.trackers, self.name, self.run_config = trackers, name, run_config
        self.sample_every, self.sample_size = sample_every, sample_size
        self._started = False

    def _call(self, t: Any, what: str, *args: Any) -> None:
        try:
            getattr(t, what)(*args)
        except Exception as e:  # a tracker's outage must not stop training
            log.warning("tracker %r failed in %s (%s); pipeline %s sends it no more steps", t, what, e, self.name)
            t.failed = True

    def send(self, rep: StepReport, batch: list[Any]) -> None:
        """Log ``rep`` (and a sample of ``batch`` when one is due) to every working tracker."""
        if not self.trackers:
            return
        every = self.sample_every
        rows = sample_rows(batch, self.sample_size) if every and (rep.step + 1) % every == 0 else []
        if not self._started:
            self._started = True
            config = self.run_config()
            for t in self.trackers:
                self._call(t, "start", config)
        for t in self.trackers:
            if not getattr(t, "failed", False):
                self._call(t, "log_step", rep)
            if rows and hasattr(t, "log_samples") and not getattr(t, "failed", False):
                self._call(t, "log_samples", rep.step, rows)

    def close(self) -> None:
        """Close every tracker (a failure is logged)."""
        for t in self.trackers:
            try:
                t.close()
            except Exception as e:
                log.warning("tracker %r failed to close: %s", t, e)


def progress_bar(total: int, desc: str) -> Any:
    """A ``tqdm.auto`` bar for ``total`` steps (a notebook widget or a terminal line)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a core dependency
        return None
    return tqdm(total=total, desc=desc, leave=False)
