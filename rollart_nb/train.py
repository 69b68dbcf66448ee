"""``rollart-nb train``: a whole run from one typed config (YAML plus dotted overrides).

:func:`run_train` runs a :class:`TrainConfig` on ``Session.local()``: a row per step,
``steps.jsonl``, the HTML report and ``config.yaml`` into ``out``; it returns the RESULT, also
after Ctrl-C (``"interrupted": true``). ``rollart-nb demo`` runs ``rollart_nb/configs/demo.yaml``.

Example:
    >>> from rollart_nb.train import TrainConfig, demo_config
    >>> demo_config(["pipeline.alpha=1"]).pipeline.alpha
    1
"""

from __future__ import annotations

import importlib
import json
import math
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart_nb._checks import is_number, is_whole
from rollart_nb.algo.grpo import GRPO
from rollart_nb.config import PipelineConfig, dump, load
from rollart_nb.errors import ConfigError

__all__ = [
    "BUILTIN_ENVS",
    "DEMO_YAML",
    "FORMAT_YAML",
    "ModelConfig",
    "TaskConfig",
    "TrainConfig",
    "demo_config",
    "run_train",
]

DEMO_YAML = Path(__file__).parent / "configs" / "demo.yaml"
#: The same pipeline from a format-only warm start instead of a base model.
FORMAT_YAML = DEMO_YAML.with_name("format.yaml")
BUILTIN_ENVS = ("frozenlake", "math")  # env names a TaskConfig may use besides "module:Class"
BUILTIN_REWARDS = ("close", "exact")  # rewards.close_answer / rewards.exact_answer
SIZES = ("s", "m")
GENERATORS = ("hf", "vllm")
#: Concurrent env instances of a task that ``envs_per_task`` does not name.
DEFAULT_ENVS = 16


@dataclass(frozen=True)
class ModelConfig:
    """The model, built here (no downloads): a tiny Qwen-style model over the tasks' vocabulary."""

    size: str = "s"
    """Tiny model size: "s" or "m"."""
    warm_steps: int = 60
    """Steps of the format-only warm start (random content in the tasks' answer formats; 0: none)."""
    pretrain_steps: int = 0
    """Steps of the base-model stage (``rn.models.pretrain``: next-token training on worked training
    problems, never a validation one; 0: none). It runs after the warm start, if both are set."""
    pretrain_batch: int = 64
    """Corpus entries per base-model step."""
    pretrain_lr: float = 3e-3
    """Peak learning rate of the base-model stage (AdamW, warm-up then cosine decay)."""
    pretrain_stop_at: dict[str, float] | None = None
    """Task -> accuracy on worked training problems at which the base-model stage stops early
    (checked every 5 steps; ``pretrain_steps`` is then the most it runs). None: all the steps."""
    pretrain_weights: dict[str, float] | None = None
    """Task -> share of the base-model corpus (relative). None: the tasks' batch weights. RL
    batches and the corpus need not be mixed alike: a task that is cheap to sample may take most
    of the RL batch and still want a fair part of the base model's training."""

    def __post_init__(self) -> None:
        p = []
        if self.size not in SIZES:
            p.append(f"size={self.size!r} must be one of {', '.join(SIZES)}")
        for name in ("warm_steps", "pretrain_steps"):
            v = getattr(self, name)
            if not is_whole(v) or v < 0:
                p.append(f"{name}={v!r} must be a whole number >= 0")
        if not is_whole(self.pretrain_batch) or self.pretrain_batch < 1:
            p.append(f"pretrain_batch={self.pretrain_batch!r} must be a whole number >= 1")
        if not (is_number(self.pretrain_lr) and self.pretrain_lr > 0):
            p.append(f"pretrain_lr={self.pretrain_lr!r} must be a number > 0")
        stop = self.pretrain_stop_at
        if stop is not None and not (
            isinstance(stop, dict) and all(isinstance(k, str) and is_number(v) and 0 < v <= 1 for k, v in stop.items())
        ):
            p.append(f"pretrain_stop_at={stop!r} must map task names to accuracies in (0, 1], or be None")
        w = self.pretrain_weights
        if w is not None and not (
            isinstance(w, dict) and w and all(isinstance(k, str) and is_number(v) and v >= 0 for k, v in w.items())
        ):
            p.append(f"pretrain_weights={w!r} must map task names to weights >= 0, or be None")
        if p:
            raise ConfigError(p, where="model config")


@dataclass(frozen=True)
class TaskConfig:
    """One task of the run."""

    env: str = "math"
    """The env: "frozenlake", "math" (Arithmetic) or "package.module:EnvClass"."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the env's constructor."""
    weight: float = 1.0
    """Share of each batch's groups (relative to the other tasks' weights)."""
    reward: str | None = None
    """Training reward: None (the env's own), "close" (partial credit by distance), "exact" (exact
    match) or "package.module:function"."""
    validate_with: str | None = None
    """Reward that scores validation, with a training ``reward`` set (same choices); None: the
    training reward."""
    curriculum: float | None = None
    """Draw prompts by learnability (PromptCurriculum) with this uniform share; None: random seeds."""

    def __post_init__(self) -> None:
        p = []
        if not isinstance(self.env, str) or (self.env not in BUILTIN_ENVS and ":" not in self.env):
            p.append(f"env={self.env!r} must be one of {', '.join(BUILTIN_ENVS)} or 'package.module:EnvClass'")
        if not isinstance(self.options, dict):
            p.append(f"options={self.options!r:.60} must be a mapping of constructor arguments")
        if not (is_number(self.weight) and math.isfinite(self.weight) and self.weight >= 0):
            p.append(f"weight={self.weight!r} must be a finite number >= 0")
        for name in ("reward", "validate_with"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or (v not in BUILTIN_REWARDS and ":" not in v)):
                p.append(f"{name}={v!r} must be None, {', '.join(map(repr, BUILTIN_REWARDS))} or 'module:function'")
        if self.curriculum is not None and not (is_number(self.curriculum) and 0 <= self.curriculum <= 1):
            p.append(f"curriculum={self.curriculum!r} (the uniform share) must be in [0, 1] or None")
        if p:
            raise ConfigError(p, where="task config")


def _default_tasks() -> dict[str, TaskConfig]:
    return {"frozenlake": TaskConfig(env="frozenlake"), "math": TaskConfig(env="math")}


@dataclass(frozen=True)
class TrainConfig:
    """A whole training run: ``rollart-nb train run.yaml key=value ...``.

    Example:
        >>> cfg = TrainConfig(steps=5)
        >>> cfg.algo.group_size, cfg.pipeline.batch_size
        (8, 32)
    """

    name: str = "train"
    """Pipeline name (and the default output folder ``runs/<name>``)."""
    seed: int = 0
    """Everything derives from it: model init, warm start, sampling, env seeds."""
    steps: int = 1000
    """Training steps at most (the run also stops after ``minutes``)."""
    minutes: float = 5.0
    """Wall-clock budget for the training steps."""
    out: str | None = None
    """Folder for steps.jsonl, report.html, curves.svg and config.yaml; None: ``runs/<name>``."""
    generator: str = "hf"
    """Generation backend: "hf" (transformers) or "vllm"."""
    envs_per_task: int | dict[str, int] = DEFAULT_ENVS
    """Concurrent env instances per task: one number for every task, or task -> number (a task it
    leaves out gets :data:`DEFAULT_ENVS`). A one-turn task whose groups are cheap may want more
    than a long multi-turn one, so that its share of the batch takes fewer engine passes."""
    pass_k: int = 0
    """Before and after training, also sample every validation seed this many times and report
    pass@1 and pass@k per task (0: greedy validation only)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    tasks: dict[str, TaskConfig] = field(default_factory=_default_tasks)
    """Task name -> its env, reward, weight and curriculum."""
    algo: GRPO = field(default_factory=GRPO)
    """The algorithm (GRPO settings)."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """The loop (batch size, alpha, mode, rollout, validation, checkpoints, trackers)."""

    def __post_init__(self) -> None:
        p = []
        if not isinstance(self.name, str) or not self.name:
            p.append(f"name={self.name!r} must be a non-empty string")
        if not is_whole(self.seed) or self.seed < 0:
            p.append(f"seed={self.seed!r} must be a whole number >= 0")
        if not is_whole(self.steps) or self.steps < 1:
            p.append(f"steps={self.steps!r} must be a whole number >= 1")
        if not (is_number(self.minutes) and self.minutes > 0):
            p.append(f"minutes={self.minutes!r} must be a number > 0")
        if self.generator not in GENERATORS:
            p.append(f"generator={self.generator!r} must be one of {', '.join(GENERATORS)}")
        per = self.envs_per_task
        counts: dict[Any, Any] = per if isinstance(per, dict) else {"": per}
        if not counts or not all(isinstance(k, str) and is_whole(v) and v >= 1 for k, v in counts.items()):
            p.append(f"envs_per_task={per!r} must be a whole number >= 1, or map task names to such numbers")
        if not is_whole(self.pass_k) or self.pass_k < 0:
            p.append(f"pass_k={self.pass_k!r} must be a whole number >= 0")
        for name, cls in (("model", ModelConfig), ("algo", GRPO), ("pipeline", PipelineConfig)):
            if not isinstance(getattr(self, name), cls):
                p.append(f"{name} must be a {cls.__name__}, not {getattr(self, name)!r:.60}")
        if p:
            raise ConfigError(p, where="train config")
        if not isinstance(self.tasks, dict) or not self.tasks:
            p.append("tasks must name at least one task")
        elif not all(isinstance(t, TaskConfig) for t in self.tasks.values()):
            p.append("tasks must map task names to TaskConfig")
        elif not any(t.weight > 0 for t in self.tasks.values()):
            p.append("tasks: at least one task needs a weight > 0")
        else:
            for name, named in (
                ("envs_per_task", self.envs_per_task),
                ("model.pretrain_weights", self.model.pretrain_weights),
                ("model.pretrain_stop_at", self.model.pretrain_stop_at),
            ):
                unknown = sorted(set(named) - set(self.tasks)) if isinstance(named, dict) else []
                if unknown:
                    p.append(
                        f"{name} names {unknown}, which are not tasks of this run ({', '.join(sorted(self.tasks))})"
                    )
        if is_whole(self.pipeline.batch_size) and self.pipeline.batch_size % self.algo.group_size:
            p.append(
                f"pipeline.batch_size={self.pipeline.batch_size} must be a multiple of "
                f"algo.group_size={self.algo.group_size}"
            )
        if p:
            raise ConfigError(p, where="train config")

    @property
    def out_dir(self) -> Path:
        return Path(self.out) if self.out else Path("runs") / self.name

    def only(self, tasks: Sequence[str]) -> TrainConfig:
        """This config with only ``tasks`` (in this config's order), and the per-task settings
        (``envs_per_task``, ``model.pretrain_weights``, ``model.pretrain_stop_at``) cut to them."""
        import dataclasses

        unknown = sorted(set(tasks) - set(self.tasks))
        if unknown:
            raise ConfigError(f"unknown tasks {unknown}; this config has {', '.join(self.tasks)}")

        def cut(d: Any) -> Any:
            return ({t: v for t, v in d.items() if t in tasks} or None) if isinstance(d, dict) else d

        m = self.model
        model = dataclasses.replace(
            m, pretrain_weights=cut(m.pretrain_weights), pretrain_stop_at=cut(m.pretrain_stop_at)
        )
        per = self.envs_per_task
        return dataclasses.replace(
            self,
            tasks={t: tc for t, tc in self.tasks.items() if t in tasks},
            model=model,
            envs_per_task=(cut(per) or DEFAULT_ENVS) if isinstance(per, dict) else per,
        )


def demo_config(overrides: Sequence[str] = ()) -> TrainConfig:
    """The main job's config: ``rollart_nb/configs/demo.yaml`` with ``overrides`` applied."""
    return load(TrainConfig, DEMO_YAML, overrides)


# -- building the run's parts ------------------------------------------------------------------------
def _import(spec: str, what: str) -> Any:
    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{what} {spec!r} cannot be imported: {e}") from None


def _make_env(tc: TaskConfig) -> Any:
    from rollart_nb.envs import Arithmetic, FrozenLake

    cls = {"frozenlake": FrozenLake, "math": Arithmetic}.get(tc.env) or _import(tc.env, "env")
    try:
        return cls(**tc.options)
    except TypeError as e:
        raise ConfigError(f"env {tc.env!r} does not take options {tc.options}: {e}") from None


def _reward(spec: str | None) -> Callable[..., Any] | None:
    from rollart_nb.rewards import close_answer, exact_answer

    if spec is None:
        return None
    return {"close": close_answer, "exact": exact_answer}.get(spec) or _import(spec, "reward")


# -- the run ---------------------------------------------------------------------------------------
HEADER = (
    f"{'step':>4} {'v':>3} {'wall':>7} {'step_s':>6} {'wait':>6} {'susp':>5} {'upd':>5} {'train':>5} "
    f"{'tok/s':>8}  {'reward':<26} {'validation':<26} {'abrt':>4} {'fail':>4}"
)


def _row(rep: Any, t0: float) -> str:
    rw = " ".join(f"{k}={v:.2f}" for k, v in rep.reward.items())
    val = " ".join(f"{k}={v:.2f}" for k, v in rep.validation.items())
    ph = rep.phases
    return (
        f"{rep.step:>4} {rep.version:>3} {time.monotonic() - t0:>7.1f} {rep.step_s:>6.2f} "
        f"{ph.get('rollout_wait', 0):>6.2f} {ph.get('suspend', 0):>5.2f} {ph.get('update', 0):>5.2f} "
        f"{ph.get('train', 0):>5.2f} {rep.throughput:>8.0f}  {rw:<26} {val:<26} "
        f"{rep.counts.get('aborted_stale', 0):>4} {rep.counts.get('failed', 0):>4}"
    )


def _passes(by_task: dict[str, dict[str, float]]) -> str:
    return "  ".join(f"{t}: " + " ".join(f"{k}={v:.2f}" for k, v in r.items()) for t, r in by_task.items())


def _clean(d: dict[str, float]) -> dict[str, float | None]:
    return {k: (None if v is None or math.isnan(v) else round(v, 4)) for k, v in d.items()}


def summary(first: dict[str, float], history: list[dict[str, float]], reports: list[Any]) -> dict[str, Any]:
    """Per task: ``base`` (before training), ``best`` and ``last5_mean`` over the validations
    during and after training, ``last``; and what the run cost."""
    tasks: dict[str, dict[str, float | None]] = {}
    for t, base in first.items():
        scores = [v[t] for v in history if t in v and not math.isnan(v[t])]
        tail = scores[-5:]
        tasks[t] = _clean(
            {
                "base": base,
                "best": max(scores) if scores else math.nan,
                "last5_mean": sum(tail) / len(tail) if tail else math.nan,
                "last": scores[-1] if scores else math.nan,
            }
        )
    completed = sum(r.counts.get("completed", 0) for r in reports)
    aborted = sum(r.counts.get("aborted_stale", 0) for r in reports)
    failed = sum(r.counts.get("failed", 0) for r in reports)
    ended = completed + aborted + failed
    return {
        "tasks": tasks,
        "steps": len(reports),
        "trained_tokens": int(sum(r.tokens for r in reports)),
        "aborted_fraction": round(aborted / ended, 4) if ended else 0.0,
        "failed": failed,
    }


class _Interrupt:
    """While active, the first Ctrl-C only asks the loop to stop after the step in progress."""

    def __init__(self, say: Callable[..., None]) -> None:
        self.hit = False
        self._say = say
        self._old: Any = None

    def __enter__(self) -> _Interrupt:
        import threading

        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, *_: Any) -> None:
        if self.hit:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.hit = True
        self._say("\ninterrupted: finishing the current step, then the report (Ctrl-C again to stop now)")

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


@dataclass
class _Progress:
    """What a run has measured so far: the report and the RESULT come from it, Ctrl-C or not."""

    reports: list[Any] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)  # validations, the first before RL
    first: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    passes: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # "base"/"final" -> task
    generated: dict[str, int] = field(default_factory=dict)
    interrupted: bool = False


def run_train(cfg: TrainConfig, *, quiet: bool = False) -> dict[str, Any]:
    """Run ``cfg`` on ``Session.local()``. Returns the RESULT: ``first`` / ``last`` validation per
    task, ``tasks`` (``base``, ``best``, ``last5_mean``, ``last``, and with ``pass_k`` the sampled
    ``base_sampled`` / ``final_sampled`` pass@1 and pass@k), ``steps``, ``trained_tokens``,
    ``generated_tokens`` (every response token generated for training, kept or not),
    ``aborted_fraction`` (of ended trajectories), ``aborted_generated_fraction`` (of generated
    tokens), ``failed``, ``wall_s`` and ``interrupted``."""
    import rollart_nb as rn

    t_start = time.monotonic()
    say: Callable[..., None] = (lambda *a, **k: None) if quiet else (lambda *a, **k: print(*a, flush=True, **k))
    out = cfg.out_dir
    out.mkdir(parents=True, exist_ok=True)
    dump(cfg, out / "config.yaml")
    envs = {name: _make_env(tc) for name, tc in cfg.tasks.items()}
    model = _base_model(cfg, envs, say, quiet=quiet)
    run = _Progress()
    sess = rn.Session.local(seed=cfg.seed)
    try:
        say(repr(sess))
        pipe = _pipeline(sess, cfg, envs, model, say)
        _score(pipe, cfg, run, "before", say)
        say(HEADER)
        _rl_loop(pipe, cfg, run, say)
        _write_report(out, run.reports, run.first, run.last, cfg)
        say(f"report: {out / 'report.html'} (curves alone: {out / 'curves.svg'}; steps: {out / 'steps.jsonl'})")
        run.generated = dict(pipe.stats().get("generated_tokens") or {})
        pipe.close()
    except KeyboardInterrupt:  # a second Ctrl-C: what was written stays, the RESULT still comes
        run.interrupted = True
        run.last = run.history[-1] if run.history else {}
        if run.reports:
            _write_report(out, run.reports, run.first, run.last, cfg)
    finally:
        sess.close()
    return _result(run, time.monotonic() - t_start)


def _base_model(cfg: TrainConfig, envs: dict[str, Any], say: Callable[..., None], *, quiet: bool) -> Any:
    """The tiny model over the tasks' vocabulary, after its warm start and base-model stage."""
    from rollart_nb.models import tiny_qwen

    vocab = sorted({w for e in envs.values() for w in getattr(e, "vocab", ())})
    stages = [f"a format-only warm start ({cfg.model.warm_steps} steps)"] if cfg.model.warm_steps else []
    if cfg.model.pretrain_steps:
        stages.append(f"a base-model stage ({cfg.model.pretrain_steps} steps on worked training problems)")
    say(f"building tiny-qwen-{cfg.model.size}" + (" and " + " and ".join(stages) if stages else "") + " ...")
    model = tiny_qwen(task_vocab=vocab, size=cfg.model.size, seed=cfg.seed)
    if cfg.model.warm_steps:
        model = _warm_start(model, envs, cfg, quiet=quiet)
    if cfg.model.pretrain_steps:
        model = _pretrain(model, envs, cfg, quiet=quiet)
    return model


def _pipeline(sess: Any, cfg: TrainConfig, envs: dict[str, Any], model: Any, say: Callable[..., None]) -> Any:
    """The generator and trainer clusters, the tasks with their rewards, and the pipeline over them."""
    import dataclasses

    import rollart_nb as rn
    from rollart_nb.workers.roles import HFGenerator, TorchTrainer, VLLMGenerator

    gen_cls = VLLMGenerator if cfg.generator == "vllm" else HFGenerator
    gen = sess.cluster("actor_gen", gen_cls, pool="H20", model=model, seed=cfg.seed)
    train = sess.cluster("actor_train", TorchTrainer, pool="H800", model=model, algo=cfg.algo, seed=cfg.seed)
    for b in sess.bindings():
        say(f"  {b.worker:<22} -> {b.pool:<6} ({b.hardware}{', fell back: ' + b.reason if b.fell_back else ''})")
    weights = {t: tc.weight for t, tc in cfg.tasks.items()}
    curriculum = {  # training problems only: an env with a held-out split says which they are
        t: rn.PromptCurriculum(getattr(envs[t], "training_seeds", envs[t].validation_seeds)(), uniform=tc.curriculum)
        for t, tc in cfg.tasks.items()
        if tc.curriculum is not None
    }
    tasks = sess.tasks(envs, envs_per_task=_envs_per_task(cfg), weights=weights, curriculum=curriculum or None)
    for t, tc in cfg.tasks.items():
        fn = _reward(tc.reward)
        if fn is not None:
            sess.reward(t, fn, validate_with=_reward(tc.validate_with))
    pipeline_cfg = cfg.pipeline
    if pipeline_cfg.seed is None:
        pipeline_cfg = dataclasses.replace(pipeline_cfg, seed=cfg.seed)
    return sess.pipeline(train, gen, tasks, algo=cfg.algo, name=cfg.name, config=pipeline_cfg)


def _score(pipe: Any, cfg: TrainConfig, run: _Progress, when: str, say: Callable[..., None]) -> None:
    """Held-out scores ``when`` ("before" / "after") training: greedy validation, sampled pass@k."""
    scores = pipe.validate()
    run.history.append(scores)
    if when == "before":
        run.first = scores
    else:
        run.last = scores
    say(f"validation {when} training: {scores}")
    if cfg.pass_k:
        key = "base" if when == "before" else "final"
        run.passes[key] = pipe.pass_at(cfg.pass_k)
        say(f"sampled {when} training: {_passes(run.passes[key])}")
    if when == "after":
        for task, res in pipe.last_validation.items():  # a collapse onto one answer shows here
            top = ", ".join(f"{a!r} x{n}" for a, n in res["top_actions"])
            say(f"  {task}: {res['distinct_actions']} distinct final actions over {res['n']}; commonest: {top}")


def _rl_loop(pipe: Any, cfg: TrainConfig, run: _Progress, say: Callable[..., None]) -> None:
    """Steps until ``cfg.steps``, ``cfg.minutes`` or a Ctrl-C, a line each in steps.jsonl; then,
    unless interrupted, the held-out scores after training."""
    t0 = time.monotonic()
    with (cfg.out_dir / "steps.jsonl").open("w") as steps_file, _Interrupt(say) as stop:
        for _ in range(cfg.steps):
            if stop.hit or time.monotonic() - t0 > cfg.minutes * 60:
                break
            rep = pipe.step()
            run.reports.append(rep)
            steps_file.write(json.dumps(rep.to_dict(), default=str) + "\n")
            steps_file.flush()
            if rep.validation:
                run.history.append(dict(rep.validation))
                _write_report(cfg.out_dir, run.reports, run.first, run.history[-1], cfg)
            say(_row(rep, t0))
        run.interrupted = stop.hit
        if stop.hit:
            run.last = run.history[-1]
        else:
            _score(pipe, cfg, run, "after", say)


def _result(run: _Progress, wall_s: float) -> dict[str, Any]:
    """The RESULT of :func:`run_train`."""
    result: dict[str, Any] = {"first": _clean(run.first), "last": _clean(run.last)}
    result.update(summary(run.first, run.history[1:], run.reports))
    for task, row in result["tasks"].items():
        for when, by_task in run.passes.items():
            if task in by_task:
                row[f"{when}_sampled"] = _clean(by_task[task])
    total = sum(run.generated.values())
    result["generated_tokens"] = int(total)
    result["aborted_generated_fraction"] = round(run.generated.get("aborted_stale", 0) / total, 4) if total else 0.0
    result["wall_s"] = round(wall_s, 1)
    result["interrupted"] = run.interrupted
    return result


def _with_bar(total: int, desc: str, quiet: bool, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, progress=..., **kwargs)`` with a progress bar of ``total`` steps (none when quiet)."""
    if quiet:
        return fn(*args, progress=None, **kwargs)
    from tqdm.auto import tqdm

    with tqdm(total=total, desc=desc, unit="step", leave=False) as bar:

        def progress(step: int, loss: float) -> None:
            bar.n = step + 1
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            bar.refresh()

        return fn(*args, progress=progress, **kwargs)


def _warm_start(base: Any, envs: dict[str, Any], cfg: TrainConfig, *, quiet: bool) -> Any:
    from rollart_nb.models.warmstart import format_warm_start

    steps = cfg.model.warm_steps
    return _with_bar(steps, "warm start", quiet, format_warm_start, base, envs, steps=steps, seed=cfg.seed)


def _envs_per_task(cfg: TrainConfig) -> int | dict[str, int]:
    """``cfg.envs_per_task`` as ``sess.tasks`` takes it: a mapping names every task of the run,
    :data:`DEFAULT_ENVS` for those it leaves out (the config checked it names no other task)."""
    per = cfg.envs_per_task
    return {t: int(per.get(t, DEFAULT_ENVS)) for t in cfg.tasks} if isinstance(per, dict) else per


def _pretrain(base: Any, envs: dict[str, Any], cfg: TrainConfig, *, quiet: bool) -> Any:
    from rollart_nb.models.pretraining import pretrain, pretrain_record

    m = cfg.model
    weights = {t: tc.weight for t, tc in cfg.tasks.items()}
    if m.pretrain_weights is not None:  # the config checked that it names only tasks of the run
        weights = {t: float(m.pretrain_weights.get(t, 0.0)) for t in weights}
    stop = dict(m.pretrain_stop_at or {})
    model = _with_bar(
        m.pretrain_steps,
        "base model",
        quiet,
        pretrain,
        base,
        envs,
        steps=m.pretrain_steps,
        batch=m.pretrain_batch,
        lr=m.pretrain_lr,
        seed=cfg.seed,
        weights=weights,
        stop_at=stop or None,
    )
    rec = pretrain_record(model)
    if stop and not quiet:
        acc = ", ".join(f"{t} {v:.2f}" for t, v in rec.get("accuracy", {}).items())
        when = f"stopped at step {rec['stopped_at']}" if rec.get("stopped_at") else "ran every step"
        print(f"base model: {when}; accuracy on worked training problems: {acc or '-'}", flush=True)
    return model


def _write_report(
    out: Path, reports: list[Any], first: dict[str, float], last: dict[str, float], cfg: TrainConfig
) -> None:
    from rollart_nb.nb.report import curves_svg, report_html

    p = cfg.pipeline
    title = f"rollart_nb {cfg.name} ({p.mode}, alpha={p.alpha}, seed {cfg.seed})"
    (out / "report.html").write_text(report_html(reports, title=title, before=first, after=last))
    (out / "curves.svg").write_text(
        curves_svg(reports, before=first, after=last, title=f"{title}: greedy validation and batch reward")
    )
