"""Typed configuration: frozen dataclasses, a docstring per field, YAML files and dotted overrides.

Every setting of a run lives in one frozen dataclass, documented where it is declared (the
docstring under each field, as in cleanrl's ``Args``), validated in one place that reports every
problem at once (:class:`~rollart_nb.errors.ConfigError`):

- :class:`PipelineConfig`: the loop (batch size, staleness, mode, redundancy, checkpoints,
  failover, trackers) and its :class:`~rollart_nb.control.env_manager.RolloutConfig`;
  :class:`~rollart_nb.algo.GRPO`: the algorithm; :class:`~rollart_nb.train.TrainConfig`: a whole
  ``rollart-nb train`` run (model, tasks, algorithm, pipeline, budget).

The helpers here work on any of them: :func:`load` reads YAML and applies ``a.b=value``
overrides, :func:`to_dict` / :func:`from_dict` / :func:`dump` round-trip them, :func:`describe`
lists every field with its default and docstring (``rollart-nb train --list-options``).

Example:
    >>> from rollart_nb.config import PipelineConfig, apply_overrides
    >>> cfg = apply_overrides(PipelineConfig(), ["alpha=2", "rollout.max_turns=8"])
    >>> cfg.alpha, cfg.rollout.max_turns
    (2, 8)
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rollart_nb._checks import is_number, is_whole
from rollart_nb.config_docs import field_docs
from rollart_nb.envs.base import DEFAULT_MAX_REPLACEMENTS
from rollart_nb.errors import ConfigError, brief

__all__ = [
    "DISPATCH",
    "FAILED_POLICIES",
    "WEIGHTS",
    "PipelineConfig",
    "RolloutConfig",
    "apply_overrides",
    "describe",
    "dump",
    "field_docs",
    "from_dict",
    "load",
    "portable",
    "to_dict",
]

T = TypeVar("T")

DISPATCH = ("direct", "batched")
WEIGHTS = ("direct", "object_store", "mooncake")
FAILED_POLICIES = ("exclude", "penalize")
TRACKERS = ("tensorboard", "wandb", "mlflow")


@dataclass(frozen=True)
class RolloutConfig:
    """How EnvManagers talk to envs and the model (every bad value is reported at once).

    Example:
        >>> RolloutConfig(max_turns=1, temperature=0).max_new_tokens
        32
    """

    max_turns: int = 16
    """Turns per trajectory unless the env says less (``env.max_turns``)."""
    max_new_tokens: int = 32
    """Response budget per turn, in tokens."""
    max_context: int = 4096
    """Tokens of history after which the trajectory is truncated."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    env_timeout_s: float | None = 60.0
    """An env ``reset``/``step`` slower than this fails the trajectory; a sync call still running
    then is abandoned and the env replaced. None: wait forever (a hung env then holds its
    EnvManager for good)."""
    max_abandoned_threads: int = DEFAULT_MAX_REPLACEMENTS
    """Hung sync env calls whose threads are replaced by new ones (the env thread pool's cap is one
    thread per env plus this). At the cap the pool stops growing, says so in the log and in
    ``stats()["env"]["at_cap"]``, and env calls wait for a thread."""
    user_tag: str = "<|user|>"
    """Chat marker before an observation."""
    assistant_tag: str = "<|assistant|>"
    """Chat marker before a response."""

    def __post_init__(self) -> None:
        p = []
        for name, low in (("max_turns", 1), ("max_new_tokens", 1), ("max_abandoned_threads", 0)):
            value = getattr(self, name)
            if not is_whole(value) or value < low:
                p.append(f"{name}={value!r} must be a whole number >= {low}")
        if is_whole(self.max_new_tokens) and self.max_new_tokens >= 1:
            if not is_whole(self.max_context) or self.max_context < self.max_new_tokens:
                p.append(
                    f"max_context={self.max_context!r} must be a whole number >= max_new_tokens="
                    f"{self.max_new_tokens} (a turn's response has to fit in the context)"
                )
        elif not is_whole(self.max_context) or self.max_context < 1:
            p.append(f"max_context={self.max_context!r} must be a whole number >= 1")
        if not is_number(self.temperature) or self.temperature < 0:
            p.append(f"temperature={self.temperature!r} must be a finite number >= 0 (0: greedy)")
        if self.env_timeout_s is not None and (not is_number(self.env_timeout_s) or self.env_timeout_s <= 0):
            p.append(
                f"env_timeout_s={self.env_timeout_s!r} must be a finite number of seconds > 0, or None to wait forever"
            )
        for name in ("user_tag", "assistant_tag"):
            if not isinstance(getattr(self, name), str):
                p.append(f"{name}={getattr(self, name)!r} must be a string")
        if p:
            raise ConfigError(p, where="RolloutConfig")


@dataclass(frozen=True)
class PipelineConfig:
    """The settings of a pipeline's loop (everything but the workers, the tasks and the algorithm).

    ``sess.pipeline(train, gen, tasks, config=PipelineConfig(...))``, or the same names as keyword
    arguments, or both (keywords override the config). ``pipe.config`` is what is in force.

    Example:
        >>> PipelineConfig(batch_size=16, alpha=2).mode
        'rollart'
    """

    batch_size: int = 32
    """Trajectories per training step; a multiple of the algorithm's group size."""
    alpha: int = 1
    """Per-trajectory staleness bound: a trajectory whose oldest turn is more than ``alpha``
    versions behind the trainer is aborted (0: fully on-policy)."""
    staleness: str = "drop"
    """What happens to a trajectory that passes ``alpha`` (:mod:`~rollart_nb.control.staleness`):
    "drop" (aborted, the default), "wait" (a batch waits for it), "pace" (groups open only for the
    next batch), "cancel" (only its turn in flight restarts) or "correct" (trained, importance-weighted)."""
    wait_s: float = 10.0
    """The "wait" staleness policy's longest hold of a step's batch, in seconds."""
    mode: str = "rollart"
    """Pipeline mode: "sync", "sync+", "one-off", "areal" or "rollart" (the six-step protocol)."""
    redundancy: int = 0
    """Extra members launched per GRPO group; the slowest are cancelled once the group is complete."""
    seed: int | None = None
    """Seeds env seeds and task sampling; None: the session's seed (a resumed run draws fresh ones)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """How env managers talk to envs and the model (turns, tokens, temperature, env timeouts)."""
    validate_every: int = 0
    """Steps between greedy validations on each task's validation seeds (0: only when asked). A
    validation runs after its step's time is taken and holds the rollout meanwhile (no new
    trajectory or training turn), so it is in neither ``step_s`` nor tokens/s."""
    validation_seeds: dict[str, list[int]] | None = None
    """Task -> validation seeds; None: each env's own ``validation_seeds()``."""
    validate_pass_k: int = 0
    """With k >= 2, each periodic validation also samples every validation seed k times at the
    rollout's temperature (``pipe.pass_at(k)``): ``StepReport.pass_k`` holds pass@1 and pass@k
    per task. It costs about k greedy validations. 0: greedy only."""
    pd: bool = False
    """Prefill/decode disaggregation on the generator cluster (workers split into P and D)."""
    max_inflight: int = 256
    """Turns in flight per generator worker at most (the proxy's admission limit)."""
    dispatch: str = "direct"
    """How turns reach generators: "direct" (one actor call a turn) or "batched" (streamed: one call
    at a time per worker carries every queued turn and brings back every finished one; see
    :mod:`rollart_nb.workers.streaming`). Batched keeps an engine full with far less CPU a turn."""
    rollout_shards: int | None = None
    """Rollout actors (one CPU-pool slot each) the envs are split over; each runs a disjoint slice of
    every task's envs and supplies a fixed part of each batch (whole groups), so batches, groups and
    the staleness bound are what one actor gives. None: one per 1024 envs (rounded up), within the
    CPU pool's free slots and the batch's groups; ``pipe.stats()["shards"]`` shows each share."""
    step_timeout_s: float | None = None
    """A step whose batch is not complete after this many seconds raises; None: wait."""
    weights: Any = "direct"
    """Weight sync: "direct" (trainer to generators), "object_store" or "mooncake" (a bucketed
    transport), or a transport object."""
    hw_affinity: bool = True
    """Route each task's trajectories to the generator pool its env is bound to."""
    failed_trajectories: str = "exclude"
    """What training does with a failed trajectory. "exclude": never trained on; its GRPO group runs
    a replacement member (same seed, current policy). "penalize": one whose env step or reward raised
    or timed out after the model acted is a member of its group with reward ``failure_reward``,
    counted ``completed`` and ``penalized``, its reason kept; other failures are excluded either way.
    Timeouts count as the model's doing: with an env pool overloaded or a reward endpoint down,
    "penalize" trains on the outage."""
    failure_reward: float = 0.0
    """The reward a penalized failed trajectory gets (``failed_trajectories="penalize"``)."""
    max_group_failures: int = 16
    """Failed members after which a GRPO group is given up for a fresh one (its env keeps failing)."""
    run_dir: str | None = None
    """Folder of ``steps.jsonl`` (a line per step) and autosaves; None: ``runs/<name>`` when
    ``autosave_every`` > 0, else nothing is written."""
    autosave_every: int = 0
    """A checkpoint in ``run_dir/checkpoints/`` every N steps and when paused or closed (0: off)."""
    keep_checkpoints: int = 3
    """Autosaves kept (the newest)."""
    max_worker_restarts: int = 3
    """Automatic replacements of a dead generator, or restores of a dead trainer, per worker slot."""
    health_every_s: float = 5.0
    """How often a step waiting for its batch probes the workers for deaths."""
    trackers: tuple[Any, ...] = ()
    """Experiment trackers: "tensorboard", "wandb", "mlflow" or tracker objects."""
    tracker_sample_every: int = 10
    """Every N steps, trackers also get a table of a few of the step's trajectories (0: never)."""
    tracker_sample_size: int = 4
    """Trajectories in that table (spread over the batch, so over its tasks)."""

    def __post_init__(self) -> None:
        if isinstance(self.rollout, Mapping):  # a nested mapping (YAML) becomes its dataclass
            object.__setattr__(self, "rollout", from_dict(RolloutConfig, self.rollout, where="rollout"))
        if isinstance(self.trackers, str):
            object.__setattr__(self, "trackers", (self.trackers,))
        elif isinstance(self.trackers, list):
            object.__setattr__(self, "trackers", tuple(self.trackers))
        if isinstance(self.run_dir, os.PathLike):
            object.__setattr__(self, "run_dir", os.fspath(self.run_dir))
        problems = self.problems()
        if problems:
            raise ConfigError(problems, where="pipeline config")

    def problems(self) -> list[str]:
        """Every invalid value, as a list of messages (empty when the config is valid)."""
        p: list[str] = []

        def whole(name: str, low: int, note: str = "") -> None:
            v = getattr(self, name)
            if not is_whole(v) or v < low:
                p.append(f"{name}={v!r} must be a whole number >= {low}{note}")

        def seconds(name: str, *, optional: bool) -> None:
            v = getattr(self, name)
            if (v is None and not optional) or (v is not None and not (is_number(v) and math.isfinite(v) and v > 0)):
                p.append(f"{name}={v!r} must be a number of seconds > 0" + (" or None" if optional else ""))

        whole("batch_size", 1)
        whole("alpha", 0, " (a number of versions)")
        whole("redundancy", 0)
        whole("max_group_failures", 1)
        whole("validate_every", 0, " (0: off)")
        whole("validate_pass_k", 0, " (0: greedy validation only)")
        if self.validate_pass_k == 1:
            p.append("validate_pass_k=1 is greedy validation's pass@1 again: use 0, or k >= 2 for pass@k")
        whole("max_inflight", 1)
        if self.rollout_shards is not None:
            whole("rollout_shards", 1, " or None (one per 1024 envs)")
            if is_whole(self.rollout_shards) and is_whole(self.batch_size) and self.rollout_shards > self.batch_size:
                p.append(
                    f"rollout_shards={self.rollout_shards} must be <= batch_size={self.batch_size}: each shard "
                    "supplies at least one group of every batch"
                )
        whole("autosave_every", 0, " (0: off)")
        whole("keep_checkpoints", 1)
        whole("max_worker_restarts", 0)
        whole("tracker_sample_every", 0, " (0: never)")
        whole("tracker_sample_size", 1)
        seconds("step_timeout_s", optional=True)
        seconds("health_every_s", optional=False)
        seconds("wait_s", optional=False)
        return p + self._choice_problems()

    def _choice_problems(self) -> list[str]:
        """The invalid names, flags, objects and mappings (:meth:`problems` checks the numbers)."""
        from rollart_nb.control.modes import MODES, Mode
        from rollart_nb.control.staleness import POLICIES

        p: list[str] = []

        if not (isinstance(self.mode, Mode) or self.mode in MODES):
            close = difflib.get_close_matches(str(self.mode), list(MODES), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            p.append(f"mode={self.mode!r} must be one of {', '.join(MODES)}{hint}")
        if self.staleness not in POLICIES:
            p.append(f"staleness={brief(self.staleness)} must be one of {', '.join(POLICIES)}")
        if self.seed is not None and not is_whole(self.seed):
            p.append(f"seed={self.seed!r} must be a whole number or None")
        if self.dispatch not in DISPATCH:
            p.append(f"dispatch={self.dispatch!r} must be one of {', '.join(DISPATCH)}")
        if self.failed_trajectories not in FAILED_POLICIES:
            p.append(
                f"failed_trajectories={brief(self.failed_trajectories)} must be one of {', '.join(FAILED_POLICIES)}"
            )
        fr = self.failure_reward
        if not (is_number(fr) and not isinstance(fr, bool) and math.isfinite(fr)):
            p.append(f"failure_reward={brief(fr)} must be a finite number")
        if isinstance(self.weights, str) and self.weights not in WEIGHTS:
            p.append(f"weights={self.weights!r} must be one of {', '.join(WEIGHTS)} or a transport object")
        for name in ("pd", "hw_affinity"):
            if not isinstance(getattr(self, name), bool):
                p.append(f"{name}={getattr(self, name)!r} must be True or False")
        if not isinstance(self.rollout, RolloutConfig):
            p.append(f"rollout={brief(self.rollout)} must be a RolloutConfig (or a mapping of its fields)")
        elif is_whole(self.validate_pass_k) and self.validate_pass_k > 1 and not self.rollout.temperature > 0:
            p.append(
                f"validate_pass_k={self.validate_pass_k} samples: rollout.temperature must be > 0, "
                f"got {self.rollout.temperature}"
            )
        if self.validation_seeds is not None:
            vs = self.validation_seeds
            if not isinstance(vs, Mapping) or not all(
                isinstance(k, str) and isinstance(s, list | tuple) and all(is_whole(x) for x in s)
                for k, s in vs.items()
            ):
                p.append(f"validation_seeds={brief(vs)} must map task names to lists of whole numbers")
        if self.run_dir is not None and not isinstance(self.run_dir, str):
            p.append(f"run_dir={self.run_dir!r} must be a path or None")
        for t in self.trackers:
            if isinstance(t, str) and t not in TRACKERS:
                close = difflib.get_close_matches(t, TRACKERS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                p.append(f"trackers: {t!r} is not a tracker name; use {', '.join(TRACKERS)} or a Tracker object{hint}")
        return p

    def replace(self, **changes: Any) -> PipelineConfig:
        """A copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **changes)


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _hints(cls: type) -> dict[str, Any]:
    module = sys.modules.get(cls.__module__)
    return typing.get_type_hints(cls, vars(module) if module else None)


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


# -- dict <-> dataclass ---------------------------------------------------------------------------
def to_dict(cfg: Any) -> Any:
    """``cfg`` as plain data (dicts, lists, scalars): what :func:`dump` writes and :func:`from_dict`
    reads back. Objects that are not data (a tracker or transport object) appear as their repr."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if type(cfg).__name__ == "Mode" and hasattr(cfg, "name"):  # control.modes.Mode
        return cfg.name
    if isinstance(cfg, Mapping):
        return {str(k): to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, list | tuple):
        return [to_dict(v) for v in cfg]
    if cfg is None or isinstance(cfg, bool | int | float | str):
        return cfg
    if isinstance(cfg, os.PathLike):
        return os.fspath(cfg)
    return repr(cfg)


def portable(cfg: PipelineConfig) -> dict[str, Any]:
    """``cfg`` as plain data that :func:`from_dict` reads back: tracker and transport objects,
    which are not data, are left out (a resumed pipeline gets them from its call)."""
    data = to_dict(cfg)
    data["trackers"] = [t for t in cfg.trackers if isinstance(t, str)]
    if not isinstance(cfg.weights, str):
        del data["weights"]
    return data


def from_dict(cls: type[T], data: Mapping[str, Any], *, where: str = "") -> T:
    """Build dataclass ``cls`` from plain data, nested dataclasses included. Unknown keys and every
    invalid value are reported together in one :class:`ConfigError` (with dotted names)."""
    label = where or cls.__name__
    if not isinstance(data, Mapping):
        raise ConfigError(f"{label} must be a mapping of field names to values, got {brief(data)}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    prefix = f"{where}." if where else ""
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; the fields are: {', '.join(names)}"
            problems.append(f"{prefix}{key} is not a setting of {cls.__name__}{hint}")
            continue
        tp = _unwrap_optional(hints.get(key))
        try:
            kwargs[key] = _convert(tp, value, f"{prefix}{key}")
        except ConfigError as e:
            problems.extend(e.problems)
    try:  # with a bad nested section left at its default, the rest is still checked
        out = cls(**kwargs)
    except ConfigError as e:
        problems.extend(f"{prefix}{p}" if prefix else p for p in e.problems)
    except TypeError as e:  # a required field is missing
        problems.append(str(e))
    if problems:
        raise ConfigError(problems, where=label)
    return out


def _convert(tp: Any, value: Any, where: str) -> Any:
    if _is_config(tp):
        if isinstance(value, Mapping):
            return from_dict(tp, value, where=where)
        if not isinstance(value, tp):
            raise ConfigError(f"{where} must be a mapping of {tp.__name__} settings, not {brief(value, 60)}")
    origin = typing.get_origin(tp)
    if origin in (dict, Mapping) and isinstance(value, Mapping):
        args = typing.get_args(tp)
        inner = _unwrap_optional(args[1]) if len(args) == 2 else None
        if inner is not None and _is_config(inner):
            out, problems = {}, []
            for k, v in value.items():
                try:
                    out[k] = from_dict(inner, v if v is not None else {}, where=f"{where}.{k}")
                except ConfigError as e:
                    problems.extend(e.problems)
            if problems:
                raise ConfigError(problems)
            return out
        return dict(value)
    if origin is tuple and isinstance(value, list):
        return tuple(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


# -- YAML and overrides ---------------------------------------------------------------------------
def _parse_value(text: str) -> Any:
    """An override's value: YAML (``8``, ``true``, ``null``, ``[a, b]``, ``{a: 1}``), with the
    exponent floats YAML 1.1 reads as strings (``5e-4``) read as numbers."""
    import yaml

    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value) if value.strip().lower() not in ("nan", "inf", "-inf", "infinity") else value
        except ValueError:
            return value
    return value


def _paths(cls: type, prefix: str = "") -> list[str]:
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp = _unwrap_optional(hints.get(f.name))
        out.append(prefix + f.name)
        if _is_config(tp):
            out.extend(_paths(tp, f"{prefix}{f.name}."))
    return out


def apply_overrides(cfg: T, overrides: Sequence[str] | Mapping[str, Any]) -> T:
    """A copy of ``cfg`` with dotted overrides: ``["algo.lr=5e-4", "pipeline.rollout.max_turns=8"]``
    (values parsed as YAML) or ``{"algo.lr": 5e-4}``. Unknown names and bad values are reported
    together."""
    if isinstance(overrides, Mapping):
        pairs = list(overrides.items())
    else:
        pairs = []
        bad = [o for o in overrides if "=" not in o or not o.split("=", 1)[0].strip()]
        if bad:
            raise ConfigError(
                [f"override {o!r} must look like name=value, e.g. alpha=2 or rollout.max_turns=8" for o in bad],
                where="overrides",
            )
        for o in overrides:
            k, v = o.split("=", 1)
            pairs.append((k.strip(), _parse_value(v)))
    data = to_dict(cfg)
    problems = []
    known = _paths(type(cfg))
    for key, value in pairs:
        node, parts = data, key.split(".")
        ok = True
        for i, part in enumerate(parts[:-1]):
            child = node.get(part) if isinstance(node, dict) else None
            if child is None and isinstance(node, dict) and ".".join(parts[: i + 1]) in known:
                child = node[part] = {}  # an optional section (None) being filled in
            if not isinstance(child, dict):
                ok = False
                break
            node = child
        if not ok or not isinstance(node, dict) or (parts[-1] not in node and key not in known):
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"{key} is not a setting{hint} (rollart-nb train --list-options lists them)")
            continue
        node[parts[-1]] = value
    try:
        out = from_dict(type(cfg), data)
    except ConfigError as e:
        raise ConfigError(problems + e.problems, where="overrides") from None
    if problems:
        raise ConfigError(problems, where="overrides")
    return out


def load(cls: type[T], path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()) -> T:
    """``cls`` from a YAML file (its defaults for what the file leaves out; no file: the defaults),
    then ``overrides``. A missing file, a YAML syntax error, an unknown key and every bad value
    raise :class:`ConfigError` naming the file."""
    import yaml

    data: Any = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist (or is not a file)")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p} is not valid YAML: {e}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"{p} must hold a mapping of settings at the top level, not {type(data).__name__}")
    cfg = from_dict(cls, data, where=str(Path(path)) if path is not None else "")
    return apply_overrides(cfg, overrides) if overrides else cfg


def dump(cfg: Any, path: str | os.PathLike[str] | None = None) -> str:
    """``cfg`` as YAML (written to ``path`` if given); :func:`load` reads it back equal."""
    import yaml

    text = yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)
    if path is not None:
        Path(path).write_text(text)
    return text


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """``(dotted name, type, default, docstring)`` for every field of ``cls``, nested ones included."""
    out: list[tuple[str, str, Any, str]] = []
    hints = _hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp = hints.get(f.name)
        inner = _unwrap_optional(tp)
        if _is_config(inner):
            out.extend(describe(inner, f"{prefix}{f.name}."))
            continue
        factory = f.default_factory
        default = f.default if factory is dataclasses.MISSING else factory()
        name = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
        out.append((prefix + f.name, name, to_dict(default), docs.get(f.name, "")))
    return out
