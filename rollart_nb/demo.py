"""The main job: real GRPO learning on FrozenLake + Arithmetic with a tiny local model.

``rollart-nb demo`` runs :func:`run_demo`: ``Session.local()``, a tiny Qwen-style model built
here (no downloads) with a format-only warm start, an HF (or vLLM) generator on the simulated
H20 pool, a torch GRPO trainer on the simulated H800 pool, FrozenLake and Arithmetic through
the six-step ``rollart`` pipeline. It prints a table per step, writes an HTML report with the
learning curves, and ends with ``RESULT {json}``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["TASKS", "DemoConfig", "run_demo"]

TASKS = ("frozenlake", "math")
MATH_REWARDS = ("close", "exact")  # DemoConfig.math_reward: rewards.close_answer or exact_answer


@dataclass
class DemoConfig:
    """Knobs of the demo (the CLI flags). The defaults are the best settings found so far on a
    2-core CPU box; docs/learning.md has the alternatives measured.

    Attributes:
        steps: training steps (the run also stops at ``minutes``, which usually comes first).
        minutes: wall-clock budget for training steps.
        mode: pipeline mode.
        alpha: staleness bound (2: at alpha=1 a third or more of each step's rollouts were
            aborted as stale on this box, since a FrozenLake episode outlasts a step).
        generator: "hf" or "vllm".
        batch_size / group_size: GRPO batch and group sizes (128 = 16 groups of 8: with the
            default weights, 4 FrozenLake groups and 12 math groups per step).
        envs_per_task: concurrent env instances per task.
        lr: learning rate (2e-3 learned as fast but greedy FrozenLake flipped between 0.55 and 0.0).
        entropy_coef: entropy bonus (0: over the whole vocabulary it pushed mass onto
            unparseable tokens).
        loss_agg: "task-token-mean" (default: each task's share of the gradient is its share of
            the trained trajectories; under "token-mean" a FrozenLake episode's ~20 trained tokens outweighed a
            sum's 3), "token-mean" or "seq-mean".
        scale_by_std: divide group advantages by the group's reward std (GRPO) or not (Dr. GRPO);
            per task by default: FrozenLake scales, math does not (with it, math collapsed onto
            one answer; without it, FrozenLake learned more slowly).
        kl_coef: k3 KL to the warm-start policy: without it the FrozenLake policy drifted onto
            digits (the other task's answer tokens) within a few steps in some runs.
        task_weights: share of each task's groups in a batch (math 3 : FrozenLake 1 by default:
            a math group is cheap to generate and math needs several thousand groups to learn;
            tasks not trained are dropped from it).
        math_reward: "close" (default: :func:`~rollart_nb.rewards.close_answer`, partial credit
            by distance) or "exact" (:func:`~rollart_nb.rewards.exact_answer`) for training;
            math's validation is exact match either way.
        math_curriculum: math's prompts come from a :class:`~rollart_nb.PromptCurriculum` over the
            100 problems with this uniform share (None: random training seeds, answer-balanced).
        max_new_tokens: response budget per turn (a move or a sum needs at most 4 tokens).
        validate_every: steps between greedy validations.
        seed: everything derives from it.
        out: directory for the HTML report and the JSON of every step.
        size: tiny model size ("s" or "m").
        warm_steps: steps of the format-only warm start.
        extra: further :class:`~rollart_nb.algo.GRPO` settings, e.g. ``{"clip_eps_high": 0.28}``.
        tasks: which of the demo's tasks to train, among ``TASKS`` (``("math",)``: Arithmetic
            alone gets every group of a step).
    """

    steps: int = 1000
    minutes: float = 5.0
    mode: str = "rollart"
    alpha: int = 2
    generator: str = "hf"
    batch_size: int = 128
    group_size: int = 8
    envs_per_task: int = 16
    lr: float = 1e-3
    entropy_coef: float = 0.0
    loss_agg: str = "task-token-mean"
    scale_by_std: bool | dict[str, bool] = field(default_factory=lambda: {"math": False})
    kl_coef: float = 0.1
    task_weights: dict[str, float] | None = field(default_factory=lambda: {"frozenlake": 1.0, "math": 3.0})
    math_reward: str = "close"
    math_curriculum: float | None = None
    max_new_tokens: int = 4
    validate_every: int = 5
    seed: int = 0
    out: str = "rollart_demo"
    size: str = "s"
    warm_steps: int = 60
    tasks: tuple[str, ...] = TASKS
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from rollart_nb.errors import ConfigError

        self.tasks = tuple(self.tasks)
        if not self.tasks or set(self.tasks) - set(TASKS):
            raise ConfigError(f"demo tasks must be a non-empty subset of {TASKS}, got {self.tasks!r}")
        if self.math_reward not in MATH_REWARDS:
            raise ConfigError(f"demo math_reward must be one of {MATH_REWARDS}, got {self.math_reward!r}")
        if self.math_curriculum is not None and not 0.0 <= self.math_curriculum <= 1.0:
            raise ConfigError(f"demo math_curriculum (the uniform share) must be in [0, 1], got {self.math_curriculum}")


def _print_row(rep: Any, t0: float) -> None:
    rw = " ".join(f"{k}={v:.2f}" for k, v in rep.reward.items())
    val = " ".join(f"{k}={v:.2f}" for k, v in rep.validation.items())
    ph = rep.phases
    print(
        f"{rep.step:>4} {rep.version:>3} {time.monotonic() - t0:>7.1f} {rep.step_s:>6.2f} "
        f"{ph['rollout_wait']:>6.2f} {ph['suspend']:>5.2f} {ph['update']:>5.2f} {ph['train']:>5.2f} "
        f"{rep.throughput:>8.0f}  {rw:<26} {val:<26} {rep.counts.get('aborted_stale', 0):>4} "
        f"{rep.counts.get('failed', 0):>4}",
        flush=True,
    )


def run_demo(cfg: DemoConfig, *, quiet: bool = False) -> dict[str, Any]:
    """Run the demo; returns ``{"first": {task: score}, "last": {task: score}, "wall_s": t}``."""
    import rollart_nb as rn
    from rollart_nb.algo import GRPO
    from rollart_nb.control.env_manager import RolloutConfig
    from rollart_nb.envs import Arithmetic, FrozenLake
    from rollart_nb.models import tiny_qwen
    from rollart_nb.models.warmstart import format_warm_start
    from rollart_nb.rewards import close_answer, exact_answer
    from rollart_nb.workers.roles import HFGenerator, TorchTrainer, VLLMGenerator

    t_start = time.monotonic()
    say = (lambda *a: None) if quiet else print
    make = {"frozenlake": FrozenLake, "math": Arithmetic}  # one per name in TASKS
    envs = {t: make[t]() for t in TASKS if t in cfg.tasks}
    vocab = sorted({w for e in envs.values() for w in e.vocab})
    say(f"building tiny-qwen-{cfg.size} and a format-only warm start ...")
    base = tiny_qwen(task_vocab=vocab, size=cfg.size, seed=cfg.seed)
    model = format_warm_start(base, envs, steps=cfg.warm_steps, seed=cfg.seed)
    # Micro-batches by padded tokens: math rows go many at a time, long FrozenLake rows few.
    settings = dict(
        group_size=cfg.group_size,
        lr=cfg.lr,
        entropy_coef=cfg.entropy_coef,
        loss_agg=cfg.loss_agg,
        scale_by_std=cfg.scale_by_std,
        kl_coef=cfg.kl_coef,
        micro_batch_size=64,
        micro_batch_tokens=1024,
    )
    algo = GRPO(**{**settings, **cfg.extra})  # extra may override any of them
    sess = rn.Session.local(seed=cfg.seed)
    try:
        say(repr(sess))
        gen_cls = VLLMGenerator if cfg.generator == "vllm" else HFGenerator
        gen = sess.cluster("actor_gen", gen_cls, pool="H20", model=model, seed=cfg.seed)
        train = sess.cluster("actor_train", TorchTrainer, pool="H800", model=model, algo=algo, seed=cfg.seed)
        for b in sess.bindings():
            say(f"  {b.worker:<22} -> {b.pool:<6} ({b.hardware}{', fell back: ' + b.reason if b.fell_back else ''})")
        weights = {t: w for t, w in cfg.task_weights.items() if t in envs} if cfg.task_weights else None
        curriculum = None
        if "math" in envs and cfg.math_curriculum is not None:
            curriculum = {"math": rn.PromptCurriculum(envs["math"].validation_seeds(), uniform=cfg.math_curriculum)}
        tasks = sess.tasks(envs, envs_per_task=cfg.envs_per_task, weights=weights or None, curriculum=curriculum)
        if "math" in envs:  # validation scores exact match whatever the training reward
            sess.reward(
                "math", close_answer if cfg.math_reward == "close" else exact_answer, validate_with=exact_answer
            )
        pipe = sess.pipeline(
            train,
            gen,
            tasks,
            algo=algo,
            batch_size=cfg.batch_size,
            alpha=cfg.alpha,
            mode=cfg.mode,
            rollout=RolloutConfig(max_new_tokens=cfg.max_new_tokens, temperature=1.0),
            validate_every=cfg.validate_every,
        )
        first = pipe.validate()
        say(f"validation before training: {first}")
        say(
            f"{'step':>4} {'v':>3} {'wall':>7} {'step_s':>6} {'wait':>6} {'susp':>5} {'upd':>5} {'train':>5} "
            f"{'tok/s':>8}  {'reward':<26} {'validation':<26} {'abrt':>4} {'fail':>4}"
        )
        t0 = time.monotonic()
        reports = []
        for _ in range(cfg.steps):
            if time.monotonic() - t0 > cfg.minutes * 60:
                break
            rep = pipe.step()
            reports.append(rep)
            if not quiet:
                _print_row(rep, t0)
        last = pipe.validate()
        say(f"validation after training: {last}")
        for task, res in pipe.last_validation.items():  # a collapse onto one answer shows here
            top = ", ".join(f"{a!r} x{n}" for a, n in res["top_actions"])
            say(f"  {task}: {res['distinct_actions']} distinct final actions over {res['n']}; commonest: {top}")
        wall = time.monotonic() - t_start
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "steps.jsonl").write_text("\n".join(json.dumps(r.to_dict(), default=str) for r in reports))
        _write_report(out / "report.html", reports, first, last, cfg)
        (out / "curves.svg").write_text(_curves(reports, first, last, cfg))
        say(f"report: {out / 'report.html'} (curves alone: {out / 'curves.svg'})")
        pipe.close()
    finally:
        sess.close()
    return {"first": _clean(first), "last": _clean(last), "wall_s": round(wall, 1)}


def _clean(d: dict[str, float]) -> dict[str, float | None]:
    return {k: (None if math.isnan(v) else round(v, 4)) for k, v in d.items()}


def _curves(reports: list[Any], first: dict[str, float], last: dict[str, float], cfg: DemoConfig) -> str:
    from rollart_nb.nb.figures import curves_svg

    return curves_svg(
        reports,
        before=first,
        after=last,
        title=f"rollart_nb demo ({cfg.mode}, alpha={cfg.alpha}, seed {cfg.seed}): greedy validation and batch reward",
    )


def _write_report(
    path: Path, reports: list[Any], first: dict[str, float], last: dict[str, float], cfg: DemoConfig
) -> None:
    from rollart_nb.nb.figures import report_html

    path.write_text(
        report_html(reports, title=f"rollart_nb demo ({cfg.mode}, alpha={cfg.alpha})", before=first, after=last)
    )
