"""Affinity routing shared by :class:`Cluster` (``@hw_mapping``) and the LLMProxy.

Pure functions over (hardware, in-flight count) so the same rule runs in the driver, in a
rollout actor, and under the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollart_nb.resources.profiles import PROFILES

__all__ = [
    "TokenProfile",
    "assign_affinity",
    "hardware_kinds",
    "hardware_matches",
    "pick_worker",
    "profile_affinity",
    "shape_affinity",
    "turn_device_seconds",
]

#: Turns of a task observed before its measured profile decides its routing.
MIN_PROFILE_TURNS = 8


def hardware_matches(hardware: str, pool: str, pref: str) -> bool:
    """True if a worker on ``hardware``/``pool`` satisfies preference ``pref``.

    ``pref`` is a hardware name ("H20"), a pool name, or "compute"/"bandwidth" for any
    compute- or bandwidth-optimized device.
    """
    p = pref.lower()
    if p in ("compute", "bandwidth"):
        prof = PROFILES.get(hardware.upper())
        return prof is not None and prof.optimized_for == p
    return hardware.upper() == pref.upper() or pool == pref


def pick_worker(
    workers: Sequence[tuple[str, str]],
    inflight: Sequence[int],
    pref: str | None,
    max_inflight: int | Sequence[int],
    exclude: frozenset[int] = frozenset(),
) -> tuple[int, bool]:
    """Choose a worker index for one call; returns ``(index, fell_back)``.

    Matching workers (see :func:`hardware_matches`) with fewer than ``max_inflight`` calls
    win, least loaded first; else the least-loaded non-matching worker with room (a
    fallback); else the least-loaded worker overall.

    Args:
        workers: (hardware, pool) per worker.
        inflight: calls in flight per worker.
        pref: preferred hardware, or None for "any".
        max_inflight: in-flight count at which a worker counts as busy: one for all, or one per
            worker (its engine's capacity).
        exclude: indices not to use (e.g. dead workers).
    """
    limit = [max_inflight] * len(workers) if isinstance(max_inflight, int) else list(max_inflight)
    order = sorted((i for i in range(len(workers)) if i not in exclude), key=lambda i: (inflight[i], i))
    if not order:
        raise IndexError("no worker to route to")
    if pref is None:
        return order[0], False
    match = [i for i in order if hardware_matches(*workers[i], pref)]
    free = [i for i in match if inflight[i] < limit[i]]
    if free:
        return free[0], False
    others = [i for i in order if i not in match and inflight[i] < limit[i]]
    if others:
        return others[0], True
    return order[0], order[0] not in match


def shape_affinity(shape: str | None) -> str | None:
    """Default hardware preference of a task shape: prefill-heavy -> compute, decode-heavy -> bandwidth."""
    return {"prefill": "compute", "decode": "bandwidth"}.get(shape or "")


@dataclass
class TokenProfile:
    """A task's measured token profile, per generation turn: prompt tokens the worker had to
    compute (those it did not hold), the context they extend, and the tokens generated."""

    turns: int = 0
    new_tokens: int = 0
    context_tokens: int = 0
    generated_tokens: int = 0

    def observe(self, new: int, context: int, generated: int) -> None:
        self.turns += 1
        self.new_tokens += new
        self.context_tokens += context
        self.generated_tokens += generated

    def means(self) -> tuple[float, float, float]:
        """Mean (new prompt, context, generated) tokens per turn."""
        n = max(self.turns, 1)
        return self.new_tokens / n, self.context_tokens / n, self.generated_tokens / n


def turn_device_seconds(spec: Any, hardware: str, profile: TokenProfile, batch: float, tp: int = 1) -> float:
    """Roofline device-seconds one mean turn of ``profile`` takes from ``hardware``: its prefill
    holds the whole device (every decode sharing it waits), its decode shares each step with
    ``batch`` sequences (:mod:`rollart_nb.sim.roofline`)::

        prefill_time(new, context) + decode_time(generated, context + new, batch) / batch
    """
    from rollart_nb.sim.roofline import decode_time, prefill_time

    hw = PROFILES[hardware.upper()]
    new, ctx, gen = profile.means()
    b = max(int(round(batch)), 1)
    prefill = prefill_time(spec, hw, int(round(new)), int(round(ctx)), tp=tp)
    return prefill + decode_time(spec, hw, int(round(gen)), ctx + new, batch=b, tp=tp) / b


def profile_affinity(spec: Any, hardware: Sequence[str], profile: TokenProfile, batch: float) -> str | None:
    """Where a task's measured profile runs best, relative to the cluster's other hardware:
    "compute" if its turn takes more device time on the bandwidth-optimized devices than on the
    compute-optimized ones (prefill-heavy, long context: FLOPs dominate), "bandwidth" if it does
    not (decode-heavy: weight and KV reads dominate), None when the cluster lacks one of the two
    kinds, the profile has fewer than :data:`MIN_PROFILE_TURNS` turns, or a device is unknown.

    The comparison is the roofline device time of the mean turn (:func:`turn_device_seconds`)
    on the fastest device of each kind, so no threshold is tuned: the devices' own FLOP/s and
    bandwidth decide.
    """
    kinds = hardware_kinds(hardware)
    if profile.turns < MIN_PROFILE_TURNS or kinds is None:
        return None
    best = {k: _best_seconds(spec, hs, profile, batch) for k, hs in kinds.items()}
    return "compute" if best["bandwidth"] > best["compute"] else "bandwidth"


def hardware_kinds(hardware: Sequence[str]) -> dict[str, list[str]] | None:
    """The cluster's hardware types by kind, ``{"compute": [...], "bandwidth": [...]}``; None
    unless both kinds are there and every type is a known profile (routing by token profile has
    nothing to choose between otherwise)."""
    kinds: dict[str, list[str]] = {"compute": [], "bandwidth": []}
    for h in set(hardware):
        prof = PROFILES.get(h.upper())
        if prof is None:
            return None
        if prof.optimized_for in kinds:
            kinds[prof.optimized_for].append(h)
    return kinds if kinds["compute"] and kinds["bandwidth"] else None


def _best_seconds(spec: Any, hardware: Sequence[str], profile: TokenProfile, batch: float) -> float:
    """Device time of the mean turn on the fastest of ``hardware``."""
    return min(turn_device_seconds(spec, h, profile, batch) for h in hardware)


def assign_affinity(
    spec: Any, hardware: Sequence[str], profiles: dict[str, TokenProfile], batch: float
) -> dict[str, str]:
    """Each task's kind of hardware by comparative advantage: the roofline device time of its mean
    turn on the best bandwidth-optimized device over that on the best compute-optimized one
    (:func:`turn_device_seconds`) ranks the tasks; those above the geometric mean of all ratios go
    to compute-optimized devices (they lose most on the others: prefill-heavy, long context), the
    rest to bandwidth-optimized ones. With one task, the plain comparison of
    :func:`profile_affinity` decides. Tasks with fewer than :data:`MIN_PROFILE_TURNS` turns, or a
    cluster without both kinds, get nothing.

    Ranking, rather than comparing each task with 1, keeps the decision stable where a low
    decode batch makes every turn weight-read-bound (then a bandwidth-optimized device is a
    little faster for every task, but not equally so).
    """
    ready = {t: p for t, p in profiles.items() if p.turns >= MIN_PROFILE_TURNS}
    kinds = hardware_kinds(hardware)
    if not ready or kinds is None:
        return {}
    if len(ready) == 1:
        ((t, p),) = ready.items()
        pref = profile_affinity(spec, hardware, p, batch)
        return {t: pref} if pref else {}
    ratio = {
        t: _best_seconds(spec, kinds["bandwidth"], p, batch) / _best_seconds(spec, kinds["compute"], p, batch)
        for t, p in ready.items()
    }
    mean = math.exp(sum(math.log(r) for r in ratio.values()) / len(ratio))
    return {t: "compute" if r > mean else "bandwidth" for t, r in ratio.items()}
