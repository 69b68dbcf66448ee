"""Roofline arithmetic against hand computation, and the paper's qualitative hardware claims."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollart_nb.models.spec import spec
from rollart_nb.resources.profiles import PROFILES
from rollart_nb.sim import roofline
from rollart_nb.sim.roofline import (
    decode_step_time,
    decode_time,
    prefill_time,
    train_time,
    weight_sync_time,
)

Q8 = spec("qwen3-8b")  # 8.2e9 params, 36 layers, hidden 4096, 8 kv heads x 128
MOE = spec("qwen3-30b-a3b")
H800, H20 = PROFILES["H800"], PROFILES["H20"]
KV8 = 2 * 36 * 8 * 128 * 2  # bytes per token of KV cache = 147456


def test_prefill_4096_tokens_by_hand():
    flops = 2 * 8.2e9 * 4096 + 4 * 36 * 4096 * 4096 * (0 + 4096 / 2)
    assert flops == pytest.approx(7.2118e13, rel=1e-4)
    assert prefill_time(Q8, H800, 4096) == pytest.approx(flops / (989e12 * 0.5), rel=1e-9)  # ~0.146 s
    assert prefill_time(Q8, H20, 4096) == pytest.approx(flops / (148e12 * 0.5), rel=1e-9)  # ~0.975 s
    # tp splits the FLOPs evenly and adds two all-reduces of the activations per layer over NVLink
    # (400 GB/s on an H800): 2 * 36 * 2 * (1/2) * 4096 tokens * 4096 hidden * 2 bytes / 400e9 ~ 3 ms.
    allreduce = 2 * 36 * 2 * 0.5 * 4096 * 4096 * 2 / 400e9
    assert prefill_time(Q8, H800, 4096, tp=2) == pytest.approx(prefill_time(Q8, H800, 4096) / 2 + allreduce)
    with_ctx = 2 * 8.2e9 * 4096 + 4 * 36 * 4096 * 4096 * (8000 + 2048)
    assert prefill_time(Q8, H800, 4096, context=8000) == pytest.approx(with_ctx / (989e12 * 0.5))


def test_short_prefill_hits_the_weight_read_floor():
    # One token: 2*8.2e9 FLOPs = 33 us on H800, but the weights (16.4 GB) take 4.9 ms to stream.
    assert prefill_time(Q8, H800, 1) == pytest.approx(16.4e9 / 3350e9)
    assert prefill_time(Q8, H800, 0) == 0.0


def test_decode_step_batch1_is_weight_bandwidth():
    t = decode_step_time(Q8, H800, batch=1, context_tokens_total=1000)
    assert t == pytest.approx((16.4e9 + KV8 * 1000) / (3350e9 * 0.7))  # ~7.06 ms
    assert t == pytest.approx(16.4e9 / (3350e9 * 0.7), rel=0.01)  # KV of 1000 tokens is < 1%
    t20 = decode_step_time(Q8, H20, batch=1, context_tokens_total=1000)
    assert t20 == pytest.approx((16.4e9 + KV8 * 1000) / (4000e9 * 0.7))  # ~5.91 ms


def test_decode_step_goes_compute_bound_at_huge_batch():
    b = 8192
    t = decode_step_time(Q8, H20, batch=b, context_tokens_total=0)
    assert t == pytest.approx(2 * 8.2e9 * b / (148e12 * 0.5))
    assert t > 16.4e9 / (4000e9 * 0.7)


def test_moe_decode_reads_only_touched_experts():
    one = decode_step_time(MOE, H20, batch=1, context_tokens_total=0)
    assert one == pytest.approx(3.3e9 * 2 / (4000e9 * 0.7))  # active params only
    many = roofline.weights_read_bytes(MOE, 512)
    assert many == pytest.approx(MOE.weight_bytes, rel=1e-6)  # a big batch touches every expert
    assert roofline.weights_read_bytes(Q8, 1) == Q8.weight_bytes  # dense reads everything


def test_decode_time_batch1_by_hand():
    # 100 tokens from context 1000: memory-bound every step, an arithmetic series.
    expected = sum((16.4e9 + KV8 * (1000 + i)) / (3350e9 * 0.7) for i in range(100))
    assert decode_time(Q8, H800, 100, context=1000) == pytest.approx(expected, rel=1e-12)
    assert decode_time(Q8, H800, 0, context=1000) == 0.0


@settings(max_examples=200, deadline=None)
@given(
    new=st.integers(1, 400),
    context=st.floats(0, 40000),
    batch=st.integers(1, 16384),
    tp=st.integers(1, 4),
    moe=st.booleans(),
    h20=st.booleans(),
)
def test_decode_time_closed_form_equals_the_step_sum(new, context, batch, tp, moe, h20):
    m, hw = (MOE if moe else Q8), (H20 if h20 else H800)
    loop = sum(decode_step_time(m, hw, batch, batch * (context + i), tp=tp) for i in range(new))
    assert decode_time(m, hw, new, context, batch=batch, tp=tp) == pytest.approx(loop, rel=1e-9)


@given(
    a1=st.floats(-10, 10),
    b1=st.floats(-1, 1),
    a2=st.floats(-10, 10),
    b2=st.floats(-1, 1),
    n=st.integers(0, 300),
)
def test_sum_max_linear(a1, b1, a2, b2, n):
    loop = sum(max(a1 + b1 * i, a2 + b2 * i) for i in range(n))
    assert roofline._sum_max_linear(a1, b1, a2, b2, n) == pytest.approx(loop, rel=1e-9, abs=1e-6)


def test_train_time_and_weight_sync_by_hand():
    # 32 GPUs span 4 nodes: the bf16 gradients' ring all-reduce goes over the 50 GB/s network.
    grads = 2 * 31 / 32 * 8.2e9 * 2 / 50e9  # ~0.64 s
    assert train_time(Q8, H800, 1_000_000, gpus=32) == pytest.approx(6 * 8.2e9 * 1e6 / (32 * 989e12 * 0.4) + grads)
    # Inside one node it goes over NVLink (400 GB/s on an H800).
    assert roofline.grad_sync_time(Q8, H800, 8) == pytest.approx(2 * 7 / 8 * 8.2e9 * 2 / 400e9)
    # MoE trains on active parameters (one device: nothing to all-reduce).
    assert train_time(MOE, H800, 1000, gpus=1) == pytest.approx(6 * 3.3e9 * 1000 / (989e12 * 0.4))
    assert weight_sync_time(Q8, 25.0) == pytest.approx(16.4e9 / 25e9)  # 200 Gbit/s Ethernet: 0.656 s
    assert weight_sync_time(Q8, 50.0) == pytest.approx(weight_sync_time(Q8, 25.0) / 2)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="tp"):
        prefill_time(Q8, H800, 10, tp=0)
    with pytest.raises(ValueError, match="mbu"):
        decode_step_time(Q8, H800, 1, 0, mbu=0)
    with pytest.raises(ValueError, match="gbps"):
        weight_sync_time(Q8, 0)


# -- the paper's qualitative claims (§2.2 hardware affinity) ------------------------------


def _turn(hw, prompt, new_prompt, response):
    return prefill_time(Q8, hw, new_prompt, context=prompt - new_prompt) + decode_time(Q8, hw, response, prompt)


def test_decode_heavy_turn_is_faster_on_h20_per_gpu():
    # GEM-Math-like: 200 prompt tokens, 2500 tokens of chain of thought.
    h800, h20 = _turn(H800, 200, 200, 2500), _turn(H20, 200, 200, 2500)
    assert h20 < h800
    assert h800 / h20 == pytest.approx(4000 / 3350, rel=0.05)  # the bandwidth ratio


def test_prefill_heavy_turn_is_much_faster_on_h800():
    # Many-turn history: 16k tokens of new context, a 30-token action.
    h800, h20 = _turn(H800, 16384, 16384, 30), _turn(H20, 16384, 16384, 30)
    assert h20 / h800 > 3
    assert prefill_time(Q8, H20, 4096) / prefill_time(Q8, H800, 4096) == pytest.approx(989 / 148)


def test_cost_normalized_affinity():
    """Dollars per token: H800 wins prefill, H20 wins decode (why the paper mixes pools)."""

    def dollars(hw, seconds):
        return seconds * hw.price_per_hour / 3600

    prefill = {hw.name: dollars(hw, prefill_time(Q8, hw, 4096)) for hw in (H800, H20)}
    decode = {hw.name: dollars(hw, decode_time(Q8, hw, 1000, context=1000, batch=32)) for hw in (H800, H20)}
    assert prefill["H800"] < prefill["H20"]
    assert decode["H20"] < decode["H800"] / 2


def test_iteration_with_a_prefill_chunk_stalls_its_decodes_more_on_h20():
    """Chunked prefill: the decodes sharing a pass with a prefill chunk wait for its FLOPs."""
    decode_only = roofline.iteration_time(Q8, H20, 16, 16 * 4000)
    assert decode_only == pytest.approx(decode_step_time(Q8, H20, 16, 16 * 4000))
    mixed = {hw.name: roofline.iteration_time(Q8, hw, 16, 16 * 4000, [(8192, 0)]) for hw in (H800, H20)}
    # 8192 prompt tokens: ~1.3e14 FLOPs, 2.1 s on an H20 against 0.31 s on an H800 (6.7x less compute)
    assert mixed["H20"] > 200 * decode_only and mixed["H20"] > 6 * mixed["H800"]
    flops = 2 * 8.2e9 * (16 + 8192) + 4 * 36 * 4096 * 16 * 4000 + roofline.attention_flops(Q8, 8192, 0)
    assert mixed["H20"] == pytest.approx(flops / (148e12 * 0.5))


def test_decode_steps_within_inverts_decode_time():
    t = decode_time(Q8, H20, 100, 4000, batch=16)
    assert roofline.decode_steps_within(Q8, H20, t, 4000, 16, limit=1000) == 100
    assert roofline.decode_steps_within(Q8, H20, t * 0.999, 4000, 16, limit=1000) == 99
    assert roofline.decode_steps_within(Q8, H20, t, 4000, 16, limit=50) == 50
    assert roofline.decode_steps_within(Q8, H20, 0.0, 4000, 16, limit=50) == 0


def test_tensor_parallelism_needs_a_link():
    assert roofline.tp_comm_time(Q8, PROFILES["CPU"], 100, tp=1) == 0.0
    with pytest.raises(ValueError, match="tp must be 1"):
        roofline.tp_comm_time(Q8, PROFILES["CPU"], 100, tp=2)
