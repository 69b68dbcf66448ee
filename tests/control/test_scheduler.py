"""RolloutScheduler + LLMProxy + EnvManager in one event loop, on the sim backend (no Ray)."""

import asyncio
import collections
import dataclasses
import time

import pytest

from rollart_nb.config import PipelineConfig
from rollart_nb.control.curriculum import PromptCurriculum
from rollart_nb.control.env_manager import RolloutConfig, request_seed
from rollart_nb.control.local import LocalGenerator, LocalHandle
from rollart_nb.control.proxy import GenTarget, LLMProxy
from rollart_nb.control.reward import RewardDispatcher
from rollart_nb.control.scheduler import RolloutScheduler
from rollart_nb.control.shards import plan_rollout
from rollart_nb.envs import Arithmetic, WithFailures, WithLatency
from rollart_nb.errors import RolloutStalledError
from rollart_nb.models.spec import spec
from rollart_nb.protocols import GenerationRequest
from rollart_nb.resources.profiles import PROFILES
from rollart_nb.sim import SimBackend, SimTokenizer
from rollart_nb.trajectory import Status

M = spec("qwen3-0.6b")


def make(
    envs,
    *,
    mode="rollart",
    batch=8,
    group=4,
    alpha=1,
    redundancy=0,
    n_workers=2,
    time_scale=1e-4,
    max_turns=4,
    rewards=None,
    timeout=60.0,
    weights=None,
    dispatch="direct",
    curricula=None,
    failed="exclude",
    failure_reward=0.0,
):
    backends = [
        SimBackend(M, PROFILES["H20"], time_scale=time_scale, mean_response_tokens=8, name=f"g{i}")
        for i in range(n_workers)
    ]
    targets = [GenTarget(LocalHandle(LocalGenerator(b)), f"gen/{i}", "H20", "H20") for i, b in enumerate(backends)]
    proxy = LLMProxy(targets, {}, dispatch=dispatch)
    cfg = PipelineConfig(
        batch_size=batch,
        alpha=alpha,
        mode=mode,
        redundancy=redundancy,
        failed_trajectories=failed,
        failure_reward=failure_reward,
        rollout=RolloutConfig(max_turns=max_turns, max_new_tokens=8, env_timeout_s=timeout),
    )
    plan = plan_rollout(envs, cfg, group, task_weights=weights, curricula=curricula)
    return RolloutScheduler(plan, SimTokenizer(), proxy, rewards or RewardDispatcher()), backends


def arith(n):
    return {"math": [Arithmetic() for _ in range(n)]}


def run(coro):
    return asyncio.run(coro)


def test_batches_are_whole_scored_groups():
    async def go():
        s, _ = make(arith(8))
        batch = await s.get_batch(8, timeout_s=30)
        groups = {}
        for t in batch:
            groups.setdefault(t.group_id, set()).add(t.seed)
            assert t.status is Status.COMPLETED and t.scored and t.reward_version == 0
            assert t.turns and t.turns[0].prompt_ids and t.turns[0].version == 0
        assert len(groups) == 2 and all(len(seeds) == 1 for seeds in groups.values())  # shared prompt
        await s.close()

    run(go())


def test_batched_dispatch_routes_each_result_to_its_trajectory():
    async def go():
        s, backends = make(arith(16), batch=16, group=4, dispatch="batched", n_workers=2)
        batch = await s.get_batch(16, timeout_s=30)
        st = s.proxy.stats()
        assert st["batches"] < st["requests"]  # several turns shared one call
        fresh = SimBackend(M, PROFILES["H20"], time_scale=0, mean_response_tokens=8)
        for t in batch:  # the sim policy is a function of the request: a mixed-up result would not match
            req = GenerationRequest(t.id, "math", t.turns[0].prompt_ids, 8, 1.0, seed=request_seed(t, 0))
            assert (await fresh.generate(req)).token_ids == t.turns[0].response_ids
        assert all(t.turns[0].worker for t in batch)
        await s.close()

    run(go())


def test_suspend_preserves_in_flight_and_resume_continues():
    async def go():
        envs = {"slow": [WithLatency(Arithmetic(max_turns=3), mean_s=0.05, std_s=0.0) for _ in range(4)]}
        s, _ = make(envs, batch=4, group=4, max_turns=3)
        s.schedule()
        await asyncio.sleep(0.02)
        running_before = set(s.running)
        assert running_before
        await s.proxy.suspend(timeout_s=5)
        assert s.proxy.suspended
        await asyncio.sleep(0.3)  # envs step, but no new generation is admitted
        assert set(s.running) == running_before  # nothing was dropped while suspended
        s.proxy.resume()
        batch = await s.get_batch(4, timeout_s=30)
        assert {t.id for t in batch} <= running_before | {t.id for t in s.ledger.ended}
        assert s.ledger.counts.get("failed", 0) == 0
        await s.close()

    run(go())


def test_a_hold_lets_only_exempt_trajectories_generate():
    async def go():
        envs = {"math": [WithLatency(Arithmetic(max_turns=3), mean_s=0.05, std_s=0.0) for _ in range(8)]}
        s, _ = make(envs, batch=8, group=4, max_turns=3)
        s.schedule()
        await asyncio.sleep(0.02)
        s.proxy.hold()
        await asyncio.sleep(0.1)  # turns in flight finish, the next ones wait
        before = s.proxy.requests
        s.proxy.exempt.add("validation-1")
        req = GenerationRequest("validation-1", "math", [5, 6, 7], 8, 0.0, seed=1)
        res = await asyncio.wait_for(s.proxy.generate(req), timeout=5)
        assert res.token_ids
        await asyncio.sleep(0.3)
        assert s.proxy.requests == before + 1  # only the exempt trajectory went through
        s.proxy.hold()  # holds nest: one release is not enough
        s.proxy.release()
        await asyncio.sleep(0.1)
        assert s.proxy.requests == before + 1
        s.proxy.release()
        batch = await s.get_batch(8, timeout_s=30)
        assert len(batch) == 8 and s.proxy.stats()["held_s"] > 0.3
        await s.close()

    run(go())


def test_a_turn_held_for_a_validation_still_waits_for_a_weight_update_begun_meanwhile():
    async def go():
        s, _ = make(arith(4), batch=4, group=4)
        s.proxy.hold()
        req = GenerationRequest("t-1", "math", [5, 6, 7], 8, 1.0, seed=1)
        turn = asyncio.ensure_future(s.proxy.generate(req))
        await asyncio.sleep(0.05)
        await s.proxy.suspend(timeout_s=1)  # nothing in flight: the weight update may begin
        s.proxy.release()  # the validation ends before the update does
        await asyncio.sleep(0.1)
        assert not turn.done()  # the held turn now waits for the update
        s.proxy.resume()
        assert (await asyncio.wait_for(turn, timeout=5)).token_ids
        await s.close()

    run(go())


def test_redundant_rollouts_cancel_the_surplus():
    async def go():
        envs = {"math": [WithLatency(Arithmetic(), mean_s=0.02, std_s=0.02, seed=i) for i in range(12)]}
        s, _ = make(envs, batch=8, group=4, redundancy=2)
        batch = await s.get_batch(8, timeout_s=30)
        await asyncio.sleep(0.1)
        assert len(batch) == 8
        assert s.ledger.counts["redundant_cancelled"] >= 1
        cancelled = [t for t in s.ledger.ended if t.status is Status.CANCELLED and t.reason.startswith("redundant")]
        assert cancelled and all(not t.scored for t in cancelled)
        await s.close()

    run(go())


def test_crashing_and_hanging_envs_fail_with_reason_without_stalling():
    async def go():
        envs = {
            "math": [Arithmetic() for _ in range(8)],
            "crash": [WithFailures(Arithmetic(), p_raise=1.0, seed=i) for i in range(2)],
            "hang": [WithFailures(Arithmetic(), p_hang=1.0, hang_s=3600, seed=i) for i in range(2)],
        }
        s, _ = make(envs, batch=8, group=4, timeout=0.3, weights={"math": 1.0, "crash": 0.0, "hang": 0.0})
        t0 = time.monotonic()
        await s.wait_ready(8, timeout_s=30)
        assert time.monotonic() - t0 < 10
        batch = s.take_batch(8)
        assert {t.task for t in batch} == {"math"}
        await asyncio.sleep(0.5)
        failed = [t for t in s.ledger.ended if t.status is Status.FAILED]
        reasons = {t.task: t.reason for t in failed}
        assert "crash" in reasons and "env" in reasons["crash"]
        assert "did not answer" in reasons["hang"] and "0.3s" in reasons["hang"]
        await s.close()

    run(go())


@pytest.mark.parametrize("policy", ["exclude", "penalize"])
def test_failed_trajectories_are_excluded_or_trained_on_with_the_failure_reward(policy):
    async def go():
        # half the env steps raise after the model acted; resets never fail
        envs = {"math": [WithFailures(Arithmetic(), p_raise=0.5, on=("step",), seed=i) for i in range(8)]}
        s, _ = make(envs, batch=16, group=4, failed=policy, failure_reward=-1.0)
        batch = await s.get_batch(16, timeout_s=30)
        groups = collections.Counter(t.group_id for t in batch)
        assert set(groups.values()) == {4}  # whole groups either way
        penalized = [t for t in batch if t.reason.startswith("penalized: ")]
        assert all(t.status is Status.COMPLETED and t.scored for t in batch)
        stats = s.stats()
        if policy == "exclude":
            assert not penalized and all(t.reward >= 0 for t in batch)
            assert stats["events"].get("failed", 0) > 0 and "penalized" not in stats["events"]
        else:
            assert penalized and all(t.reward == -1.0 and t.reward_version == -1 for t in penalized)
            assert all(
                "injected failure" in t.info["rollart_failure"] and t.info["rollart_failed_in"] == "env_step"
                for t in penalized
            )
            assert all(t.turns and t.turns[-1].response_ids for t in penalized)  # the action that failed
            assert stats["events"]["penalized"] == stats["task_events"]["math"]["penalized"] >= len(penalized)
            assert any(r.startswith("penalized: ") for _, r in stats["failures"])  # the reason stays visible
        await s.close()

    run(go())


def test_penalize_never_trains_on_a_failure_before_the_model_acted():
    async def go():
        envs = {
            "math": [Arithmetic() for _ in range(4)],
            "flaky": [WithFailures(Arithmetic(), p_raise=0.5, on=("reset",), seed=i) for i in range(4)],
        }
        s, _ = make(envs, batch=8, group=4, failed="penalize", failure_reward=-1.0)
        batch = await s.get_batch(8, timeout_s=30)
        assert not any(t.reason.startswith("penalized") for t in batch)
        failed = [t for t in s.ledger.ended if t.status is Status.FAILED]
        assert failed and all(t.info["rollart_failed_in"] == "env_reset" for t in failed)
        await s.close()

    run(go())


class _BuggyStep(Arithmetic):
    def step(self, action):
        return {}["missing"]  # a bug in the user's env: KeyError on every step


def test_penalize_still_stops_early_on_a_bug_in_user_code():
    async def go():
        s, _ = make({"math": [_BuggyStep() for _ in range(4)]}, batch=8, group=4, failed="penalize")
        # every member is penalized, so batches could form; the user's bug stops the run all the same
        with pytest.raises(RolloutStalledError, match=r"same error[\s\S]*KeyError"):
            await s.wait_ready(8, timeout_s=60)
        await s.close()

    run(go())


def test_a_task_that_always_fails_stalls_with_its_reasons():
    async def go():
        envs = {
            "math": [Arithmetic() for _ in range(4)],
            "crash": [WithFailures(Arithmetic(), p_raise=1.0, seed=i) for i in range(2)],
        }
        s, _ = make(envs, batch=8, group=4)  # uniform weights: every batch needs a crash group
        with pytest.raises(RolloutStalledError, match=r"task 'crash' all failed[\s\S]*injected failure"):
            await s.wait_ready(8, timeout_s=60)
        await s.close()

    run(go())


def test_bad_rewards_fail_the_trajectory_with_reason():
    async def go():
        rw = RewardDispatcher()
        rw.set("nan", lambda t: float("nan"), retries=1)
        rw.set("boom", lambda t: 1 / 0, retries=0)
        rw.set("math", lambda t: 1.0)
        envs = {"math": [Arithmetic() for _ in range(4)], "nan": [Arithmetic()], "boom": [Arithmetic()]}
        s, _ = make(envs, batch=4, group=4, rewards=rw)
        await s.get_batch(4, timeout_s=30)

        def failed() -> dict[str, str]:
            return {t.task: t.reason for t in s.ledger.ended if t.status is Status.FAILED}

        for _ in range(300):  # the failing tasks' rewards finish on their own time (a busy machine: later)
            if {"nan", "boom"} <= failed().keys():
                break
            await asyncio.sleep(0.05)
        reasons = failed()
        assert "not a finite number" in reasons["nan"] and "after 2 attempt" in reasons["nan"]
        assert "ZeroDivisionError" in reasons["boom"]
        await s.close()

    run(go())


def test_every_trajectory_ends_in_exactly_one_terminal_status():
    async def go():
        envs = {
            "math": [WithLatency(Arithmetic(max_turns=2), mean_s=0.01, std_s=0.01, seed=i) for i in range(8)],
            "crash": [WithFailures(Arithmetic(), p_raise=0.5, seed=3)],
        }
        s, backends = make(envs, batch=8, group=4, redundancy=1, alpha=0, weights={"math": 1.0, "crash": 0.0})
        for v in range(1, 4):
            await s.get_batch(8, timeout_s=30)
            for b in backends:  # what the pipeline's update step does before set_version
                b.load_weights({}, v)
            await s.set_version(v)
        await s.close()
        # every launched trajectory is counted under exactly one terminal status
        statuses = {k: v for k, v in s.ledger.counts.items() if k != "redundant_cancelled"}
        assert sum(statuses.values()) == s.ledger.launched
        assert set(statuses) <= {"completed", "failed", "cancelled", "aborted_stale"}
        assert all(t.status.terminal for t in s.ledger.ended)
        assert not s.running and not s.scoring

    run(go())


@pytest.mark.parametrize("mode,aborted", [("rollart", True), ("areal", False)])
def test_areal_keeps_what_rollart_aborts(mode, aborted):
    """A long trajectory that crosses two version bumps: rollart (alpha=1) aborts it, areal keeps it."""

    async def go():
        envs = {
            "long": [WithLatency(Arithmetic(max_turns=1), mean_s=0.6, std_s=0.0)],
            "fast": [Arithmetic() for _ in range(4)],
        }
        s, _ = make(envs, mode=mode, batch=4, group=4)
        s.schedule()
        await asyncio.sleep(0.05)
        long_ids = [tid for tid, (t, _, _) in s.running.items() if t.task == "long"]
        assert long_ids
        await s.set_version(1)
        await s.set_version(2)
        await asyncio.sleep(0.05)
        t = next(t for t in list(s.ledger.ended) + [r[0] for r in s.running.values()] if t.id == long_ids[0])
        if aborted:
            assert t.status is Status.ABORTED_STALE and "alpha=1" in t.reason
        else:
            assert not t.status.terminal or t.status is Status.COMPLETED
        await s.close()

    run(go())


def test_sync_mode_waits_for_the_slowest_env_each_turn():
    """Batch-level interaction: every turn lasts as long as the slowest env's step."""

    async def go(mode):
        envs = {"m": [WithLatency(Arithmetic(max_turns=3), mean_s=0.01 if i else 0.15, std_s=0.0) for i in range(4)]}
        s, _ = make(envs, mode=mode, batch=4, group=4, max_turns=3)
        batch = await s.get_batch(4, timeout_s=30)
        await s.close()
        return batch

    sync = asyncio.run(go("sync"))
    fast = [t for t in sync if all(tr.timings["env"] < 0.1 for tr in t.turns)]
    assert len(fast) == 3
    for t in fast:  # each fast env waited at the barrier for the slow one, every turn
        assert all(tr.timings["barrier"] > 0.1 for tr in t.turns)
    plus = asyncio.run(go("sync+"))
    assert all("barrier" not in tr.timings for t in plus for tr in t.turns)


def test_trajectory_ids_are_seeded_and_salted():
    """Same seed and salt: the same ids (sampling seeds and sim responses hash them); another salt
    (another pipeline sharing the generators): other ids."""

    async def ids(salt):
        s, _ = make(arith(6))
        if salt:
            s = RolloutScheduler(
                dataclasses.replace(s.plan, envs=arith(6)), SimTokenizer(), s.proxy, RewardDispatcher(), id_salt=salt
            )
        s.schedule()
        out = [t.id for t, _, _ in s.running.values()], sorted({t.group_id for t, _, _ in s.running.values()})
        await s.close()
        return out

    a, b, c = run(ids("")), run(ids("")), run(ids("other.rollout"))
    assert a == b and len(set(a[0])) == 6
    assert not set(a[0]) & set(c[0]) and not set(a[1]) & set(c[1])


def test_evicted_samples_move_counts_but_events_only_grow():
    """A buffered sample evicted as stale: counts move it from completed to aborted_stale; the
    event log (what a StepReport diffs per step) never goes down, so no step reports < 0."""

    async def go():
        s, _ = make(arith(4), batch=4, group=4)
        await s.wait_ready(4, timeout_s=30)
        before_counts, before_events = dict(s.ledger.counts), dict(s.ledger.events)
        assert before_counts["completed"] >= 4 and before_events == before_counts
        await s.set_version(1)
        await s.set_version(2)  # buffered samples began at version 0: outside alpha=1
        assert s.ledger.counts["completed"] < before_counts["completed"]
        assert s.ledger.counts["aborted_stale"] > 0
        assert all(s.ledger.events[k] >= v for k, v in before_events.items())
        assert s.ledger.events["aborted_stale"] >= s.ledger.counts["aborted_stale"]
        await s.close()

    run(go())


def test_only_the_last_allowed_turn_is_marked_last_turn():
    """The env manager tells the generator when no request of a trajectory can follow (so an HF
    backend keeps no KV for it): on turn ``max_turns - 1`` and no other."""

    async def go():
        s, backends = make({"math": [Arithmetic(max_turns=3) for _ in range(8)]}, batch=8, group=4)
        seen: dict[str, list[bool]] = {}
        for b in backends:
            inner = b.generate

            async def generate(req, inner=inner):
                seen.setdefault(req.traj_id, []).append(req.last_turn)
                return await inner(req)

            b.generate = generate
        batch = await s.get_batch(8, timeout_s=30)
        await s.close()
        for t in batch:
            flags = seen[t.id]
            assert len(flags) == len(t.turns)
            assert flags == [k == 2 for k in range(len(flags))], (t.id, flags)
        assert any(len(t.turns) == 3 for t in batch)  # the sim policy rarely answers a sum right

    run(go())


def test_group_seeds_come_from_the_schedulers_copy_of_the_curriculum():
    """With a curriculum, every group's seed is one of its prompts; the scheduler draws from and
    updates its own copy (one draw per group, one update per scored trajectory) and reports it."""
    template = PromptCurriculum(range(7, 17))

    async def go():
        s, _ = make(arith(8), batch=16, group=4, curricula={"math": template})
        batch = await s.get_batch(16, timeout_s=30)
        # no await between the two: the scheduler's copy cannot change in between (trajectories
        # still in flight go on scoring until close, so compare at one moment)
        stats, updates_then = s.stats(), s.curricula["math"].updates
        await s.close()
        return s, batch, stats, updates_then

    s, batch, stats, updates_then = run(go())
    assert {t.seed for t in batch} <= set(range(7, 17))
    cur = s.curricula["math"]
    assert cur is not template and template.draws == template.updates == 0
    assert cur.draws == s.started_groups and cur.updates == s.ledger.events["completed"] >= len(batch)
    assert stats["curriculum"]["math"]["updates"] == updates_then <= cur.updates


def _ahead_recounted(s) -> collections.Counter:
    """What the scheduler's kept per-task counts must equal: a full pass over its state."""
    ahead = collections.Counter(t.task for t, _, _ in s.running.values())
    ahead.update(s.scoring.values())
    for g in s.groups.values():
        ahead[g.task] += len(g.buffered)
    return ahead


def test_kept_counts_match_a_full_recount_through_aborts_failures_and_batches():
    """schedule() reads idle envs and per-task counts kept as they change (not a pass over every
    env and group); they equal a recount at every point of a run with stale aborts, env failures,
    redundant members and batches taken."""

    async def go():
        envs = {
            "math": [WithFailures(Arithmetic(), p_raise=0.2, on=("step",), seed=i) for i in range(10)],
            "slow": [WithLatency(Arithmetic(), 0.002, 0.001) for _ in range(6)],
        }
        s, backends = make(envs, batch=8, group=2, alpha=0, redundancy=1, max_turns=2)
        checks = 0
        for v in range(1, 7):
            for _ in range(20):
                await asyncio.sleep(0.002)
                assert +s._ahead() == +_ahead_recounted(s)
                assert s._idle == {m.index for m in s.managers if not m.busy}
                checks += 1
            await s.wait_ready(8, timeout_s=30)
            s.take_batch(8)
            for b in backends:
                b.load_weights({}, v)
            await s.set_version(v)  # alpha=0: everything begun before v is aborted
        assert +s._ahead() == +_ahead_recounted(s)
        assert s.ledger.counts["aborted_stale"] > 0 and s.ledger.counts["failed"] > 0 and checks == 120
        await s.close()
        assert s.accounting()["unaccounted"] == 0

    run(go())


def test_the_rl_prompt_stream_holds_no_validation_problem():
    """Every trajectory a scheduler starts, with random seeds and with a curriculum over the env's
    training seeds, asks a training problem of an env with a held-out split."""

    def env():
        return Arithmetic(max_operand=99, holdout=200, fixed_width=True, reverse_answer=True, balance_answers=False)

    val = {f"{a} {op} {b}" for a, op, b in env().validation_problems()}

    async def go(curricula):
        s, backends = make({"math": [env() for _ in range(8)]}, batch=32, group=4, max_turns=1, curricula=curricula)
        asked = set()
        for v in range(1, 7):
            asked |= {t.info["question"] for t in await s.get_batch(32, timeout_s=60)}
            for b in backends:  # what the pipeline's update step does before set_version
                b.load_weights({}, v)
            await s.set_version(v)
        asked |= {t.info["question"] for t in s.trajectories()}
        await s.close()
        return asked

    for curricula in (None, {"math": PromptCurriculum(env().training_seeds())}):
        asked = run(go(curricula))
        assert len(asked) > 40
        assert not asked & val
