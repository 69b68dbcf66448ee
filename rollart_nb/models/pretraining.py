"""The base-model stage: next-token training on a corpus of worked training problems.

RL post-training sharpens what a base model can already sometimes do; it does not teach a random
model a task from a reward alone. :func:`pretrain` gives the tiny locally built model such a base:
a short supervised pass on :func:`corpus`, which holds worked solutions to *training* problems only
(each env's ``demonstrate(seed)`` for seeds drawn below
:data:`~rollart_nb.envs.arithmetic.HELDOUT_SEED_BASE`), so a held-out validation problem is never
in it. Stopped early, it leaves a base that is partly right: greedy decoding solves some held-out
problems and sampling solves more (pass@k above pass@1), which is where RL has something to
sharpen. What the corpus holds, per env:

- :class:`~rollart_nb.envs.Arithmetic`: a training question and its right answer as the env wants
  it written (one turn);
- :class:`~rollart_nb.envs.FrozenLake`: a shortest path on a training map, cut at a random turn:
  the walk so far as the prompt and the next shortest-path move as the response.

Cached like the warm start: the same model, corpus and settings reuse the saved directory.

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
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollart_nb.envs.arithmetic import HELDOUT_SEED_BASE
from rollart_nb.errors import ConfigError
from rollart_nb.models.tiny import ModelRef, format_history

__all__ = ["Example", "corpus", "pretrain", "supervised"]

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
) -> ModelRef:
    """Next-token training of ``model`` on ``examples`` (loss on the responses and their ``<eos>``),
    ``batch`` examples a step in order, saved to ``out`` with the tokenizer files."""
    import torch

    torch.manual_seed(seed)
    tok = model.load_tokenizer()
    net = model.load_model()
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    pairs = [(e.prompt, e.response) if isinstance(e, Example) else (e[0], e[1]) for e in examples]
    eos = tok.eos_token_id
    for step in range(steps):
        chunk = pairs[(step * batch) % len(pairs) :][:batch] or pairs[:batch]
        seqs, masks = [], []
        for prompt, resp in chunk:
            p = tok.encode(prompt)
            r = tok.encode(resp) + [eos]
            seqs.append(p + r)
            masks.append([0] * len(p) + [1] * len(r))
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        logits = net(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if progress is not None:
            progress(step, float(loss.detach()))
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
) -> ModelRef:
    """Return ``model`` after ``steps`` of next-token training: the base that RL starts from.

    Args:
        model: the model to train (e.g. :func:`~rollart_nb.models.tiny_qwen`); it is not changed.
        data: task -> env (the corpus is :func:`corpus` of ``steps * batch`` entries, ``weights``
            apportioning tasks), or a ready list of :class:`Example`.
        steps, batch, lr: the supervised pass (AdamW). Few steps leave a partly right base; many
            leave one that already solves what RL would have taught.
        seed: corpus draws and torch's seed.
        path: where to save; default beside ``model`` with a key of everything above.
        progress: called as ``progress(step, loss)`` after each step.
    """
    if steps < 1 or batch < 1 or not lr > 0:
        raise ConfigError(f"pretrain needs steps >= 1, batch >= 1 and lr > 0, got {steps}, {batch}, {lr}")
    examples = corpus(data, steps * batch, seed=seed, weights=weights) if isinstance(data, dict) else list(data)
    if not examples:
        raise ConfigError("pretrain got an empty corpus")
    digest = hashlib.sha1(json.dumps([(e.prompt, e.response) for e in examples]).encode()).hexdigest()[:12]
    key = json.dumps({"recipe": 1, "m": model.path, "corpus": digest, "steps": steps, "batch": batch, "lr": lr})
    out = Path(path or f"{model.path}-base-{hashlib.sha1(key.encode()).hexdigest()[:10]}")
    name = f"{model.name}-base"
    if (out / "config.json").exists():
        return ModelRef(str(out), name, model.params, model.seed)
    return supervised(
        model, examples, steps=steps, batch=batch, lr=lr, seed=seed, out=out, name=name, progress=progress
    )
