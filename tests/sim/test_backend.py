"""SimBackend: deterministic tokens, versions, prefix cache and KV recompute, batching, abort,
PD disaggregation, and hardware affinity."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from rollart_nb.errors import ConfigError
from rollart_nb.models.spec import ModelSpec, spec
from rollart_nb.protocols import GenerationBackend, GenerationRequest
from rollart_nb.resources.profiles import PROFILES
from rollart_nb.sim import SimBackend, decode_time
from rollart_nb.sim.roofline import iteration_time

Q8 = spec("qwen3-8b")
H800, H20 = PROFILES["H800"], PROFILES["H20"]


def req(traj="t0", prompt=100, max_new=64, **kw):
    return GenerationRequest(traj, kw.pop("task", "math"), list(range(3, 3 + prompt)), max_new_tokens=max_new, **kw)


def pf(hw, tokens, context=0):
    """A lone prompt's prefill: one engine pass (it fits one chunk)."""
    return iteration_time(Q8, hw, 0, 0, [(tokens, context)])


def SimClockRun(scenario, host=None):
    """Run ``scenario()`` on a virtual clock (modelled seconds at time_scale 1, no real sleeping);
    ``host``: the clock's :class:`Host` (shared cores) for the run."""
    from rollart_nb.clock import SimClock

    clock = SimClock()
    if host is not None:
        clock.host = host
    try:
        return clock.run(scenario(), timeout=30)
    finally:
        clock.close()


def fixed(n):
    return lambda request: n


def run(coro):
    return asyncio.run(coro)


def test_implements_the_protocol():
    assert isinstance(SimBackend(Q8, H20), GenerationBackend)


def test_same_request_same_tokens_and_negative_logprobs():
    a, b = SimBackend(Q8, H20, time_scale=0), SimBackend(Q8, H20, time_scale=0)
    r1, r2 = run(a.generate(req(seed=7))), run(b.generate(req(seed=7)))
    assert r1.token_ids == r2.token_ids and r1.logprobs == r2.logprobs
    assert len(r1.token_ids) == len(r1.logprobs) >= 1
    assert all(lp < 0 for lp in r1.logprobs)
    assert all(0 <= t < 32000 for t in r1.token_ids)
    assert run(a.generate(req("other", seed=7))).token_ids != r1.token_ids
    assert run(a.generate(req("x", seed=8))).token_ids != run(b.generate(req("x", seed=7))).token_ids
    # Greedy ignores the sampling seed, as a real engine does.
    g1 = run(a.generate(req("g", seed=1, temperature=0.0)))
    g2 = run(b.generate(req("g", seed=2, temperature=0.0)))
    assert g1.token_ids == g2.token_ids


def test_finish_reasons_and_eos():
    b = SimBackend(Q8, H20, time_scale=0, response_tokens=fixed(10))
    r = run(b.generate(req(max_new=32)))
    assert r.finish_reason == "stop" and len(r.token_ids) == 10 and r.token_ids[-1] == 1
    b = SimBackend(Q8, H20, time_scale=0, response_tokens=fixed(100))
    r = run(b.generate(req(max_new=32)))
    assert r.finish_reason == "length" and len(r.token_ids) == 32 and 1 not in r.token_ids[-1:]
    assert r.worker == "sim" and r.text  # decoded by the SimTokenizer


def test_default_lengths_average_mean_response_tokens():
    b = SimBackend(Q8, H20, time_scale=0, mean_response_tokens=50)
    lens = [len(run(b.generate(req(f"t{i}", max_new=10_000))).token_ids) for i in range(300)]
    assert 40 < sum(lens) / len(lens) < 60


def test_results_carry_the_serving_version():
    b = SimBackend(Q8, H20, time_scale=0)
    assert run(b.generate(req())).version == 0
    b.load_weights({"version": 3}, 3)
    r = run(b.generate(req("t1")))
    assert b.version == 3 and r.version == 3


def test_prefix_cache_charges_only_new_tokens():
    b = SimBackend(Q8, H800, time_scale=0, response_tokens=fixed(20))
    r1 = run(b.generate(req(prompt=1000, max_new=64)))
    assert r1.prefill_s == pytest.approx(pf(H800, 1000))
    assert b.cached_tokens("t0") == 1020  # prompt + response KV stay cached
    r2 = run(b.generate(req(prompt=1020 + 50, max_new=64)))  # history + 50 observation tokens
    assert b.stats()["prefill_tokens"] == 1000 + 50
    assert r2.prefill_s == pytest.approx(pf(H800, 50, 1020))
    assert r2.recomputed_tokens == 0
    # A fresh trajectory pays its whole prompt.
    run(b.generate(req("t1", prompt=1070)))
    assert b.stats()["prefill_tokens"] == 1000 + 50 + 1070


def test_weight_update_mid_trajectory_recomputes_the_whole_prompt():
    b = SimBackend(Q8, H800, time_scale=0, response_tokens=fixed(20))
    run(b.generate(req(prompt=1000)))
    b.load_weights({}, 1)
    r = run(b.generate(req(prompt=1070)))
    assert r.recomputed_tokens == 1070 and r.version == 1
    assert r.prefill_s == pytest.approx(pf(H800, 1070))
    s = b.stats()
    assert s["recomputed_tokens"] == 1070 and s["prefill_tokens"] == 1000 + 1070
    # Recomputed under version 1: the next turn is incremental again.
    r = run(b.generate(req(prompt=1090 + 10)))
    assert r.recomputed_tokens == 0 and b.stats()["prefill_tokens"] == 1000 + 1070 + 10


def test_score_prefills_each_row_afresh_and_computes_no_logprobs():
    b = SimBackend(Q8, H800, time_scale=0, response_tokens=fixed(20))
    run(b.generate(req(prompt=1000)))  # t0's 1020 tokens cached
    b.load_weights({}, 2)
    res = run(b.score([list(range(3, 1003))]))
    assert res.version == 2 and len(res.rows[0]) == 999 and all(math.isnan(x) for x in res.rows[0])
    assert res.score_s == pytest.approx(pf(H800, 1000))  # no cached prefix read: a whole prefill
    s = b.stats()
    assert s["prefill_tokens"] == 1000 + 1000 and s["decode_tokens"] == 20  # nothing decoded for it
    assert b.cached_tokens("t0") == 1020 and s["cached_tokens"] == 1020  # nor a prefix kept
    assert run(b.score([[5], []])).rows == [[], []]
    # prefill is compute-bound: scoring is slower on the bandwidth-optimized H20
    h20 = run(SimBackend(Q8, H20, time_scale=0).score([list(range(3, 1003))]))
    assert h20.score_s > res.score_s


def test_forget_drops_the_prefix_without_counting_a_recompute():
    b = SimBackend(Q8, H800, time_scale=0, response_tokens=fixed(20))
    run(b.generate(req(prompt=500)))
    b.forget("t0")
    r = run(b.generate(req(prompt=600)))
    assert r.recomputed_tokens == 0 and b.stats()["prefill_tokens"] == 1100


def test_prefix_cache_is_bounded_by_device_memory():
    b = SimBackend(Q8, H800, time_scale=0, response_tokens=fixed(10))
    assert b.engine.kv_capacity_tokens == int((80e9 - 16.4e9) * 0.9 // Q8.kv_bytes_per_token)
    b.engine.kv_capacity_tokens = 250  # shrink to watch LRU eviction
    for t in ("a", "b", "c"):
        run(b.generate(req(t, prompt=100)))
    assert b.cached_tokens("a") == 0 and b.cached_tokens("b") == b.cached_tokens("c") == 110
    assert b.stats()["cached_tokens"] == 220


def test_concurrent_decodes_batch():
    """16 concurrent requests take about one request's time, not 16x (continuous batching)."""
    b = SimBackend(Q8, H20, time_scale=0.05, response_tokens=fixed(128))
    t0 = time.perf_counter()
    one = run(b.generate(req("solo", prompt=200, max_new=1000)))
    single_wall = time.perf_counter() - t0

    async def burst():
        return await asyncio.gather(*(b.generate(req(f"c{i}", prompt=200, max_new=1000)) for i in range(16)))

    t0 = time.perf_counter()
    results = run(burst())
    burst_wall = time.perf_counter() - t0
    assert burst_wall < 4 * single_wall  # serial would be 16x
    # Modelled: the 16 decode together; a step of 16 costs barely more than a step of one.
    worst = max(r.decode_s for r in results)
    assert worst == pytest.approx(decode_time(Q8, H20, 128, 200, batch=16), rel=0.01)
    assert one.decode_s < worst < 1.5 * one.decode_s
    assert b.stats()["active"] == 0 and b.stats()["requests"] == 17


@pytest.mark.parametrize("chunk", [16384, None])
def test_concurrent_prefills_share_the_device(chunk):
    """Long prefills queue on the device's FLOPs: chunked, two 8192-token prompts share each
    16384-token pass; unchunked, one prompt per pass. Either way the last ends after 4x one."""
    b = SimBackend(Q8, H20, time_scale=0, response_tokens=fixed(1), chunk_tokens=chunk)

    async def burst():
        return await asyncio.gather(*(b.generate(req(f"p{i}", prompt=8192)) for i in range(4)))

    results = run(burst())
    alone = pf(H20, 8192)
    times = sorted(r.prefill_s for r in results)
    assert times[-1] == pytest.approx(4 * alone, rel=1e-3)
    assert times[0] == pytest.approx((2 if chunk else 1) * alone, rel=1e-3)


def test_a_prefill_slows_the_decodes_sharing_its_device_more_on_h20():
    """Interference: a long prompt arriving mid-decode stalls the running decode for its
    pass(es); the stall is the prompt's FLOPs, about 6.7x longer on an H20 than on an H800."""

    def stall(hw, chunk):
        b = SimBackend(
            Q8, hw, time_scale=1.0, response_tokens=lambda r: 1 if r.traj_id == "long" else 400, chunk_tokens=chunk
        )

        async def scenario():
            quiet = await b.generate(req("alone", prompt=100, max_new=1000))
            first = asyncio.create_task(b.generate(req("d", prompt=100, max_new=1000)))
            await asyncio.sleep(quiet.decode_s / 4)
            await b.generate(req("long", prompt=8000, max_new=1000))
            return quiet, await first

        quiet, hit = SimClockRun(scenario)
        return hit.decode_s - quiet.decode_s

    for chunk in (16384, None):
        h20, h800 = stall(H20, chunk), stall(H800, chunk)
        assert h20 == pytest.approx(pf(H20, 8000), rel=0.05)
        assert h800 == pytest.approx(pf(H800, 8000), rel=0.1)
        assert h20 > 5 * h800


def test_kv_capacity_queues_what_does_not_fit():
    """A request waits (FCFS) until its whole sequence fits in the KV memory left."""
    b = SimBackend(Q8, H800, time_scale=0, response_tokens=fixed(100))
    b.engine.kv_capacity_tokens = 2500  # two sequences of 1000 + 100 fit, a third must wait

    async def burst():
        return await asyncio.gather(*(b.generate(req(f"k{i}", prompt=1000, max_new=200)) for i in range(3)))

    r = run(burst())
    assert b.stats()["kv_waits"] == 1 and b.stats()["kv_used_tokens"] == 0
    # the third started its prefill only once the first two were done
    assert r[2].prefill_s > r[0].prefill_s + r[0].decode_s
    # with room for all three it would have run alongside
    roomy = SimBackend(Q8, H800, time_scale=0, response_tokens=fixed(100))

    async def burst2():
        return await asyncio.gather(*(roomy.generate(req(f"k{i}", prompt=1000, max_new=200)) for i in range(3)))

    r2 = run(burst2())
    assert r2[2].prefill_s < r[2].prefill_s / 3 and roomy.stats()["kv_waits"] == 0


def test_abort_returns_promptly_with_partial_tokens_and_drops_the_cache():
    # ~14 modelled s of decode slept at 1:1 scale: only a prompt abort can end it in time.
    b = SimBackend(Q8, H20, time_scale=1.0, response_tokens=fixed(2000))

    async def scenario():
        b.engine.remember("t0", 100, 0)
        task = asyncio.create_task(b.generate(req(prompt=100, max_new=4000)))
        await asyncio.sleep(0.3)
        t0 = time.perf_counter()
        await b.abort("t0")
        r = await task
        return r, time.perf_counter() - t0

    r, latency = run(scenario())
    assert r.finish_reason == "abort" and latency < 0.2
    assert 0 < len(r.token_ids) < 2000 and len(r.logprobs) == len(r.token_ids)
    assert b.cached_tokens("t0") == 0 and b.stats()["aborted"] == 1 and b.stats()["active"] == 0


def test_abort_during_prefill_and_of_idle_trajectory():
    b = SimBackend(Q8, H20, time_scale=1.0, response_tokens=fixed(5))

    async def scenario():
        task = asyncio.create_task(b.generate(req("long", prompt=32000)))  # ~4 s of prefill on H20
        await asyncio.sleep(0.05)
        await b.abort("long")
        await b.abort("never-started")  # a no-op
        return await asyncio.wait_for(task, 1.0)

    r = run(scenario())
    assert r.finish_reason == "abort" and r.token_ids == []


def test_pd_split_equals_colocated_plus_kv_transfer():
    col = SimBackend(Q8, H800, time_scale=0, response_tokens=fixed(300))
    p = SimBackend(Q8, H800, time_scale=0, response_tokens=fixed(300))
    d = SimBackend(Q8, H800, time_scale=0, response_tokens=fixed(300), link_gbps=25.0)
    request = req(prompt=4000, max_new=1000)
    c = run(col.generate(request))
    pre = run(p.prefill(request))
    assert pre["tokens"] == 4000 and pre["version"] == 0 and not pre["aborted"]
    r = run(d.decode(request, pre))
    transfer = Q8.kv_bytes_per_token * 4000 / 25e9  # ~24 ms for 4000 tokens of qwen3-8b KV
    assert r.prefill_s == pytest.approx(c.prefill_s)
    assert r.prefill_s + r.decode_s == pytest.approx(c.prefill_s + c.decode_s + transfer)
    assert r.token_ids == c.token_ids  # same policy, same version
    assert d.stats()["kv_transfer_s"] == pytest.approx(transfer)
    # Next turn: the P node's cache holds the prompt only, so it computes response + obs.
    pre2 = run(p.prefill(req(prompt=4000 + 300 + 40)))
    assert pre2["tokens"] == 340


def test_pd_decode_after_an_aborted_prefill_aborts():
    p, d = SimBackend(Q8, H20, time_scale=1.0), SimBackend(Q8, H20, time_scale=0)

    async def scenario():
        task = asyncio.create_task(p.prefill(req("long", prompt=32000)))
        await asyncio.sleep(0.05)
        await p.abort("long")
        return await asyncio.wait_for(task, 1.0)

    pre = run(scenario())
    assert pre["aborted"] and p.cached_tokens("long") == 0
    r = run(d.decode(req("long", prompt=32000), pre))
    assert r.finish_reason == "abort" and r.token_ids == [] and d.stats()["decode_tokens"] == 0


def test_pd_result_takes_the_older_version():
    p, d = SimBackend(Q8, H800, time_scale=0), SimBackend(Q8, H20, time_scale=0)
    d.load_weights({}, 2)
    pre = run(p.prefill(req()))
    assert run(d.decode(req(), pre)).version == 0


def test_h20_wins_decode_heavy_and_h800_wins_prefill_heavy():
    def turn(hw, prompt, response):
        b = SimBackend(Q8, hw, time_scale=0, response_tokens=fixed(response))
        r = run(b.generate(req(prompt=prompt, max_new=response + 1)))
        return r.prefill_s + r.decode_s

    assert turn(H20, 200, 2500) < turn(H800, 200, 2500)  # GEM-Math-like chain of thought
    assert turn(H800, 16384, 30) * 3 < turn(H20, 16384, 30)  # long history, short action


def test_stats_count_tokens_and_busy_time():
    b = SimBackend(Q8, H20, time_scale=0, response_tokens=fixed(10))
    r = run(b.generate(req(prompt=100, max_new=64)))
    s = b.stats()
    assert s["prefill_tokens"] == 100 and s["decode_tokens"] == 10 and s["requests"] == 1
    assert s["busy_s"] == pytest.approx(r.prefill_s + r.decode_s)


def test_config_errors_list_every_problem():
    with pytest.raises(ConfigError) as e:
        SimBackend(Q8, H20, time_scale=-1, tp=0, policy="lm", mfu=2)
    assert len(e.value.problems) == 4
    big = ModelSpec("dense-70b", 70e9, 70e9, 80, 8192, 8, 128)
    with pytest.raises(ConfigError, match="does not fit.*raise tp"):
        SimBackend(big, H20)
    assert SimBackend(big, H20, tp=2).engine.kv_capacity_tokens > 0


def test_a_batching_engines_wait_delays_a_request_and_a_pd_prefill_but_not_the_decode_node():
    """``batch_wait_s`` (a batching engine such as hf holding a request for batch mates) adds to
    the modelled time of a whole turn and of a PD prefill; the decode node takes the KV at once."""

    def timed(backend_kwargs, call):
        async def scenario():
            loop = asyncio.get_running_loop()
            b = SimBackend(Q8, H800, time_scale=1, response_tokens=fixed(20), **backend_kwargs)
            t0 = loop.time()
            out = await call(b)
            return loop.time() - t0, out

        return SimClockRun(scenario)

    plain, _ = timed({}, lambda b: b.generate(req()))
    held, _ = timed({"batch_wait_s": 0.25}, lambda b: b.generate(req()))
    assert held - plain == pytest.approx(0.25, abs=1e-6)
    pre_plain, pre = timed({}, lambda b: b.prefill(req()))
    pre_held, _ = timed({"batch_wait_s": 0.25}, lambda b: b.prefill(req()))
    assert pre_held - pre_plain == pytest.approx(0.25, abs=1e-6)
    dec_plain, _ = timed({}, lambda b: b.decode(req(), pre))
    dec_held, _ = timed({"batch_wait_s": 0.25}, lambda b: b.decode(req(), pre))
    assert dec_held == pytest.approx(dec_plain)
    with pytest.raises(ConfigError, match="batch_wait_s must be >= 0"):
        SimBackend(Q8, H800, batch_wait_s=-1)


def _arrivals(backend_kwargs, arrivals, hw=H800, host=None):
    """Requests ``(traj, at_s, response_tokens)`` arriving at simulated times; returns traj ->
    (finish time, result). ``host``: as in :func:`SimClockRun`."""
    lengths = {t: n for t, _, n in arrivals}

    async def scenario():
        loop = asyncio.get_running_loop()
        b = SimBackend(Q8, hw, time_scale=1, response_tokens=lambda r: lengths[r.traj_id], **backend_kwargs)

        async def one(traj, at):
            await asyncio.sleep(at)
            res = await b.generate(req(traj, prompt=200, max_new=1000))
            return traj, (loop.time(), res)

        return dict(await asyncio.gather(*(one(t, at) for t, at, _ in arrivals)))

    return SimClockRun(scenario, host)


def test_static_batching_runs_a_batch_to_its_end_before_the_next():
    """A request arriving during a batch waits for its end with a static batcher (hf); a
    continuous one (vLLM) takes it at the next iteration."""
    alone = _arrivals({}, [("a", 0.0, 400)])["a"][0]
    arrivals = [("a", 0.0, 400), ("b", alone / 4, 10)]
    cont = _arrivals({}, arrivals)
    static = _arrivals({"static_batching": True}, arrivals)
    assert cont["b"][0] < alone  # joined the running batch, ended long before a
    assert static["b"][0] > static["a"][0] >= alone * 0.999  # queued behind a's whole batch
    assert static["b"][1].prefill_s > static["a"][0] - alone / 4  # its wait counts as its prefill time


def test_static_batching_waits_once_per_batch_and_prefills_it_in_one_pass():
    together = [("a", 0.0, 5), ("b", 0.001, 5), ("c", 0.002, 5)]
    out = _arrivals({"static_batching": True, "batch_wait_s": 0.01}, together)
    ends = {t: end for t, (end, _) in out.items()}
    assert len({round(e, 9) for e in ends.values()}) == 1  # one batch: a's wait gathered b and c
    one = _arrivals({"static_batching": True, "batch_wait_s": 0.01}, [("a", 0.0, 5)])["a"][0]
    three = iteration_time(Q8, H800, 0, 0, [(200, 0)] * 3) - iteration_time(Q8, H800, 0, 0, [(200, 0)])
    at = {t: a for t, a, _ in together}
    assert len({round(at[t] + r.prefill_s, 9) for t, (_, r) in out.items()}) == 1  # one prefill pass for all
    assert ends["a"] - one == pytest.approx(three, rel=0.05)  # three prompts' pass (decodes barely cost more)


def test_row_overhead_is_paid_once_per_request_in_its_first_pass():
    burst = [(f"r{i}", 0.0, 5) for i in range(4)]
    plain = _arrivals({"static_batching": True}, burst)
    rows = _arrivals({"static_batching": True, "row_overhead_s": 0.002}, burst)
    assert rows["r0"][0] - plain["r0"][0] == pytest.approx(4 * 0.002, rel=1e-6)
    with pytest.raises(ConfigError, match="row_overhead_s"):
        SimBackend(Q8, H800, row_overhead_s=-1)


def test_a_load_overhead_adds_to_every_weight_load():
    async def scenario(overhead):
        loop = asyncio.get_running_loop()
        b = SimBackend(Q8, H800, time_scale=1, load_overhead_s=overhead)
        t0 = loop.time()
        reported = await b.aload_weights({}, 1)
        return reported, loop.time() - t0, b.version

    base, base_took, _ = SimClockRun(lambda: scenario(0.0))
    more, more_took, version = SimClockRun(lambda: scenario(0.03))
    assert more - base == pytest.approx(0.03) and version == 1  # reported ...
    assert more_took - base_took == pytest.approx(0.03)  # ... and waited
    with pytest.raises(ConfigError, match="load_overhead_s"):
        SimBackend(Q8, H800, load_overhead_s=-0.1)


def test_engines_on_one_shared_core_slow_each_other_and_gpus_do_not():
    from rollart_nb.clock.cores import Host, SharedCores
    from rollart_nb.resources.profiles import HardwareProfile

    cpu = HardwareProfile("CPU-TEST-SHARED", "cpu", 0.1, 20.0, 64.0, 0.0, "general")

    def two_engines(hw, host):
        async def scenario():
            loop = asyncio.get_running_loop()
            engines = [SimBackend(Q8, hw, time_scale=1, response_tokens=fixed(50)) for _ in range(2)]
            t0 = loop.time()
            await asyncio.gather(*(e.generate(req(f"t{i}")) for i, e in enumerate(engines)))
            return loop.time() - t0

        return SimClockRun(scenario, host)

    own = two_engines(cpu, Host())
    assert two_engines(cpu, Host(SharedCores(2))) == pytest.approx(own, rel=1e-6)  # a core each
    assert two_engines(cpu, Host(SharedCores(1))) == pytest.approx(2 * own, rel=1e-3)  # one core, shared
    assert two_engines(H800, Host(SharedCores(1))) == pytest.approx(
        two_engines(H800, Host()), rel=1e-6
    )  # GPUs compute on their own


def test_an_abort_during_a_shared_core_pass_frees_the_core():
    """An engine whose request is aborted mid-pass leaves the shared core: the other engine's
    work then runs at full speed."""
    from rollart_nb.clock.cores import Host, SharedCores
    from rollart_nb.resources.profiles import HardwareProfile

    cpu = HardwareProfile("CPU-TEST-ABORT", "cpu", 0.1, 20.0, 64.0, 0.0, "general")
    host = Host(SharedCores(1))

    async def scenario():
        loop = asyncio.get_running_loop()
        a = SimBackend(Q8, cpu, time_scale=1, response_tokens=fixed(50))
        b = SimBackend(Q8, cpu, time_scale=1, response_tokens=fixed(50))
        t0 = loop.time()
        await b.generate(req("solo"))
        took_alone = loop.time() - t0
        victim = asyncio.ensure_future(a.generate(req("victim", prompt=4000)))
        t0 = loop.time()
        other = asyncio.ensure_future(b.generate(req("other")))
        await asyncio.sleep(took_alone / 4)
        await a.abort("victim")
        res = await victim
        await other
        return took_alone, loop.time() - t0, res.finish_reason, host.cores.running

    took_alone, took, reason, running = SimClockRun(scenario, host)
    assert reason == "abort" and running == 0
    # half speed for the first quarter (an eighth of its work done), full speed after the abort:
    # 1/4 + 7/8 = 1.125x its time alone, not 2x
    assert took == pytest.approx(1.125 * took_alone, rel=0.02)
