"""What a train step saw, token by token, and how far the sampler was from the trainer.

A GRPO backend scores every trained row once per step: the first epoch's forward pass, under
the policy before the update. :class:`TokenRecorder` keeps those per-token logprobs, entropies
and loss weights per trajectory (the pipeline attaches them as ``Trajectory.train``; the token
frame shows them beside the sampler's), and reduces them to the step's figures, over trained
tokens whose sampler logprob is known, with ``r = exp(logprob_trainer - logprob_sampler)``:

- ``mismatch_kl``: the mean of ``r - 1 - log r``, the k3 estimate of KL(sampler || trainer);
- ``mismatch_ratio_out``: the share of tokens whose ``r`` leaves :data:`RATIO_BAND`;
- ``cross_version_frac``: the share of trained tokens not written by their trajectory's oldest
  version (a trajectory continued across a weight update; known without a forward pass).

Each also comes per task as ``"<metric>/<task>"``.

:func:`tis_weights` turns the same ratio, per token or per version segment, into the truncated
importance weights of the "correct" staleness policy (``GRPO.tis``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from rollart_nb.trajectory_frames import importance_ratio

if TYPE_CHECKING:
    import torch

    from rollart_nb.backends.torch_train import Row
    from rollart_nb.trajectory import Trajectory

__all__ = ["MISMATCH_METRICS", "RATIO_BAND", "TokenRecorder", "tis_weights"]

RATIO_BAND = (0.5, 2.0)
"""Importance ratios (trainer / sampler probability) outside this band count as mismatched."""

MISMATCH_METRICS = ("mismatch_kl", "mismatch_ratio_out", "cross_version_frac")
"""The figures a train step reports about its batch's provenance (see the module docstring)."""


class TokenRecorder:
    """Collects a train step's per-token figures for ``batch``, whose training rows are ``rows``.

    Example:
        >>> rec = TokenRecorder(batch, rows)                        # doctest: +SKIP
        >>> rec.add(part, logprobs, entropy, weights)               # each micro-batch, first epoch
        >>> rec.records(adv, version=3)["<trajectory id>"]["rows"]  # doctest: +SKIP
    """

    def __init__(self, batch: list[Trajectory], rows: list[Row]) -> None:
        self.batch = batch
        self.rows_of: list[int] = [0] * len(batch)  # training sequences per trajectory
        for r in rows:
            self.rows_of[r.traj] = max(self.rows_of[r.traj], r.seq + 1)
        self._scored: dict[tuple[int, int], dict[str, list[float]]] = {}
        self._sums: dict[str, float] = defaultdict(float)
        for r in rows:  # provenance needs no forward pass: every trained token counts
            oldest = self.batch[r.traj].min_version
            task = self.batch[r.traj].task
            for m, v in zip(r.mask, r.versions, strict=True):
                if m > 0:
                    cross = float(v != oldest)
                    for key in ("", f"/{task}"):
                        self._sums["cross" + key] += cross
                        self._sums["trained" + key] += 1.0

    def add(self, part: list[Row], lp: torch.Tensor, entropy: torch.Tensor | None, weights: torch.Tensor) -> None:
        """One micro-batch's forward pass: logprobs and entropies [B, L-1] of positions 1..L-1
        (entropy None or 0 where not measured) and the loss weights [B, L-1]."""
        lp_rows, w_rows = lp.detach().float().cpu().tolist(), weights.detach().float().cpu().tolist()
        ent_rows = entropy.detach().float().cpu().tolist() if entropy is not None else None
        for i, r in enumerate(part):
            n = len(r.ids)
            trained = r.mask[1:]
            logprob = [math.nan, *lp_rows[i][: n - 1]]
            ent = [math.nan] * n
            if ent_rows is not None:
                ent[1:] = [e if m > 0 else math.nan for e, m in zip(ent_rows[i][: n - 1], trained, strict=True)]
            self._scored[r.traj, r.seq] = {
                "logprob": logprob,
                "entropy": ent,
                "loss_weight": [0.0, *w_rows[i][: n - 1]],
            }
            self._tally(r, logprob)

    def _tally(self, r: Row, logprob: list[float]) -> None:
        task = self.batch[r.traj].task
        for m, new, old in zip(r.mask, logprob, r.old_logprobs, strict=True):
            ratio = importance_ratio(new, old)
            if m <= 0 or math.isnan(ratio):
                continue
            k3 = ratio - 1.0 - (new - old)
            out = float(not RATIO_BAND[0] <= ratio <= RATIO_BAND[1])
            for key in ("", f"/{task}"):
                self._sums["kl" + key] += k3
                self._sums["out" + key] += out
                self._sums["compared" + key] += 1.0

    def metrics(self) -> dict[str, float]:
        """:data:`MISMATCH_METRICS`, for the batch and per task (NaN with nothing to compare)."""
        s = self._sums
        out: dict[str, float] = {}
        for key in ["", *sorted({f"/{t.task}" for t in self.batch})]:
            n, trained = s.get("compared" + key, 0.0), s.get("trained" + key, 0.0)
            out["mismatch_kl" + key] = s["kl" + key] / n if n else math.nan
            out["mismatch_ratio_out" + key] = s["out" + key] / n if n else math.nan
            out["cross_version_frac" + key] = s["cross" + key] / trained if trained else math.nan
        return out

    def records(self, adv: Any, version: int) -> dict[str, dict[str, Any]]:
        """Per trajectory id: ``version`` (the policy that scored it), its ``advantage`` and
        ``rows`` (None for a sequence the step skipped: its advantage was 0)."""
        return {
            t.id: {
                "version": version,
                "advantage": float(adv[i]),
                "rows": [self._scored.get((i, k)) for k in range(self.rows_of[i])],
            }
            for i, t in enumerate(self.batch)
        }


def tis_weights(
    trainer_lp: torch.Tensor,
    sampler_lp: torch.Tensor,
    versions: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float,
    level: str,
    trainer_version: int,
    weights: torch.Tensor,
    task_weights: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights of trained tokens, provenance-aware, and their figures.

    ``log r = trainer_lp - sampler_lp`` (0 where the sampler's logprob is unknown: give it
    equal to ``trainer_lp``). ``level="token"``: each token's weight is ``min(r, cap)``;
    ``"sequence"``: every token of a version segment (a row's stretch written by one version)
    gets ``min(prod r, cap)`` over that segment's trained tokens, so a trajectory written by two
    versions is corrected per segment.

    Args:
        trainer_lp / sampler_lp: shape [B, T], the trainer's logprobs before the update and the sampler's.
        versions: shape [B, T], the version that wrote each token (-1 on the prompt side).
        mask: shape [B, T], 1 on trained tokens.
        weights / task_weights: the loss weights (and per task) the figures are weighted by.

    Returns:
        ``(w, metrics)``: ``w`` [B, T] detached (1 off the mask); ``corrected_frac`` (share of
        trained tokens written by a version older than ``trainer_version``), ``tis_clip_frac``
        (share whose ratio was cut at ``cap``) and ``tis_weight_mean``, each also per task.

    Example:
        >>> import torch
        >>> w, m = tis_weights(torch.tensor([[0.0, 0.0]]), torch.tensor([[-1.0, 0.5]]), torch.tensor([[2, 3]]),
        ...                    torch.ones(1, 2), cap=2.0, level="token", trainer_version=3,
        ...                    weights=torch.full((1, 2), 0.5))
        >>> [round(x, 3) for x in w[0].tolist()], m["tis_clip_frac"], m["corrected_frac"]
        ([2.0, 0.607], 0.5, 0.5)
    """
    import torch

    with torch.no_grad():
        m = mask.float()
        log_r = (trainer_lp - sampler_lp).float() * m
        if level == "sequence":
            change = torch.zeros_like(versions, dtype=torch.long)
            change[:, 1:] = (versions[:, 1:] != versions[:, :-1]).long()
            seg = torch.cumsum(change, dim=1) + torch.arange(versions.shape[0], device=versions.device)[:, None] * (
                versions.shape[1] + 1
            )
            total = torch.zeros(int(seg.max()) + 1, device=log_r.device).index_add_(0, seg.flatten(), log_r.flatten())
            log_r = total[seg]
        log_cap = math.log(cap)
        clipped = (log_r > log_cap).float() * m
        w = torch.where(m > 0, torch.exp(torch.clamp(log_r, max=log_cap)), torch.ones_like(log_r))
        stale = ((versions < trainer_version) & (versions >= 0)).float() * m
        out: dict[str, float] = {}
        for key, tw in [("", weights), *((f"/{t}", v) for t, v in (task_weights or {}).items())]:
            tw = tw.to(m.device)
            out["corrected_frac" + key] = float((stale * tw).sum())
            out["tis_clip_frac" + key] = float((clipped * tw).sum())
            if not key:
                out["tis_weight_mean"] = float((w * m * tw).sum())
    return w, out
