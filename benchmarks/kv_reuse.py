"""KV reuse across turns in the ``hf`` backend: multi-turn FrozenLake rollouts with and without it.

``--envs`` FrozenLake episodes run concurrently against one in-process :class:`HFBackend`
(tiny Qwen, random init, sampling at T=1, so most moves are invalid or wander and episodes
run to their turn limit: the prefill-heavy worst case). Every turn's prompt is the whole
history, exactly as the EnvManager builds it. One backend keeps each trajectory's KV between
turns (``kv_reuse=True``), the other re-prefills the history every turn. The two run
alternately (A B A B ...) with the same seeds, so both see the same machine noise and the
same episodes; the headline is the ratio of their median wall times.

Also printed: prompt tokens prefilled per turn with and without reuse, and whether the two
produced the same tokens (they should: same seeds, logits equal up to float rounding).

Last line: ``RESULT {json}``. Usage: ``python benchmarks/kv_reuse.py [--envs 32] [--reps 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rollart_nb.backends.hf import HFBackend  # noqa: E402
from rollart_nb.control.env_manager import RolloutConfig  # noqa: E402
from rollart_nb.envs import FrozenLake  # noqa: E402
from rollart_nb.models import tiny_qwen  # noqa: E402
from rollart_nb.protocols import GenerationRequest  # noqa: E402


async def rollouts(be: HFBackend, n: int, rep: int) -> tuple[float, list[list[int]]]:
    cfg = RolloutConfig()
    tok = be.tokenizer

    def enc(obs: str) -> list[int]:
        return tok.encode(f"{cfg.user_tag} {obs} {cfg.assistant_tag}")

    async def episode(i: int) -> list[int]:
        env = FrozenLake()
        obs, _ = env.reset(seed=i)
        prompt, out = enc(obs), []
        for turn in range(env.max_turns):
            r = await be.generate(
                GenerationRequest(f"r{rep}e{i}", "frozenlake", list(prompt), 4, 1.0, seed=rep * 10_000 + i * 100 + turn)
            )
            out += r.token_ids
            obs, _, terminated, truncated, _ = env.step(r.text)
            if terminated or truncated:
                break
            prompt = prompt + r.token_ids + enc(obs)
        return out

    t0 = time.perf_counter()
    tokens = await asyncio.gather(*[episode(i) for i in range(n)])
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", type=int, default=32, help="concurrent episodes")
    ap.add_argument("--reps", type=int, default=3, help="alternating repeats per side")
    args = ap.parse_args()
    env = FrozenLake()
    ref = tiny_qwen(task_vocab=sorted(env.vocab), size="s")
    sides = {
        "reuse": HFBackend(ref, kv_reuse=True, max_batch_size=64),
        "no_reuse": HFBackend(ref, kv_reuse=False, max_batch_size=64),
    }
    walls: dict[str, list[float]] = {k: [] for k in sides}
    same = True
    for rep in range(args.reps):
        outs = {}
        for name, be in sides.items():
            wall, outs[name] = asyncio.run(rollouts(be, args.envs, rep))
            walls[name].append(wall)
        same &= outs["reuse"] == outs["no_reuse"]
        print(f"rep {rep}: " + "  ".join(f"{k} {v[-1]:.2f}s" for k, v in walls.items()), flush=True)
    med = {k: statistics.median(v) for k, v in walls.items()}
    st = sides["reuse"].stats
    per_req = {
        k: (be.stats["prefill_tokens"] + be.stats["reused_tokens"]) / be.stats["requests"] for k, be in sides.items()
    }
    prefilled = st["prefill_tokens"] / st["requests"]
    print(
        f"median wall: reuse {med['reuse']:.2f}s, no reuse {med['no_reuse']:.2f}s -> "
        f"speedup {med['no_reuse'] / med['reuse']:.2f}x"
    )
    print(
        f"prompt tokens per turn {per_req['reuse']:.1f}; prefilled with reuse {prefilled:.1f} "
        f"({st['reused_tokens'] / (st['reused_tokens'] + st['prefill_tokens']):.0%} reused); "
        f"same tokens on both sides: {same}"
    )
    print(
        "RESULT "
        + json.dumps(
            {
                "speedup": round(med["no_reuse"] / med["reuse"], 3),
                "wall_s": {k: round(v, 3) for k, v in med.items()},
                "prefill_tokens_per_turn": {"reuse": round(prefilled, 1), "no_reuse": round(per_req["no_reuse"], 1)},
                "same_tokens": same,
                "envs": args.envs,
            }
        )
    )


if __name__ == "__main__":
    main()
