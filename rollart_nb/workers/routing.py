"""Affinity routing shared by :class:`Cluster` (``@hw_mapping``) and the LLMProxy.

Pure functions over (hardware, in-flight count) so the same rule runs in the driver, in a
rollout actor, and under the simulator.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollart_nb.resources.profiles import PROFILES

__all__ = ["hardware_matches", "pick_worker", "shape_affinity"]


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
