"""Time to accuracy on sums: our GRPO (in-process) vs TRL's ``GRPOTrainer``, from the same start.

Both sides start from the same tiny model: ``tiny_qwen`` (word-level tokenizer, ~1M parameters)
warm-started on the answer format with :func:`format_warm_start` (random content, so it knows how
to answer but not the sums). Both train on the same prompts in the same order (``Arithmetic()``,
balanced answers: ``--prompts`` training seeds per step drawn from ``random.Random(seed)``), with the same
training reward (``--reward exact``: 1.0 when :func:`parse_int` of the completion equals the sum;
``--reward close``: :func:`~rollart_nb.rewards.close_answer`, partial credit by distance), the
same GRPO settings and the same wall budget, one after the other on the CPU (never concurrently):

- ours: :class:`HFBackend` samples, :class:`TorchTrainBackend` trains
  (``GRPO(group_size=8, lr=1e-3, kl_coef=0.1, scale_by_std=False, micro_batch_size=64)`` by
  default), weights published to the sampler after every step; no Ray, no scheduler.
- TRL: ``GRPOTrainer`` in a subprocess run by ``--trl-python`` (TRL lives in its own venv), with
  the options that mirror ours: ``num_generations=8``, 64 completions per optimizer step (one
  forward/backward, no accumulation), ``learning_rate=1e-3`` (constant), ``beta=0.1`` (k3 KL to
  the initial policy, as ours), ``scale_rewards="none"`` (mean-only baseline, as
  ``scale_by_std=False``), ``loss_type="dapo"`` (token-level: every completion token of the batch
  weighs the same, as our ``loss_agg="token-mean"``), temperature 1.0, 4 new tokens, float32,
  no gradient checkpointing (TRL's default is on), ``use_cpu=True``.

``--group`` (completions per prompt), ``--prompts`` (prompts per step), ``--lr``, ``--kl`` and
``--epochs`` (optimizer steps per sampled batch; TRL's ``num_iterations``) change those settings on
both sides. ``--curriculum`` and ``--skip-flat`` are ours only: TRL has
neither a prompt curriculum nor a way to skip the rows of groups that all scored the same.

Measured: greedy accuracy over all 100 problems (``env.validation_seeds()``), decoded by the same
code on both sides (an :class:`HFBackend` fed the current weights, ``temperature=0``, 4 new
tokens), every ``--eval-every`` seconds of training. The clock is training time: it starts when
the first step starts (TRL: ``on_train_begin``) and stops while evaluating, so evaluation costs
neither side. Reported per side: the accuracy curve, ``t_to_0.3`` (training seconds to the first
evaluation at >= 0.3 accuracy, or null), ``best``, ``last`` and ``steps``; and the ratio
``trl t_to_0.3 / ours t_to_0.3`` when both got there. Also per side: ``ms_per_step`` (ours:
sample / score / train / sync, where train includes the reference pass; TRL: its sampling phase,
which includes rewards and the reference pass, and the rest of its step) and ``response_tokens``
(mean completion length). ``steps`` counts optimizer steps on both sides.

``--overlap`` runs ours as RollArt does, asynchronously: a second thread samples batch b+1 (one
version behind, ``behaviour_lag``) and runs the KL reference pass on it (a ``ReferencePolicy``, as
TRL's sampling phase does) while the trainer trains on batch b; ``ms_per_step`` then has the
sampler thread's own sample / score / ref time and the trainer's ``wait`` for it. Each side then
uses two cores: give TRL ``--threads 2``.

``--seeds 0-7`` runs several seeds one after the other (each: ours, then TRL) and ends with a table
and a RESULT holding every seed's figures, their medians (a side that never reached the target
counts as slower than any time, so a median that lands on it is null) and how often each side
reached the target first. The machine's speed drifts by ~20% over minutes here, and the two sides
run minutes apart, so compare over several seeds rather than one.

``--task heldout`` asks what RL post-training is for: sharpening a base that is partly right.
Both sides start from one pretrained base (:func:`rollart_nb.models.pretrain`, ``--base-steps``
on worked *training* problems, stopped once ``--base-stop-at`` of them come out right, the same
base for every seed, cached on disk) on two-digit sums
written least significant digit first (``Arithmetic(max_operand=99, holdout=200,
fixed_width=True, reverse_answer=True)``, as ``configs/demo.yaml``); both train on training
problems only (``env.training_seeds()``) and are scored on the 200 held-out ones. ``--gain 0.2``
sets the target to the base's held-out accuracy plus 0.2, so ``t_to_<target>`` is the time to
+0.2 over the base; RESULT then also holds ``base``.

Run (TRL in its own venv, so that it cannot change this environment's torch/transformers)::

    python -m venv --system-site-packages /tmp/trlvenv
    /tmp/trlvenv/bin/pip install 'trl==1.16.*'
    python benchmarks/math_vs_trl.py --trl-python /tmp/trlvenv/bin/python --seconds 300
    python benchmarks/math_vs_trl.py --trl-python /tmp/trlvenv/bin/python --task heldout --gain 0.2 --seeds 0-2

Without ``--trl-python`` the TRL side runs with this interpreter, and is reported as skipped (with
the reason) in the RESULT line when ``import trl`` fails there.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollart_nb.algo.grpo import GRPO, batch_advantages  # noqa: E402
from rollart_nb.backends.hf import HFBackend  # noqa: E402
from rollart_nb.envs import Arithmetic  # noqa: E402
from rollart_nb.envs.arithmetic import parse_digits, parse_int  # noqa: E402
from rollart_nb.models.tiny import format_history  # noqa: E402
from rollart_nb.protocols import GenerationRequest  # noqa: E402

# Defaults of the shared GRPO settings; --group, --prompts, --lr and --kl change them on both sides.
GROUP = 8  # completions per prompt
PROMPTS = 8  # prompts per optimizer step (64 completions)
MAX_NEW = 4
LR, KL, TEMPERATURE = 1e-3, 0.1, 1.0
EPOCHS = 1  # optimizer steps per sampled batch (TRL: num_iterations)
# --task: "format" (single-digit sums from a format warm start, scored on all 100) or "heldout"
# (two-digit sums from a pretrained base, scored on held-out problems only; see make_env)
TASK = "format"
HELDOUT_ENV = {"max_operand": 99, "holdout": 200, "fixed_width": True, "reverse_answer": True, "balance_answers": False}


def make_env() -> Arithmetic:
    """The task's env: ``Arithmetic()``, or for ``--task heldout`` two-digit sums written least
    significant digit first with 200 problems held out (as ``configs/demo.yaml``)."""
    return Arithmetic(**HELDOUT_ENV) if TASK == "heldout" else Arithmetic()


# -- shared by both sides --------------------------------------------------------------------
def reward(text: str, answer: int | str) -> float:
    """Exact match: the number (``--task format``) or the digits as written (``heldout``)."""
    if isinstance(answer, str):
        return 1.0 if parse_digits(text) == answer else 0.0
    return 1.0 if parse_int(text) == answer else 0.0


def train_reward(kind: str, text: str, answer: int | str) -> float:
    """The training reward (evaluation is always exact match, :func:`reward`)."""
    if kind == "exact":
        return reward(text, answer)
    from rollart_nb.rewards import close_answer
    from rollart_nb.trajectory import Trajectory, Turn

    return close_answer(Trajectory(task="math", info={"answer": str(answer)}, turns=[Turn("", text)]))


def problem(env: Arithmetic, seed: int) -> tuple[str, int | str]:
    """The prompt text (as the model sees it) and the answer of ``env.reset(seed)`` (``heldout``:
    its digits as written, a string)."""
    obs, info = env.reset(seed=seed)
    return format_history([(obs, None)]), str(info["answer"]) if TASK == "heldout" else int(info["answer"])


def train_seeds(seed: int, env: Arithmetic) -> Iterator[int]:
    """Training seeds in order, without end: ``>= 100`` so the env draws balanced answers, or
    (``heldout``) drawn from ``env.training_seeds()``, which hold no held-out problem."""
    rng = random.Random(seed)
    pool = env.training_seeds() if TASK == "heldout" else None
    while True:
        yield rng.choice(pool) if pool is not None else rng.randrange(100, 2**31)


class GreedyEval:
    """Greedy accuracy over every problem, with an HFBackend fed the weights under test."""

    def __init__(self, model_path: str, env: Arithmetic) -> None:
        self.gen = HFBackend(model_path, device="cpu", batch_wait_s=0.001, max_batch_size=128)
        probs = [problem(env, s) for s in env.validation_seeds()]
        self.prompts = [self.gen.tokenizer.encode(p) for p, _ in probs]
        self.answers = [a for _, a in probs]

    def __call__(self, state: dict | None = None, version: int = 0) -> float:
        if state is not None:
            self.gen.load_weights(state, version)

        async def run():
            reqs = [
                GenerationRequest(f"val-{i}", "math", p, max_new_tokens=MAX_NEW, temperature=0.0, last_turn=True)
                for i, p in enumerate(self.prompts)
            ]
            return await asyncio.gather(*[self.gen.generate(r) for r in reqs])

        res = asyncio.run(run())
        return sum(reward(r.text, a) for r, a in zip(res, self.answers, strict=True)) / len(res)


class Clock:
    """Training seconds: wall time since start, less the time spent evaluating."""

    def __init__(self, seconds: float, eval_every: float, evaluate: GreedyEval) -> None:
        self.seconds, self.eval_every, self.evaluate = seconds, eval_every, evaluate
        self.t0 = time.monotonic()
        self.paused = 0.0
        self.next_eval = 0.0
        self.curve: list[tuple[float, int, float]] = []

    def now(self) -> float:
        return time.monotonic() - self.t0 - self.paused

    def tick(self, step: int, state_fn, *, force: bool = False) -> bool:
        """Evaluate when due (or forced); True when the budget is spent."""
        t = self.now()
        if force or t >= self.next_eval:
            e0 = time.monotonic()
            acc = self.evaluate(state_fn(), step)
            self.paused += time.monotonic() - e0
            self.curve.append((round(t, 2), step, acc))
            print(f"  {t:7.1f} s  step {step:>5}  greedy acc {acc:.2f}", file=sys.stderr, flush=True)
            self.next_eval = t + self.eval_every
        return t >= self.seconds


def summary(curve: list[tuple[float, int, float]], steps: int, target: float) -> dict:
    hit = next((t for t, _, a in curve if a >= target), None)
    return {
        f"t_to_{target:g}": hit,
        "best": max(a for _, _, a in curve),
        "last": curve[-1][2],
        "steps": steps,
        "curve": curve,
    }


# -- ours ------------------------------------------------------------------------------------
def run_ours(
    model_path: str,
    *,
    seconds: float,
    seed: int,
    eval_every: float,
    target: float,
    reward_kind: str,
    curriculum: float | None = None,
    skip_flat: bool = False,
    overlap: bool = False,
) -> dict:
    from rollart_nb.backends.torch_train import ReferencePolicy, TorchTrainBackend
    from rollart_nb.control.curriculum import PromptCurriculum
    from rollart_nb.trajectory import Trajectory, Turn

    env = make_env()
    # --skip-flat: groups whose samples all scored the same get no forward/backward at all (TRL
    # always trains every row, as ours does by default when a KL term acts on them)
    algo = GRPO(
        group_size=GROUP,
        lr=LR,
        kl_coef=KL,
        scale_by_std=False,
        micro_batch_size=GROUP * PROMPTS,
        regularize_all_rows=not skip_flat,
        epochs=EPOCHS,
    )
    trainer = TorchTrainBackend(model_path, algo, seed=seed, device="cpu")
    gen = HFBackend(model_path, device="cpu", batch_wait_s=0.001, max_batch_size=GROUP * PROMPTS, seed=seed)
    evaluate = GreedyEval(model_path, env)
    seeds = train_seeds(seed, env)
    # --curriculum U: the prompts come from a PromptCurriculum over the 100 problems instead, U of
    # them uniformly (U = 1: uniform over problems, the control for the learnability weighting)
    pool = env.training_seeds() if TASK == "heldout" else env.validation_seeds()  # never held-out problems
    cur = PromptCurriculum(pool, uniform=curriculum) if curriculum is not None else None
    cur_rng = random.Random(seed)

    async def sample(step: int, prompts: list[list[int]]):
        reqs = [
            GenerationRequest(
                f"{step}-{i}",
                "math",
                prompts[i // GROUP],
                max_new_tokens=MAX_NEW,
                temperature=TEMPERATURE,
                seed=(seed * 10**6 + step) * 64 + i,
                last_turn=True,
            )
            for i in range(GROUP * len(prompts))
        ]
        return await asyncio.gather(*[gen.generate(r) for r in reqs])

    # --overlap: the sampler thread also runs the KL reference pass (a ReferencePolicy: the
    # reference role of verl and ROLL, and where TRL computes it too, in its generation phase)
    refpol = ReferencePolicy(model_path, device="cpu") if overlap and KL > 0 else None

    def make_batch(b: int, probs: list, prompts: list[list[int]]) -> tuple[list, dict[str, float]]:
        """Sample batch ``b``, score it, and (with a ReferencePolicy) attach its reference
        logprobs: the trained rows only when flat groups are skipped."""
        t0 = time.perf_counter()
        results = asyncio.run(sample(b, prompts))
        t1 = time.perf_counter()
        batch = []
        for i, r in enumerate(results):
            s, text, answer = probs[i // GROUP]
            t = Trajectory(task="math", seed=s, group_id=f"{b}-{i // GROUP}", info={"answer": str(answer)})
            t.turns.append(
                Turn(text, r.text, prompts[i // GROUP], r.token_ids, r.logprobs, [1] * len(r.token_ids), r.version)
            )
            t.reward = train_reward(reward_kind, r.text, answer)
            batch.append(t)
        t2 = time.perf_counter()
        if refpol is not None:  # the trainer's own rule for the rows it trains
            adv = batch_advantages(algo, batch)[1].tolist()
            refpol.score([t for t, a in zip(batch, adv, strict=True) if a != 0.0 or not skip_flat])
        return batch, {"sample": t1 - t0, "score": t2 - t1, "ref": time.perf_counter() - t2}

    def draw_batch(b: int) -> concurrent.futures.Future:
        """Draw batch ``b``'s prompts (on this thread: the curriculum is not shared) and start
        making it: on the sampler thread with --overlap, else right here."""
        draw = (lambda: cur.next_seed(cur_rng)) if cur is not None else (lambda: next(seeds))
        probs = [(s, *problem(env, s)) for s in (draw() for _ in range(PROMPTS))]
        prompts = [gen.tokenizer.encode(p) for _, p, _ in probs]
        if sampler is not None:
            return sampler.submit(make_batch, b, probs, prompts)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(make_batch(b, probs, prompts))
        return done

    # --overlap: batch b+1 is sampled on a second thread (the generator's weights one version
    # behind) while batch b trains: RollArt's asynchronous rollout at staleness 1, each phase on its
    # own core. The weights are loaded only while nothing samples, so no batch sees half a version.
    sampler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sampler") if overlap else None
    clock = Clock(seconds, eval_every, evaluate)
    step, batches, trained_rows, tokens = 0, 0, 0.0, 0  # step: optimizer steps (EPOCHS per batch)
    lag = 0.0  # batches the sampling weights were behind the trainer's, summed (--overlap: 1 after the first)
    # seconds per phase over all steps. Without --overlap, "sample" and "score" are the batch's
    # own phases; with it, "wait" is the time the trainer waited for the sampler thread, and
    # "sample", "score" and "ref" are the sampler's own time, which overlaps training
    phases = ("sample", "score", "ref", "wait") if overlap else ("sample", "score")
    phase_s = dict.fromkeys((*phases, "train", "sync"), 0.0)
    pending = draw_batch(0)
    try:
        while True:
            t0 = time.perf_counter()
            batch, made = pending.result()
            t1 = time.perf_counter()
            if clock.tick(step, trainer.state_dict):  # nothing samples while it evaluates
                break
            for k, v in made.items():
                if k in phase_s:
                    phase_s[k] += v
            if overlap:
                phase_s["wait"] += t1 - t0
                pending = draw_batch(batches + 1)
            if cur is not None:
                for t in batch:
                    cur.update(t.seed, t.reward)
            lag += (trainer.version - min(t.turns[0].version for t in batch)) / EPOCHS
            t2 = time.perf_counter()
            trained_rows += trainer.train_step(batch)["trained_rows"]  # EPOCHS optimizer steps
            t3 = time.perf_counter()
            if overlap:
                pending.result()  # the next batch is sampled; only now may the weights change
            t3b = time.perf_counter()
            gen.load_weights(trainer.state_dict(), trainer.version)
            t4 = time.perf_counter()
            phase_s["train"] += t3 - t2
            phase_s["sync"] += t4 - t3b
            if overlap:
                phase_s["wait"] += t3b - t3
            tokens += sum(len(t.turns[0].response_ids) for t in batch)
            step += EPOCHS
            batches += 1
            if not overlap:
                pending = draw_batch(batches)
    finally:
        if sampler is not None:
            sampler.shutdown(wait=True, cancel_futures=True)
    if clock.curve[-1][1] != step:
        clock.tick(step, trainer.state_dict, force=True)
    out = summary(clock.curve, step, target)
    out["trained_rows_per_step"] = round(trained_rows / max(batches, 1), 1)
    out["response_tokens"] = round(tokens / max(batches * GROUP * PROMPTS, 1), 2)
    out["behaviour_lag"] = round(lag / max(batches, 1), 3)
    out["ms_per_step"] = {k: round(1000 * v / max(step, 1), 1) for k, v in phase_s.items()}
    if cur is not None:
        out["curriculum"] = cur.summary()
    return out


# -- TRL (runs in the --trl-python interpreter) ------------------------------------------------
def run_trl(model_path: str, *, seconds: float, seed: int, eval_every: float, target: float, reward_kind: str) -> dict:
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    env = make_env()
    evaluate = GreedyEval(model_path, env)
    # One epoch is more prompts than any budget gets through; the callback stops on time.
    n_steps = max(1000, int(seconds * 20))
    rows = [problem(env, s) for s in islice(train_seeds(seed, env), n_steps * PROMPTS)]
    data = Dataset.from_dict({"prompt": [p for p, _ in rows], "answer": [a for _, a in rows]})

    lengths = [0, 0]  # completion tokens, completions

    def math_reward(prompts, completions, answer, completion_ids=None, **_):
        if completion_ids is not None:
            lengths[0] += sum(len(c) for c in completion_ids)
            lengths[1] += len(completion_ids)
        return [train_reward(reward_kind, c, a) for c, a in zip(completions, answer, strict=True)]

    out = tempfile.mkdtemp(prefix="math_vs_trl-")
    cfg = GRPOConfig(
        output_dir=out,
        seed=seed,
        data_seed=seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=10**9,
        disable_tqdm=True,
        dataloader_num_workers=0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        per_device_train_batch_size=GROUP * PROMPTS,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=GROUP,
        num_iterations=EPOCHS,
        max_steps=n_steps,
        shuffle_dataset=False,
        max_completion_length=MAX_NEW,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        beta=KL,
        epsilon=0.2,
        scale_rewards="none",
        loss_type="dapo",
    )
    tok = PreTrainedTokenizerFast.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="float32")

    def weights_of(model):
        return lambda: {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    class Timer(TrainerCallback):
        """Starts the clock once TRL's setup is done, evaluates the start weights, then every
        ``eval_every`` training seconds; stops training when the budget is spent."""

        clock: Clock

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.clock = Clock(seconds, eval_every, evaluate)
            self.clock.tick(0, weights_of(model))

        def on_step_end(self, args, state, control, model=None, **kw):
            if self.clock.tick(state.global_step, weights_of(model)):
                control.should_training_stop = True

    timer = Timer()
    trainer = GRPOTrainer(
        model=model, reward_funcs=math_reward, args=cfg, train_dataset=data, processing_class=tok, callbacks=[timer]
    )
    # Time TRL's sampling phase (generation, rewards, reference logprobs) apart from the rest of
    # its step (policy pass, backward, optimizer), for comparison with ours' ms_per_step.
    sampling = trainer._generate_and_score_completions
    spent = [0.0]

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return sampling(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    trainer._generate_and_score_completions = timed
    trainer.train()
    clock = timer.clock
    steps = trainer.state.global_step
    if clock.curve[-1][1] != steps:
        clock.tick(steps, weights_of(trainer.model), force=True)
    res = {**summary(clock.curve, steps, target), "trl": trl.__version__}
    step_ms = 1000 * clock.now() / max(steps, 1)
    res["ms_per_step"] = {
        "sample_score_ref": round(1000 * spent[0] / max(steps, 1), 1),
        "rest": round(step_ms - 1000 * spent[0] / max(steps, 1), 1),
    }
    if lengths[1]:
        res["response_tokens"] = round(lengths[0] / lengths[1], 2)
    return res


def trl_side(python: str, model_path: str, a: argparse.Namespace) -> dict:
    probe = subprocess.run([python, "-c", "import trl, sys; print(trl.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or ["import trl failed"])[-1]
        return {"skipped": f"{python}: {reason}"}
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--child",
        "trl",
        "--model-path",
        model_path,
        "--seconds",
        str(a.seconds),
        "--seed",
        str(a.seed),
        "--eval-every",
        str(a.eval_every),
        "--target",
        str(a.target),
        "--threads",
        str(a.threads),
        "--reward",
        a.reward,
        "--group",
        str(a.group),
        "--prompts",
        str(a.prompts),
        "--lr",
        str(a.lr),
        "--kl",
        str(a.kl),
        "--epochs",
        str(a.epochs),
        "--task",
        a.task,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "TOKENIZERS_PARALLELISM": "false"}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.seconds * 3 + 600)
    except subprocess.TimeoutExpired:
        return {"error": f"the TRL side ran past {a.seconds * 3 + 600:g} s and was stopped"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("CHILD ")]
    if p.returncode != 0 or not lines:
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-20:])
        print(f"TRL side failed (rc {p.returncode}):\n{tail}", file=sys.stderr)
        return {"error": f"rc {p.returncode}: {tail.splitlines()[-1] if tail else ''}"}
    return json.loads(lines[-1][len("CHILD ") :])


def print_curve(name: str, res: dict) -> None:
    if "curve" not in res:
        print(f"{name}: {res}")
        return
    print(f"{name}: {res['steps']} steps")
    print(f"{'t s':>8} {'step':>6} {'acc':>6}")
    for t, step, acc in res["curve"]:
        print(f"{t:>8.1f} {step:>6} {acc:>6.2f}")


def parse_seeds(spec: str) -> list[int]:
    """``"0-3"`` -> [0, 1, 2, 3]; ``"0,2,5"`` -> [0, 2, 5]; ranges and lists mix (``"0-2,7"``)."""
    out: list[int] = []
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(f"bad seed list {spec!r}: use e.g. 0-3 or 0,2,5")
        out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    if len(set(out)) != len(out):
        raise ValueError(f"seed list {spec!r} names a seed twice")
    return out


def across_seeds(runs: list[dict], key: str, seconds: float) -> dict:
    """Medians and who-got-there-first over seeds. A side that never reached the target counts as
    slower than any time (a censored value): a median that lands on one is null."""
    summary: dict = {}
    for side in ("ours", "trl"):
        done = [r[side] for r in runs if key in r.get(side, {})]  # not the skipped or failed
        if not done:
            continue
        times = sorted(math.inf if d.get(key) is None else d[key] for d in done)
        med = statistics.median(times)
        summary[side] = {
            "seeds": len(done),
            "reached": sum(t != math.inf for t in times),
            f"median_{key}": None if math.isinf(med) else round(med, 1),
            "median_best": round(statistics.median(d["best"] for d in done), 3),
            "median_last": round(statistics.median(d["last"] for d in done), 3),
            "median_steps_per_s": round(statistics.median(d["steps"] / seconds for d in done), 2),
        }
    if "ours" in summary and "trl" in summary:
        first = dict.fromkeys(("ours", "trl", "tie", "neither"), 0)
        for r in (r for r in runs if key in r.get("ours", {}) and key in r.get("trl", {})):
            o, t = r["ours"][key], r["trl"][key]
            first[
                "neither"
                if o is None and t is None
                else "trl"
                if o is None
                else "ours"
                if t is None
                else "ours"
                if o < t
                else "trl"
                if t < o
                else "tie"
            ] += 1
        summary["first_to_target"] = first
    return summary


def start_model(a: argparse.Namespace, env: Arithmetic, seed: int):
    """Where both sides start. ``format``: a fresh tiny model per seed, warm-started on the answer
    format only. ``heldout``: one pretrained base for every seed (``--base-seed``), trained by
    :func:`rollart_nb.models.pretrain` on worked training problems only (cached on disk), so the
    seeds differ in RL alone."""
    from rollart_nb.models import pretrain, tiny_qwen
    from rollart_nb.models.warmstart import format_warm_start

    if TASK == "heldout":
        base = tiny_qwen(task_vocab=env.vocab, seed=a.base_seed)
        return pretrain(base, {"math": env}, steps=a.base_steps, seed=a.base_seed, stop_at={"math": a.base_stop_at})
    return format_warm_start(tiny_qwen(task_vocab=env.vocab, seed=seed), {"math": env}, steps=60, seed=seed)


def side_kw(a: argparse.Namespace) -> dict:
    """The arguments both sides' runners take, from the command line."""
    return {
        "seconds": a.seconds,
        "seed": a.seed,
        "eval_every": a.eval_every,
        "target": a.target,
        "reward_kind": a.reward,
    }


def run_seed(a: argparse.Namespace, seed: int) -> dict:
    """Both sides on one seed (ours, then TRL); the per-side summaries without their curves."""
    a.seed = seed  # side_kw and the TRL child read it from here
    env = make_env()
    model = start_model(a, env, seed)
    sides = a.sides.split(",")
    print(
        f"model {model.path} ({model.params} params); {a.seconds:g} s per side, seed {seed}, "
        f"{PROMPTS}x{GROUP} completions per step, greedy eval on {len(env.validation_seeds())} problems "
        f"every {a.eval_every:g} s",
        flush=True,
    )
    res: dict = {"seed": seed}
    if "ours" in sides:
        res["ours"] = run_ours(
            model.path, **side_kw(a), curriculum=a.curriculum, skip_flat=a.skip_flat, overlap=a.overlap
        )
        print_curve("ours", res["ours"])
    if "trl" in sides:
        res["trl"] = trl_side(a.trl_python, model.path, a)
        print_curve("trl", res["trl"])
    key = f"t_to_{a.target:g}"
    ours_t, trl_t = (res.get(s, {}).get(key) for s in ("ours", "trl"))
    res["trl_over_ours"] = round(trl_t / ours_t, 3) if ours_t and trl_t is not None else None
    for s in ("ours", "trl"):
        res.get(s, {}).pop("curve", None)
    return res


def main() -> None:
    global GROUP, PROMPTS, LR, KL, EPOCHS, TASK, MAX_NEW
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=300, help="training seconds per side")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--seeds",
        default=None,
        metavar="LIST",
        help="several seeds, one after the other (e.g. 0-7 or 0,2,5); RESULT then holds every "
        "seed's figures and their medians, and counts which side reached --target first",
    )
    ap.add_argument("--eval-every", type=float, default=10, help="training seconds between evaluations")
    ap.add_argument("--target", type=float, default=0.3, help="accuracy for the time-to-accuracy figure")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (each side; with --overlap, TRL's only: ours then runs one per phase)",
    )
    ap.add_argument("--trl-python", default=sys.executable, help="interpreter that has trl installed")
    ap.add_argument("--sides", default="ours,trl")
    ap.add_argument(
        "--reward",
        choices=["exact", "close"],
        default="exact",
        help="training reward on both sides (evaluation is exact match either way)",
    )
    ap.add_argument("--group", type=int, default=GROUP, help="completions per prompt (both sides)")
    ap.add_argument("--prompts", type=int, default=PROMPTS, help="prompts per optimizer step (both sides)")
    ap.add_argument("--lr", type=float, default=LR, help="learning rate (both sides)")
    ap.add_argument(
        "--kl", type=float, default=KL, help="KL coefficient to the start policy (both sides; 0: no reference model)"
    )
    ap.add_argument(
        "--epochs",
        type=int,
        default=EPOCHS,
        help="optimizer steps per sampled batch, both sides (TRL: num_iterations); the later ones "
        "are off-policy, corrected by the clipped ratio to the behaviour logprobs",
    )
    ap.add_argument(
        "--curriculum",
        type=float,
        default=None,
        metavar="UNIFORM",
        help="ours draws its prompts from a PromptCurriculum with this uniform share (1.0: uniform "
        "over the problems); TRL keeps the fixed order (it has no curriculum)",
    )
    ap.add_argument(
        "--skip-flat",
        action="store_true",
        help="ours skips the forward/backward of groups whose samples all scored the same, KL "
        "term included (GRPO(regularize_all_rows=False)); TRL trains every row",
    )
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="ours samples the next batch on a second thread while it trains on this one (one "
        "step stale, one core each); ours then uses two cores, so give TRL --threads 2",
    )
    ap.add_argument(
        "--task",
        choices=["format", "heldout"],
        default="format",
        help="format: single-digit sums from a format warm start, scored on all 100; heldout: "
        "two-digit sums (least significant digit first) from one pretrained base, trained on "
        "training problems and scored on the 200 held-out ones",
    )
    ap.add_argument("--base-steps", type=int, default=400, help="--task heldout: most steps of the base-model stage")
    ap.add_argument(
        "--base-stop-at",
        type=float,
        default=0.25,
        help="--task heldout: the base-model stage stops once this share of worked training problems is right",
    )
    ap.add_argument(
        "--base-seed", type=int, default=0, help="--task heldout: seed of the base (the same for every seed)"
    )
    ap.add_argument(
        "--gain",
        type=float,
        default=None,
        help="--task heldout: the target is the base's held-out accuracy plus this (e.g. 0.2); replaces --target",
    )
    ap.add_argument("--child", choices=["trl"], help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    a = ap.parse_args()
    GROUP, PROMPTS, LR, KL, EPOCHS, TASK = a.group, a.prompts, a.lr, a.kl, a.epochs, a.task
    if TASK == "heldout":
        MAX_NEW = 6  # three digits, least significant first, then <eos>
    if a.gain is not None and TASK != "heldout":
        ap.error("--gain needs --task heldout (one base for every seed)")
    if GROUP < 2 or PROMPTS < 1 or LR <= 0 or KL < 0 or EPOCHS < 1:
        ap.error("need --group >= 2, --prompts >= 1, --lr > 0, --kl >= 0 and --epochs >= 1")
    try:
        seeds = parse_seeds(a.seeds) if a.seeds is not None else [a.seed]
    except ValueError as e:
        ap.error(str(e))

    import torch

    # --threads is TRL's; ours with --overlap runs each op on its calling thread (one core per phase)
    torch.set_num_threads(1 if a.overlap and a.child is None else a.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if a.child == "trl":
        print("CHILD " + json.dumps(run_trl(a.model_path, **side_kw(a))), flush=True)
        return

    settings: dict = {"task": TASK}
    if TASK == "heldout":  # one base for every seed: measure it once, and set the target from it
        env = make_env()
        model = start_model(a, env, a.base_seed)
        base = GreedyEval(model.path, env)()
        from rollart_nb.models.pretraining import pretrain_record

        settings.update(
            base=round(base, 3),
            base_steps=pretrain_record(model).get("stopped_at") or a.base_steps,
            base_seed=a.base_seed,
        )
        print(f"base: held-out greedy accuracy {base:.3f} on {len(env.validation_seeds())} problems", flush=True)
        if a.gain is not None:
            a.target = round(base + a.gain, 3)
            settings["gain"] = a.gain
    settings |= {
        "seconds": a.seconds,
        "target": a.target,
        "reward": a.reward,
        "curriculum": a.curriculum,
        "skip_flat": a.skip_flat,
        "overlap": a.overlap,
        "threads": a.threads,
        "group": GROUP,
        "prompts": PROMPTS,
        "lr": LR,
        "kl": KL,
        "epochs": EPOCHS,
    }
    runs = [run_seed(a, s) for s in seeds]
    if a.seeds is None:  # one seed: its figures at the top level, as before
        print("RESULT " + json.dumps({**settings, **runs[0]}))
        return
    key = f"t_to_{a.target:g}"
    print(f"\n{'seed':>4} {'ours ' + key:>14} {'trl ' + key:>14} {'ours best':>10} {'trl best':>9}")
    for r in runs:
        o, t = r.get("ours", {}), r.get("trl", {})
        print(
            f"{r['seed']:>4} {o.get(key, '-')!s:>14} {t.get(key, '-')!s:>14} {o.get('best', '-')!s:>10} "
            f"{t.get('best', '-')!s:>9}"
        )
    print(
        "RESULT "
        + json.dumps({**settings, "seeds": seeds, "summary": across_seeds(runs, key, a.seconds), "per_seed": runs})
    )


if __name__ == "__main__":
    main()
