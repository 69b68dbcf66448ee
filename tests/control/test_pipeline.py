"""The Pipeline on a real local Ray with the sim backends: six steps, modes, rewards, lifecycle."""

import asyncio

import pytest

from rollart_nb.config import RolloutConfig
from rollart_nb.control.pipeline import PipelineState
from rollart_nb.envs import Arithmetic, WithFailures, WithLatency
from rollart_nb.errors import ConfigError, StateError
from rollart_nb.models import spec
from rollart_nb.sim import SimEnv
from rollart_nb.workers.roles import SimGenerator, SimTrainer

M = spec("qwen3-0.6b")


@pytest.fixture(scope="module")
def parts(local_session):
    sess = local_session
    gen = sess.cluster(
        "actor_gen", SimGenerator, pool="H20", replicas=2, model=M, time_scale=1e-4, mean_response_tokens=8
    )
    train = sess.cluster("actor_train", SimTrainer, pool="H800", model=M, time_scale=1e-4)
    tasks = sess.tasks({"fl": SimEnv("frozenlake", time_scale=1e-4), "math": Arithmetic()}, envs_per_task=8)
    return sess, gen, train, tasks


@pytest.mark.parametrize("mode", ["sync", "sync+", "one-off", "areal", "rollart"])
def test_each_mode_steps_and_reports(parts, mode):
    sess, gen, train, tasks = parts
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, mode=mode, name="p")
    v0 = pipe.version
    reps = pipe.run(3, progress=False)
    assert [r.step for r in reps] == [0, 1, 2]
    for r in reps:
        assert r.batch_size == 8 and r.tokens > 0 and r.throughput > 0
        assert set(r.reward) == {"fl", "math"}  # uniform task sampling: both tasks in each batch
        assert r.step_s >= r.phases["rollout_wait"] > 0
        assert sum(r.staleness.values()) == 8
    # sync modes train inside the step; overlapped modes train behind the next rollout
    versions = [r.version for r in reps]
    if mode in ("sync", "sync+"):
        assert versions == [v0 + 1, v0 + 2, v0 + 3] and all(r.phases["train"] > 0 for r in reps)
        assert all(set(r.staleness) == {1} for r in reps)  # trained on fresh data, then updated
    else:
        assert versions == [v0, v0 + 1, v0 + 2]
    assert gen.version() == [pipe.version, pipe.version]
    assert "Pipeline" in pipe._repr_html_() and "version" in repr(pipe)
    pipe.close()
    with pytest.raises(StateError, match=r"Pipeline is closed; create a new one with session.pipeline"):
        pipe.step()


def test_reward_swap_versions_trajectories(parts):
    sess, gen, train, tasks = parts
    # set before the pipeline exists: rollout starts in its constructor, so a swap right after
    # construction would race the first trajectories (scored with the env's own reward)
    sess.reward("math", lambda t: 0.25)
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, name="swap")
    r1 = pipe.step()
    assert r1.reward["math"] == 0.25
    v = pipe.swap_reward("math", lambda t: 0.75)
    assert v == 1
    hist = pipe.reward_history()
    assert [h["version"] for h in hist if h["task"] == "math"] == [0, 1] and "0.75" in hist[-1]["source"]
    for _ in range(4):
        rep = pipe.step()
    assert rep.reward["math"] == 0.75  # the old-version samples were consumed by earlier batches
    scored = [t for t in pipe.trajectories(task="math", status="completed")]
    assert {t.reward_version for t in scored} == {0, 1}
    assert all((t.reward == 0.25) == (t.reward_version == 0) for t in scored)
    with pytest.raises(ConfigError, match="unknown task 'nope'"):
        pipe.swap_reward("nope", lambda t: 0.0)
    pipe.close()
    sess._rewards.pop("math")  # later tests in this module build pipelines with the env's reward


def test_validation_scores_with_validate_with_and_keeps_it_across_swaps(parts):
    sess, gen, train, tasks = parts
    # Train on one reward, validate on another; a later swap of the training reward keeps it.
    sess.reward("math", lambda t: 0.25, validate_with=lambda t: 0.5)
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, name="valwith")
    assert pipe.step().reward["math"] == 0.25
    assert pipe.validate(["math"]) == {"math": 0.5}
    res = pipe.last_validation["math"]  # the full result, with the final actions' spread
    assert res["n"] == 100 and res["failed"] == 0 and 1 <= res["distinct_actions"] <= 100
    assert 0 < sum(n for _, n in res["top_actions"]) <= 100
    pipe.swap_reward("math", lambda t: 0.75)
    assert pipe.validate(["math"]) == {"math": 0.5}
    pipe.swap_reward("math", lambda t: 0.75, validate_with=lambda t: 1.0)
    assert pipe.validate(["math"]) == {"math": 1.0}
    assert {h["version"] for h in pipe.reward_history() if h["task"] == "math"} == {0, 1, 2}
    with pytest.raises(ConfigError, match="validate_with"):
        sess.reward("math", lambda t: 0.0, validate_with="exact")
    pipe.close()
    # A later sess.reward without validate_with keeps the scorer for pipelines built after it.
    sess.reward("math", lambda t: 0.25)
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, name="valwith")
    assert pipe.validate(["math"]) == {"math": 0.5}
    pipe.close()
    sess._rewards.pop("math")


def test_background_run_pause_and_astep(parts):
    sess, gen, train, tasks = parts
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, name="bg")
    seen = []
    th = pipe.run(50, background=True, progress=False, on_step=seen.append)
    assert th.is_alive() or seen  # returned at once
    while len(seen) < 2:
        th.join(0.05)
    pipe.pause()
    pipe.wait(timeout=60)
    assert not th.is_alive() and pipe.state == "paused" and 2 <= len(seen) < 50
    rep = asyncio.run(pipe.astep())  # a later step continues where it stopped
    assert rep.step == len(seen)
    pipe.close()


def test_a_background_run_that_raises_leaves_the_failed_state_until_the_next_step(parts):
    sess, gen, train, tasks = parts
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, name="bgfail")

    def boom(rep):
        raise ValueError(f"callback broke at step {rep.step}")

    th = pipe.run(5, background=True, progress=False, on_step=boom)
    assert pipe.running or not th.is_alive()
    th.join(120)
    assert not pipe.running and pipe.state == "failed" and isinstance(pipe.error, ValueError)
    assert len(pipe.reports) == 1  # it stopped at the first failure
    rep = pipe.step()  # a later step runs; the state is no longer failed
    assert rep.step == 1 and pipe.state == "idle"
    with pytest.raises(ValueError, match="callback broke at step 0"):
        pipe.wait()
    pipe.close()


def test_validation_and_viewer_data(parts):
    sess, gen, train, tasks = parts
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, name="val", validate_every=1)
    rep = pipe.step()
    assert set(rep.validation) == {"fl", "math"} and 0.0 <= rep.validation["math"] <= 1.0
    trajs = pipe.trajectories(last=5)
    assert 0 < len(trajs) <= 5 and all(t.status.terminal for t in trajs)
    t = trajs[-1]
    assert t.turns and len(t.turns[0].loss_mask) == len(t.turns[0].response_ids)
    pipe.close()


def test_pass_at_k_samples_every_seed_k_times_and_counts_any_success(parts):
    """A validation scorer that passes about 30% of runs, each run on its own (by trajectory id):
    pass@1 is near 0.3 and pass@8 near 1 - 0.7**8; a scorer that passes by seed gives pass@8 ==
    pass@1. Generated tokens are counted by how trajectories ended."""
    import zlib

    sess, gen, train, tasks = parts

    def by_run(t):
        return 1.0 if zlib.crc32(t.id.encode()) % 10 < 3 else 0.0

    def by_seed(t):
        return 1.0 if t.seed % 2 else 0.0

    sess.reward("math", lambda t: 0.0, validate_with=by_run)
    pipe = sess.pipeline(
        train, gen, tasks, batch_size=8, group_size=4, name="passk", validation_seeds={"math": list(range(40))}
    )
    pipe.step()
    got = pipe.pass_at(8, tasks=["math"])["math"]
    assert set(got) == {"pass@1", "pass@8"}
    assert 0.15 < got["pass@1"] < 0.45 and got["pass@8"] > 0.75
    pipe.swap_reward("math", lambda t: 0.0, validate_with=by_seed)
    got = pipe.pass_at(4, tasks=["math"])["math"]
    assert got["pass@1"] == got["pass@4"] == 0.5
    with pytest.raises(ConfigError, match="temperature"):
        pipe.pass_at(4, temperature=0.0)
    gen_tokens = pipe.stats()["generated_tokens"]
    assert gen_tokens.get("completed", 0) > 0 and all(v >= 0 for v in gen_tokens.values())
    pipe.close()


def test_periodic_validation_also_samples_pass_at_k_when_asked(parts):
    """validate_pass_k=4: every validation step's report has pass@1 and pass@4 per task beside
    the greedy score (a scorer that passes by seed: pass@4 == pass@1 == its share), in the
    report's row and the trackers' scalars; other steps have none."""
    from rollart_nb.trackers import step_scalars

    sess, gen, train, tasks = parts
    sess.reward("math", lambda t: 0.0, validate_with=lambda t: 1.0 if t.seed % 4 == 0 else 0.0)
    seeds = {"math": list(range(20)), "fl": list(range(4))}
    pipe = sess.pipeline(
        train,
        gen,
        tasks,
        batch_size=8,
        group_size=4,
        name="pk",
        validate_every=2,
        validate_pass_k=4,
        validation_seeds=seeds,
    )
    reps = pipe.run(4, progress=False)
    assert [bool(r.pass_k) for r in reps] == [False, True, False, True]
    got = reps[1].pass_k["math"]
    assert got == {"pass@1": 0.25, "pass@4": 0.25} and reps[1].validation["math"] == 0.25
    assert set(reps[3].pass_k) == {"math", "fl"}
    assert reps[1].row()["val/math/pass@4"] == 0.25
    assert step_scalars(reps[1])["validation/math/pass@4"] == 0.25
    pipe.close()
    with pytest.raises(ConfigError, match="temperature must be > 0"):
        sess.pipeline(
            train, gen, tasks, group_size=4, name="pk0", validate_pass_k=4, rollout=RolloutConfig(temperature=0.0)
        )
    with pytest.raises(ConfigError, match="validate_pass_k=1"):
        sess.pipeline(train, gen, tasks, group_size=4, name="pk1", validate_pass_k=1)


def test_a_validation_holds_training_generation_and_stays_out_of_tokens_per_s(parts):
    sess, gen, train, _ = parts
    # slow multi-turn episodes: when a validation starts, some are between two turns (their next
    # turn is held), and a validation of 32 seeds takes several steps' worth of time
    tasks = sess.tasks({"math": WithLatency(Arithmetic(max_turns=3), mean_s=0.05, std_s=0.0)}, envs_per_task=16)
    pipe = sess.pipeline(
        train,
        gen,
        tasks,
        batch_size=8,
        group_size=4,
        name="vt",
        validate_every=2,
        validation_seeds={"math": list(range(32))},
    )
    reps = pipe.run(6, progress=False)
    held = pipe.stats()["proxy"]["held_s"]
    assert held > 0  # training turns waited while the validations ran
    assert [r.step for r in reps if r.validation] == [1, 3, 5]
    assert all(reps[i].phases["validation"] > 0 for i in (1, 3, 5))
    assert all(r.throughput == pytest.approx(r.tokens / r.step_s) for r in reps)
    pipe.close()


@pytest.mark.parametrize("policy", ["exclude", "penalize"])
def test_failed_trajectories_policy_and_per_task_counts_reach_the_report(parts, policy):
    sess, gen, train, _ = parts
    tasks = sess.tasks(
        {"math": WithFailures(Arithmetic(), p_raise=0.3, on=("step",), seed=0), "ok": Arithmetic()},
        envs_per_task=8,
    )
    pipe = sess.pipeline(
        train,
        gen,
        tasks,
        batch_size=8,
        group_size=4,
        name=f"fail-{policy}",
        failed_trajectories=policy,
        failure_reward=-1.0,
    )
    assert pipe.config.failed_trajectories == policy and pipe.config.failure_reward == -1.0
    reps = pipe.run(4, progress=False)
    failed = sum(r.counts.get("failed", 0) for r in reps)
    penalized = sum(r.counts.get("penalized", 0) for r in reps)
    for r in reps:  # per task, the report's counts add up to its totals
        for kind in ("failed", "penalized", "completed"):
            assert sum(c.get(kind, 0) for c in r.task_counts.values()) == r.counts.get(kind, 0)
        assert "ok" not in r.task_counts or not r.task_counts["ok"].get("failed")
    if policy == "exclude":
        assert failed > 0 and penalized == 0
        assert all(r.reward.get("math", 0.0) >= 0 for r in reps)
    else:
        assert penalized > 0 and failed == 0  # every failure came after the model acted: all penalized
        assert any(r.reward.get("math", 0.0) < 0 for r in reps)  # the -1 pulls the batch mean down
        assert any("penalized" in r.row() for r in reps)
        assert any(x.startswith("penalized: ") for r in reps for x in r.failures.get("math", []))
    pipe.close()


def test_slow_env_latency_does_not_block_other_tasks(parts):
    sess, gen, train, _ = parts
    tasks = sess.tasks(
        {"slow": WithLatency(Arithmetic(), mean_s=30.0, std_s=0.0), "math": Arithmetic()},
        envs_per_task={"slow": 2, "math": 8},
        weights={"math": 1.0, "slow": 0.0},
    )
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, name="slow", step_timeout_s=60)
    rep = pipe.step()
    assert rep.step_s < 20 and set(rep.reward) == {"math"}
    assert pipe.stats()["running"] >= 2  # the slow ones are still going
    pipe.close()
    assert pipe.stats.__self__.state == "closed"


def test_bad_pipeline_config_is_clear(parts):
    sess, gen, train, tasks = parts
    with pytest.raises(ConfigError, match="batch_size=6 must be a multiple of the group size 4"):
        sess.pipeline(train, gen, tasks, batch_size=6, group_size=4, name="bad")
    with pytest.raises(ConfigError, match="mode='async' must be one of sync, sync.*, rollart"):
        sess.pipeline(train, gen, tasks, mode="async", name="bad")
    with pytest.raises(ConfigError, match="is not an env"):
        sess.tasks({"x": object()})


def test_a_prompt_curriculum_reaches_the_rollout_worker(parts):
    sess, gen, train, _ = parts
    import rollart_nb as rn

    tasks = sess.tasks({"math": Arithmetic()}, envs_per_task=8, curriculum={"math": rn.PromptCurriculum(range(5))})
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, name="curriculum")
    pipe.step()
    assert {t.seed for t in pipe.trajectories(task="math")} <= set(range(5))
    cur = pipe.stats()["curriculum"]["math"]
    assert cur["seeds"] == 5 and cur["draws"] >= 2 and cur["updates"] >= 8
    pipe.close()


def test_bad_arguments_to_a_pipeline_are_clear_and_change_nothing(parts, tmp_path):
    sess, gen, train, tasks = parts
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, name="badargs")
    assert pipe.state == PipelineState.IDLE == "idle"
    for steps in (-5, 2.5, True):
        with pytest.raises(ConfigError, match=r"steps must be a whole number >= 1 \(0 runs none\)"):
            pipe.run(steps, progress=False)
    with pytest.raises(ConfigError, match=r"steps must be a whole number"):
        pipe.run(-1, background=True, progress=False)
    assert pipe.run(0, progress=False) == [] and not pipe.reports and pipe.state == "idle"
    with pytest.raises(ConfigError, match=r"unknown task 'nope'; tasks are \['fl', 'math'\]"):
        pipe.trajectories(task="nope")
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    for path in ("/proc/x", blocker / "ckpt", blocker / "sub" / "ckpt"):
        with pytest.raises(
            ConfigError, match=r"cannot write a checkpoint to .*ckpt|cannot write a checkpoint to '/proc/x'"
        ):
            pipe.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"] and blocker.read_text() == "not a directory"
    made = tmp_path / "new" / "deeper" / "ckpt"
    assert pipe.save(made) == str(made) and (made / "pipeline.json").is_file()  # missing parents are created
    pipe.close()
    assert pipe.state is PipelineState.CLOSED and f"{pipe.state}" == "closed"
