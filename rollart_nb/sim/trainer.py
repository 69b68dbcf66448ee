"""SimTrainBackend: a training backend whose step time comes from the roofline model.

It consumes real trajectories (their token counts and rewards) and advances the policy
version like a real trainer, but computes no gradients: a step sleeps
``train_time(tokens) * time_scale``. Its metrics are only numbers it actually knows (token
counts, the mean response length, modelled time, the batch's rewards). Of the training metrics
a GRPO trainer reports (:data:`~rollart_nb.algo.grpo.TRAIN_METRICS`) it has only
``response_length``: it computes no loss, KL, entropy, gradient or clipping, and made-up curves
would read as a real run's on the dashboard, so it leaves them out (the plot shows what is there).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path
from typing import Any

from rollart_nb.algo.grpo import mean_response_length, micro_batches
from rollart_nb.clock import host_for, resolve_time_scale
from rollart_nb.clock import sleep as clock_sleep
from rollart_nb.errors import ConfigError, StateError
from rollart_nb.models.spec import ModelSpec
from rollart_nb.resources.profiles import HardwareProfile
from rollart_nb.sim.roofline import train_time
from rollart_nb.trajectory import Trajectory

__all__ = ["SIM_STATE", "SimTrainBackend", "flops_factor", "padded_tokens", "trajectory_tokens"]

SIM_STATE = "sim_trainer.json"
"""File name of a sim trainer checkpoint."""


def trajectory_tokens(traj: Trajectory) -> int:
    """Tokens one trajectory contributes to training: its full sequence (the last turn's
    prompt, which holds the whole history, plus its response), as a trainer packs one row
    per trajectory. Turns with a non-cumulative prompt are summed instead."""
    if not traj.turns:
        return 0
    last = traj.turns[-1]
    full = len(last.prompt_ids) + len(last.response_ids)
    # A history-carrying last prompt is at least as long as every earlier turn's tokens.
    if all(len(t.prompt_ids) <= len(last.prompt_ids) for t in traj.turns):
        return full
    return traj.num_tokens


def padded_tokens(lengths: list[int], algo: Any) -> int:
    """Tokens a padding trainer computes on: rows of ``lengths`` sorted, cut into micro-batches
    of ``algo.micro_batch_size`` rows and ``algo.micro_batch_tokens`` padded tokens
    (:func:`~rollart_nb.algo.grpo.micro_batches`), each micro-batch ``rows x longest row``.

    Example:
        >>> from rollart_nb.algo.grpo import GRPO
        >>> padded_tokens([10, 40, 12], GRPO(micro_batch_size=2, micro_batch_tokens=0))
        64
    """
    rows = sorted(n for n in lengths if n > 0)
    spans = micro_batches(rows, max(1, int(algo.micro_batch_size)), int(getattr(algo, "micro_batch_tokens", 0) or 0))
    return sum((hi - lo) * rows[hi - 1] for lo, hi in spans)


def flops_factor(algo: Any) -> float:
    """FLOPs per parameter and token of one GRPO train step, over the roofline's 6: forward and
    backward per epoch (``6 * epochs``) plus a reference forward (2) when a KL term is on.

    Example:
        >>> from rollart_nb.algo.grpo import GRPO
        >>> flops_factor(GRPO(kl_coef=0.0)), flops_factor(GRPO(kl_coef=0.1, epochs=2))
        (1.0, 2.3333333333333335)
    """
    epochs = int(getattr(algo, "epochs", 1))
    ref = 2.0 if getattr(algo, "kl_coef", 0.0) > 0 else 0.0
    return (6.0 * epochs + ref) / 6.0


class SimTrainBackend:
    """Roofline-timed train backend (implements :class:`~rollart_nb.protocols.TrainBackend`).

    Args:
        gpus: devices the step is spread over (data/tensor/pipeline parallel alike).
        time_scale: seconds slept per modelled second (0: no sleep); default
            :func:`rollart_nb.clock.resolve_time_scale`.
        algo: the run's GRPO settings, to price the step as a padding trainer runs it
            (:func:`flops_factor` times :func:`padded_tokens`); None: every token once at 6 FLOPs
            per parameter, as a packing trainer runs it.
        step_overhead_s: fixed seconds per optimizer step besides its FLOPs
            (:func:`rollart_nb.bench.real_costs.measure_trainer`).
        export_overhead_s: fixed seconds to hand the weights over for a sync, paid by
            :meth:`aexport` (:func:`rollart_nb.bench.real_costs.measure_weight_sync`).

    Example:
        >>> from rollart_nb.models.spec import spec
        >>> from rollart_nb.resources.profiles import PROFILES
        >>> t = SimTrainBackend(spec("qwen3-8b"), PROFILES["H800"], gpus=32, time_scale=0)
        >>> t.train_step([])["tokens"], t.version
        (0.0, 1)
    """

    def __init__(
        self,
        spec: ModelSpec,
        hardware: HardwareProfile,
        gpus: int = 1,
        time_scale: float | None = None,
        mfu: float = 0.4,
        algo: Any = None,
        step_overhead_s: float = 0.0,
        export_overhead_s: float = 0.0,
    ) -> None:
        problems = []
        if gpus < 1:
            problems.append(f"gpus must be >= 1, got {gpus}")
        time_scale = resolve_time_scale(time_scale)
        if time_scale < 0:
            problems.append(f"time_scale must be >= 0, got {time_scale}")
        if not 0 < mfu <= 1:
            problems.append(f"mfu must be in (0, 1], got {mfu}")
        if step_overhead_s < 0:
            problems.append(f"step_overhead_s must be >= 0, got {step_overhead_s}")
        if export_overhead_s < 0:
            problems.append(f"export_overhead_s must be >= 0, got {export_overhead_s}")
        if problems:
            raise ConfigError(problems, where="SimTrainBackend")
        self.spec, self.hardware, self.gpus = spec, hardware, gpus
        self.time_scale, self.mfu = time_scale, mfu
        self.algo, self.step_overhead_s, self.export_overhead_s = algo, step_overhead_s, export_overhead_s
        self.version = 0
        self.modelled_s = 0.0  # total modelled training seconds
        self.published_at: float | None = None

    def train_step(self, batch: list[Trajectory]) -> dict[str, float]:
        """One optimizer step over ``batch``: sleep the modelled time, bump the version.

        Blocks (:func:`rollart_nb.clock.sleep`): call it off any event loop (:meth:`atrain_step` on one).

        Returns:
            ``tokens``, ``trajectories``, ``response_length`` (mean generated tokens per
            trajectory; NaN for an empty batch), ``modelled_s``, ``reward_mean`` (over scored
            trajectories; NaN if none), ``version`` (after the step).
        """
        tokens, modelled_s = self._price(batch)
        if self.time_scale > 0:
            clock_sleep(modelled_s * self.time_scale)
        return self._finish(batch, tokens, modelled_s)

    async def _compute(self, modelled_s: float) -> None:
        if self.time_scale > 0:
            await host_for(self.hardware).compute(modelled_s * self.time_scale)

    async def aexport(self) -> dict[str, Any]:
        """:meth:`state_dict` after ``export_overhead_s`` (the weights handed over for a sync);
        with an overhead, the weights count as published when the export ends."""
        await self._compute(self.export_overhead_s)
        if self.export_overhead_s > 0 and self.time_scale > 0:
            self.published_at = asyncio.get_running_loop().time()
        return self.state_dict()

    async def atrain_step(self, batch: list[Trajectory]) -> dict[str, float]:
        """:meth:`train_step` as a coroutine (work on the host's shared cores for a CPU device).
        Its metrics add ``step_s``: the seconds it took (``modelled_s`` unless cores were shared)."""
        tokens, modelled_s = self._price(batch)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await self._compute(modelled_s)
        out = self._finish(batch, tokens, modelled_s)
        if self.time_scale > 0:
            out["step_s"] = (loop.time() - t0) / self.time_scale
        return out

    def _price(self, batch: list[Trajectory]) -> tuple[int, float]:
        lengths = [trajectory_tokens(t) for t in batch]
        tokens = sum(lengths)
        priced = tokens if self.algo is None else padded_tokens(lengths, self.algo) * flops_factor(self.algo)
        return tokens, train_time(self.spec, self.hardware, priced, self.gpus, self.mfu) + self.step_overhead_s

    def _finish(self, batch: list[Trajectory], tokens: int, modelled_s: float) -> dict[str, float]:
        self.modelled_s += modelled_s
        self.version += 1
        try:  # when these weights were published (loop time), for the generators' background pull
            self.published_at = asyncio.get_running_loop().time()
        except RuntimeError:  # called off any loop (train_step on a thread): the pull starts when asked
            self.published_at = None
        rewards = [t.reward for t in batch if not math.isnan(t.reward)]
        return {
            "tokens": float(tokens),
            "trajectories": float(len(batch)),
            "response_length": mean_response_length(batch),
            "modelled_s": modelled_s,
            "reward_mean": sum(rewards) / len(rewards) if rewards else math.nan,
            "version": float(self.version),
        }

    def save_checkpoint(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``directory/sim_trainer.json`` (atomically: its presence marks a complete checkpoint)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / (SIM_STATE + ".tmp")
        tmp.write_text(json.dumps({"version": self.version, "modelled_s": self.modelled_s, "model": self.spec.name}))
        os.replace(tmp, d / SIM_STATE)
        return d

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> None:
        """Restore what :meth:`save_checkpoint` wrote (same model spec required)."""
        f = Path(directory) / SIM_STATE
        if not f.is_file():
            raise StateError(f"{str(directory)!r} holds no complete sim trainer checkpoint ({SIM_STATE} missing)")
        state = json.loads(f.read_text())
        if state["model"] != self.spec.name:
            raise ConfigError(
                f"checkpoint {str(directory)!r} is of model {state['model']!r}, this trainer models "
                f"{self.spec.name!r}; resume with the model it was saved from"
            )
        self.version, self.modelled_s = int(state["version"]), float(state["modelled_s"])

    def state_dict(self) -> dict[str, Any]:
        """A tiny stand-in for the weights: ``{"version": v, "published_at": loop time}`` (what
        :meth:`~rollart_nb.sim.backend.SimBackend.aload_weights` needs to price the pull)."""
        return {"version": self.version, "published_at": self.published_at}

    def __repr__(self) -> str:
        return f"SimTrainBackend({self.spec.name} on {self.gpus}x{self.hardware.name}, version={self.version})"
