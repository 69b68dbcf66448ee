"""Training with plain PyTorch (CPU or one GPU): the ``torch`` train backend.

How a trajectory becomes training rows
--------------------------------------
When every turn's ``prompt_ids + response_ids`` is a prefix of the last turn's, the
trajectory becomes ONE row (the final sequence, loss mask on every turn's response times its
``loss_mask``), so each response token sees the context it was generated from. Otherwise it
falls back to one row per turn: more compute, still exact. With ``loss_agg="seq-mean"`` a
trajectory's rows weigh as one sequence.

Behaviour logprobs are the turns' ``logprobs`` (the trainer's own, detached, where missing:
ratio 1). Reference logprobs are the turns' ``ref_logprobs`` when a :class:`ReferencePolicy`
filled them for a whole micro-batch; otherwise the trainer computes them itself.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollart_nb.algo.grpo import (
    GRPO,
    batch_advantages,
    grpo_loss,
    loss_weights,
    mean_response_length,
    micro_batches,
    step_metrics,
    task_weights,
)
from rollart_nb.algo.provenance import TokenRecorder, tis_weights
from rollart_nb.errors import ConfigError, StateError
from rollart_nb.models.tiny import ModelRef, from_pretrained
from rollart_nb.tokens import starts_with
from rollart_nb.trajectory import Trajectory, Turn

__all__ = ["ReferencePolicy", "TorchTrainBackend", "build_rows"]

log = logging.getLogger(__name__)

_STATE_FILE = "trainer.pt"


@dataclass
class Row:
    """One training sequence.

    Attributes:
        ids: token ids, shape [L].
        mask: 1.0 on trained tokens, shape [L] (position i is token i).
        old_logprobs: behaviour logprobs, NaN where unknown, shape [L].
        traj: index of the trajectory in the batch.
        ref_logprobs: reference-policy logprobs from the turns' ``ref_logprobs``, NaN where
            unknown, shape [L].
        seq: which of the trajectory's training sequences this is.
        versions: the policy version that wrote each token, -1 on the prompt side, shape [L].
    """

    ids: list[int]
    mask: list[float]
    old_logprobs: list[float]
    traj: int
    ref_logprobs: list[float] = field(default_factory=list)
    seq: int = 0
    versions: list[int] = field(default_factory=list)


def row_groups(traj: Trajectory) -> list[tuple[list[int], list[Turn]]]:
    """The token sequences a trajectory trains on, each with the turns whose responses lie in it:
    one sequence for the whole trajectory when every turn extends the previous one, else one
    per turn (see the module docstring)."""
    turns = [t for t in traj.turns if t.response_ids]
    if not turns:
        return []
    last = turns[-1]
    final = list(last.prompt_ids) + list(last.response_ids)
    # Views of one buffer (what the EnvManager records) are checked by position, lists by value.
    consistent = all(
        starts_with(last.prompt_ids, parts) or starts_with(final, parts)
        for parts in ((t.prompt_ids, t.response_ids) for t in turns[:-1])
    )
    return [(final, turns)] if consistent else [(list(t.prompt_ids) + list(t.response_ids), [t]) for t in turns]


def build_rows(traj: Trajectory, index: int = 0) -> list[Row]:
    """Turn a trajectory into training rows (see the module docstring for the rule)."""
    rows = []
    for seq, (ids, members) in enumerate(row_groups(traj)):
        mask, old, ref = [0.0] * len(ids), [math.nan] * len(ids), [math.nan] * len(ids)
        versions = [-1] * len(ids)
        for t in members:
            start, n = len(t.prompt_ids), len(t.response_ids)
            tmask = t.loss_mask if len(t.loss_mask) == n else [1] * n
            tlp = t.logprobs if len(t.logprobs) == n else [math.nan] * n
            tref = t.ref_logprobs if len(t.ref_logprobs) == n else [math.nan] * n
            for j in range(n):
                mask[start + j] = float(tmask[j])
                old[start + j] = float(tlp[j])
                ref[start + j] = float(tref[j])
            for lo, hi, v in t.segments():
                versions[start + lo : start + hi] = [v] * (hi - lo)
        if mask[0]:
            raise ConfigError(f"trajectory {traj.id}: a turn has an empty prompt; the first token has no context")
        rows.append(Row(ids, mask, old, index, ref, seq, versions))
    return rows


def batch_rows(batch: list[Trajectory]) -> list[Row]:
    """A batch's training rows (:func:`build_rows`); ConfigError: empty, unscored or nothing to train."""
    if not batch:
        raise ConfigError("train_step got an empty batch")
    unscored = [t.id for t in batch if not math.isfinite(t.reward)]
    if unscored:
        raise ConfigError(f"trajectories {unscored[:5]} have no finite reward; score them before training")
    rows = [r for i, t in enumerate(batch) for r in build_rows(t, i)]
    if not rows or not any(any(r.mask) for r in rows):
        raise ConfigError("batch has no trainable tokens (no turn has response_ids with loss_mask 1)")
    return rows


def row_tensors(
    rows: list[Row], adv: torch.Tensor, tasks: list[str], loss_agg: str
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """For ``rows`` and the batch's per-trajectory ``adv`` and ``tasks``: the trained-token mask
    [N, L-1], the loss weights [N, L-1], the per-task metric weights (not the loss's) and the
    rows' advantages [N]."""
    width = max(len(r.ids) for r in rows)
    mask = torch.tensor([r.mask + [0.0] * (width - len(r.ids)) for r in rows])[:, 1:]
    row_tasks = [tasks[r.traj] for r in rows]
    weights = loss_weights(mask, loss_agg, [r.traj for r in rows], row_tasks)
    return mask, weights, task_weights(mask, row_tasks), adv[torch.tensor([r.traj for r in rows])]


def _pad_ids(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token sequences: real tokens keep positions 0..L-1, exactly as in generation."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    return ids.to(device), attn.to(device)


def _token_logprobs(
    model: Any,
    ids: torch.Tensor,
    attn: torch.Tensor,
    with_entropy: bool = False,
    entropy_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of token t given tokens < t, for t = 1..L-1: shape [B, L-1], and the per-token
    entropy of the next-token distribution, shape [B, L-1] or None.

    Args:
        with_entropy: the entropy at every position, differentiable (for an entropy bonus).
        entropy_mask: shape [B, L-1]; without ``with_entropy``, the entropy at these positions only
            (0 elsewhere) and without grad: a metric that leaves the gradient as it is.
    """
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, ids[:, 1:, None])[..., 0]
    if with_entropy:
        return lp, -(logp.exp() * logp).sum(-1)
    return lp, None if entropy_mask is None else _entropy_at(logp.detach(), entropy_mask)


@torch.no_grad()
def _entropy_at(logp: torch.Tensor, mask: torch.Tensor, chunk_tokens: int = 1024) -> torch.Tensor:
    """Entropy of the distributions ``logp`` [B, T, V] at the positions where ``mask`` [B, T] is set
    (0 elsewhere): shape [B, T]. Only trained tokens, ``chunk_tokens`` at a time, so the metric
    costs one pass over their logits and little memory beyond the forward pass's."""
    out = torch.zeros(logp.shape[:2], dtype=logp.dtype, device=logp.device)
    rows, cols = (mask > 0).nonzero(as_tuple=True)
    for i in range(0, rows.numel(), chunk_tokens):
        r, c = rows[i : i + chunk_tokens], cols[i : i + chunk_tokens]
        sel = logp[r, c]
        out[r, c] = -(sel.exp() * sel).sum(-1)
    return out


class ReferencePolicy:
    """The KL reference as a worker of its own: fills each turn's ``ref_logprobs``, so a
    :class:`TorchTrainBackend` given those trajectories skips its reference forward pass.

    Load it from the same path the trainer started from; run it where it overlaps training.

    Args:
        model: a :class:`ModelRef` or a path to a Hugging Face model directory.
        device: torch device; default ``cuda`` when available, else ``cpu``.
        micro_batch_tokens: padded tokens per forward pass (0: one pass for the whole batch).

    Example:
        >>> ref = ReferencePolicy(model_path)                 # doctest: +SKIP
        >>> ref.score(trajectories)                           # fills turn.ref_logprobs
        >>> trainer.train_step(trajectories)                  # doctest: +SKIP
    """

    def __init__(self, model: ModelRef | str, device: str | None = None, micro_batch_tokens: int = 4096):
        ref = model if isinstance(model, ModelRef) else from_pretrained(model)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        tok = ref.load_tokenizer()
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.model = ref.load_model(dtype=torch.float32, device=self.device).requires_grad_(False).eval()
        self.micro_batch_tokens = micro_batch_tokens

    def score(self, batch: list[Trajectory]) -> None:
        """Set ``ref_logprobs`` on every turn of ``batch`` that has a response, in place."""
        seqs = [(ids, members) for t in batch for ids, members in row_groups(t)]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
        lengths = [len(seqs[i][0]) for i in order]
        with torch.no_grad():
            for lo, hi in micro_batches(lengths, len(lengths), self.micro_batch_tokens):
                part = [seqs[i] for i in order[lo:hi]]
                ids, attn = _pad_ids([p[0] for p in part], self.pad_id, self.device)
                lp = _token_logprobs(self.model, ids, attn)[0].cpu()
                for row, (_, members) in enumerate(part):
                    for turn in members:
                        start, n = len(turn.prompt_ids), len(turn.response_ids)
                        turn.ref_logprobs = lp[row, start - 1 : start - 1 + n].tolist()


class TorchTrainBackend:
    """A :class:`~rollart_nb.protocols.TrainBackend`: GRPO with AdamW on a HF causal LM.

    Args:
        model: a :class:`ModelRef` or a path to a Hugging Face model directory.
        algo: the :class:`GRPO` config.
        seed: seeds torch's RNG of this process (the trainer owns its worker process).
        device: torch device; default ``cuda`` when available, else ``cpu``.

    Example:
        >>> trainer = TorchTrainBackend(rn.models.tiny_qwen(), GRPO(group_size=4))  # doctest: +SKIP
        >>> metrics = trainer.train_step(scored_trajectories)                       # doctest: +SKIP
        >>> trainer.version                                                          # doctest: +SKIP
        1
    """

    def __init__(self, model: ModelRef | str, algo: GRPO | None = None, seed: int = 0, device: str | None = None):
        self.ref = model if isinstance(model, ModelRef) else from_pretrained(model)
        self.algo = algo or GRPO()
        self.seed = seed
        torch.manual_seed(seed)
        random.seed(seed)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = self.ref.load_tokenizer()
        self.model = self.ref.load_model(dtype=torch.float32, device=self.device)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # The KL reference is the policy we start from; kept only when it is used.
        self.reference = copy.deepcopy(self.model).requires_grad_(False) if self.algo.kl_coef > 0 else None
        # The fused kernel (CPU and CUDA, float32/16) is ~3x faster than the per-tensor loop;
        # same update up to float rounding.
        fused = self.device.type in ("cpu", "cuda") and all(
            p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in self.model.parameters()
        )
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.algo.lr, weight_decay=self.algo.weight_decay, fused=fused or None
        )
        self.version = 0

    # -- TrainBackend -------------------------------------------------------------------
    def train_step(self, batch: list[Trajectory]) -> dict[str, Any]:
        """One optimizer step on scored trajectories; bumps :attr:`version` by one.

        Returns:
            The step's metrics (:func:`~rollart_nb.algo.grpo.step_metrics`), among them ``loss``,
            ``kl``, ``entropy``, ``grad_norm``, ``clip_frac``, ``response_length`` and the
            :data:`~rollart_nb.algo.provenance.MISMATCH_METRICS`; with several ``epochs``, the
            loss terms are the last epoch's. ``token_records``: per trajectory id, what the step
            computed for each token (:meth:`~rollart_nb.algo.provenance.TokenRecorder.records`).

        Raises:
            ConfigError: empty batch, unscored trajectories, or no trainable tokens.
        """
        t0 = time.perf_counter()
        rows = batch_rows(batch)
        rewards, adv = batch_advantages(self.algo, batch)
        num_rows = len(rows)
        regularized = (self.algo.entropy_coef or self.algo.kl_coef) and self.algo.regularize_all_rows
        if self.algo.skip_zero_advantage and not regularized:
            # A row whose advantage is 0 adds nothing to the policy gradient; skip its forward/backward.
            rows = [r for r in rows if float(adv[r.traj]) != 0.0]
        recorder = TokenRecorder(batch, rows)
        sums: dict[str, float] = {
            "loss": 0.0,
            "pg_loss": 0.0,
            "clip_frac": 0.0,
            "ratio_mean": 1.0,
            "approx_kl_old": 0.0,
            "kl": math.nan,  # nothing trained: nothing measured
            "entropy": math.nan,
        }
        grad_norm = 0.0
        if rows:
            # per micro-batch, once per batch: the reference pass and the tis reference (the policy before the update)
            cache: dict[tuple[str, int, int], torch.Tensor] = {}
            for epoch in range(self.algo.epochs):
                rec = recorder if epoch == 0 else None  # the policy before the update scores the tokens
                sums, grad_norm = self._optimize(rows, adv, [t.task for t in batch], cache, rec)
        # else: no group had a reward spread, so there is no gradient, and no optimizer step either:
        # AdamW would keep moving the weights along its momentum on a zero gradient.
        self.version += 1
        sums["trained_rows"] = float(len(rows))
        sums["epochs"] = float(self.algo.epochs if rows else 0)
        sums.update(recorder.metrics())
        out: dict[str, Any] = step_metrics(
            sums,
            grad_norm=grad_norm,
            rewards=rewards,
            adv=adv,
            num_trajectories=len(batch),
            num_rows=num_rows,
            num_tokens=sum(sum(r.mask) for r in rows),
            step_s=time.perf_counter() - t0,
            version=self.version,
            response_length=mean_response_length(batch),
            task_response_length=mean_response_length(batch, by_task=True),
        )
        out["token_records"] = recorder.records(adv, self.version - 1)
        return out

    def _optimize(
        self,
        rows: list[Row],
        adv: torch.Tensor,
        tasks: list[str],
        cache: dict[tuple[str, int, int], torch.Tensor],
        recorder: TokenRecorder | None = None,
    ) -> tuple[dict[str, float], float]:
        """Forward/backward over ``rows`` in micro-batches, then one optimizer step (``tasks``: per
        trajectory of the batch, for ``loss_agg="task-token-mean"``; ``cache``: per micro-batch
        ``("ref", lo, hi)`` the reference logprobs and ``("prox", lo, hi)`` the trainer's own before
        the update (``tis``), filled on the first call for a batch and reused by later epochs;
        ``recorder``: takes each micro-batch's per-token figures)."""
        # Similar lengths share a micro-batch: less padding when tasks of very different lengths mix.
        rows = sorted(rows, key=lambda r: len(r.ids))
        mask, weights, by_task, row_adv = row_tensors(rows, adv, tasks, self.algo.loss_agg)

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for lo, hi in micro_batches(
            [len(r.ids) for r in rows], self.algo.micro_batch_size, self.algo.micro_batch_tokens
        ):
            sl = slice(lo, hi)
            part = rows[lo:hi]
            m = mask[sl, : max(len(r.ids) for r in part) - 1].to(self.device)
            # The entropy is always measured; with no bonus, without grad (the update is unchanged).
            new_lp, entropy, ids, attn = self._forward(part, with_entropy=self.algo.entropy_coef > 0, entropy_mask=m)
            w = weights[sl, : new_lp.shape[1]].to(self.device)
            task_w = {t: v[sl, : new_lp.shape[1]] for t, v in by_task.items()}
            if recorder is not None:
                recorder.add(part, new_lp, entropy, w)
            old = self._padded([r.old_logprobs for r in part], new_lp.shape[1] + 1, math.nan)[:, 1:]
            old = torch.where(torch.isnan(old), new_lp.detach(), old)
            isw = None
            if self.algo.tis != "off":  # the PPO ratio is then against the trainer's own logprobs
                prox = cache.setdefault(("prox", lo, hi), new_lp.detach())
                old, isw = prox, self._tis(part, prox, old, m, w, task_w, sums)
            ref_lp = None
            if self.reference is not None:
                ref_lp = cache.get(("ref", lo, hi))
                if ref_lp is None:
                    given = self._padded([r.ref_logprobs for r in part], new_lp.shape[1] + 1, math.nan)[:, 1:]
                    if bool(torch.isfinite(given)[m > 0].all()):  # a ReferencePolicy scored every trained token
                        ref_lp = torch.where(m > 0, given, torch.zeros_like(given))
                    else:
                        with torch.no_grad():
                            ref_lp = _token_logprobs(self.reference, ids, attn)[0]
                    cache["ref", lo, hi] = ref_lp
            loss, metrics = grpo_loss(
                new_lp,
                old,
                row_adv[sl].to(self.device),
                m,
                clip_eps=self.algo.clip_eps,
                clip_eps_high=self.algo.clip_eps_high,
                weights=w,
                ref_logprobs=ref_lp,
                kl_coef=self.algo.kl_coef,
                entropy=entropy,
                entropy_coef=self.algo.entropy_coef,
                task_weights=task_w,
                is_weights=isw,
            )
            loss.backward()  # weights sum to 1 over the batch: accumulation is exact
            sums["loss"] = sums.get("loss", 0.0) + float(loss.detach())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        max_norm = self.algo.max_grad_norm or float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        self.optimizer.step()
        self.model.eval()
        return sums, grad_norm

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Model weights as detached CPU tensors (safe to publish while training goes on)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    # -- probes and checkpoints ---------------------------------------------------------
    def logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Logprobs of ``response_ids`` after ``prompt_ids`` under the current weights, shape [R]."""
        if not prompt_ids:
            raise ConfigError("logprobs needs a non-empty prompt")
        ids = torch.tensor([list(prompt_ids) + list(response_ids)], device=self.device)
        self.model.eval()
        with torch.no_grad():
            lp, _ = _token_logprobs(self.model, ids, torch.ones_like(ids))
        return lp[0, len(prompt_ids) - 1 :].tolist()

    def save_checkpoint(self, directory: str | os.PathLike[str]) -> Path:
        """Save model (servable HF dir under ``model/``), optimizer, version and RNG states."""
        d = Path(directory)
        (d / "model").mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(d / "model")
        self.tokenizer.save_pretrained(d / "model")
        state = {
            "version": self.version,
            "optimizer": self.optimizer.state_dict(),
            "algo": self.algo.to_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "reference": None if self.reference is None else self.reference.state_dict(),
        }
        # Written last and atomically: its presence marks a complete checkpoint.
        tmp = d / (_STATE_FILE + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, d / _STATE_FILE)
        log.info("saved trainer checkpoint version %d to %s", self.version, d)
        return d

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same architecture required)."""
        from transformers import AutoModelForCausalLM

        d = Path(directory)
        if not (d / _STATE_FILE).is_file():
            raise StateError(f"{str(d)!r} holds no complete trainer checkpoint ({_STATE_FILE} missing)")
        state = torch.load(d / _STATE_FILE, map_location="cpu", weights_only=True)
        saved = AutoModelForCausalLM.from_pretrained(d / "model", dtype=torch.float32)
        self.model.load_state_dict(saved.state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("algo"):  # the settings it trained with (a later configure() may change them)
            self.algo = GRPO(**state["algo"])
        if state.get("reference") is not None:
            if self.reference is None:  # this trainer was built without KL: make room for the saved one
                self.reference = copy.deepcopy(self.model).requires_grad_(False)
            self.reference.load_state_dict(state["reference"])
        self.version = int(state["version"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])

    @property
    def algo(self) -> GRPO:
        """The GRPO settings of the next step."""
        return self._algo

    @algo.setter
    def algo(self, algo: GRPO) -> None:
        """Train with ``algo`` from the next step: its learning rate and weight decay go to the
        optimizer, and turning KL on keeps the current policy as the reference."""
        self._algo = algo
        opt = getattr(self, "optimizer", None)
        if opt is not None:
            for g in opt.param_groups:
                g["lr"], g["weight_decay"] = algo.lr, algo.weight_decay
        if algo.kl_coef > 0 and getattr(self, "reference", None) is None and hasattr(self, "model"):
            self.reference = copy.deepcopy(self.model).requires_grad_(False)

    # -- internals ----------------------------------------------------------------------
    def _tis(
        self,
        part: list[Row],
        prox: torch.Tensor,
        sampler: torch.Tensor,
        m: torch.Tensor,
        w: torch.Tensor,
        task_w: dict[str, torch.Tensor],
        sums: dict[str, float],
    ) -> torch.Tensor:
        """The truncated importance weights of ``part``'s tokens, the trainer's logprobs before
        the update (``prox``) against the sampler's (:func:`~rollart_nb.algo.provenance.tis_weights`),
        their figures summed into ``sums``."""
        versions = self._padded([[float(v) for v in r.versions] for r in part], prox.shape[1] + 1, -1.0)[:, 1:]
        isw, metrics = tis_weights(
            prox, sampler, versions, m, cap=self.algo.tis_cap, level=self.algo.tis,
            trainer_version=self.version, weights=w, task_weights=task_w,
        )  # fmt: skip
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
        return isw

    def _padded(self, seqs: list[list[float]], width: int, fill: float) -> torch.Tensor:
        out = torch.full((len(seqs), width), fill, dtype=torch.float32)
        for i, s in enumerate(seqs):
            out[i, : len(s)] = torch.tensor(s, dtype=torch.float32)
        return out.to(self.device)

    def _forward(
        self, rows: list[Row], *, with_entropy: bool, entropy_mask: torch.Tensor
    ) -> tuple[torch.Tensor, Any, Any, Any]:
        ids, attn = _pad_ids([r.ids for r in rows], self.pad_id, self.device)
        lp, entropy = _token_logprobs(self.model, ids, attn, with_entropy=with_entropy, entropy_mask=entropy_mask)
        return lp, entropy, ids, attn
