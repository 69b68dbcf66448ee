"""GRPO: group-relative advantages and the clipped policy-gradient loss.

Config is a frozen dataclass (:class:`GRPO`); the maths are pure functions on tensors so
that trainers (torch, sim, megatron) share one definition.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from rollart_nb.errors import ConfigError, brief

__all__ = [
    "GRPO",
    "TASK_METRICS",
    "TRAIN_METRICS",
    "batch_advantages",
    "group_advantages",
    "grpo_loss",
    "loss_weights",
    "mean_response_length",
    "micro_batches",
    "per_task",
    "step_metrics",
    "task_weights",
]

LOSS_AGGS = ("token-mean", "seq-mean", "task-token-mean")
TIS_LEVELS = ("off", "token", "sequence")

TRAIN_METRICS = (
    "loss", "kl", "entropy", "grad_norm", "clip_frac", "response_length",
    "mismatch_kl", "mismatch_ratio_out", "cross_version_frac",
)  # fmt: skip
"""Metrics every GRPO train step reports under these names (see :func:`step_metrics`; the last
three are :data:`~rollart_nb.algo.provenance.MISMATCH_METRICS`); the dashboard's and the report's
"training" plot draws them."""

TASK_METRICS = (
    "kl", "entropy", "clip_frac", "response_length", "mismatch_kl", "mismatch_ratio_out", "cross_version_frac",
    "corrected_frac", "tis_clip_frac",
)  # fmt: skip
"""Metrics a train step also reports per task, as ``"<metric>/<task>"`` (e.g. ``"kl/math"``),
each a mean over that task's trained tokens (``response_length``: over its trajectories). The
dashboard's and the report's "per task" plot draws them (:func:`per_task` reads them back)."""


def per_task(train: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``{"kl/math": 0.1, "entropy/math": 2.0, ...}`` -> ``{"math": {"kl": 0.1, "entropy": 2.0}}``:
    the per-task :data:`TASK_METRICS` of a train step's metrics (other keys are left out).

    Example:
        >>> per_task({"kl": 0.2, "kl/math": 0.3, "entropy/frozenlake": 1.5})
        {'math': {'kl': 0.3}, 'frozenlake': {'entropy': 1.5}}
    """
    out: dict[str, dict[str, float]] = {}
    for key, v in train.items():
        metric, sep, task = key.partition("/")
        if sep and task and metric in TASK_METRICS and isinstance(v, int | float):
            out.setdefault(task, {})[metric] = float(v)
    return out


@dataclass(frozen=True)
class GRPO:
    """Group Relative Policy Optimization settings.

    Example:
        >>> GRPO(group_size=4, lr=5e-4).clip_eps
        0.2
    """

    group_size: int = 8
    """Trajectories sampled per prompt (env seed); advantages are relative within a group."""
    clip_eps: float = 0.2
    """PPO ratio clip: the ratio is clipped to ``[1 - clip_eps, 1 + clip_eps_high]``."""
    clip_eps_high: float | None = None
    """Upper clip ("clip-higher", DAPO); None means ``clip_eps``."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to the initial (reference) policy; 0 keeps no reference."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    lr: float = 1e-3
    """AdamW learning rate. Suits the tiny random-init models; use ~1e-6 for pretrained LLMs."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    loss_agg: str = "token-mean"
    """"token-mean": every trained token weighs the same; "seq-mean": every trajectory weighs
    the same; "task-token-mean": token-mean within each task, each task weighing by its share of
    the trained trajectories (so long-response tasks do not outweigh short ones)."""
    adv_eps: float = 1e-6
    """Added to the group reward std before dividing."""
    scale_by_std: bool | Mapping[str, bool] = True
    """Divide advantages by the group's reward std (False gives Dr. GRPO's mean-only baseline).
    A mapping sets it per task, e.g. ``{"math": False}``; tasks it leaves out scale."""
    micro_batch_size: int = 8
    """Sequences per forward/backward; gradients accumulate over micro-batches to one step."""
    micro_batch_tokens: int = 0
    """If > 0, a micro-batch also holds at most this many padded tokens (rows x longest row)."""
    skip_zero_advantage: bool = True
    """Leave trajectories with advantage 0 out of the loss; a batch with none makes no step."""
    regularize_all_rows: bool = True
    """With ``kl_coef`` or ``entropy_coef`` > 0, still train the zero-advantage rows."""
    epochs: int = 1
    """Optimizer steps per ``train_step`` on the same batch (PPO epochs); one new version."""
    tis: str = "off"
    """Truncated importance sampling of off-policy tokens (the "correct" staleness policy turns
    "token" on): "token" weighs each token by ``min(exp(trainer - sampler logprob), tis_cap)``,
    "sequence" each version segment of a row by the product of its tokens' ratios, capped; the
    PPO ratio is then taken against the trainer's own logprobs before the update
    (:func:`~rollart_nb.algo.provenance.tis_weights`). "off": the PPO ratio is against the sampler's."""
    tis_cap: float = 2.0
    """The truncation of the importance weight (``tis``)."""

    def __post_init__(self) -> None:
        problems = []
        if not (isinstance(self.group_size, int) and self.group_size >= 1):
            problems.append(f"group_size must be an int >= 1, got {self.group_size!r}")
        if not 0 < self.clip_eps < 1:
            problems.append(f"clip_eps must be in (0, 1), got {self.clip_eps!r}")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0:
            problems.append(f"clip_eps_high must be > 0 or None, got {self.clip_eps_high!r}")
        for name in ("kl_coef", "entropy_coef", "weight_decay", "max_grad_norm"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                problems.append(f"{name} must be a finite number >= 0, got {v!r}")
        if not (isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0):
            problems.append(f"lr must be a finite number > 0, got {self.lr!r}")
        if self.loss_agg not in LOSS_AGGS:
            problems.append(f"loss_agg must be one of {LOSS_AGGS}, got {self.loss_agg!r}")
        if not self.adv_eps > 0:
            problems.append(f"adv_eps must be > 0, got {self.adv_eps!r}")
        if not isinstance(self.scale_by_std, bool) and not (
            isinstance(self.scale_by_std, Mapping) and all(isinstance(v, bool) for v in self.scale_by_std.values())
        ):
            problems.append(f"scale_by_std must be a bool or a task -> bool mapping, got {self.scale_by_std!r}")
        if not (isinstance(self.micro_batch_tokens, int) and self.micro_batch_tokens >= 0):
            problems.append(f"micro_batch_tokens must be an int >= 0, got {self.micro_batch_tokens!r}")
        if not (isinstance(self.epochs, int) and self.epochs >= 1):
            problems.append(f"epochs must be an int >= 1, got {self.epochs!r}")
        if self.tis not in TIS_LEVELS:
            problems.append(f"tis must be one of {TIS_LEVELS}, got {self.tis!r}")
        if not (isinstance(self.tis_cap, int | float) and math.isfinite(self.tis_cap) and self.tis_cap >= 1):
            problems.append(f"tis_cap must be a finite number >= 1, got {self.tis_cap!r}")
        if not (isinstance(self.micro_batch_size, int) and self.micro_batch_size >= 1):
            problems.append(f"micro_batch_size must be an int >= 1, got {self.micro_batch_size!r}")
        if problems:
            raise ConfigError(problems, where="GRPO config")

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if isinstance(self.scale_by_std, Mapping):
            d["scale_by_std"] = dict(self.scale_by_std)
        return d

    def std_scaling(self, tasks: Sequence[str]) -> list[bool]:
        """Per trajectory (given its task): whether its group's advantages divide by the std."""
        if isinstance(self.scale_by_std, bool):
            return [self.scale_by_std] * len(tasks)
        return [self.scale_by_std.get(t, True) for t in tasks]


def step_metrics(
    sums: dict[str, float],
    *,
    grad_norm: float,
    rewards: Any,
    adv: Any,
    num_trajectories: int,
    num_rows: int,
    num_tokens: float,
    step_s: float,
    version: int,
    response_length: float = math.nan,
    task_response_length: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """A train step's metrics, as every GRPO backend reports them, from the loss ``sums``.

    Always has :data:`TRAIN_METRICS`: ``kl`` is the k3 KL to the reference (also ``kl_ref``)
    when ``kl_coef > 0``, else ``approx_kl_old`` (k1 KL from the behaviour policy); token means
    weigh as ``loss_agg`` does, and are NaN when no token was trained. Per-task means come in
    ``sums`` as ``"<metric>/<task>"`` and ``task_response_length``.
    """
    sums.setdefault("entropy", math.nan)
    for key in TRAIN_METRICS[-3:]:  # the mismatch figures: NaN where the backend measured none
        sums.setdefault(key, math.nan)
    sums.setdefault("kl", sums.get("kl_ref", sums.get("approx_kl_old", math.nan)))
    for task in {k.partition("/")[2] for k in sums if k.startswith(("kl_ref/", "approx_kl_old/"))}:
        # per task, "kl" means what it means for the whole batch
        ref, old = sums.pop(f"kl_ref/{task}", None), sums.pop(f"approx_kl_old/{task}", math.nan)
        sums.setdefault(f"kl/{task}", old if ref is None else ref)
    for task, n in (task_response_length or {}).items():
        sums[f"response_length/{task}"] = float(n)
        for key in ("corrected_frac", "tis_clip_frac"):  # the importance weights' (NaN without GRPO.tis)
            sums.setdefault(f"{key}/{task}", math.nan)
    sums.update(
        grad_norm=grad_norm,
        response_length=float(response_length),
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std(unbiased=False)),
        adv_abs_mean=float(adv.abs().mean()),
        num_trajectories=float(num_trajectories),
        num_rows=float(num_rows),
        num_tokens=float(num_tokens),
        step_s=step_s,
        version=float(version),
    )
    return sums


def mean_response_length(batch: Sequence[Any], *, by_task: bool = False) -> Any:
    """Mean generated tokens (every turn's ``response_ids``) per trajectory; NaN for no
    trajectories. ``by_task``: a dict task -> that task's mean instead."""
    if by_task:
        tasks = dict.fromkeys(t.task for t in batch)
        return {task: mean_response_length([t for t in batch if t.task == task]) for task in tasks}
    if not batch:
        return math.nan
    return sum(len(turn.response_ids) for t in batch for turn in t.turns) / len(batch)


def task_weights(loss_mask: Any, row_tasks: Sequence[str]) -> dict[str, Any]:
    """Per task, weights [B, T] that average a per-token quantity over that task's trained
    tokens by a plain sum (each sums to 1 over the batch; micro-batch slices add up), for the
    per-task metrics of :func:`grpo_loss` (``task_weights``).

    Example:
        >>> w = task_weights([[1, 1, 0], [1, 0, 0]], ["math", "maze"])
        >>> {t: v.sum().item() for t, v in w.items()}
        {'math': 1.0, 'maze': 1.0}
    """
    import torch

    m = torch.as_tensor(loss_mask, dtype=torch.float32)
    out = {}
    for task in dict.fromkeys(row_tasks):
        sel = torch.tensor([t == task for t in row_tasks], dtype=torch.float32)[:, None] * m
        out[task] = sel / sel.sum().clamp(min=1.0)
    return out


def group_advantages(
    rewards: Sequence[float] | Any,
    group_ids: Sequence[Hashable],
    *,
    eps: float = 1e-6,
    scale_by_std: bool | Sequence[bool] = True,
) -> Any:
    """Per-trajectory advantage ``(r - mean_g) / (std_g + eps)`` within each group.

    ``std_g`` is the population std of the group. A group of one has no baseline, so its
    advantage is 0 (no learning signal rather than a biased one).

    Args:
        rewards: shape [N].
        group_ids: length N; equal ids form a group.
        scale_by_std: divide by ``std_g`` (False: ``r - mean_g`` only); a sequence of N flags
            sets it per trajectory, and a group follows its first member's flag.

    Returns:
        float32 tensor, shape [N]; zero-mean within every group.
    """
    import torch

    r = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
    if len(group_ids) != r.numel():
        raise ConfigError(f"{r.numel()} rewards but {len(group_ids)} group ids")
    if not torch.isfinite(r).all():
        raise ConfigError("rewards must be finite; score every trajectory before computing advantages")
    index: dict[Hashable, int] = {}
    gid = torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)
    scales = [scale_by_std] * r.numel() if isinstance(scale_by_std, bool) else list(scale_by_std)
    if len(scales) != r.numel():
        raise ConfigError(f"{r.numel()} rewards but {len(scales)} scale_by_std flags")
    first: dict[int, bool] = {}
    for i, g in enumerate(gid.tolist()):
        first.setdefault(g, bool(scales[i]))
    adv = torch.zeros_like(r)
    for g in range(len(index)):
        members = gid == g
        if int(members.sum()) < 2:
            continue
        rg = r[members]
        centred = rg - rg.mean()
        adv[members] = centred / (rg.std(unbiased=False) + eps) if first[g] else centred
    return adv


def micro_batches(lengths: list[int], max_rows: int, max_tokens: int = 0) -> list[tuple[int, int]]:
    """Split rows (sorted by length, ascending) into ``[lo, hi)`` micro-batches of at most
    ``max_rows`` rows and, when ``max_tokens`` > 0, at most ``max_tokens`` padded tokens
    (rows x the longest row); a row longer than ``max_tokens`` goes alone."""
    out, lo = [], 0
    while lo < len(lengths):
        hi = lo + 1
        while (
            hi < len(lengths) and hi - lo < max_rows and (not max_tokens or (hi - lo + 1) * lengths[hi] <= max_tokens)
        ):
            hi += 1
        out.append((lo, hi))
        lo = hi
    return out


def batch_advantages(algo: GRPO, batch: Sequence[Any]) -> tuple[Any, Any]:
    """Rewards and group advantages (float32, shape [N]) of scored trajectories, as every GRPO
    trainer computes them: a group is a ``group_id`` (else task/seed), scaled per ``algo``."""
    import torch

    groups = [t.group_id or f"{t.task}/{t.seed}" for t in batch]
    rewards = torch.tensor([t.reward for t in batch], dtype=torch.float32)
    scales = algo.std_scaling([t.task for t in batch])
    return rewards, group_advantages(rewards, groups, eps=algo.adv_eps, scale_by_std=scales)


def loss_weights(
    loss_mask: Any, loss_agg: str = "token-mean", seq_index: Any = None, task_index: Sequence[Hashable] | None = None
) -> Any:
    """Per-token weights that turn a per-token loss into the batch loss by a plain sum.

    Computed once per batch, they make gradient accumulation over micro-batches exact.

    Args:
        loss_mask: shape [B, T], 1 where a token is trained.
        loss_agg: "token-mean", "seq-mean" or "task-token-mean".
        seq_index: shape [B]; rows with the same index belong to one trajectory (for
            "seq-mean" when a trajectory spans several rows). Default: one row each.
        task_index: length B, each row's task (for "task-token-mean"; required there).

    Returns:
        float32 tensor [B, T] summing to 1 (0 when the mask is empty).
    """
    import torch

    m = torch.as_tensor(loss_mask, dtype=torch.float32)
    if loss_agg == "token-mean":
        return m / m.sum().clamp(min=1.0)
    if loss_agg not in LOSS_AGGS:
        raise ConfigError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    idx = torch.arange(m.shape[0]) if seq_index is None else torch.as_tensor(seq_index, dtype=torch.long)
    _, idx = torch.unique(idx, return_inverse=True)
    tokens = torch.zeros(int(idx.max()) + 1 if idx.numel() else 0).index_add_(0, idx, m.sum(-1))
    n_seqs = (tokens > 0).sum().clamp(min=1)
    if loss_agg == "seq-mean":
        return m / tokens[idx].clamp(min=1.0)[:, None] / n_seqs
    if task_index is None or len(task_index) != m.shape[0]:
        raise ConfigError(f"loss_agg 'task-token-mean' needs one task per row ({m.shape[0]}), got {brief(task_index)}")
    labels = {t: k for k, t in enumerate(dict.fromkeys(task_index))}
    task = torch.tensor([labels[t] for t in task_index], dtype=torch.long)
    task_tokens = torch.zeros(len(labels)).index_add_(0, task, m.sum(-1))
    # Trajectories (with trained tokens) per task: a trajectory's rows all carry its task.
    seq_task = torch.zeros(tokens.shape[0], dtype=torch.long).index_copy_(0, idx, task)
    share = torch.bincount(seq_task[tokens > 0], minlength=len(labels)).float() / n_seqs
    return m * (share / task_tokens.clamp(min=1.0))[task][:, None]


def grpo_loss(
    new_logprobs: Any,
    old_logprobs: Any,
    advantages: Any,
    loss_mask: Any,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    loss_agg: str = "token-mean",
    weights: Any = None,
    ref_logprobs: Any = None,
    kl_coef: float = 0.0,
    entropy: Any = None,
    entropy_coef: float = 0.0,
    task_weights: Mapping[str, Any] | None = None,
    is_weights: Any = None,
) -> tuple[Any, dict[str, float]]:
    """Clipped surrogate loss of GRPO (to minimise).

    Per token: ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps_high) * A)`` with
    ``ratio = exp(new - old)``, plus ``kl_coef * k3(new, ref)`` minus ``entropy_coef * H``.

    Args:
        new_logprobs: shape [B, T], differentiable.
        old_logprobs: shape [B, T], behaviour logprobs (no grad).
        advantages: shape [B] (one per sequence) or [B, T].
        loss_mask: shape [B, T].
        weights: shape [B, T] from :func:`loss_weights`; default computed from this batch
            (not possible for "task-token-mean", which needs each row's task: pass weights).
        ref_logprobs: shape [B, T] under the reference policy (needed when ``kl_coef > 0``).
        entropy: shape [B, T] per-token entropy (needed when ``entropy_coef > 0``).
        task_weights: per task, weights [B, T] from :func:`task_weights`: the metrics are also
            reported per task as ``"<metric>/<task>"`` (clip_frac, approx_kl_old, kl_ref, entropy).
        is_weights: shape [B, T], detached importance weights each token's surrogate is
            multiplied by (:func:`~rollart_nb.algo.provenance.tis_weights`); None: 1.

    Returns:
        ``(loss, metrics)``; metrics are ``weights``-weighted sums, i.e. means over trained
        tokens for full-batch weights, and partial sums that add up across micro-batches.
    """
    import torch

    mask = torch.as_tensor(loss_mask, dtype=new_logprobs.dtype, device=new_logprobs.device)
    w = loss_weights(mask.cpu(), loss_agg).to(mask.device) if weights is None else weights.to(mask.device)
    adv = torch.as_tensor(advantages, dtype=new_logprobs.dtype, device=new_logprobs.device)
    if adv.dim() == 1:
        adv = adv[:, None]
    old = old_logprobs.detach()
    log_ratio = (new_logprobs - old) * mask  # masked first: padding must not overflow exp()
    ratio = torch.exp(log_ratio)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    surr = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + high) * adv)
    if is_weights is not None:
        surr = surr * is_weights.detach()
    per_token = -surr
    kl = None
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ConfigError("kl_coef > 0 needs ref_logprobs")
        d = (ref_logprobs.detach() - new_logprobs) * mask
        kl = torch.exp(d) - d - 1  # k3 estimator: unbiased, always >= 0
        per_token = per_token + kl_coef * kl
    if entropy_coef > 0:
        if entropy is None:
            raise ConfigError("entropy_coef > 0 needs entropy")
        per_token = per_token - entropy_coef * entropy
    loss = (per_token * w).sum()

    with torch.no_grad():
        clipped = ((ratio < 1 - clip_eps) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
        metrics = {
            "pg_loss": float((-surr * w).sum()),
            "clip_frac": float((clipped.float() * w).sum()),
            "ratio_mean": float((ratio * w).sum()),
            "approx_kl_old": float(((old - new_logprobs) * mask * w).sum()),
        }
        if kl is not None:
            metrics["kl_ref"] = float((kl * w).sum())
        if entropy is not None:
            metrics["entropy"] = float((entropy * w).sum())
        for task, tw in (task_weights or {}).items():
            tw = tw.to(mask.device)
            metrics[f"clip_frac/{task}"] = float((clipped.float() * tw).sum())
            metrics[f"approx_kl_old/{task}"] = float(((old - new_logprobs) * mask * tw).sum())
            if kl is not None:
                metrics[f"kl_ref/{task}"] = float((kl * tw).sum())
            if entropy is not None:
                metrics[f"entropy/{task}"] = float((entropy * tw).sum())
    return loss, metrics
