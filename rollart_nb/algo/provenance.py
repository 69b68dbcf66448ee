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

__all__ = ["MISMATCH_METRICS", "RATIO_BAND", "TokenRecorder"]

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
