"""Pure figure functions: the plotted data is exactly the input's."""

import pytest

from rollart_nb.algo.grpo import TASK_METRICS, TRAIN_METRICS
from rollart_nb.control.report import PHASES
from rollart_nb.nb import figures, timeline

pytest.importorskip("plotly")


@pytest.fixture(autouse=True)
def _factories(synth):
    global T0, make_report, make_trajectory
    T0, make_report, make_trajectory = synth["T0"], synth["report"], synth["trajectory"]


def test_reward_figure_has_a_line_per_task_and_validation_where_run():
    reps = [make_report(0), make_report(1, validation={"math": 0.7}), make_report(2)]
    fig = figures.reward_figure(reps)
    by_name = {t.name: t for t in fig.data}
    assert set(by_name) == {"reward/fl", "reward/math", "validation/math", "failure rate"}
    assert list(by_name["reward/math"].y) == pytest.approx([0.0, 0.1, 0.2])
    assert list(by_name["validation/math"].x) == [1] and list(by_name["validation/math"].y) == [0.7]


def test_reward_figure_marks_swaps_at_the_first_step_after_them():
    reps = [make_report(i) for i in range(4)]
    swaps = [{"task": "math", "version": 0, "created": 0.0}, {"task": "math", "version": 1, "created": T0 + 15}]
    assert figures.swap_step(reps, swaps[0]) is None
    assert figures.swap_step(reps, swaps[1]) == 2  # step 2 started at T0 + 20
    fig = figures.reward_figure(reps, swaps=swaps)
    assert [s.x0 for s in fig.layout.shapes] == [1.5]
    assert "math reward v1" in fig.layout.annotations[0].text


def test_step_time_figure_stacks_every_phase():
    reps = [make_report(0), make_report(1)]
    fig = figures.step_time_figure(reps)
    assert fig.layout.barmode == "stack"
    assert [t.name for t in fig.data] == list(PHASES)
    assert list(fig.data[0].y) == [1.5, 1.5] and list(fig.data[-1].y) == [0.15, 0.15]


def test_staleness_figure_sums_gaps_and_counts_aborts():
    reps = [make_report(0), make_report(1), make_report(2)]
    fig = figures.staleness_figure(reps)
    hist, aborts = fig.data
    assert list(hist.x) == [0, 1] and list(hist.y) == [18, 6]
    assert list(aborts.y) == [0, 1, 2]


def test_throughput_figure():
    fig = figures.throughput_figure([make_report(0), make_report(1)])
    assert list(fig.data[0].y) == [400.0, 401.0]


def test_empty_inputs_make_empty_figures():
    assert timeline.utilization_figure([], []).layout.title.text == "Pool utilization"
    assert all(len(t.x) == 0 for t in figures.step_time_figure([]).data)
    assert len(figures.reward_figure([]).data) == 0
    assert all(len(t.x) == 0 for t in figures.training_figure([]).data)


def _train(step, **kw):
    m = {"loss": 0.5 - 0.1 * step, "kl": 0.01 * step, "entropy": 2.0 - 0.1 * step, "grad_norm": 1.0 + step}
    m.update(clip_frac=0.1 * step, response_length=10.0 + step, pg_loss=0.0)
    m.update(mismatch_kl=0.001 * step, mismatch_ratio_out=0.01 * step, cross_version_frac=0.1 + 0.01 * step)
    return {**m, **kw}


def test_training_figure_plots_each_metric_over_steps():
    reps = [make_report(i, train=_train(i)) for i in range(3)]
    reps.append(make_report(3, train=_train(3, entropy=float("nan"))))  # NaN: a gap, valid JSON
    reps.append(make_report(4))  # a step without train metrics (e.g. before the first overlapped step)
    fig = figures.training_figure(reps)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name) == list(TRAIN_METRICS)  # one trace each, in a fixed order: live updates extend them
    for key, trace in by_name.items():
        assert list(trace.x) == [0, 1, 2, 3]
        want: list = [_train(i)[key] for i in range(4)]
        if key == "entropy":
            want[3] = None
        assert list(trace.y) == [w if w is None else pytest.approx(w) for w in want]
    titles = [a.text for a in fig.layout.annotations]
    assert "KL from behaviour policy (approx.)" in titles and "clip fraction" in titles
    ref = figures.training_figure([make_report(0, train=_train(0, kl_ref=0.0))])
    assert "KL to reference (k3)" in [a.text for a in ref.layout.annotations]
    # a trainer that reports only some metrics (the sim trainer: response length) draws those
    sim = figures.training_figure([make_report(i, train={"response_length": 7.0}) for i in range(2)])
    assert [len(t.x) for t in sim.data] == [0, 0, 0, 0, 0, 2, 0, 0, 0]


def test_task_figure_draws_each_tasks_curves_in_its_own_color():
    """One color per task across every panel; validation, pass@k and pass@1 where a step measured
    them; per-task trainer metrics from ``"<metric>/<task>"`` keys; every trace from the start."""

    def per(step):
        return {f"{m}/{t}": v + step for t, v in (("math", 1.0), ("fl", 2.0)) for m in TASK_METRICS}

    reps = [make_report(i, train={**_train(i), **per(i)}) for i in range(4)]
    reps[1].validation = {"math": 0.2, "fl": 0.4}
    reps[1].pass_k = {"math": {"pass@1": 0.1, "pass@8": 0.5}, "fl": {"pass@1": 0.3, "pass@8": 0.7}}
    reps[3].validation = {"math": 0.3, "fl": 0.6}
    fig = figures.task_figure(reps)
    by_task: dict = {}
    for tr in fig.data:
        by_task.setdefault(tr.name, []).append(tr)
    assert set(by_task) == {"math", "fl"} and len(by_task["math"]) == len(by_task["fl"]) == 4 + len(TASK_METRICS)
    for traces in by_task.values():
        assert len({tr.line.color for tr in traces}) == 1  # one color per task
        assert sum(bool(tr.showlegend) for tr in traces) == 1  # named once in the legend
    math_traces = by_task["math"]
    assert list(math_traces[0].y) == [pytest.approx(0.1 * i) for i in range(4)]  # reward
    assert list(math_traces[1].x) == [1, 3] and list(math_traces[1].y) == [0.2, 0.3]  # held-out greedy
    assert list(math_traces[2].y) == [0.5] and list(math_traces[3].y) == [0.1]  # pass@8, pass@1 (dotted)
    assert math_traces[3].line.dash == "dot"
    assert list(math_traces[4 + TASK_METRICS.index("kl")].y) == [pytest.approx(1.0 + i) for i in range(4)]
    titles = [a.text for a in fig.layout.annotations]
    assert "held-out pass@8 (dotted: pass@1)" in titles and "KL from behaviour policy" in titles
    # nothing measured yet: the traces are there, empty (a live plot extends them)
    early = figures.task_figure([make_report(0)])
    assert len(early.data) == 2 * (4 + len(TASK_METRICS)) and all(len(t.x) == 0 for t in early.data[1:4])


def test_step_reports_round_trip_through_their_json_lines():
    import json

    from rollart_nb.control.report import StepReport

    rep = make_report(2, validation={"math": 0.5})
    back = StepReport.from_dict(json.loads(json.dumps(rep.to_dict())))
    assert back == rep and back.staleness == {0: 6, 1: 2}


def test_failover_events_are_marked_on_the_pool_timeline_and_summed_in_a_line():
    trajs = [make_trajectory(0, versions=(0, 0, 0))]
    events = [
        {
            "kind": "generator_replaced",
            "worker": "actor_gen/0",
            "pool": "H20",
            "version": 3,
            "at": T0 + 1.5,
            "reason": "ActorDiedError: killed",
        },
        {
            "kind": "trainer_restored",
            "worker": "actor_train/0",
            "pool": "H800",
            "version": 2,
            "at": T0 + 2.0,
            "reason": "ActorDiedError",
            "versions_lost": 1,
        },
    ]
    reps = [make_report(0), make_report(1, events=events)]
    fig = timeline.utilization_figure(trajs, reps)
    marks = next(t for t in fig.data if t.name == "failover")
    assert list(marks.y) == ["actor_gen/0", timeline.TRAIN_ROW] and list(marks.x) == pytest.approx([1.5, 2.0])
    assert "generator replaced: actor_gen/0" in marks.hovertext[0]
    line = figures.failover_line(reps)
    assert line == "failover: 1 generator(s) replaced (actor_gen/0), 1 trainer restore(s) (last to v2)"
    assert figures.failover_line([make_report(0)]) == ""
    assert not any(t.name == "failover" for t in timeline.utilization_figure(trajs, [make_report(0)]).data)


def test_reward_figure_shows_the_failure_rate_beside_the_mean():
    reps = [make_report(0, counts={"completed": 6, "failed": 2}), make_report(1, counts={"aborted_stale": 3})]
    rate = next(t for t in figures.reward_figure(reps).data if t.name == "failure rate")
    assert list(rate.y) == [0.25, None] and rate.yaxis == "y2"  # none ended: no rate, not 0
    assert figures.failure_rate(reps[0]) == 0.25


def test_reason_kind_groups_reasons_that_differ_by_trajectory():
    a = "reward: reward f v1 for task 'math' (trajectory 3fa2b1) failed after 2 attempt(s): ValueError: bad"
    b = a.replace("3fa2b1", "77aa00")
    assert figures.reason_kind(a) == figures.reason_kind(b) == "reward: ValueError: bad"
    assert figures.reason_kind("env #3 crashed: EnvError: boom") == "EnvError: boom"
    assert len(figures.reason_kind("x" * 500)) == 60


def test_step_failures_pairs_each_step_with_its_reasons_and_counts_the_unnamed():
    r0 = make_report(0, counts={"failed": 2}, failures={"math": ["e (trajectory aa11)", "e (trajectory aa12)"]})
    # 3 failed, but the rollout kept only one reason of them
    r1 = make_report(1, counts={"failed": 3}, failures={"math": ["f (trajectory aa13)"]})
    r2 = make_report(2, counts={})
    out = figures.step_failures([r0, r1, r2])
    assert out[0] == ([("math", "e (trajectory aa11)"), ("math", "e (trajectory aa12)")], 0)
    assert out[1] == ([("math", "f (trajectory aa13)")], 2)
    assert out[2] == ([], 0)


def test_failed_aborted_figure_stacks_aborts_and_failures_by_task_and_reason():
    reason = "reward: reward f v1 for task 'math' (trajectory {}) failed after 1 attempt(s): ValueError: bad"
    reps = [
        make_report(0, counts={"aborted_stale": 2}),
        make_report(1, counts={"failed": 2}, failures={"math": [reason.format("aa01"), reason.format("aa02")]}),
        make_report(2, counts={"failed": 1, "aborted_stale": 1}, failures={"fl": ["env: EnvError: x"]}),
    ]
    fig = figures.failed_aborted_figure(reps)
    assert fig.layout.barmode == "stack"
    by = {t.name: t for t in fig.data}
    aborted = by["aborted (stale)"]  # reports without per-task counts: one trace
    assert list(aborted.x) == [0, 2] and list(aborted.y) == [2, 1]
    bad = by["failed · math: reward: ValueError: bad"]
    assert list(bad.x) == [1] and list(bad.y) == [2] and "aa02" in bad.text[0]
    assert list(by["failed · fl: env: EnvError: x"].x) == [2]


def test_failed_aborted_figure_splits_aborts_by_task_and_shows_penalized_failures():
    reps = [
        make_report(
            0, counts={"aborted_stale": 3}, task_counts={"math": {"aborted_stale": 2}, "fl": {"aborted_stale": 1}}
        ),
        make_report(
            1,
            counts={"completed": 4, "penalized": 1, "failed": 1, "aborted_stale": 1},
            task_counts={"fl": {"aborted_stale": 1}},
            failures={"math": ["penalized: env: TimeoutError: step took 5s", "reward: ValueError: bad"]},
        ),
    ]
    by = {t.name: t for t in figures.failed_aborted_figure(reps).data}
    assert list(by["aborted (stale) · math"].y) == [2] and list(by["aborted (stale) · fl"].x) == [0, 1]
    assert list(by["penalized · math: env: TimeoutError: step took 5s"].y) == [1]
    assert list(by["failed · math: reward: ValueError: bad"].y) == [1]
    assert figures.failure_rate(reps[1]) == 2 / 5  # the penalized one is a failure, though trained on
