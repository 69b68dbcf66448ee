"""Experiment trackers: every :class:`~rollart_nb.control.report.StepReport` of a pipeline goes to
TensorBoard, Weights & Biases, MLflow, or your own.

A tracker is any object with ``start(config)``, ``log_step(report)`` and ``close()``
(:class:`Tracker` has no-op defaults); one that raises is reported once and dropped. The
built-in adapters need the ``trackers`` extra. See ``docs/trackers.md``.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_nb.errors import ConfigError, StateError
from rollart_nb.redact import MASK, redact
from rollart_nb.trajectory_frames import rows

if TYPE_CHECKING:
    from rollart_nb.control.report import StepReport

__all__ = [
    "SAMPLE_COLUMNS",
    "MLflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "resolve_trackers",
    "sample_rows",
    "step_scalars",
]

_EXTRA = "pip install 'rollart_nb[trackers]'"
# Config keys whose values are never sent to a tracker (the values become "***").
_SECRET_KEY = re.compile(r"(?i)token|api[_-]?key|apikey|password|passwd|secret|credential")


class Tracker:
    """Base of experiment trackers (subclass and override what you need).

    ``failed`` is set by the pipeline once the tracker raised; it then gets no more steps.
    """

    failed = False

    def start(self, config: dict[str, Any]) -> None:
        """Called once, before the first step, with the run's parameters."""

    def log_step(self, report: StepReport) -> None:
        """Called after every step."""

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Called every ``tracker_sample_every`` steps with a few trajectories of the step's
        batch as table rows (:data:`SAMPLE_COLUMNS`; text redacted)."""

    def close(self) -> None:
        """Called when the pipeline closes."""


SAMPLE_COLUMNS = (
    "id",
    "task",
    "status",
    "reward",
    "min_version",
    "max_version",
    "turns",
    "tokens",
    "prompt",
    "response",
    "advantage",
    "mismatch_kl",
    "token_ids",
    "versions",
    "sampler_logprobs",
    "trainer_logprobs",
    "entropies",
)
"""The columns of a trajectory sample: ``prompt`` is the first observation, ``response`` the last
turn's decoded response; ``advantage`` and ``mismatch_kl`` (the mean k3 KL from the sampler to
the trainer over its trained tokens) come from the train step that consumed it (None before),
and the last five are its first :data:`SAMPLE_TOKENS` trained tokens' figures from the token
frame, as JSON lists (rounded; null where unknown)."""

SAMPLE_TOKENS = 256
"""Trained tokens per sampled trajectory whose per-token figures a tracker gets."""


def _token_columns(t: Any) -> dict[str, Any]:
    """A sample's per-token columns (see :data:`SAMPLE_COLUMNS`)."""
    toks = [r for r in rows([t], "token") if r["loss_mask"]]
    k3 = [r["importance_ratio"] - 1 - math.log(r["importance_ratio"]) for r in toks if r["importance_ratio"] > 0]
    train = getattr(t, "train", None) or {}

    def col(key: str) -> str:
        vals = [r[key] for r in toks[:SAMPLE_TOKENS]]
        return json.dumps([v if isinstance(v, int) else _num(v, 4) for v in vals], separators=(",", ":"))

    return {
        "advantage": _num(train.get("advantage", math.nan), 4),
        "mismatch_kl": _num(sum(k3) / len(k3), 6) if k3 else None,
        "token_ids": col("token_id"),
        "versions": col("version"),
        "sampler_logprobs": col("sampler_logprob"),
        "trainer_logprobs": col("trainer_logprob"),
        "entropies": col("entropy"),
    }


def _num(v: float, digits: int) -> float | None:
    return round(float(v), digits) if math.isfinite(v) else None


def sample_rows(trajectories: list[Any], k: int) -> list[dict[str, Any]]:
    """Up to ``k`` of ``trajectories``, spread over the list (so over its tasks), as table rows
    with redacted text."""
    if k <= 0 or not trajectories:
        return []
    stride = max(1, len(trajectories) // k)
    out = []
    for t in trajectories[::stride][:k]:
        turns = list(getattr(t, "turns", []))
        out.append(
            {
                "id": str(t.id),
                "task": str(t.task),
                "status": str(getattr(t.status, "value", t.status)),
                "reward": float(t.reward) if t.reward == t.reward else None,  # NaN (unscored): None
                "min_version": int(t.min_version),
                "max_version": int(t.max_version),
                "turns": len(turns),
                "tokens": int(t.num_tokens),
                "prompt": redact(str(turns[0].observation))[:2000] if turns else "",
                "response": redact(str(turns[-1].action))[:2000] if turns else "",
                **_token_columns(t),
            }
        )
    return out


def _markdown_table(rows: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        return str(v).replace("|", "&#124;").replace("\n", " ")

    head = "| " + " | ".join(SAMPLE_COLUMNS) + " |\n|" + "---|" * len(SAMPLE_COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(cell(r[c]) for c in SAMPLE_COLUMNS) + " |\n" for r in rows)


def step_scalars(report: StepReport) -> dict[str, float]:
    """The numbers of a step as flat ``group/name -> value`` pairs (what trackers plot)."""
    out: dict[str, float] = {
        "step/seconds": report.step_s,
        "step/tokens_per_s": report.throughput,
        "step/version": float(report.version),
        "step/batch_size": float(report.batch_size),
    }
    out.update({f"reward/{k}": v for k, v in report.reward.items()})
    out.update({f"validation/{k}": v for k, v in report.validation.items()})
    out.update({f"validation/{t}/{k}": v for t, ks in report.pass_k.items() for k, v in ks.items()})
    out.update({f"phase/{k}": v for k, v in report.phases.items()})
    out.update({f"count/{k}": float(v) for k, v in report.counts.items()})
    out.update({f"env/{k}": float(v) for k, v in report.env.items()})
    out.update({f"train/{k}": v for k, v in report.train.items()})
    out.update({f"weights/{k}": v for k, v in report.weights.items()})
    out.update({f"waste/{k}": v for k, v in report.waste.items()})  # aborted, renewed tokens; waited seconds
    out["failover/events"] = float(len(report.events))
    n = sum(report.staleness.values())
    if n:  # version gaps of the trained batch (policy version - trajectory start version)
        out["staleness/mean"] = sum(int(g) * c for g, c in report.staleness.items()) / n
        out["staleness/max"] = float(max(int(g) for g in report.staleness))
    return {k: float(v) for k, v in out.items() if isinstance(v, int | float)}


def _safe_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, bool | int | float | str | None]:
    """``config`` flattened (``a.b`` keys) to scalars and strings, with secrets masked.

    A value under a secret-looking key (token, api_key, password, ...) becomes ``***``; strings
    pass through :func:`~rollart_nb.redact.redact` (credentials in URLs, bearer tokens).
    """
    out: dict[str, bool | int | float | str | None] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_safe_config(v, prefix=f"{key}."))
        elif _SECRET_KEY.search(key):
            out[key] = MASK
        elif v is None or isinstance(v, bool | int | float):
            out[key] = v
        else:
            out[key] = redact(v if isinstance(v, str) else json.dumps(v, default=str))
    return out


def _redact_tree(x: Any) -> Any:
    """``x`` (JSON-like) with every string redacted; other leaves become JSON-safe."""
    if isinstance(x, Mapping):
        return {str(k): _redact_tree(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_redact_tree(v) for v in x]
    return x if x is None or isinstance(x, bool | int | float) else redact(str(x))


def _event_text(e: dict[str, Any]) -> str:
    """One failover event as a line of markdown."""
    return redact(
        f"**{e.get('kind', '?')}**: {e.get('worker', '')} on {e.get('pool', '')} "
        f"(version {e.get('version')}): {str(e.get('reason', ''))[:500]}"
    )


def _check_running(tracker: Tracker, running: bool) -> None:
    if not running:
        raise StateError(f"{tracker!r} is not running: call start(config) first, once")


def _missing(what: str, package: str, e: ImportError) -> ConfigError:
    return ConfigError(
        f"{what} needs the {package!r} package, which is not installed ({e}); install the trackers extra: {_EXTRA}"
    )


class TensorBoardTracker(Tracker):
    """Writes every step to TensorBoard event files in ``log_dir``.

    Logged: :func:`step_scalars` per step, the parameters (tag ``config``), failover events.

    Example:
        >>> pipe = sess.pipeline(train, gen, tasks, trackers=["tensorboard"])  # doctest: +SKIP
        >>> # then: tensorboard --logdir <run_dir>/tensorboard
    """

    def __init__(self, log_dir: str | os.PathLike[str], run_name: str | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise _missing("TensorBoardTracker", "tensorboard", e) from e
        self.log_dir, self.run_name = Path(log_dir), run_name
        self._writer_cls = SummaryWriter
        self._writer: Any = None

    def _open(self) -> Any:
        if self._writer is None:
            self._writer = self._writer_cls(log_dir=str(self.log_dir))
        return self._writer

    def start(self, config: dict[str, Any]) -> None:
        rows = "".join(f"| {k} | {str(v).replace('|', '&#124;')} |\n" for k, v in _safe_config(config).items())
        self._open().add_text("config", f"| parameter | value |\n|---|---|\n{rows}", global_step=0)

    def log_step(self, report: StepReport) -> None:
        w = self._open()
        for k, v in step_scalars(report).items():
            w.add_scalar(k, v, global_step=report.step)
        if report.events:
            w.add_text("failover", "\n\n".join(_event_text(e) for e in report.events), global_step=report.step)
        w.flush()

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        w = self._open()
        w.add_text("samples", _markdown_table(rows), global_step=step)
        w.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __repr__(self) -> str:
        return f"TensorBoardTracker(log_dir={str(self.log_dir)!r})"


def _wandb_has_credentials() -> bool:
    """Whether W&B could log in without a prompt: an API key or identity token in the
    environment, or a ``.netrc`` entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = Path(os.environ.get("NETRC", "~/.netrc")).expanduser()
    try:
        return path.is_file() and netrc.netrc(str(path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbTracker(Tracker):
    """Sends every step to a Weights & Biases run (one run per pipeline).

    ``mode`` defaults to ``$WANDB_MODE``, else ``"online"`` with W&B credentials and
    ``"offline"`` without (never a login prompt); ``init_kwargs`` go to ``wandb.init``.

    Example:
        >>> t = WandbTracker("runs/demo/wandb", run_name="demo", project="rl", tags=["grpo"])  # doctest: +SKIP
        >>> pipe = sess.pipeline(train, gen, tasks, trackers=[t])  # doctest: +SKIP
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        run_name: str | None = None,
        project: str = "rollart_nb",
        mode: str | None = None,
        **init_kwargs: Any,
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise _missing("WandbTracker", "wandb", e) from e
        self._wandb = wandb
        self.log_dir, self.run_name, self.project = Path(log_dir), run_name, project
        self.mode = mode or os.environ.get("WANDB_MODE") or ("online" if _wandb_has_credentials() else "offline")
        self.init_kwargs = init_kwargs
        self.run: Any = None
        """The ``wandb`` run, once started (kept after :meth:`close`: ``run.id``, ``run.dir``)."""
        self._ended = False

    def start(self, config: dict[str, Any]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        kwargs = {
            "project": self.project,
            "name": self.run_name,
            "dir": str(self.log_dir),
            "config": _safe_config(config),
            "mode": self.mode,
            "reinit": "create_new",
            **self.init_kwargs,
        }
        self.run = self._wandb.init(**kwargs)

    def log_step(self, report: StepReport) -> None:
        _check_running(self, self.run is not None and not self._ended)
        self.run.log(step_scalars(report), step=report.step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        _check_running(self, self.run is not None and not self._ended)
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[r[c] for c in SAMPLE_COLUMNS] for r in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        if self.run is not None and not self._ended:
            self._ended = True
            self.run.finish()

    def __repr__(self) -> str:
        return f"WandbTracker(project={self.project!r}, mode={self.mode!r}, log_dir={str(self.log_dir)!r})"


def _mlflow_key(name: str) -> str:
    """``name`` as a valid MLflow param/metric key: alphanumerics, ``_ - . /`` and spaces, no
    empty, ``.`` or ``..`` path segments, at most 250 characters."""
    parts = [p if p not in (".", "..") else "_" for p in re.sub(r"[^\w.\- /]", "_", name).split("/") if p]
    return "/".join(parts)[:250] or "_"


class MLflowTracker(Tracker):
    """Logs every step to an MLflow run (one run per pipeline, in ``experiment``).

    ``tracking_uri`` defaults to ``$MLFLOW_TRACKING_URI``, else ``<log_dir>/mlflow.db`` (SQLite).

    Example:
        >>> pipe = sess.pipeline(train, gen, tasks, trackers=["mlflow"])  # doctest: +SKIP
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        run_name: str | None = None,
        tracking_uri: str | None = None,
        experiment: str = "rollart_nb",
    ) -> None:
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise _missing("MLflowTracker", "mlflow-skinny", e) from e
        self.log_dir, self.run_name, self.experiment = Path(log_dir).absolute(), run_name, experiment
        self._local = not (tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
        self.tracking_uri = (
            tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.log_dir / 'mlflow.db'}"
        )
        if self.tracking_uri.startswith("sqlite:"):
            try:
                import alembic  # noqa: F401
                import sqlalchemy  # noqa: F401
            except ImportError as e:
                raise _missing(
                    f"MLflowTracker with a SQLite store ({self.tracking_uri})", "sqlalchemy/alembic", e
                ) from e
        self._client_cls, self._metric, self._param = MlflowClient, Metric, Param
        self.client: Any = None
        self.run_id: str | None = None
        """The MLflow run, once started (kept after :meth:`close`, to find it again)."""
        self._ended = False

    def start(self, config: dict[str, Any]) -> None:
        if self._local:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self.client = c = self._client_cls(self.tracking_uri)
        exp = c.get_experiment_by_name(self.experiment)
        if exp is None:
            try:
                exp_id = c.create_experiment(
                    self.experiment, artifact_location=(self.log_dir / "artifacts").as_uri() if self._local else None
                )
            except Exception:  # another pipeline created it meanwhile
                exp = c.get_experiment_by_name(self.experiment)
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
        self.run_id = c.create_run(exp_id, run_name=self.run_name).info.run_id
        params = [self._param(_mlflow_key(k), str(v)[:6000]) for k, v in _safe_config(config).items()]
        for i in range(0, len(params), 100):  # MLflow's limit per batch
            c.log_batch(self.run_id, params=params[i : i + 100])

    def log_step(self, report: StepReport) -> None:
        _check_running(self, self.run_id is not None and not self._ended)
        ts = int(time.time() * 1000)
        metrics = [self._metric(_mlflow_key(k), v, ts, report.step) for k, v in step_scalars(report).items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        if report.events:
            self.client.log_dict(self.run_id, _redact_tree(report.events), f"failover/step_{report.step:06d}.json")

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        _check_running(self, self.run_id is not None and not self._ended)
        table = {c: [r[c] for r in rows] for c in SAMPLE_COLUMNS}  # MLflow's table layout (columns)
        self.client.log_dict(self.run_id, table, f"samples/step_{step:06d}.json")

    def close(self) -> None:
        if self.run_id is not None and not self._ended:
            self._ended = True
            self.client.set_terminated(self.run_id)

    def __repr__(self) -> str:
        return f"MLflowTracker(tracking_uri={redact(self.tracking_uri)!r}, experiment={self.experiment!r})"


_BUILTIN: dict[str, Callable[..., Tracker]] = {
    "mlflow": MLflowTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
}
"""Tracker names accepted as strings -> their class."""


def resolve_trackers(trackers: Any, *, run_dir: str | os.PathLike[str] | None, name: str) -> list[Any]:
    """Tracker objects for ``trackers`` (None, a name, an object, or a list of them).

    A name is built with ``log_dir=<run_dir>/<name>`` (``runs/<pipeline>/<name>`` without a
    run folder) and ``run_name=<pipeline name>``.
    """
    if trackers is None:
        return []
    items = [trackers] if isinstance(trackers, str) or not isinstance(trackers, Iterable) else list(trackers)
    out = []
    for t in items:
        if isinstance(t, str):
            if t not in _BUILTIN:
                raise ConfigError(
                    f"trackers: unknown tracker {t!r}; use one of {sorted(_BUILTIN)} or an object with "
                    "start(config), log_step(report) and close()"
                )
            t = _BUILTIN[t](log_dir=Path(run_dir or Path("runs") / name) / t, run_name=name)
        if not all(callable(getattr(t, m, None)) for m in ("start", "log_step", "close")):
            raise ConfigError(f"trackers: {t!r} is not a tracker: it needs start(config), log_step(report) and close()")
        out.append(t)
    return out
