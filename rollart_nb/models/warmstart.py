"""Format-only warm start: teach a fresh model the *shape* of an answer, never the answers.

A randomly initialised model almost never emits a parseable action, so RL has no signal.
:func:`format_warm_start` runs a short supervised pass on (observation, response) pairs whose
responses have the right format but random content (a random direction for FrozenLake, a
random number for Arithmetic), so the policy starts from "answers in format, uniformly at
random" and RL does all the learning.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollart_nb.models.pretraining import supervised
from rollart_nb.models.tiny import ModelRef, format_history

__all__ = ["format_warm_start", "random_format_examples"]

_DIRECTIONS = ["left", "right", "up", "down"]
_MAX_WALK = 3


def random_format_examples(envs: dict[str, Any], n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt text, random well-formed response) pairs from the envs' own observations.

    FrozenLake-like envs (``shape == "prefill"``) get a random direction, at a random point of a
    random walk (the prompt holds the walk so far, as the EnvManager renders it), so later turns
    are in format too; Arithmetic-like envs get a random number written digit by digit. Other
    envs are skipped.
    """
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    names = sorted(envs)
    for i in range(n):
        task = names[i % len(names)]
        env = envs[task]
        obs, _ = env.reset(seed=rng.randrange(10_000))
        if getattr(env, "shape", "") == "prefill":
            history: list[tuple[str, str | None]] = []
            # A short walk is enough to put later turns in format; long ones would only cost time.
            for _ in range(rng.randrange(min(int(getattr(env, "max_turns", 1) or 1), _MAX_WALK + 1))):
                move = rng.choice(_DIRECTIONS)
                nxt, _, terminated, truncated, _ = env.step(move)
                if terminated or truncated:
                    break
                history.append((obs, move))
                obs = nxt
            out.append((format_history([*history, (obs, None)]), rng.choice(_DIRECTIONS)))
        elif getattr(env, "shape", "") == "decode":
            resp = " ".join(str(rng.randrange(0, 19)))
            out.append((format_history([(obs, None)]), resp))
    return out


def format_warm_start(
    model: ModelRef,
    envs: dict[str, Any],
    *,
    steps: int = 60,
    batch: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
    path: str | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> ModelRef:
    """Return a copy of ``model`` fine-tuned to answer in the envs' formats (random content).

    Cached: the same (model, envs, steps, seed) reuses the saved directory.
    """
    # The envs' own first observations are part of the key: a changed rendering needs a new warm start.
    looks = {k: envs[k].reset(seed=0)[0] for k in sorted(envs)}
    key = json.dumps(
        {"recipe": 2, "m": model.path, "envs": looks, "steps": steps, "batch": batch, "seed": seed, "lr": lr}
    )

    out = Path(path or f"{model.path}-warm-{hashlib.sha1(key.encode()).hexdigest()[:10]}")
    name = f"{model.name}-warm"
    if (out / "config.json").exists():
        return ModelRef(str(out), name, model.params, model.seed)
    examples = random_format_examples(envs, steps * batch, seed)
    return supervised(
        model, examples, steps=steps, batch=batch, lr=lr, seed=seed, out=out, name=name, progress=progress
    )
