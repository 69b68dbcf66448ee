"""``rollart-nb`` command line: ``demo`` (the main job), ``train`` (a run from a YAML config with
``name=value`` overrides), ``bench`` (what-if experiments) and
``env-server`` (serve an env class over HTTP, see :mod:`rollart_nb.envs.server`).

Bad flag values end in a usage error (exit status 2) before anything starts. A
:class:`~rollart_nb.errors.RollartError` raised by the run itself prints ``error: <message>`` on
one line and exits with 2 (a :class:`~rollart_nb.errors.ConfigError`) or 1 (any other).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from rollart_nb import __version__
from rollart_nb.errors import ConfigError, RollartError
from rollart_nb.redact import RedactingFilter

__all__ = ["build_parser", "main"]


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each flag's default to its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default in (None, argparse.SUPPRESS):
            return text
        if action.nargs == 0:  # an on/off flag
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: %(default)s)"


# -- flag value types: each raises ArgumentTypeError, which argparse turns into a usage error ----
def _whole(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = lo - 1
        if value < lo:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {lo}")
        return value

    return parse


def _number(lo: float, hi: float = math.inf, *, above: bool = False) -> Callable[[str], float]:
    """A finite float in [lo, hi] (in (lo, hi] with ``above``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > lo if above else value >= lo) and value <= hi):
            bound = f"> {lo:g}" if above else f">= {lo:g}"
            bound += f" and <= {hi:g}" if math.isfinite(hi) else ""
            raise argparse.ArgumentTypeError(f"{text!r} is not a number {bound}")
        return value

    return parse


def _task_list(text: str) -> tuple[str, ...]:
    from rollart_nb.train import BUILTIN_ENVS as TASKS

    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        got = f"unknown task {', '.join(map(repr, unknown))}" if unknown else f"no task in {text!r}"
        raise argparse.ArgumentTypeError(f"{got}; choose from {', '.join(TASKS)} (comma-separated)")
    return names


def _parse_weights(text: str) -> dict[str, float]:
    """``"frozenlake=1,math=3"`` -> ``{"frozenlake": 1.0, "math": 3.0}``."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = (x.strip() for x in part.partition("="))
        try:
            w = float(value) if eq else math.nan
        except ValueError:
            w = math.nan
        if not name or not math.isfinite(w) or name in out:
            raise ConfigError(
                f"--weights: {part!r} is not task=number, or names a task twice (e.g. frozenlake=1,math=3)"
            )
        out[name] = w
    return out


def _weights(text: str) -> dict[str, float]:
    from rollart_nb.train import BUILTIN_ENVS as TASKS

    try:
        weights = _parse_weights(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--weights: ")) from e
    unknown = [t for t in weights if t not in TASKS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown task {', '.join(map(repr, unknown))}; choose from {', '.join(TASKS)}"
        )
    negative = [t for t, w in weights.items() if w < 0]
    if negative or not weights:
        raise argparse.ArgumentTypeError(f"{text!r}: give each task a share >= 0 (e.g. frozenlake=1,math=3)")
    return weights


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} must be a JSON object, e.g. '{{\"size\": 4}}'")
    return value


# -- demo ------------------------------------------------------------------------------------
# The demo's flags in help order: (flag, the TrainConfig setting it sets or None, argparse keywords).
# A flag's default is its setting's value in demo.yaml (one place defines them); what needs the
# config or a lazy import (choices, some helps) _add_demo adds.
_DEMO_FLAGS: tuple[tuple[str, str | None, dict[str, Any]], ...] = (
    ("--steps", "steps", {"type": _whole(1), "help": "training steps (the run also stops at --minutes)"}),
    ("--minutes", "minutes", {"type": _number(0, above=True), "help": "wall-clock budget for training"}),
    ("--mode", "pipeline.mode", {"help": "pipeline mode"}),
    ("--alpha", "pipeline.alpha", {"type": _whole(0), "help": "staleness bound, per trajectory, in policy versions"}),
    ("--generator", "generator", {"help": "generation backend"}),
    (
        "--batch-size",
        "pipeline.batch_size",
        {"type": _whole(1), "help": "trajectories per training step (a multiple of --group-size)"},
    ),
    ("--group-size", "algo.group_size", {"type": _whole(1), "help": "GRPO group size"}),
    ("--envs-per-task", "envs_per_task", {"type": _whole(1), "help": "concurrent envs per task"}),
    ("--lr", "algo.lr", {"type": _number(0, above=True), "help": "learning rate"}),
    ("--entropy", "algo.entropy_coef", {"type": _number(0), "help": "entropy bonus coefficient"}),
    ("--kl", "algo.kl_coef", {"type": _number(0), "help": "k3 KL coefficient to the model RL starts from"}),
    (
        "--loss-agg",
        "algo.loss_agg",
        {"help": "how token losses average over the batch (see GRPO.loss_agg)"},
    ),
    ("--math-reward", "tasks.math.reward", {}),
    (
        "--math-curriculum",
        "tasks.math.curriculum",
        {
            "type": _number(0, 1),
            "metavar": "UNIFORM",
            "default": None,
            "help": "draw math's prompts by learnability (PromptCurriculum), this share uniformly "
            "(default: off, random prompts)",
        },
    ),
    (
        "--no-std",
        None,
        {"action": "store_true", "help": "mean-only group baseline (Dr. GRPO) for every task, not only for math"},
    ),
    ("--tasks", None, {"type": _task_list, "help": "comma-separated tasks to train"}),
    ("--weights", None, {"type": _weights}),
    (
        "--validate-every",
        "pipeline.validate_every",
        {"type": _whole(0), "help": "steps between greedy validations (0: only before and after training)"},
    ),
    ("--seed", "seed", {"type": _whole(0), "help": "seed everything derives from"}),
    ("--out", "out", {"help": "directory for report.html, curves.svg, steps.jsonl and config.yaml"}),
)


def _setting(cfg: Any, name: str) -> Any:
    """The value of dotted setting ``name`` in ``cfg`` (None where a task it names is not in it)."""
    for part in name.split("."):
        cfg = cfg.get(part) if isinstance(cfg, dict) else getattr(cfg, part)
        if cfg is None:
            return None
    return cfg


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="NAME=VALUE",
        help="settings by dotted name, applied last, e.g. algo.lr=5e-4 pipeline.rollout.max_turns=8 "
        "(rollart-nb train --list-options lists them)",
    )
    parser.add_argument("--quiet", action="store_true", help="print only the RESULT line")


def _add_demo(sub: argparse._SubParsersAction) -> None:
    from rollart_nb import train
    from rollart_nb.algo.grpo import LOSS_AGGS
    from rollart_nb.control.modes import MODES

    c = train.demo_config()
    math_task = c.tasks.get("math")
    d = sub.add_parser(
        "demo",
        help="train a tiny model on FrozenLake + Arithmetic on Session.local()",
        description="The main job: a base-model stage on worked training problems (cached), then "
        "GRPO on a tiny locally built model, FrozenLake and Arithmetic, on Session.local(), scored on "
        "held-out problems; prints a table per step, writes steps.jsonl as it goes, an HTML report, "
        "and ends with RESULT {json}. The same as `rollart-nb train` with the shipped "
        "rollart_nb/configs/demo.yaml; the flags below are its commonest settings.",
        usage="%(prog)s [options] [NAME=VALUE ...]",
        formatter_class=_Help,
    )
    late: dict[str, dict[str, Any]] = {
        "--mode": {"choices": list(MODES)},
        "--generator": {"choices": train.GENERATORS},
        "--loss-agg": {"choices": LOSS_AGGS},
        "--math-reward": {
            "choices": train.BUILTIN_REWARDS,
            "help": "math's training reward: partial credit by distance (close) or exact match"
            + ("" if math_task and math_task.reward else " (default: the env's own, exact match)")
            + "; validation is exact match either way",
        },
        "--tasks": {"default": ",".join(c.tasks)},
        "--weights": {
            "help": "share of each batch per task (default: "
            + ",".join(f"{t}={tc.weight:g}" for t, tc in c.tasks.items())
            + ")"
        },
    }
    for flag, name, kw in _DEMO_FLAGS:
        d.add_argument(flag, **({"default": _setting(c, name)} if name else {}) | kw | late.get(flag, {}))
    _add_overrides(d)
    d.set_defaults(fn=_demo, check=_check_demo, error=d.error)
    assert set(c.tasks) == set(train.BUILTIN_ENVS)  # --tasks and --weights choose among them


def _check_demo(args: argparse.Namespace) -> str | None:
    if args.batch_size % args.group_size:
        return f"--batch-size {args.batch_size} is not a multiple of --group-size {args.group_size}"
    return None


def demo_train_config(args: argparse.Namespace) -> Any:
    """The :class:`~rollart_nb.train.TrainConfig` that ``rollart-nb demo`` flags describe."""
    from rollart_nb.config import apply_overrides
    from rollart_nb.train import demo_config

    cfg = demo_config().only(args.tasks)
    given: dict[str, Any] = {}
    for flag, name, _ in _DEMO_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if (
            name is not None
            and value is not None
            and (not name.startswith("tasks.") or name.split(".")[1] in cfg.tasks)
        ):
            given[name] = value
    if args.no_std:
        given["algo.scale_by_std"] = False
    for t, w in (args.weights or {}).items():
        if t in cfg.tasks:
            given[f"tasks.{t}.weight"] = w
    cfg = apply_overrides(cfg, given)
    return apply_overrides(cfg, args.overrides) if args.overrides else cfg


def _run(cfg: Any, quiet: bool) -> int:
    """Run a TrainConfig and print its RESULT line (demo and train end the same way)."""
    from rollart_nb.train import run_train

    result = run_train(cfg, quiet=quiet)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def _demo(args: argparse.Namespace) -> int:
    return _run(demo_train_config(args), args.quiet)


# -- train -----------------------------------------------------------------------------------
def _add_train(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser(
        "train",
        help="a training run from a YAML config with NAME=VALUE overrides",
        description="Run a TrainConfig (model, tasks, algo, pipeline, budget) on Session.local(): "
        "CONFIG is a YAML file (settings it leaves out take their defaults), then each NAME=VALUE "
        "override (values are YAML: 8, 5e-4, true, null, [a, b]). Writes steps.jsonl as it goes, "
        "config.yaml, report.html and curves.svg to `out`, and ends with RESULT {json}. "
        "Example: rollart-nb train rollart_nb/configs/demo.yaml algo.lr=5e-4 pipeline.alpha=1",
        usage="%(prog)s [CONFIG.yaml] [NAME=VALUE ...] [options]",
        formatter_class=_Help,
    )
    t.add_argument("config", nargs="?", help="a YAML file (default: every setting at its default)")
    _add_overrides(t)
    t.add_argument("--list-options", action="store_true", help="list every setting with its default and exit")
    t.add_argument("--print-config", action="store_true", help="print the resulting config as YAML and exit")
    t.set_defaults(fn=_train, check=_check_train, error=t.error)


def _check_train(args: argparse.Namespace) -> str | None:
    if args.config is not None and "=" in args.config and not os.path.exists(args.config):
        args.overrides.insert(0, args.config)  # no file, only overrides
        args.config = None
    return None


def _train(args: argparse.Namespace) -> int:
    from rollart_nb.config import describe, dump, load
    from rollart_nb.train import TrainConfig

    if args.list_options:
        for name, kind, default, doc in describe(TrainConfig):
            print(f"{name} ({kind}, default {json.dumps(default, default=str)})")
            if doc:
                print("    " + " ".join(doc.split()))
        return 0
    cfg = load(TrainConfig, args.config, args.overrides)
    if args.print_config:
        print(dump(cfg), end="")
        return 0
    return _run(cfg, args.quiet)


# -- bench -----------------------------------------------------------------------------------
def _add_bench(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser(
        "bench",
        help="what-if experiments on a simulated cluster (sim backend)",
        description="The RollArt paper's experiments on simulated clusters, next to the paper's "
        "numbers; ends with RESULT {json}.",
        formatter_class=_Help,
    )
    b.add_argument("experiment", nargs="?", help="an experiment or its alias, or 'all' (default: list the experiments)")
    b.add_argument("--list", action="store_true", help="list the experiments and exit")
    b.add_argument("--out", default="rollart_bench", help="directory for the figures")
    b.add_argument("--quick", action="store_true", help="fewer configurations and steps (a smoke run)")
    b.set_defaults(fn=_bench, check=_check_bench, error=b.error)


def _experiments() -> list[tuple[str, list[str], str]]:
    """(name, aliases, one-line description) of every experiment."""
    from rollart_nb.bench import _ALIASES, EXPERIMENTS

    return [
        (name, [a for a, n in _ALIASES.items() if n == name], (fn.__doc__ or "").strip().splitlines()[0])
        for name, fn in EXPERIMENTS.items()
    ]


def _check_bench(args: argparse.Namespace) -> str | None:
    if args.list or args.experiment is None or args.experiment == "all":
        return None
    known = [(name, *aliases) for name, aliases, _ in _experiments()]
    if not any(args.experiment in names for names in known):
        return (
            f"unknown experiment {args.experiment!r}; choose 'all' or one of "
            f"{', '.join(n[0] for n in known)} (rollart-nb bench --list)"
        )
    return None


def _bench(args: argparse.Namespace) -> int:
    if args.list or args.experiment is None:
        rows = [(name, ", ".join(aliases), doc.replace("``", "")) for name, aliases, doc in _experiments()]
        rows.append(("all", "", "every experiment above, in this order"))
        w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
        for name, aliases, doc in rows:
            print(f"{name:<{w0}}  {aliases:<{w1}}  {doc}")
        return 0
    from rollart_nb.bench import run_experiments

    result = run_experiments(args.experiment, out=args.out, quick=args.quick)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# -- env-server ------------------------------------------------------------------------------
def _add_env_server(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser(
        "env-server",
        help="serve an env class over HTTP/JSON (protocol v1) for RemoteEnv",
        description="Serve an env class over HTTP/JSON (protocol v1); prints LISTENING <url> "
        "once it accepts connections.",
        usage="%(prog)s --env MODULE:CLASS [options]",
        formatter_class=_Help,
    )
    e.add_argument(
        "--env",
        required=True,
        metavar="MODULE:CLASS",
        help="env class to serve, e.g. rollart_nb.envs:FrozenLake (required)",
    )
    e.add_argument(
        "--kwargs", type=_json_object, default="{}", help="JSON object of constructor arguments, e.g. '{\"size\": 4}'"
    )
    e.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 only inside a pod)")
    e.add_argument("--port", type=_whole(0), default=8000, help="port; 0 picks a free one (see the LISTENING line)")
    e.add_argument("--task", help="task name reported by /v1/metadata (default: none)")
    e.add_argument("--replica-id", help="name of this replica in answers (default: host:port)")
    e.add_argument("--max-episodes", type=_whole(1), default=256, help="concurrent episodes before 503")
    e.add_argument(
        "--idle-timeout", type=_number(0, above=True), default=600.0, help="seconds before an idle episode closes"
    )
    e.add_argument("--threads", type=_whole(1), default=8, help="threads for sync env methods")
    e.add_argument("--max-body-bytes", type=_whole(1), default=1 << 20, help="larger request bodies get 413")
    e.add_argument("--exit-with-parent", action="store_true", help="stop when the starting process dies")
    e.set_defaults(fn=_env_server, check=_check_port, error=e.error)


def _check_port(args: argparse.Namespace) -> str | None:
    return f"--port {args.port} is not a port (0-65535)" if args.port > 65535 else None


def _env_server(args: argparse.Namespace) -> int:
    import asyncio

    from rollart_nb.envs.server import EnvServer, load_env_factory, serve

    server = EnvServer(
        load_env_factory(args.env, args.kwargs),
        task=args.task,
        replica_id=args.replica_id,
        max_episodes=args.max_episodes,
        idle_timeout_s=args.idle_timeout,
        threads=args.threads,
        max_body_bytes=args.max_body_bytes,
    )
    asyncio.run(serve(server, args.host, args.port, exit_with_parent=args.exit_with_parent))
    return 0


# -- entry point -----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``rollart-nb`` argument parser (every flag with its help and default)."""
    p = argparse.ArgumentParser(
        prog="rollart-nb",
        formatter_class=_Help,
        description="rollart_nb from a shell: the main job (demo), what-if experiments on a "
        "simulated cluster (bench), a run from a YAML config (train), and an env served over HTTP (env-server).",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _add_demo(sub)
    _add_train(sub)
    _add_bench(sub)
    _add_env_server(sub)
    return p


def _one_line(err: BaseException) -> str:
    """A (possibly multi-problem) error message on one line."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return " ".join(lines[:1] + ["; ".join(ln.removeprefix("- ") for ln in lines[1:])]).strip()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rollart-nb`` script; returns the exit status.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        problem = args.check(args)
        if problem:
            args.error(problem)
    except SystemExit as e:  # --help, --version, or a usage error (status 2)
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    logging.basicConfig(
        level=os.environ.get("ROLLART_LOG", "WARNING"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for h in logging.getLogger().handlers:
        h.addFilter(RedactingFilter())
    try:
        return args.fn(args)
    except RollartError as e:  # messages say what to do; a traceback would bury that
        print(f"error: {_one_line(e)}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
