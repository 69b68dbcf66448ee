"""Pipeline checkpoints: what ``pipe.save(path)`` writes and ``sess.pipeline(..., resume_from=path)`` reads.

Layout of a checkpoint directory::

    path/
      trainer/          the trainer's own checkpoint (TrainerWorker.save_checkpoint: model as a
                        servable HF directory, optimizer, version, RNG states)
      pipeline.json     step count, policy version, tasks, reward sources, scheduler seed, config;
                        written last and atomically: its presence marks a complete checkpoint

The trainer writes ``trainer/`` from its own process, so ``path`` must be on a filesystem the
trainer worker and this process share (always true for :meth:`rollart_nb.Session.local`).
What is not saved: trajectories in flight or buffered (a resumed pipeline starts its rollout
afresh, serving the saved version) and reward functions themselves (set them again with
``sess.reward``; their sources are recorded so a resume can warn when they differ).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_nb.errors import ConfigError, StateError

if TYPE_CHECKING:
    from rollart_nb.control.pipeline import Pipeline
    from rollart_nb.control.tasks import TaskSet

__all__ = ["FORMAT", "PipelineCheckpoint", "read_checkpoint", "write_checkpoint"]

FORMAT = 1
"""Version of the ``pipeline.json`` layout."""

_META = "pipeline.json"
_TRAINER = "trainer"


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
            raise ConfigError(problems + [f"resume with the saved tasks {sorted(want)}"],
                              where=f"resume_from={self.path!r}")

    def warn_reward_changes(self, rewards: dict[str, str]) -> list[str]:
        """Warn (and return the tasks) whose reward source differs from the saved one.

        ``rewards``: task -> source of the rewards set so far; a task without one gets the
        default reward (the env's return) when it first scores, and is compared as that.
        """
        from rollart_nb.control.reward import RewardDispatcher

        default = RewardDispatcher()
        changed = sorted(t for t, src in self.rewards.items() if rewards.get(t, default.spec(t).source) != src)
        if changed:
            warnings.warn(f"resuming {self.path!r} with different rewards for {changed} than when it was saved; "
                          "set them with sess.reward(...) before sess.pipeline(...) if that is not intended",
                          stacklevel=3)
        return changed


def latest_reward_sources(history: list[dict[str, Any]]) -> dict[str, str]:
    """task -> source of the newest reward version, from ``pipe.reward_history()``."""
    out: dict[str, tuple[int, str]] = {}
    for h in history:
        v = int(h.get("version", 0))
        if h.get("task") is not None and (h["task"] not in out or v >= out[h["task"]][0]):
            out[h["task"]] = (v, str(h.get("source", "")))
    return {t: src for t, (_, src) in sorted(out.items())}


def write_checkpoint(pipe: Pipeline, path: str | os.PathLike[str]) -> PipelineCheckpoint:
    """Save ``pipe``'s trainer and resume metadata to ``path`` (the caller holds the step lock)."""
    d = Path(path).absolute()
    d.mkdir(parents=True, exist_ok=True)
    (d / _META).unlink(missing_ok=True)  # an interrupted overwrite must not look complete
    pipe.train.save_checkpoint(str(d / _TRAINER))
    ckpt = PipelineCheckpoint(
        path=str(d), version=int(pipe.train.version()), steps=pipe.first_step + len(pipe.reports),
        seed=int(pipe.cfg.seed), tasks={t: type(e).__name__ for t, e in pipe.tasks.envs.items()},
        rewards=latest_reward_sources(pipe.reward_history()),
        config={"name": pipe.name, "mode": pipe.mode.name, "alpha": pipe.cfg.alpha,
                "batch_size": pipe.cfg.batch_size, "group_size": pipe.cfg.group_size,
                "served_version": pipe.version},
        saved_at=time.time())
    tmp = d / (_META + ".tmp")
    tmp.write_text(json.dumps(asdict(ckpt), indent=1, sort_keys=True))
    os.replace(tmp, d / _META)
    return ckpt


def read_checkpoint(path: str | os.PathLike[str]) -> PipelineCheckpoint:
    """Read a checkpoint written by ``pipe.save(path)``.

    Raises:
        StateError: ``path`` holds no complete pipeline checkpoint.
        ConfigError: it was written by a newer layout.
    """
    d = Path(path).absolute()
    fix = "save one with pipe.save(path), or pass the directory pipe.save returned"
    if not d.is_dir():
        raise StateError(f"no pipeline checkpoint at {str(d)!r}: the directory does not exist; {fix}")
    if not (d / _META).is_file():
        raise StateError(f"{str(d)!r} holds no complete pipeline checkpoint ({_META} missing: "
                         f"the save was interrupted or this is not a checkpoint); {fix}")
    raw = json.loads((d / _META).read_text())
    if int(raw.get("format", 0)) > FORMAT:
        raise ConfigError(f"checkpoint {str(d)!r} has layout {raw.get('format')}, newer than this rollart_nb "
                          f"reads ({FORMAT}); upgrade rollart_nb")
    if not (d / _TRAINER).is_dir():
        raise StateError(f"{str(d)!r} is incomplete: its {_TRAINER}/ directory is missing; {fix}")
    raw["path"] = str(d)
    known = set(PipelineCheckpoint.__dataclass_fields__)
    return PipelineCheckpoint(**{k: v for k, v in raw.items() if k in known})
