"""The session's argument checks: what ``sess.tasks``, ``sess.reward`` and ``sess.pipeline``
refuse, every problem with its fix (one ConfigError per call, all problems at once)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rollart_nb._checks import is_whole
from rollart_nb.config import PipelineConfig
from rollart_nb.control.tasks import TaskSet
from rollart_nb.errors import ConfigError, brief
from rollart_nb.serverless.client import Endpoint

if TYPE_CHECKING:
    from rollart_nb.algo.grpo import GRPO
    from rollart_nb.control.checkpoint import PipelineCheckpoint

__all__ = ["check_pipeline_parts", "pipeline_settings", "place_on_launchers", "reward_problems", "stray_reward_problem"]


def _did_you_mean(task: str, known: list[str]) -> tuple[str, str]:
    """("did you mean 'x'? " or "", the name to show in an example) for a ``task`` not in ``known``."""
    close = difflib.get_close_matches(task, known, n=1)
    return (f"did you mean {close[0]!r}? " if close else ""), (close or known)[0]


def reward_problems(
    task: Any,
    fn: Any,
    url: Any,
    serverless: bool,
    serve_options: Mapping[str, Any],
    validate_with: Any,
    timeout_s: Any,
    retries: Any,
    known: list[str],
) -> list[str]:
    """What is wrong with ``sess.reward``'s arguments; ``known``: the session's tasks (a reward
    for another task is refused once there are some; with none, ``sess.pipeline`` checks)."""
    from rollart_nb.control.reward import option_problems

    p = []
    if not isinstance(task, str) or not task:
        p.append(f"task={task!r} must be a task name (a non-empty string, as in sess.tasks({{name: env}}))")
    elif known and task not in known:
        fix, example = _did_you_mean(task, known)
        p.append(
            f"task {task!r} is in no TaskSet of this session (its tasks are {known}); {fix}register the "
            f"reward under one of them, e.g. sess.reward({example!r}, fn), or build the task first with "
            f"sess.tasks({{{task!r}: env}})"
        )
    if (fn is None) == (url is None):
        p.append(
            "give a reward function fn(trajectory) -> float, or url=... of an HTTP endpoint (not both, not neither)"
        )
    elif fn is not None and not callable(fn):
        if isinstance(fn, Endpoint) or isinstance(fn, str) and fn.startswith(("http://", "https://")):
            hint = "; for an HTTP endpoint pass its address as url=..."
        else:
            hint = ", e.g. rn.rewards.exact_answer or lambda t: ..."
        p.append(f"fn={brief(fn)} ({type(fn).__name__}) is not callable; pass a function fn(trajectory) -> float{hint}")
    if url is not None and not isinstance(url, str):
        p.append(f"url={brief(url)} must be a string http(s)://...")
    if url is not None and serverless:
        p.append("serverless=True deploys fn on Ray Serve; url=... is an endpoint already running: drop one")
    if serve_options and not serverless:
        p.append(f"{', '.join(sorted(serve_options))}: options of serverless=True only (add it, or drop them)")
    return p + option_problems(validate_with, timeout_s, retries)


def stray_reward_problem(task: str, known: list[str]) -> str:
    """The problem with a reward registered for ``task``, which a pipeline's tasks ``known`` lack."""
    fix, example = _did_you_mean(task, known)
    return (
        f"a reward is registered for task {task!r}, which this pipeline's tasks {known} do not have; {fix}the "
        f"registration for {task!r} was dropped: register the reward again under one of these names, e.g. "
        f"sess.reward({example!r}, fn), then call sess.pipeline(...) again"
    )


def check_pipeline_parts(train: Any, gen: Any, tasks: Any, config: Any, where: str) -> None:
    """Refuse a config that is no PipelineConfig, tasks that are no TaskSet, and a trainer and
    generator given the wrong way round (Worker roles tell them apart)."""
    from rollart_nb.workers.roles import GeneratorWorker, TrainerWorker

    if config is not None and not isinstance(config, PipelineConfig):
        raise ConfigError(f"config={brief(config)} must be a PipelineConfig", where=where)
    if not isinstance(tasks, TaskSet):
        raise ConfigError(
            f"tasks={brief(tasks)} must be a TaskSet; build it with sess.tasks({{name: env}})", where=where
        )

    def is_a(c: Any, role: type) -> bool:
        cls = getattr(c, "worker_cls", None)
        return isinstance(cls, type) and issubclass(cls, role)

    if is_a(train, GeneratorWorker) or is_a(gen, TrainerWorker):
        raise ConfigError(
            f"the order is sess.pipeline(train, gen, tasks): train={train!r} is the {_role(train)} cluster "
            f"and gen={gen!r} the {_role(gen)} one; pass sess.pipeline({gen.name}, {train.name}, tasks, ...)",
            where=where,
        )


def _role(c: Any) -> str:
    from rollart_nb.workers.roles import GeneratorWorker

    return "generator" if issubclass(c.worker_cls, GeneratorWorker) else "trainer"


def pipeline_settings(
    config: PipelineConfig | None,
    given: dict[str, Any],
    algo: GRPO | None,
    group_size: int | None,
    resume: PipelineCheckpoint | None,
    where: str,
) -> tuple[PipelineConfig, int]:
    """The pipeline's config (``config``, else the saved one, else the defaults; ``given``
    keywords over it) and group size; every problem at once as ConfigError."""
    from rollart_nb.config import from_dict

    base = config
    if base is None and resume is not None and isinstance(resume.config.get("pipeline"), dict):
        base = from_dict(PipelineConfig, resume.config["pipeline"], where=f"the config saved in {resume.path}")
    problems: list[str] = []
    cfg = base or PipelineConfig()
    try:
        cfg = dataclasses.replace(cfg, **given)
    except ConfigError as e:
        problems += e.problems
    saved_groups = resume.config.get("group_size", 8) if resume is not None else 8
    groups = algo.group_size if algo is not None else group_size if group_size is not None else saved_groups
    if algo is not None and group_size is not None and group_size != algo.group_size:
        problems.append(f"group_size={group_size} differs from algo.group_size={algo.group_size}; give one of them")
    elif not is_whole(groups) or groups < 1:
        problems.append(f"group_size={groups!r} must be a whole number >= 1")
    batch = given.get("batch_size", cfg.batch_size)
    if is_whole(batch) and batch >= 1 and is_whole(groups) and groups >= 1 and batch % groups:
        problems.append(f"batch_size={batch} must be a multiple of the group size {groups}")
    if problems:
        raise ConfigError(problems, where=where)
    return cfg, groups


def _is_launcher(obj: Any) -> bool:
    return callable(getattr(obj, "handle", None)) and callable(getattr(obj, "start", None))


def place_on_launchers(envs: dict[str, Any], launchers: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``envs`` with each launched task's env replaced by a RemoteEnv on its launcher."""
    from rollart_nb.envs.remote import RemoteEnv

    launchers.update({t: e for t, e in envs.items() if _is_launcher(e)})
    problems = []
    for task, lau in launchers.items():
        if task not in envs:
            problems.append(f"launcher for unknown task {task!r}; tasks are {sorted(envs)}")
        elif not _is_launcher(lau):
            problems.append(f"task {task!r}: {type(lau).__name__} is not a launcher (e.g. rn.envs.LocalLauncher)")
        elif envs[task] is not lau:
            served = str(getattr(lau, "env", "")).rpartition(":")[2]
            given = type(envs[task]).__name__
            if served and served != given:
                problems.append(
                    f"task {task!r}: the launcher serves {served} but the env given is {given}; "
                    "pass the matching env, or the launcher itself as the task's env"
                )
    if problems:
        raise ConfigError(problems, where="sess.tasks(...)")
    for task, lau in launchers.items():
        envs[task] = RemoteEnv(launcher=lau)
    return envs, launchers


def staleness_algo(cfg: Any, algo: Any, where: str) -> Any:
    """The algorithm to configure the trainer with: the "correct" staleness policy needs its
    truncated importance sampling, so an ``algo`` with ``tis="off"`` gets ``tis="token"``."""
    if cfg.staleness != "correct" or (algo is not None and algo.tis != "off"):
        return algo
    if algo is None:
        raise ConfigError(
            "staleness='correct' trains stale tokens under truncated importance weights set by the algorithm: "
            "pass algo=rn.GRPO(..., tis='token') (or 'sequence')",
            where=where,
        )
    return dataclasses.replace(algo, tis="token")
