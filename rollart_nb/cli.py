"""``rollart-nb`` command line: ``demo`` (the main job) and ``bench`` (what-if experiments)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from rollart_nb.demo import DemoConfig, run_demo

    cfg = DemoConfig(steps=args.steps, minutes=args.minutes, mode=args.mode, alpha=args.alpha,
                     generator=args.generator, batch_size=args.batch_size, group_size=args.group_size,
                     envs_per_task=args.envs_per_task, seed=args.seed, out=args.out, lr=args.lr,
                     entropy_coef=args.entropy)
    result = run_demo(cfg, quiet=args.quiet)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from rollart_nb.bench import run_experiments

    result = run_experiments(args.experiment, out=args.out, quick=args.quick)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rollart-nb`` script."""
    p = argparse.ArgumentParser(prog="rollart-nb", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train a tiny model on FrozenLake + Arithmetic on Session.local()")
    d.add_argument("--steps", type=int, default=40)
    d.add_argument("--minutes", type=float, default=5.0, help="stop training after this many minutes")
    d.add_argument("--mode", default="rollart", choices=["sync", "sync+", "one-off", "areal", "rollart"])
    d.add_argument("--alpha", type=int, default=1)
    d.add_argument("--generator", default="hf", choices=["hf", "vllm"])
    d.add_argument("--batch-size", type=int, default=64)
    d.add_argument("--group-size", type=int, default=8)
    d.add_argument("--envs-per-task", type=int, default=16)
    d.add_argument("--lr", type=float, default=2e-3)
    d.add_argument("--entropy", type=float, default=0.0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default="rollart_demo", help="directory for report.html and steps.jsonl")
    d.add_argument("--quiet", action="store_true")
    d.set_defaults(fn=_demo)
    b = sub.add_parser("bench", help="what-if experiments on a simulated cluster (sim backend)")
    b.add_argument("experiment", nargs="?", default="all")
    b.add_argument("--out", default="rollart_bench")
    b.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    b.set_defaults(fn=_bench)
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("ROLLART_LOG", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
