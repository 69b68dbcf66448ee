"""The base-model stage: next-token training on a corpus of worked training problems.

RL sharpens what a base model can sometimes do; it cannot teach a random model a task from a
reward alone. :func:`pretrain` gives the tiny model such a base: a short supervised pass on
:func:`corpus`, worked solutions (each env's ``demonstrate(seed)``) to *training* problems only,
stopped while the base is partly right. Cached like the warm start.

Example:
    >>> from rollart_nb.envs import Arithmetic
    >>> env = Arithmetic(max_operand=99, holdout=200, fixed_width=True, reverse_answer=True)
    >>> examples = corpus({"math": env}, 2, seed=0)
    >>> len(examples), examples[0].task
    (2, 'math')
    >>> base = pretrain(tiny_qwen(task_vocab=env.vocab), {"math": env}, steps=300)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollart_nb.envs.arithmetic import HELDOUT_SEED_BASE
from rollart_nb.errors import ConfigError
from rollart_nb.models.tiny import ModelRef, format_history

__all__ = ["Example", "corpus", "pretrain", "pretrain_record", "supervised", "training_accuracy"]

#: Steps between two checks of ``pretrain(stop_at=...)``.
CHECK_EVERY = 5
#: Worked training problems per task that ``stop_at`` checks (drawn apart from the corpus).
CHECK_EXAMPLES = 100

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Example:
    """One corpus entry: a rendered prompt, the response to learn, and where it came from."""

    prompt: str
    response: str
    task: str = ""
    seed: int | None = None


def corpus(envs: dict[str, Any], n: int, *, seed: int = 0, weights: dict[str, float] | None = None) -> list[Example]:
    """``n`` worked training problems from ``envs`` (task -> env with ``demonstrate(seed)``).

    Tasks take turns in proportion to ``weights`` (default equal); each entry draws a training seed
    in ``[0, HELDOUT_SEED_BASE)``, asks the env for its demonstration (a list of ``(observation,
    action)`` turns) and keeps one turn of it, at random, with the turns before it as history.
    """
    bad = [t for t, e in envs.items() if not callable(getattr(e, "demonstrate", None))]
    if bad:
        raise ConfigError(
            f"tasks {bad} have envs without demonstrate(seed); a corpus needs worked solutions "
            "(Arithmetic and FrozenLake have them)",
            where="pretraining corpus",
        )
    if not envs or n < 1:
        raise ConfigError(f"a corpus needs at least one env and n >= 1, got {len(envs)} envs and n={n}")
    names = sorted(envs)
    w = [float((weights or {}).get(t, 1.0)) for t in names]
    if any(x < 0 for x in w) or not sum(w):
        raise ConfigError(f"corpus weights must be >= 0 with a positive sum, got {weights}")
    rng = random.Random(f"corpus/{seed}")
    credit = [0.0] * len(names)  # deterministic interleave: each task's share of entries is its weight's
    out: list[Example] = []
    for _ in range(n):
        credit = [c + x / sum(w) for c, x in zip(credit, w, strict=True)]
        i = max(range(len(names)), key=lambda j: credit[j])
        credit[i] -= 1.0
        task = names[i]
        s = rng.randrange(HELDOUT_SEED_BASE)
        turns = list(envs[task].demonstrate(s))
        if not turns:
            continue
        k = rng.randrange(len(turns))
        obs, action = turns[k]
        out.append(Example(format_history([*turns[:k], (obs, None)]), action, task, s))
    return out


def supervised(
    model: ModelRef,
    examples: Sequence[Example] | Sequence[tuple[str, str]],
    *,
    steps: int,
    batch: int,
    lr: float,
    seed: int,
    out: Path,
    name: str,
    progress: Callable[[int, float], None] | None = None,
    schedule: str = "constant",
    max_grad_norm: float | None = None,
    micro_batch_tokens: int | None = None,
    stop: Callable[[int, Any], bool] | None = None,
) -> ModelRef:
    """Next-token training of ``model`` on ``examples`` (loss on the responses and their ``<eos>``),
    ``batch`` examples a step in order, saved to ``out`` with the tokenizer files.

    ``schedule``: ``"constant"`` or ``"cosine"`` (linear warm-up over the first 5% of steps, then
    cosine decay to a tenth of ``lr``: the last weights are a settled model, not one caught in a
    loss spike). ``max_grad_norm`` clips the gradient. ``micro_batch_tokens`` splits each step's
    examples, sorted by length, into micro-batches of at most that many padded tokens whose
    gradients add up to the step's (a short sum does not pay for a long walk's padding).
    ``stop(step, net)``, called after each step, ends training early when it returns True."""
    import torch

    from rollart_nb.backends.torch_train import micro_batches

    if schedule not in ("constant", "cosine"):
        raise ConfigError(f"schedule={schedule!r} must be 'constant' or 'cosine'")
    torch.manual_seed(seed)
    tok = model.load_tokenizer()
    net = model.load_model()
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    warm = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if schedule == "constant":
            return lr
        if step < warm:
            return lr * (step + 1) / warm
        return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm))))

    pairs = [(e.prompt, e.response) if isinstance(e, Example) else (e[0], e[1]) for e in examples]
    eos = tok.eos_token_id
    for step in range(steps):
        chunk = pairs[(step * batch) % len(pairs) :][:batch] or pairs[:batch]
        rows = []
        for prompt, resp in chunk:
            p = tok.encode(prompt)
            r = tok.encode(resp) + [eos]
            rows.append((p + r, [0] * len(p) + [1] * len(r)))
        if micro_batch_tokens:
            rows.sort(key=lambda x: len(x[0]))
        n_tokens = sum(sum(m[1:]) for _, m in rows)  # the step's loss is the mean over all of them
        spans = micro_batches([len(x) for x, _ in rows], len(rows), micro_batch_tokens or 0)
        parts = [rows[lo:hi] for lo, hi in spans]
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad()
        total = 0.0
        for part in parts:
            loss = _part_loss(net, part, n_tokens)
            loss.backward()
            total += float(loss.detach())
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm)
        opt.step()
        if progress is not None:
            progress(step, total)
        if stop is not None and stop(step, net):
            break
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    net.save_pretrained(tmp)
    for f in Path(model.path).iterdir():  # tokenizer files and metadata travel with the weights
        if f.is_file() and not (tmp / f.name).exists():
            shutil.copy(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log.info("%s saved to %s", name, out)
    return ModelRef(str(out), name, model.params, model.seed)


def _part_loss(net: Any, part: list[tuple[list[int], list[int]]], n_tokens: int) -> Any:
    """The summed next-token loss of a micro-batch of ``(ids, loss mask)`` rows, over the step's
    ``n_tokens`` trained tokens (so the micro-batches' losses add up to the step's mean)."""
    import torch

    width = max(len(s) for s, _ in part)
    ids = torch.tensor([s + [0] * (width - len(s)) for s, _ in part])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in part], dtype=torch.float32)
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s, _ in part])
    logits = net(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -(logp * mask[:, 1:]).sum() / max(n_tokens, 1)


def training_accuracy(net: Any, tok: Any, examples: Sequence[Example]) -> dict[str, float]:
    """Per task, the share of ``examples`` whose response greedy decoding reproduces exactly
    (every response token, then ``<eos>``). Prompts of one length decode as one batch."""
    import torch

    by_len: dict[int, list[tuple[list[int], list[int], str]]] = {}
    for e in examples:
        p = tok.encode(e.prompt)
        by_len.setdefault(len(p), []).append((p, tok.encode(e.response) + [tok.eos_token_id], e.task))
    right: dict[str, list[int]] = {}
    was_training = net.training
    net.eval()
    with torch.no_grad():
        for group in by_len.values():
            ids = torch.tensor([p for p, _, _ in group])
            width = max(len(r) for _, r, _ in group)
            out = net.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=width,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
                eos_token_id=tok.eos_token_id,
            )[:, ids.shape[1] :].tolist()
            for said, (_, want, task) in zip(out, group, strict=True):
                right.setdefault(task, []).append(int(said[: len(want)] == want))
    net.train(was_training)
    return {t: sum(v) / len(v) for t, v in sorted(right.items())}


def pretrain(
    model: ModelRef,
    data: dict[str, Any] | Sequence[Example],
    *,
    steps: int = 300,
    batch: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    weights: dict[str, float] | None = None,
    path: str | None = None,
    progress: Callable[[int, float], None] | None = None,
    stop_at: dict[str, float] | None = None,
) -> ModelRef:
    """Return ``model`` after ``steps`` of next-token training: the base that RL starts from.

    A small model learns a rule such as carrying in a sudden jump at a seed-dependent step, so
    ``stop_at`` stops there: every :data:`CHECK_EVERY` steps it measures
    :func:`training_accuracy` on :data:`CHECK_EXAMPLES` training problems per task and stops
    once each listed task reaches its value (recorded in ``pretrain.json``).

    Args:
        model: the model to train (e.g. :func:`~rollart_nb.models.tiny_qwen`); it is not changed.
        data: task -> env (the corpus is :func:`corpus` of ``steps * batch`` entries, ``weights``
            apportioning tasks), or a ready list of :class:`Example`.
        steps, batch, lr: the supervised pass (AdamW, warm-up then cosine decay to lr / 10).
        seed: corpus draws and torch's seed.
        path: where to save; default beside ``model`` with a key of everything above.
        progress: called as ``progress(step, loss)`` after each step.
        stop_at: task -> training-problem accuracy at which to stop (needs ``data`` as envs).
    """
    if steps < 1 or batch < 1 or not lr > 0:
        raise ConfigError(f"pretrain needs steps >= 1, batch >= 1 and lr > 0, got {steps}, {batch}, {lr}")
    examples = corpus(data, steps * batch, seed=seed, weights=weights) if isinstance(data, dict) else list(data)
    if not examples:
        raise ConfigError("pretrain got an empty corpus")
    stop_at = dict(stop_at or {})
    if stop_at:
        bad = [t for t, v in stop_at.items() if not isinstance(data, dict) or t not in data or not 0 < v <= 1]
        if bad:
            raise ConfigError(
                f"stop_at={stop_at} must map tasks of the corpus's envs to accuracies in (0, 1]; "
                f"check {bad} (stop_at needs envs, not a list of examples)"
            )
    digest = hashlib.sha1(json.dumps([(e.prompt, e.response) for e in examples]).encode()).hexdigest()[:12]
    key = json.dumps(
        {"recipe": 2, "m": model.path, "corpus": digest, "steps": steps, "batch": batch, "lr": lr, "stop_at": stop_at}
    )
    out = Path(path or f"{model.path}-base-{hashlib.sha1(key.encode()).hexdigest()[:10]}")
    name = f"{model.name}-base"
    if (out / "config.json").exists():
        return ModelRef(str(out), name, model.params, model.seed)
    record: dict[str, Any] = {"steps": steps, "stop_at": stop_at, "stopped_at": None, "accuracy": {}}
    check = None
    if stop_at:
        assert isinstance(data, dict)
        # drawn apart from the corpus (another seed), from training problems only, like it
        held_in = [e for e in corpus(data, 4 * CHECK_EXAMPLES * len(data), seed=seed + 7919) if e.task in stop_at]
        sample = [e for t in stop_at for e in [x for x in held_in if x.task == t][:CHECK_EXAMPLES]]
        tok = model.load_tokenizer()

        def check(step: int, net: Any) -> bool:
            if (step + 1) % CHECK_EVERY:
                return False
            acc = training_accuracy(net, tok, sample)
            record["accuracy"], record["trained_steps"] = acc, step + 1
            if all(acc.get(t, 0.0) >= v for t, v in stop_at.items()):
                record["stopped_at"] = step + 1
                return True
            return False

    ref = supervised(
        model,
        examples,
        steps=steps,
        batch=batch,
        lr=lr,
        seed=seed,
        out=out,
        name=name,
        progress=progress,
        schedule="cosine",
        max_grad_norm=1.0,
        micro_batch_tokens=4096,
        stop=check,
    )
    (out / "pretrain.json").write_text(json.dumps(record))
    return ref


def pretrain_record(base: ModelRef) -> dict[str, Any]:
    """What :func:`pretrain` saved about how ``base`` was made (``stopped_at``, ``accuracy``);
    empty for a model that has no record."""
    f = Path(base.path) / "pretrain.json"
    return json.loads(f.read_text()) if f.is_file() else {}
