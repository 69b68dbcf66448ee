"""``rollart-nb`` command line: ``demo`` (the main job), ``bench`` (what-if experiments) and
``env-server`` (serve an env class over HTTP, see :mod:`rollart_nb.envs.server`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from rollart_nb.redact import RedactingFilter

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from rollart_nb.demo import DemoConfig, run_demo

    # Flags left out keep DemoConfig's defaults (one place defines them).
    given = {f: getattr(args, f) for f in _DEMO_FLAGS if getattr(args, f) is not None}
    given["entropy_coef"] = given.pop("entropy", DemoConfig.entropy_coef)
    if "kl" in given:
        given["kl_coef"] = given.pop("kl")
    if "tasks" in given:
        given["tasks"] = tuple(t.strip() for t in given["tasks"].split(",") if t.strip())
    if "weights" in given:
        given["task_weights"] = _parse_weights(given.pop("weights"))
    if args.no_std:
        given["scale_by_std"] = False
    result = run_demo(DemoConfig(**given), quiet=args.quiet)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


_DEMO_FLAGS = ("steps", "minutes", "mode", "alpha", "generator", "batch_size", "group_size", "envs_per_task",
               "lr", "entropy", "kl", "loss_agg", "math_reward", "math_curriculum", "tasks", "weights",
               "validate_every", "seed", "out")


def _parse_weights(text: str) -> dict[str, float]:
    """``"frozenlake=1,math=3"`` -> ``{"frozenlake": 1.0, "math": 3.0}``."""
    import math

    from rollart_nb.errors import ConfigError

    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = (x.strip() for x in part.partition("="))
        try:
            w = float(value) if eq else math.nan
        except ValueError:
            w = math.nan
        if not name or not math.isfinite(w) or name in out:
            raise ConfigError(f"--weights: {part!r} is not task=number, or names a task twice "
                              "(e.g. frozenlake=1,math=3)")
        out[name] = w
    return out


def _bench(args: argparse.Namespace) -> int:
    from rollart_nb.bench import run_experiments

    result = run_experiments(args.experiment, out=args.out, quick=args.quick)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _env_server(args: argparse.Namespace) -> int:
    import asyncio

    from rollart_nb.envs.server import EnvServer, load_env_factory, serve
    from rollart_nb.errors import ConfigError

    try:
        kwargs = json.loads(args.kwargs)
    except ValueError as e:
        raise ConfigError(f"--kwargs {args.kwargs!r} is not JSON: {e}") from e
    if not isinstance(kwargs, dict):
        raise ConfigError(f"--kwargs must be a JSON object (e.g. '{{\"size\": 4}}'), got {args.kwargs!r}")
    server = EnvServer(load_env_factory(args.env, kwargs), task=args.task, replica_id=args.replica_id,
                       max_episodes=args.max_episodes, idle_timeout_s=args.idle_timeout,
                       threads=args.threads, max_body_bytes=args.max_body_bytes)
    asyncio.run(serve(server, args.host, args.port, exit_with_parent=args.exit_with_parent))
    return 0


def _add_env_server(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("env-server", help="serve an env class over HTTP/JSON (protocol v1) for RemoteEnv")
    e.add_argument("--env", required=True, help="module:Class, e.g. rollart_nb.envs:FrozenLake")
    e.add_argument("--kwargs", default="{}", help="JSON object of constructor arguments, e.g. '{\"size\": 4}'")
    e.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 only inside a pod)")
    e.add_argument("--port", type=int, default=8000, help="0 picks a free port (see the LISTENING line)")
    e.add_argument("--task", help="task name reported by /v1/metadata")
    e.add_argument("--replica-id", help="name of this replica in answers (default host:port)")
    e.add_argument("--max-episodes", type=int, default=256, help="concurrent episodes before 503")
    e.add_argument("--idle-timeout", type=float, default=600.0, help="seconds before an idle episode closes")
    e.add_argument("--threads", type=int, default=8, help="threads for sync env methods")
    e.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    e.add_argument("--exit-with-parent", action="store_true", help="stop when the starting process dies")
    e.set_defaults(fn=_env_server)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rollart-nb`` script."""
    from rollart_nb.algo.grpo import LOSS_AGGS
    from rollart_nb.demo import MATH_REWARDS

    p = argparse.ArgumentParser(prog="rollart-nb", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train a tiny model on FrozenLake + Arithmetic on Session.local()")
    d.add_argument("--steps", type=int, help="training steps (default: DemoConfig.steps)")
    d.add_argument("--minutes", type=float, help="stop training after this many minutes")
    d.add_argument("--mode", choices=["sync", "sync+", "one-off", "areal", "rollart"])
    d.add_argument("--alpha", type=int, help="staleness bound")
    d.add_argument("--generator", choices=["hf", "vllm"])
    d.add_argument("--batch-size", type=int)
    d.add_argument("--group-size", type=int)
    d.add_argument("--envs-per-task", type=int)
    d.add_argument("--lr", type=float)
    d.add_argument("--entropy", type=float, help="entropy bonus coefficient")
    d.add_argument("--kl", type=float, help="k3 KL coefficient to the warm start")
    d.add_argument("--loss-agg", choices=LOSS_AGGS,
                   help="how token losses average over the batch (see GRPO.loss_agg)")
    d.add_argument("--math-reward", choices=MATH_REWARDS,
                   help="math's training reward: partial credit by distance (default) or exact match; "
                        "validation is exact match either way")
    d.add_argument("--math-curriculum", type=float, metavar="UNIFORM",
                   help="draw math's prompts by learnability (PromptCurriculum), this share uniformly")
    d.add_argument("--no-std", action="store_true",
                   help="mean-only group baseline (Dr. GRPO) for every task (default: math only)")
    d.add_argument("--tasks", help="comma-separated subset of frozenlake,math (default: both)")
    d.add_argument("--weights", help="share of each batch per task, e.g. frozenlake=1,math=3")
    d.add_argument("--validate-every", type=int, help="steps between validations")
    d.add_argument("--seed", type=int)
    d.add_argument("--out", help="directory for report.html and steps.jsonl (default rollart_demo)")
    d.add_argument("--quiet", action="store_true")
    d.set_defaults(fn=_demo)
    b = sub.add_parser("bench", help="what-if experiments on a simulated cluster (sim backend)")
    b.add_argument("experiment", nargs="?", default="all")
    b.add_argument("--out", default="rollart_bench")
    b.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    b.set_defaults(fn=_bench)
    _add_env_server(sub)
    args = p.parse_args(argv)
    logging.basicConfig(level=os.environ.get("ROLLART_LOG", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for h in logging.getLogger().handlers:
        h.addFilter(RedactingFilter())
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
