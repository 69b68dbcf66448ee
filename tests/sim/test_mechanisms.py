"""What makes RollArt's design pay, one mechanism at a time, each on a small deterministic case:
routing by measured token profile, preemption at a weight update, the windowed launch, group-
level staleness aborts, wasted-work accounting and the modelled weight pull."""

from __future__ import annotations

import asyncio
import statistics

import pytest

import rollart_nb as rn
from rollart_nb.clock import SimClock
from rollart_nb.control.env_manager import RolloutConfig
from rollart_nb.control.local import LocalGenerator, LocalHandle
from rollart_nb.control.proxy import GenTarget, LLMProxy
from rollart_nb.models.spec import spec
from rollart_nb.protocols import GenerationRequest
from rollart_nb.resources.profiles import PROFILES
from rollart_nb.sim import SimBackend, SimEnv, Workload, response_tokens_fn, workload
from rollart_nb.workers.roles import SimGenerator, SimTrainer
from rollart_nb.workers.routing import MIN_PROFILE_TURNS, TokenProfile, assign_affinity, profile_affinity

Q8 = spec("qwen3-8b")
WL = {"lake": workload("frozenlake"), "math": workload("gem-math")}


def profile(new, context, generated, turns=MIN_PROFILE_TURNS):
    p = TokenProfile()
    for _ in range(turns):
        p.observe(new, context, generated)
    return p


def test_measured_profile_picks_the_hardware_by_device_time():
    mix = ["H800", "H20"]
    # SWE-like (new tool output over a long history, short action) and FrozenLake-like turns cost
    # more device time on the H20's 148 TFLOP/s: compute. A long chain of thought reads weights
    # and KV for every token, which the H20's 4 TB/s does faster: bandwidth.
    assert profile_affinity(Q8, mix, profile(500, 8000, 150), batch=16) == "compute"
    assert profile_affinity(Q8, mix, profile(120, 1200, 30), batch=16) == "compute"
    assert profile_affinity(Q8, mix, profile(200, 0, 2500), batch=16) == "bandwidth"
    # no decision without both kinds of device, or before enough turns
    assert profile_affinity(Q8, ["H800"], profile(500, 8000, 150), batch=16) is None
    assert profile_affinity(Q8, mix, profile(500, 8000, 150, turns=MIN_PROFILE_TURNS - 1), batch=16) is None


def test_comparative_advantage_keeps_the_split_when_every_turn_is_weight_read_bound():
    """At a decode batch of 1 the H20's bandwidth makes every turn a little faster there, yet the
    SWE-like task still loses more on it than the math-like one: ranking keeps the split."""
    swe, math_ = profile(560, 9500, 152), profile(200, 0, 2500)
    assert profile_affinity(Q8, ["H800", "H20"], swe, batch=1) == "bandwidth"  # alone, it would flip
    split = assign_affinity(Q8, ["H800", "H20"], {"swe": swe, "math": math_}, batch=1)
    assert split == {"swe": "compute", "math": "bandwidth"}
    assert assign_affinity(Q8, ["H800", "H20"], {"swe": swe, "math": math_}, batch=32) == split
    assert assign_affinity(Q8, ["H20"], {"swe": swe, "math": math_}, batch=1) == {}


def _mix_pipeline(sess, *, mode="rollart", affinity=True, hints=False, name="p", alpha=1):
    gen = sess.clusters.get("actor_gen") or sess.cluster(
        "actor_gen",
        SimGenerator,
        pool="H20",
        replicas=3,
        fallback=["H800"],
        model=Q8,
        response_tokens=response_tokens_fn(WL),
    )
    train = sess.clusters.get("actor_train") or sess.cluster("actor_train", SimTrainer, pool="H800", model=Q8, gpus=4)
    envs = {}
    for k, w in WL.items():
        env = SimEnv(w)
        if not hints:
            env.shape = None  # no declared shape: only the measured profile can route it
        envs[k] = env
    tasks = sess.tasks(envs, envs_per_task=16)
    return sess.pipeline(
        train,
        gen,
        tasks,
        batch_size=32,
        group_size=8,
        alpha=alpha,
        mode=mode,
        name=name,
        hw_affinity=affinity,
        rollout=RolloutConfig(max_turns=32, max_new_tokens=4096, max_context=32768),
    )


# Reading long documents: every turn brings ~3000 new prompt tokens and asks for a short action.
DOCS = Workload("docs", "prefill", (4, 6), 6000, (3000.0, 500.0), (20.0, 5.0), (0.05, 0.01), max_response_tokens=64)


def test_routing_by_measured_profile_and_its_gain_disappears_when_switched_off():
    """One H800 and one H20 serve a prefill-heavy task and a GEM-math-shaped (decode-heavy) one
    whose envs declare no shape. The proxy measures each task's turns, prices them on both
    devices and sends the first to the compute-optimized H800, the second to the H20; with
    routing off (same cluster, same workload) the prompts' chunks land on the H20 too, where
    their FLOPs stall its decodes, and every step is slower."""
    wl = {"docs": DOCS, "math": workload("gem-math")}
    steps = {}
    with rn.Session.sim({"H800": 5, "H20": 1, "cpu": 2}) as sess:
        train = sess.cluster("actor_train", SimTrainer, pool="H800", model=Q8, gpus=4, slots=4)
        gen = sess.cluster(
            "actor_gen", SimGenerator, pool="H800", replicas=2, fallback=["H20"], model=Q8,
            response_tokens=response_tokens_fn(wl),
        )  # fmt: skip
        for routed in (True, False):
            envs = {k: SimEnv(w) for k, w in wl.items()}
            for env in envs.values():
                env.shape = None  # no declared shape: only the measured profile can route it
            pipe = sess.pipeline(
                train, gen, sess.tasks(envs, envs_per_task=16), batch_size=32, group_size=8, mode="areal",
                name=f"routed={routed}", hw_affinity=routed,
                rollout=RolloutConfig(max_turns=20, max_new_tokens=8192, max_context=32768),
            )  # fmt: skip
            steps[routed] = statistics.mean(r.step_s for r in pipe.run(5, progress=False)[1:])
            affinity = pipe.stats()["proxy"]["affinity"]
            assert affinity == ({"docs": "compute", "math": "bandwidth"} if routed else {})
            pipe.close()
    assert steps[False] > 1.15 * steps[True], steps


def test_suspend_preempts_turns_in_flight_and_they_continue_after_the_update():
    """A 2000-token turn in flight when the weights change: with preemption the update does not
    wait for it; the turn stops, then continues under the new version from its tokens so far."""

    async def scenario(preempt):
        b = SimBackend(Q8, PROFILES["H20"], time_scale=1.0, response_tokens=lambda r: 2000)
        proxy = LLMProxy([GenTarget(LocalHandle(LocalGenerator(b)), "g0", "H20", "H20")])
        loop = asyncio.get_running_loop()
        req = GenerationRequest("t0", "math", list(range(3, 203)), max_new_tokens=4096)
        task = asyncio.create_task(proxy.generate(req))
        await asyncio.sleep(5.0)  # 5 simulated seconds into a ~13 s decode
        t0 = loop.time()
        await proxy.suspend(preempt=preempt)
        waited = loop.time() - t0
        b.load_weights({}, 1)
        proxy.resume()
        return await task, waited, proxy.stats()["preemptions"]

    clock = SimClock()
    try:
        drained, wait_drain, n0 = clock.run(scenario(False), timeout=30)
        cut, wait_cut, n1 = clock.run(scenario(True), timeout=30)
    finally:
        clock.close()
    assert drained.finish_reason == "stop" and len(drained.token_ids) == 2000 and n0 == 0
    assert wait_drain > 5.0  # the update waited for the rest of the decode
    assert cut.finish_reason == "preempted" and 0 < len(cut.token_ids) < 2000 and n1 == 1
    assert wait_cut < 0.5 and cut.version == 0


def test_a_preempted_turn_is_continued_whole_and_counts_its_oldest_version():
    with rn.Session.sim({"H800": 5, "H20": 2, "cpu": 2}) as sess:
        pipe = _mix_pipeline(sess, hints=True)
        reps = pipe.run(4, progress=False)
        turns = [u for t in pipe.rollout.trajectories(task="math") for u in t.turns]
        pipe.close()
    split = [u for u in turns if u.timings.get("preempted")]
    assert split, "no turn was in flight at a weight update"
    for u in split:
        assert u.timings["preempted"] >= 1
        assert len(u.logprobs) == len(u.response_ids) == len(u.loss_mask) > 0
        # each version's stretch is recorded, oldest first; the turn counts its oldest
        offsets, versions = [o for o, _ in u.spans], [v for _, v in u.spans]
        assert offsets == sorted(set(offsets)) and versions == sorted(set(versions))
        assert not u.spans or (offsets[0] == 0 and versions[0] == u.version)
    assert any(len(u.spans) >= 2 for u in split), "no preempted turn was continued under newer weights"
    assert all(r.phases["suspend"] < 1.0 for r in reps[1:])  # no waiting for long decodes


def test_rollart_launches_only_what_the_window_can_train_and_groups_are_trained_whole():
    with rn.Session.sim({"H800": 5, "H20": 2, "cpu": 2}) as sess:
        pipe = _mix_pipeline(sess, hints=True)
        for _ in range(5):
            pipe.step()
            s = pipe.rollout.workers[0].instance.sched
            for task, quota in s._batch_quota.items():
                live = s.started_by_task[task] - s.given_up_by_task[task]
                assert live <= (s.batches_taken + pipe.cfg.alpha + 1) * quota
        aborted = pipe.rollout.trajectories(status="aborted_stale")
        completed = pipe.rollout.trajectories(status="completed")
        reps = pipe.reports
        pipe.close()
    assert aborted and completed
    # a group whose member went stale is aborted whole: none of it is trained on
    assert not {t.group_id for t in aborted} & {t.group_id for t in completed}
    # every step's waste adds up to what the aborted trajectories generated
    generated = sum(sum(len(u.response_ids) for u in t.turns) for t in aborted)
    assert sum(r.waste["aborted_tokens"] for r in reps) == generated
    assert sum(r.waste["aborted"] for r in reps) == len(aborted)
    for r in reps:
        assert set(r.waste) >= {"generated_tokens", "aborted_tokens", "aborted_frac", "wasted_frac"}
        assert 0 <= r.waste["aborted_tokens"] <= r.waste["generated_tokens"]


def test_weight_pull_is_hidden_when_published_early_and_exposed_when_late():
    b = SimBackend(Q8, PROFILES["H20"], time_scale=1.0)
    pull_s, load_s = b.weight_pull_s()
    # 16.4 GB over the H20's 25 GB/s link to the training cluster; host to device over PCIe Gen5
    assert pull_s == pytest.approx(16.4e9 / 25e9) and load_s == pytest.approx(16.4e9 / 64e9)

    async def update(published_ago):
        loop = asyncio.get_running_loop()
        await asyncio.sleep(10.0)
        return await b.aload_weights({"published_at": loop.time() - published_ago}, 1)

    clock = SimClock()
    try:
        early = clock.run(update(published_ago=5.0), timeout=10)
        late = clock.run(update(published_ago=0.0), timeout=10)
    finally:
        clock.close()
    assert early == pytest.approx(load_s)
    assert late == pytest.approx(load_s + pull_s)
    assert b.version == 1 and b.stats()["weight_load_s"] == pytest.approx(early + late)
