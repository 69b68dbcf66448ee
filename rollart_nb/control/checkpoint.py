"""Pipeline checkpoints: what ``pipe.save(path)`` writes and ``sess.pipeline(..., resume_from=path)`` reads.

Layout of a checkpoint directory::

    path/
      trainer/          the trainer's own checkpoint (TrainerWorker.save_checkpoint: model as a
                        servable HF directory, optimizer, version, RNG states)
      pipeline.json     step count, policy version, tasks, reward sources, scheduler seed, config,
                        and a manifest: size and SHA-256 of every other file

A checkpoint is written into a hidden sibling directory and renamed into place when complete
(no half checkpoint under ``path``); reading one checks every file against the manifest
(:class:`~rollart_nb.errors.CheckpointError` names a damaged file). A run folder
(``run_dir=..., autosave_every=N``) holds ``steps.jsonl`` and ``checkpoints/step-NNNNNN/``
autosaves (the newest ``keep``); ``resume_from=run_dir`` resumes from the newest complete one.
``path`` must be on a filesystem the trainer worker shares. Not saved: trajectories in flight or
buffered, and reward functions (their sources are recorded, so a resume warns when they differ).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rollart_nb.errors import CheckpointError, ConfigError, StateError

if TYPE_CHECKING:
    from rollart_nb.control.tasks import TaskSet

__all__ = [
    "FORMAT",
    "CheckpointingTrainer",
    "PipelineCheckpoint",
    "RunFolder",
    "latest_checkpoint",
    "read_checkpoint",
    "resolve_checkpoint",
    "run_checkpoints",
    "write_checkpoint",
]

log = logging.getLogger(__name__)

FORMAT = 2
"""Version of the ``pipeline.json`` layout (2 added the manifest; 1 is still read)."""

_META = "pipeline.json"
_TRAINER = "trainer"
_CKPTS = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class PipelineCheckpoint:
    """What a resume needs besides the trainer's own state (the contents of ``pipeline.json``).

    Attributes:
        path: the checkpoint directory.
        version: policy version of the saved trainer; a resumed pipeline serves it.
        steps: pipeline steps taken when saved; a resumed pipeline numbers its steps on from it.
        seed: the scheduler seed the saved pipeline ran with.
        tasks: task name -> env type name.
        rewards: task name -> source of the reward version in use when saved.
        config: mode, alpha, batch_size, group_size, name of the saved pipeline (for reference).
        saved_at: unix time of the save.
        format: layout version (:data:`FORMAT`).
        files: manifest, relative path -> [bytes, sha256] of every file but ``pipeline.json``.
    """

    path: str
    version: int
    steps: int
    seed: int
    tasks: dict[str, str] = field(default_factory=dict)
    rewards: dict[str, str] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    saved_at: float = 0.0
    format: int = FORMAT
    files: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def trainer_dir(self) -> str:
        """Directory of the trainer's checkpoint (also a servable HF model directory under ``model/``)."""
        return str(Path(self.path) / _TRAINER)

    @property
    def resume_seed(self) -> int:
        """Scheduler seed of a resumed pipeline: derived from the saved seed and step count, so
        it samples fresh env seeds instead of replaying the first run's (and does so reproducibly)."""
        return (self.seed * 1_000_003 + self.steps) % 2**31

    def check_tasks(self, tasks: TaskSet) -> None:
        """Raise ConfigError unless ``tasks`` has the saved task names."""
        have, want = set(tasks.envs), set(self.tasks)
        if have != want:
            problems = [f"task {t!r} is in the checkpoint but not in tasks" for t in sorted(want - have)]
            problems += [f"task {t!r} is in tasks but not in the checkpoint" for t in sorted(have - want)]
            raise ConfigError(
                problems + [f"resume with the saved tasks {sorted(want)}"], where=f"resume_from={self.path!r}"
            )

    def warn_reward_changes(self, rewards: dict[str, str]) -> list[str]:
        """Warn (and return the tasks) whose reward source differs from the saved one.

        ``rewards``: task -> source of the rewards set so far; a task without one gets the
        default reward (the env's return) when it first scores, and is compared as that.
        """
        from rollart_nb.control.reward import RewardDispatcher

        default = RewardDispatcher()
        changed = sorted(t for t, src in self.rewards.items() if rewards.get(t, default.spec(t).source) != src)
        if changed:
            warnings.warn(
                f"resuming {self.path!r} with different rewards for {changed} than when it was saved; "
                "set them with sess.reward(...) before sess.pipeline(...) if that is not intended",
                stacklevel=3,
            )
        return changed


def latest_reward_sources(history: list[dict[str, Any]]) -> dict[str, str]:
    """task -> source of the newest reward version, from ``pipe.reward_history()``."""
    out: dict[str, tuple[int, str]] = {}
    for h in history:
        v = int(h.get("version", 0))
        if h.get("task") is not None and (h["task"] not in out or v >= out[h["task"]][0]):
            out[h["task"]] = (v, str(h.get("source", "")))
    return {t: src for t, (_, src) in sorted(out.items())}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _manifest(d: Path) -> dict[str, list[Any]]:
    return {
        f.relative_to(d).as_posix(): [f.stat().st_size, _sha256(f)]
        for f in sorted(d.rglob("*"))
        if f.is_file() and f.relative_to(d).as_posix() != _META
    }


def _write_synced(path: Path, text: str, mode: str = "w") -> None:
    with path.open(mode) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CheckpointingTrainer(Protocol):
    """What :func:`write_checkpoint` needs of a trainer cluster (``TrainerWorker`` has both)."""

    def save_checkpoint(self, path: str) -> Any: ...

    def version(self) -> Any: ...


def write_checkpoint(
    path: str | os.PathLike[str],
    trainer: CheckpointingTrainer,
    *,
    steps: int,
    seed: int,
    tasks: dict[str, str],
    rewards: dict[str, str],
    config: dict[str, Any],
) -> PipelineCheckpoint:
    """Save ``trainer``'s checkpoint and a pipeline's resume metadata to ``path`` (the caller
    holds the pipeline's step lock). The other arguments are :class:`PipelineCheckpoint`'s fields.

    Written into a hidden sibling directory, checksummed, then renamed into place; an existing
    checkpoint at ``path`` stays whole until the new one is.
    """
    d = Path(path).absolute()
    made = next((p for p in reversed(d.parents) if not p.exists()), None)  # the first directory created here
    tmp = d.parent / f".{d.name}.tmp-{uuid.uuid4().hex[:8]}"
    done = False
    try:
        try:
            d.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        except OSError as e:
            raise ConfigError(
                f"cannot write a checkpoint to {str(d)!r} ({e.strerror or e}); give a path whose parent "
                "directories exist or can be created, and which this process and the trainer worker can write",
                where="checkpoint path",
            ) from None
        trainer.save_checkpoint(str(tmp / _TRAINER))
        ckpt = PipelineCheckpoint(
            path=str(d),
            version=int(trainer.version()),
            steps=steps,
            seed=seed,
            tasks=tasks,
            rewards=rewards,
            config=config,
            saved_at=time.time(),
            files=_manifest(tmp),
        )
        _write_synced(tmp / _META, json.dumps(asdict(ckpt), indent=1, sort_keys=True))
        _fsync_dir(tmp)
        old = d.parent / f".{d.name}.old-{uuid.uuid4().hex[:8]}"
        if d.exists():
            os.rename(d, old)  # from here to the next rename, read_checkpoint finds the old one
        os.rename(tmp, d)
        done = True
        _fsync_dir(d.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if not done:
            shutil.rmtree(made or tmp, ignore_errors=True)  # nothing half-written stays behind
        raise
    return ckpt


class RunFolder:
    """A pipeline's run folder (layout above): an autosave every ``every`` steps (0: never), the
    newest ``keep`` kept. ConfigError if ``path`` cannot be created."""

    def __init__(self, path: str | os.PathLike[str], every: int, keep: int) -> None:
        self.path, self.every, self.keep = Path(path).absolute(), every, keep
        self.last: str | None = None  # the newest autosave of this run
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"run_dir {str(self.path)!r} cannot be created ({e.strerror or e}); give a directory this process "
                "can write, or run_dir=None without autosave_every"
            ) from None

    @classmethod
    def of(cls, config: Any, name: str) -> RunFolder | None:
        """The run folder of pipeline ``name``'s config: its ``run_dir``, else ``runs/<name>``
        when it autosaves; None when neither."""
        path = config.run_dir if config.run_dir is not None or not config.autosave_every else Path("runs") / name
        if path is None:
            return None
        folder = cls(path, config.autosave_every, config.keep_checkpoints)
        every = f" and a checkpoint every {config.autosave_every} steps" if config.autosave_every else ""
        log.info("pipeline %s writes steps.jsonl%s to %s", name, every, folder.path)
        return folder

    def record(self, row: dict[str, Any]) -> None:
        """Append one StepReport's dict to ``steps.jsonl``."""
        _write_synced(self.path / "steps.jsonl", json.dumps(row, default=str) + "\n", mode="a")

    def due(self, step: int) -> bool:
        """Whether step ``step`` (0-based) ends with an autosave."""
        return bool(self.every) and (step + 1) % self.every == 0

    def autosave(self, steps: int, trained: Callable[[], int], served: int, write: Callable[[Path], Any]) -> str | None:
        """``write(path)`` the autosave after ``steps`` steps unless it is there already, and
        keep the newest ``keep``; returns the newest autosave's path. Not when the trainer's
        version (``trained()``) is behind the ``served`` one: it lost its state, and saving it
        would make the lost state the newest."""
        path = self.path / _CKPTS / f"step-{steps:06d}"
        if not self.every or self.last == str(path):
            return self.last if self.every else None
        if (version := trained()) < served:
            log.warning(
                "not autosaving to %s: the trainer is at version %d, behind the %d served (it lost its state); "
                "the newest good autosave stays %s",
                self.path,
                version,
                served,
                self.last,
            )
            return None
        t = time.monotonic()
        write(path)
        self.last = str(path)
        for old in run_checkpoints(self.path)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("autosaved to %s (%.1fs)", path, time.monotonic() - t)
        return self.last


def run_checkpoints(run_dir: str | os.PathLike[str]) -> list[Path]:
    """Autosave directories of a run folder, oldest first (complete or not)."""
    root = Path(run_dir).absolute() / _CKPTS
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def _last_good(d: Path) -> str:
    """The newest checkpoint before ``d`` in its run folder that reads and verifies."""
    if d.parent.name != _CKPTS:
        return "none known (this checkpoint is not in a run folder)"
    older = [p for p in run_checkpoints(d.parent.parent) if p.name < d.name]
    for p in reversed(older):
        try:
            read_checkpoint(p, _hint=False)
        except (StateError, ConfigError):
            continue
        return f"{str(p)!r} (resume_from={str(p)!r})"
    return "none in this run folder"


def read_checkpoint(path: str | os.PathLike[str], *, verify: bool = True, _hint: bool = True) -> PipelineCheckpoint:
    """Read a checkpoint written by ``pipe.save(path)`` (or an autosave), checking its files.

    Raises:
        StateError: ``path`` holds no complete pipeline checkpoint.
        CheckpointError: a file is missing, truncated or corrupted (names it and the last good
            checkpoint of the run), or ``pipeline.json`` cannot be read.
        ConfigError: it was written by a newer layout.
    """
    d = Path(path).absolute()
    fix = "save one with pipe.save(path), or pass the directory pipe.save returned"
    if not d.is_dir():
        olds = sorted(d.parent.glob(f".{d.name}.old-*")) if d.parent.is_dir() else []
        if olds and (olds[-1] / _META).is_file():  # a replace was cut between its two renames
            warnings.warn(
                f"{str(d)!r} was being replaced when the process stopped; reading the previous "
                f"checkpoint kept at {str(olds[-1])!r}",
                stacklevel=2,
            )
            return read_checkpoint(olds[-1], verify=verify, _hint=_hint)
        raise StateError(f"no pipeline checkpoint at {str(d)!r}: the directory does not exist; {fix}")
    if not (d / _META).is_file():
        raise StateError(
            f"{str(d)!r} holds no complete pipeline checkpoint ({_META} missing: "
            f"the save was interrupted or this is not a checkpoint); {fix}"
        )

    def broken(what: str) -> CheckpointError:
        hint = f"; the last good checkpoint: {_last_good(d)}" if _hint else ""
        return CheckpointError(f"checkpoint {str(d)!r} is damaged: {what}{hint}", path=str(d))

    try:
        raw = json.loads((d / _META).read_text())
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise broken(f"{_META} cannot be read ({type(e).__name__}: {e})") from None
    if int(raw.get("format", 0)) > FORMAT:
        raise ConfigError(
            f"checkpoint {str(d)!r} has layout {raw.get('format')}, newer than this rollart_nb "
            f"reads ({FORMAT}); upgrade rollart_nb"
        )
    if not (d / _TRAINER).is_dir():
        raise StateError(f"{str(d)!r} is incomplete: its {_TRAINER}/ directory is missing; {fix}")
    if verify:
        for rel, (size, digest) in sorted(raw.get("files", {}).items()):
            f = d / rel
            if not f.is_file():
                raise broken(f"{rel} is missing")
            have = f.stat().st_size
            if have != size:
                raise broken(f"{rel} has {have} bytes, {size} were written (truncated or overwritten)")
            if _sha256(f) != digest:
                raise broken(f"{rel} does not match its SHA-256 (corrupted)")
    raw["path"] = str(d)
    known = set(PipelineCheckpoint.__dataclass_fields__)
    return PipelineCheckpoint(**{k: v for k, v in raw.items() if k in known})


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> PipelineCheckpoint:
    """The newest complete, verified checkpoint of a run folder; damaged newer ones are skipped
    with a warning that says why.

    Raises:
        StateError: the run folder has no checkpoint at all.
        CheckpointError: it has some, and none is complete and intact.
    """
    found = run_checkpoints(run_dir)
    if not found:
        raise StateError(
            f"run folder {str(Path(run_dir).absolute())!r} has no checkpoints/step-* directory; "
            "run with autosave_every=N, or resume from a directory pipe.save(path) wrote"
        )
    skipped: list[str] = []
    for p in reversed(found):
        try:
            ckpt = read_checkpoint(p, _hint=False)
        except (StateError, CheckpointError) as e:
            skipped.append(f"{p.name}: {e}")
            continue
        if skipped:
            warnings.warn(
                f"skipped {len(skipped)} newer checkpoint(s) of {str(run_dir)!r}: " + "; ".join(skipped), stacklevel=2
            )
        return ckpt
    raise CheckpointError(f"no complete checkpoint in {str(run_dir)!r}: " + "; ".join(skipped), path=str(run_dir))


def resolve_checkpoint(path: str | os.PathLike[str]) -> PipelineCheckpoint:
    """``resume_from``: a checkpoint directory, or a run folder (its newest complete checkpoint)."""
    d = Path(path).absolute()
    if (d / _CKPTS).is_dir() and not (d / _META).exists():
        return latest_checkpoint(d)
    return read_checkpoint(d)
