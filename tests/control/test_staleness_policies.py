"""The staleness policies on small deterministic cases: which trajectories are kept, held,
paced, renewed (cancel) or weighted (correct), and the α bound per policy."""

import asyncio
import math

import pytest
import torch

from rollart_nb.algo.provenance import tis_weights
from rollart_nb.config import PipelineConfig
from rollart_nb.control.env_manager import _renewed
from rollart_nb.control.staleness import DISCARDED, POLICIES, RENEW, Staleness, trained_min_version
from rollart_nb.envs import Arithmetic, WithLatency
from rollart_nb.errors import ConfigError
from rollart_nb.tokens import TokenSeq
from rollart_nb.trajectory import Status, Trajectory, Turn
from tests.control.test_scheduler import make


def traj(start: int, *turn_versions: int) -> Trajectory:
    t = Trajectory("t", group_id="g", start_version=start)
    t.turns = [Turn("o", "a", [1], [2, 3], [0.0, 0.0], [1, 1], version=v) for v in turn_versions]
    return t


def test_policies_are_a_pipeline_setting_checked_by_name():
    assert PipelineConfig().staleness == "drop" and set(POLICIES) == {"drop", "wait", "pace", "cancel", "correct"}
    with pytest.raises(ConfigError, match="staleness='hold' must be one of drop, wait, pace, cancel, correct"):
        PipelineConfig(staleness="hold")


def test_drop_wait_pace_abort_what_passes_alpha_and_correct_keeps_it():
    old = traj(1, 1, 3)
    for policy in ("drop", "wait", "pace"):
        assert Staleness(1, policy=policy).is_stale(old, 3)
    assert not Staleness(1, policy="correct").is_stale(old, 3)  # trained, importance-weighted instead
    assert not Staleness(1, abort_stale=False, policy="drop").is_stale(old, 3)  # areal: admission only


def test_pace_admits_only_the_next_batch_groups():
    drop, pace = Staleness(2), Staleness(2, policy="pace")  # quota 2 groups a batch, 1 batch taken
    assert [drop.admits(n, 1, 2) for n in (5, 6, 7)] == [True, True, True]  # (1 + 2 + 1) * 2 = 8
    assert [pace.admits(n, 1, 2) for n in (3, 4)] == [True, False]  # (1 + 1) * 2 = 4


def test_cancel_keeps_finished_turns_as_context_and_marks_the_turn_in_flight():
    rule = Staleness(1, policy="cancel")
    t = traj(1, 1, 3)
    assert rule.is_stale(t, 3)
    masked = rule.renew(t, 3)  # floor 2: the version-1 turn leaves the loss, the version-3 one stays
    assert masked == 2 and t.turns[0].loss_mask == [0, 0] and t.turns[1].loss_mask == [1, 1]
    assert t.info[RENEW] == 2 and trained_min_version(t) == 3 and not rule.is_stale(t, 3)
    assert t.min_version == 1  # provenance is unchanged: only the loss forgets the old turn


def test_a_marked_turn_in_flight_is_generated_again_only_if_old_weights_wrote_part_of_it():
    part = lambda v: type("Part", (), {"version": v})()  # noqa: E731 - a generation result's version
    t = Trajectory("t")
    assert not _renewed(t, [part(1)])  # no mark
    t.info[RENEW] = 2
    assert not _renewed(t, [part(2)]) and RENEW in t.info  # new weights wrote it all: kept
    assert _renewed(t, [part(1), part(2)]) and RENEW not in t.info  # old weights wrote some: again, once
    seq = TokenSeq([1, 2, 3])
    prompt = seq.view(0, 2)
    seq.truncate(2)
    assert list(seq.tail()) == [1, 2] and list(prompt) == [1, 2]


def test_wait_holds_until_the_trajectories_the_next_bump_would_abort_have_finished():
    from rollart_nb.control.ledger import Ledger

    async def go():
        rule, led = Staleness(1, policy="wait", wait_s=5.0), Ledger(2)
        running = {"a": (traj(1, 1),), "b": (traj(2, 2),)}  # at version 2, "a" goes stale at 3
        scoring: set[str] = set()

        async def finish():
            await asyncio.sleep(0.1)
            running.pop("a")
            scoring.add("a")  # finished, now scored
            await asyncio.sleep(0.1)
            scoring.discard("a")

        task = asyncio.create_task(finish())
        await rule.hold(2, running, scoring, led)
        await task
        assert 0.15 < led.waited_s < 2.0 and "b" in running  # "b" is not waited for
        other = Ledger(2)
        await Staleness(1, policy="drop").hold(2, {"a": (traj(1, 1),)}, set(), other)
        assert other.waited_s == 0.0
        # bounded: one wait_s budget per version, even when a polling caller cancels and calls again
        short, slow = Staleness(1, policy="wait", wait_s=0.3), Ledger(2)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(short.hold(2, {"a": (traj(1, 1),)}, set(), slow), 0.2)
        await short.hold(2, {"a": (traj(1, 1),)}, set(), slow)
        assert 0.25 < slow.waited_s < 0.6

    asyncio.run(go())


def test_correct_weights_tokens_by_the_truncated_ratio_per_token_or_per_version_segment():
    trainer = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    sampler = torch.tensor([[-0.5, -0.5, 0.2, math.log(4.0)]])  # ratios e^.5, e^.5, e^-.2, 1/4
    versions = torch.tensor([[4, 4, 5, 5]])  # a trajectory written by two versions
    mask, w = torch.ones(1, 4), torch.full((1, 4), 0.25)
    tok, m = tis_weights(trainer, sampler, versions, mask, cap=1.5, level="token", trainer_version=5, weights=w)
    assert tok[0].tolist() == pytest.approx([1.5, 1.5, math.exp(-0.2), 0.25])
    assert m["tis_clip_frac"] == pytest.approx(0.5) and m["corrected_frac"] == pytest.approx(0.5)
    seq, m = tis_weights(trainer, sampler, versions, mask, cap=4.0, level="sequence", trainer_version=5, weights=w)
    # per segment: version 4 gets e^(0.5+0.5) = e (under the cap), version 5 gets e^-0.2 / 4
    assert seq[0].tolist() == pytest.approx([math.e, math.e, math.exp(-0.2) / 4, math.exp(-0.2) / 4])
    assert m["tis_clip_frac"] == 0.0


def test_correct_needs_the_algorithm_importance_weights():
    from rollart_nb.algo.grpo import GRPO
    from rollart_nb.session_checks import staleness_algo

    cfg = PipelineConfig(staleness="correct")
    assert staleness_algo(cfg, GRPO(group_size=4), "here").tis == "token"
    assert staleness_algo(cfg, GRPO(group_size=4, tis="sequence"), "here").tis == "sequence"
    assert staleness_algo(PipelineConfig(), None, "here") is None
    with pytest.raises(ConfigError, match="tis='token'"):
        staleness_algo(cfg, None, "here")


def _crossing(policy):
    """A long one-turn trajectory that crosses two version bumps at alpha=1."""

    async def go():
        envs = {
            "long": [WithLatency(Arithmetic(max_turns=1), mean_s=0.6, std_s=0.0)],
            "fast": [Arithmetic() for _ in range(4)],
        }
        s, _ = make(envs, batch=4, group=4)
        s.staleness = Staleness(1, True, policy)
        s.buffer.staleness = s.staleness
        s.schedule()
        await asyncio.sleep(0.05)
        tid = next(tid for tid, (t, _, _) in s.running.items() if t.task == "long")
        t = s.running[tid][0]
        await s.set_version(1)
        await s.set_version(2)
        await asyncio.sleep(0.05)
        out = (t.status, dict(s.ledger.events), t.info.get(RENEW))
        await s.close()
        return out

    return asyncio.run(go())


@pytest.mark.parametrize(
    "policy,kept", [("drop", False), ("wait", False), ("pace", False), ("cancel", True), ("correct", True)]
)
def test_at_a_bump_what_passes_alpha_is_aborted_renewed_or_kept(policy, kept):
    status, events, mark = _crossing(policy)
    assert (status is Status.ABORTED_STALE) is not kept
    assert (events.get("renewed", 0) > 0) is (policy == "cancel")
    assert (mark == 1) is (policy == "cancel")  # cancel: its turn in flight starts again above version 1


@pytest.mark.parametrize("policy", POLICIES)
def test_the_alpha_bound_per_policy(policy):
    """Batches taken at version n over several bumps: every trained token was written at
    version >= n - alpha under every policy but correct, which trains what it keeps."""

    async def go():
        envs = {"math": [WithLatency(Arithmetic(max_turns=3), mean_s=0.02, std_s=0.02) for _ in range(8)]}
        s, backends = make(envs, batch=4, group=2, alpha=1, max_turns=3)
        s.staleness = Staleness(1, True, policy, wait_s=1.0)
        s.buffer.staleness = s.staleness
        lags = []
        for v in range(1, 6):
            batch = await s.get_batch(4, timeout_s=30)
            lags += [s.version - trained_min_version(t) for t in batch]
            for b in backends:  # what the pipeline's update step does before set_version
                b.load_weights({}, v)
            await s.set_version(v)
        discarded = sum(t.info.get(DISCARDED, 0) for t in s.ledger.ended)
        await s.close()
        return lags, discarded

    lags, _ = asyncio.run(go())
    if policy != "correct":
        assert max(lags) <= 1
    assert min(lags) >= 0


def test_a_step_reports_renewed_tokens_and_the_wait_and_trackers_get_them():
    from rollart_nb.control.report import StepReport, waste
    from rollart_nb.trackers import step_scalars

    w = waste({"ended": 1000, "aborted_stale": 100, "renewed": 50, "cancelled": 10}, aborted=2, waited_s=1.5)
    assert w["renewed_tokens"] == 50 and w["aborted_frac"] == pytest.approx(0.15) and w["waited_s"] == 1.5
    assert waste({"ended": 1000, "aborted_stale": 100}, aborted=2)["aborted_frac"] == pytest.approx(0.1)  # drop
    rep = StepReport(step=3, version=4, mode="rollart", counts={"renewed": 2}, waste=w, train={"corrected_frac": 0.25})
    row = rep.row()
    assert row["renewed"] == 2 and row["waited_s"] == 1.5 and row["corrected_frac"] == 0.25
    scalars = step_scalars(rep)
    assert scalars["waste/renewed_tokens"] == 50 and scalars["waste/waited_s"] == 1.5
    assert scalars["count/renewed"] == 2 and scalars["train/corrected_frac"] == 0.25


def test_cancel_generates_a_turn_in_flight_again_under_the_new_weights_end_to_end():
    """On a simulated cluster at alpha=0, every trajectory in flight at a bump passes the bound:
    under cancel its preempted turn is discarded and generated again from its prompt (no turn
    then spans an old and a new version), its older turns leave the loss, and no trained token
    of a batch is older than the bound."""
    import rollart_nb as rn
    from rollart_nb.control.env_manager import RolloutConfig
    from rollart_nb.models.spec import spec
    from rollart_nb.sim import SimEnv, response_tokens_fn, workload
    from rollart_nb.workers.roles import SimGenerator, SimTrainer

    q8, wl = spec("qwen3-8b"), {"lake": workload("frozenlake"), "math": workload("gem-math")}
    with rn.Session.sim({"H800": 5, "H20": 2, "cpu": 2}) as sess:
        gen = sess.cluster(
            "actor_gen", SimGenerator, pool="H20", replicas=2, model=q8, response_tokens=response_tokens_fn(wl)
        )
        train = sess.cluster("actor_train", SimTrainer, pool="H800", model=q8, gpus=4)
        tasks = sess.tasks({k: SimEnv(w) for k, w in wl.items()}, envs_per_task=16)
        pipe = sess.pipeline(
            train, gen, tasks, batch_size=32, group_size=8, alpha=0, staleness="cancel", name="cancel",
            rollout=RolloutConfig(max_turns=32, max_new_tokens=4096, max_context=32768),
        )  # fmt: skip
        reps = pipe.run(4, progress=False)
        ended = pipe.rollout.trajectories(last=None)
        pipe.close()
    assert sum(r.counts.get("renewed", 0) for r in reps) > 0
    assert sum(r.waste.get("renewed_tokens", 0) for r in reps) > 0
    renewed = [t for t in ended if t.info.get(DISCARDED)]
    assert renewed, "no turn in flight was generated again"
    for t in renewed:
        assert all(len({v for _, _, v in u.segments()}) == 1 for u in t.turns if any(u.loss_mask))
    assert all(gap <= 1 for r in reps for gap in r.staleness)  # alpha=0: the gap after the update is 1


@pytest.mark.parametrize("policy,groups", [("drop", 6), ("pace", 2)])
def test_pace_opens_groups_only_for_the_next_batch_in_the_scheduler(policy, groups):
    """32 idle envs, batches of 2 groups, alpha=2: drop opens (0 + 2 + 1) x 2 groups at once,
    pace only the next batch's 2, leaving the other envs idle until a batch is taken."""

    async def go():
        envs = {"math": [WithLatency(Arithmetic(max_turns=1), mean_s=0.5, std_s=0.0) for _ in range(32)]}
        s, _ = make(envs, batch=8, group=4, alpha=2)
        s.staleness = Staleness(2, True, policy)
        s.schedule()
        await asyncio.sleep(0.01)
        out = s.started_groups, len(s.running)
        await s.close()
        return out

    assert asyncio.run(go()) == (groups, groups * 4)
