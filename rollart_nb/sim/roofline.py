"""Roofline time model of LLM prefill, decode, training and weight sync.

Pure functions of a :class:`~rollart_nb.models.ModelSpec` and a
:class:`~rollart_nb.resources.profiles.HardwareProfile`. Each returns *modelled* seconds: the
time a phase would take on real hardware if it ran at a fixed fraction of peak (MFU for
compute, MBU for memory bandwidth). They are the simulator's only source of time, so every
formula is written out in its docstring.

Units: ``bf16_tflops`` is 10^12 FLOP/s per device, ``mem_bw_gbps`` and every ``gbps`` here
are GB/s (10^9 bytes/s; 200 Gbit/s Ethernet is 25 GB/s). ``tp`` devices split a model evenly
(tensor parallelism), and every pass pays its all-reduces over NVLink (:func:`tp_comm_time`).

Example:
    >>> from rollart_nb.models.spec import spec
    >>> from rollart_nb.resources.profiles import PROFILES
    >>> m = spec("qwen3-8b")
    >>> round(decode_step_time(m, PROFILES["H20"], batch=1, context_tokens_total=0) * 1e3, 2)
    5.86
"""

from __future__ import annotations

from rollart_nb.models.spec import ModelSpec
from rollart_nb.resources.profiles import HardwareProfile

__all__ = [
    "ACT_BYTES", "attention_flops", "decode_step_time", "decode_steps_within", "decode_time", "grad_sync_time",
    "iteration_time", "prefill_flops", "prefill_time", "tp_comm_time", "train_time", "weight_sync_time",
    "weights_read_bytes",
]  # fmt: skip


ACT_BYTES = 2
"""Bytes per activation element moved by tensor-parallel all-reduces (bf16)."""


def tp_comm_time(spec: ModelSpec, hw: HardwareProfile, tokens: int, tp: int) -> float:
    """Modelled seconds of a pass's tensor-parallel all-reduces over ``tokens`` tokens.

    Megatron-style tensor parallelism all-reduces the activations twice per layer (after the
    attention and after the MLP block). A ring all-reduce of ``n`` bytes moves
    ``2 * (tp - 1) / tp * n`` bytes through each device's link::

        time = 2 * layers * 2 * (tp - 1) / tp * tokens * hidden * ACT_BYTES / (nvlink_gbps * 1e9)

    Bandwidth only: the fixed latency of each all-reduce (microseconds) is not modelled, so
    small decode batches under-count it. 0 for ``tp == 1``.

    Raises:
        ValueError: ``tp > 1`` on a device without a link (``nvlink_gbps == 0``).
    """
    if tp <= 1 or tokens <= 0:
        return 0.0
    if hw.nvlink_gbps <= 0:
        raise ValueError(f"{hw.name} has no device interconnect (nvlink_gbps=0): tp must be 1, got {tp}")
    return 4.0 * spec.layers * (tp - 1) / tp * tokens * spec.hidden * ACT_BYTES / (hw.nvlink_gbps * 1e9)


def _check(tp: int, **effs: float) -> None:
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    for what, eff in effs.items():
        if not 0.0 < eff <= 1.0:
            raise ValueError(f"{what} must be in (0, 1], got {eff}")


def attention_flops(spec: ModelSpec, tokens: float, context: float) -> float:
    """FLOPs of the attention score and value products for ``tokens`` new tokens.

    Formula: ``4 * layers * hidden * tokens * (context + tokens / 2)``. Each new token
    attends to the ``context`` cached tokens and, causally, to about half of the new ones;
    ``QK^T`` and ``AV`` each cost ``2 * hidden`` FLOPs per (query, key) pair and layer. The
    query width is taken as ``hidden`` (true for Qwen3 dense models up to head-count rounding).
    """
    return 4.0 * spec.layers * spec.hidden * tokens * (context + tokens / 2.0)


def prefill_flops(spec: ModelSpec, tokens: int, context: int = 0) -> float:
    """FLOPs to prefill ``tokens`` new tokens after ``context`` cached ones.

    Formula: ``2 * active_params * tokens + attention_flops(spec, tokens, context)`` (one
    multiply-add per active parameter per token, plus attention).
    """
    return 2.0 * spec.active_params * tokens + attention_flops(spec, tokens, context)


def weights_read_bytes(spec: ModelSpec, tokens: int) -> float:
    """Bytes of weights one forward pass over ``tokens`` tokens must read.

    Dense models read every weight. For MoE models each token activates a fraction
    ``f = active_params / params`` of the weights; treating routing as uniform and
    independent, a pass over ``n`` tokens touches ``params * (1 - (1 - f) ** n)`` of them
    (``active_params`` for one token, all weights for large batches). Shared layers
    (attention, embeddings) are always read, so this slightly under-counts small batches.

    Formula: ``bytes_per_param * params * (1 - (1 - active_params / params) ** tokens)``.
    """
    if tokens <= 0:
        return 0.0
    frac = spec.active_params / spec.params
    return spec.bytes_per_param * spec.params * (1.0 - (1.0 - frac) ** tokens)


def prefill_time(
    spec: ModelSpec,
    hw: HardwareProfile,
    tokens: int,
    context: int = 0,
    tp: int = 1,
    mfu: float = 0.5,
) -> float:
    """Modelled seconds to prefill ``tokens`` new tokens after ``context`` cached ones.

    Compute-bound, with the weight read as a floor (a short prefill still streams the
    weights once), plus the profile's fixed cost of a pass::

        time = max(prefill_flops(spec, tokens, context) / (tp * bf16_tflops * 1e12 * mfu),
                   weights_read_bytes(spec, tokens) / (tp * mem_bw_gbps * 1e9))
               + tp_comm_time(spec, hw, tokens, tp) + pass_overhead_s

    ``tokens`` of 0 cost nothing; ``hw`` is each of the ``tp`` devices.
    """
    _check(tp, mfu=mfu)
    if tokens <= 0:
        return 0.0
    compute = prefill_flops(spec, tokens, context) / (tp * hw.bf16_tflops * 1e12 * mfu)
    floor = weights_read_bytes(spec, tokens) / (tp * hw.mem_bw_gbps * 1e9)
    return max(compute, floor) + tp_comm_time(spec, hw, tokens, tp) + hw.pass_overhead_s


def _step_terms(
    spec: ModelSpec, hw: HardwareProfile, batch: int, tp: int, mbu: float, mfu: float
) -> tuple[float, float, float, float]:
    """Coefficients of one decode step's time as ``max(a_m + b_m * C, a_c + b_c * C)`` where
    ``C`` is the batch's total context tokens (memory term, compute term)."""
    bw = tp * hw.mem_bw_gbps * 1e9 * mbu
    flops = tp * hw.bf16_tflops * 1e12 * mfu
    a_mem = weights_read_bytes(spec, batch) / bw
    b_mem = spec.kv_bytes_per_token / bw
    a_cmp = 2.0 * spec.active_params * batch / flops
    b_cmp = 4.0 * spec.layers * spec.hidden / flops  # attention_flops with one query token
    return a_mem, b_mem, a_cmp, b_cmp


def decode_step_time(
    spec: ModelSpec,
    hw: HardwareProfile,
    batch: int,
    context_tokens_total: int,
    tp: int = 1,
    mbu: float = 0.7,
    mfu: float = 0.5,
) -> float:
    """Modelled seconds of one decode step (one new token for each of ``batch`` sequences).

    Bandwidth-bound: the step streams the weights once for the whole batch plus every
    sequence's KV cache; compute is a floor that matters only for large batches::

        bytes = weights_read_bytes(spec, batch) + kv_bytes_per_token * context_tokens_total
        flops = 2 * active_params * batch + 4 * layers * hidden * context_tokens_total
        time  = max(bytes / (tp * mem_bw_gbps * 1e9 * mbu),
                    flops / (tp * bf16_tflops * 1e12 * mfu))
                + tp_comm_time(spec, hw, batch, tp) + pass_overhead_s

    For MoE models ``weights_read_bytes`` counts only the experts the batch touches.
    ``context_tokens_total`` sums each sequence's cached tokens; ``mbu``/``mfu`` are the achieved
    fractions of peak memory bandwidth and FLOP/s.
    """
    _check(tp, mbu=mbu, mfu=mfu)
    if batch <= 0:
        return 0.0
    a_m, b_m, a_c, b_c = _step_terms(spec, hw, batch, tp, mbu, mfu)
    fixed = tp_comm_time(spec, hw, batch, tp) + hw.pass_overhead_s
    return max(a_m + b_m * context_tokens_total, a_c + b_c * context_tokens_total) + fixed


def _sum_max_linear(a1: float, b1: float, a2: float, b2: float, n: int) -> float:
    """``sum_{i=0}^{n-1} max(a1 + b1*i, a2 + b2*i)`` in closed form (two arithmetic series
    split where the lines cross)."""

    def series(a: float, b: float, lo: int, hi: int) -> float:  # sum over i in [lo, hi)
        k = hi - lo
        return 0.0 if k <= 0 else k * a + b * (lo + hi - 1) * k / 2.0

    if b1 == b2:
        return series(max(a1, a2), b1, 0, n)
    cross = (a2 - a1) / (b1 - b2)  # line 1 is above line 2 for i > cross when b1 > b2
    split = 0 if cross < 0 else n if cross >= n else int(cross) + 1  # first i past the crossing
    if b1 > b2:  # line 2 dominates before the crossing, line 1 after
        return series(a2, b2, 0, split) + series(a1, b1, split, n)
    return series(a1, b1, 0, split) + series(a2, b2, split, n)


def decode_time(
    spec: ModelSpec,
    hw: HardwareProfile,
    new_tokens: int,
    context: float,
    batch: int = 1,
    tp: int = 1,
    mbu: float = 0.7,
    mfu: float = 0.5,
) -> float:
    """Modelled seconds to decode ``new_tokens`` tokens for a sequence in a steady batch.

    The batch holds ``batch`` sequences that each start at ``context`` cached tokens and
    grow by one token per step (a steady state of continuous batching), so step ``i`` sees
    ``batch * (context + i)`` cached tokens::

        time = sum_{i=0}^{new_tokens-1} decode_step_time(spec, hw, batch, batch * (context + i))

    Each step is the max of two lines in ``i``, so the sum is in closed form (no loop over
    tokens). ``context`` may be fractional (a batch average).
    """
    _check(tp, mbu=mbu, mfu=mfu)
    if new_tokens <= 0 or batch <= 0:
        return 0.0
    a_m, b_m, a_c, b_c = _step_terms(spec, hw, batch, tp, mbu, mfu)
    # Substitute C = batch * (context + i): each line becomes (a + b*batch*context) + (b*batch)*i.
    return _sum_max_linear(
        a_m + b_m * batch * context, b_m * batch, a_c + b_c * batch * context, b_c * batch, new_tokens
    ) + new_tokens * (tp_comm_time(spec, hw, batch, tp) + hw.pass_overhead_s)


def decode_steps_within(
    spec: ModelSpec,
    hw: HardwareProfile,
    seconds: float,
    context: float,
    batch: int,
    limit: int,
    tp: int = 1,
    mbu: float = 0.7,
    mfu: float = 0.5,
) -> int:
    """How many whole decode steps (at most ``limit``) fit in ``seconds``: the largest ``k``
    with ``decode_time(spec, hw, k, context, batch, ...) <= seconds`` (a binary search over the
    closed form, so O(log limit))."""
    lo, hi = 0, max(limit, 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if decode_time(spec, hw, mid, context, batch=batch, tp=tp, mbu=mbu, mfu=mfu) <= seconds * (1 + 1e-12):
            lo = mid
        else:
            hi = mid - 1
    return lo


def iteration_time(
    spec: ModelSpec,
    hw: HardwareProfile,
    batch: int,
    context_tokens_total: float,
    prefill: list[tuple[int, int]] | tuple[()] = (),
    tp: int = 1,
    mbu: float = 0.7,
    mfu: float = 0.5,
) -> float:
    """Modelled seconds of one engine iteration with chunked prefill: one forward pass that
    decodes a token for each of ``batch`` sequences (``context_tokens_total`` cached tokens
    among them) and prefills the chunks in ``prefill``, ``(new tokens, cached tokens before
    them)`` each. This is how a prefill slows the decodes that share its device::

        tokens = batch + sum(new)
        bytes  = weights_read_bytes(spec, tokens) + kv_bytes_per_token * (context_tokens_total + sum(cached))
        flops  = 2 * active_params * tokens + 4 * layers * hidden * context_tokens_total
                 + sum(attention_flops(spec, new, cached))
        time   = max(bytes / (tp * mem_bw_gbps * 1e9 * mbu), flops / (tp * bf16_tflops * 1e12 * mfu))
                 + tp_comm_time(spec, hw, tokens, tp) + pass_overhead_s

    With no prefill it equals :func:`decode_step_time`.
    """
    _check(tp, mbu=mbu, mfu=mfu)
    new = sum(n for n, _ in prefill)
    tokens = batch + new
    if tokens <= 0:
        return 0.0
    nbytes = weights_read_bytes(spec, tokens) + spec.kv_bytes_per_token * (
        context_tokens_total + sum(c for _, c in prefill)
    )
    flops = (
        2.0 * spec.active_params * tokens
        + 4.0 * spec.layers * spec.hidden * context_tokens_total
        + sum(attention_flops(spec, n, c) for n, c in prefill)
    )
    mem = nbytes / (tp * hw.mem_bw_gbps * 1e9 * mbu)
    cmp = flops / (tp * hw.bf16_tflops * 1e12 * mfu)
    return max(mem, cmp) + tp_comm_time(spec, hw, tokens, tp) + hw.pass_overhead_s


def grad_sync_time(spec: ModelSpec, hw: HardwareProfile, gpus: int, gpus_per_node: int = 8) -> float:
    """Modelled seconds of one step's data-parallel gradient all-reduce over ``gpus`` devices.

    A ring all-reduce of the bf16 gradients (``params * ACT_BYTES`` bytes) moves
    ``2 * (gpus - 1) / gpus`` of them through each device's slowest link: NVLink within one
    node (``gpus <= gpus_per_node``), else the network (``net_gbps``)::

        time = 2 * (gpus - 1) / gpus * params * ACT_BYTES / (link_gbps * 1e9)

    Not overlapped with the backward pass (real trainers hide part of it), so an upper bound.
    0 on one device, or where the profile has no such link.
    """
    if gpus <= 1:
        return 0.0
    link = hw.nvlink_gbps if gpus <= gpus_per_node else hw.net_gbps
    if link <= 0:
        return 0.0
    return 2.0 * (gpus - 1) / gpus * spec.params * ACT_BYTES / (link * 1e9)


def train_time(
    spec: ModelSpec, hw: HardwareProfile, tokens: float, gpus: int, mfu: float = 0.4, gpus_per_node: int = 8
) -> float:
    """Modelled seconds of one optimizer step over ``tokens`` tokens on ``gpus`` devices.

    Formula: ``6 * active_params * tokens / (gpus * bf16_tflops * 1e12 * mfu)`` (forward 2 +
    backward 4 FLOPs per active parameter per token; attention and the old-policy logprob
    pass are folded into ``mfu``) plus :func:`grad_sync_time`. ``active_params == params``
    for dense models.
    """
    _check(gpus, mfu=mfu)
    compute = 6.0 * spec.active_params * max(tokens, 0) / (gpus * hw.bf16_tflops * 1e12 * mfu)
    return compute + grad_sync_time(spec, hw, gpus, gpus_per_node)


def weight_sync_time(spec: ModelSpec, gbps: float) -> float:
    """Modelled seconds to move the full weights over a link of ``gbps`` GB/s.

    Formula: ``params * bytes_per_param / (gbps * 1e9)`` (bandwidth only; no latency or
    protocol overhead). 400 Gbit/s InfiniBand is 50 GB/s, 200 Gbit/s Ethernet 25 GB/s.
    """
    if gbps <= 0:
        raise ValueError(f"gbps must be > 0, got {gbps}")
    return spec.weight_bytes / (gbps * 1e9)
