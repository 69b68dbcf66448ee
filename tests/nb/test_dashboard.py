"""Dashboard outside a kernel: live from its own watcher thread, incremental, failures in the banner."""

import json
import threading
import time

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")
pytest.importorskip("anywidget")

from rollart_nb.algo.grpo import TRAIN_METRICS  # noqa: E402
from rollart_nb.nb import figures  # noqa: E402
from rollart_nb.nb.dashboard import Dashboard  # noqa: E402
from rollart_nb.nb.live import spec_of  # noqa: E402

FIGS = {"reward", "tasks", "training", "failures", "step_time", "staleness", "throughput", "utilization"}


@pytest.fixture
def pipe(synth, trajectories):
    return synth["fake_pipeline"](trajectories, [synth["report"](0), synth["report"](1)])


def _until(cond, timeout=20.0, every=0.02):
    """Poll ``cond`` while this thread stays busy (sleeping, like a cell in a time.sleep loop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(every)
    return cond()


def _points(dash, fig="throughput"):
    return len(dash.plots.sent[fig]["data"][0]["x"])


def _capture(dash):
    sent = []
    orig = dash.plots.send

    def send(msg):
        sent.append(json.loads(json.dumps(msg)))
        orig(msg)

    dash.plots.send = send
    return sent


# -- with a fake pipeline: no watcher --------------------------------------------------------------
def test_builds_widgets_and_draws_the_reports(pipe):
    d = Dashboard(pipe, throttle_s=0.0, watch=False)
    assert set(d.figures) == set(d.plots.sent) == set(d.plots.figures) == FIGS
    names = {t["name"]: t for t in d.plots.sent["reward"]["data"]}
    assert names["reward/math"]["y"] == pytest.approx([0.0, 0.1])
    assert d.plots.sent["throughput"]["data"][0]["y"] == [400.0, 401.0]
    assert set(d.plots.sent["utilization"]["data"][0]["y"]) == {"actor_gen/0", "actor_gen/1"}
    assert "2 step(s)" in d.status.value and "idle" in d.status.value
    assert "rollart-dashboard" in d._dom_classes
    assert d.plots.lib is not None and "window.Plotly" in d.plots.lib._esm  # plotly.js, once per kernel
    assert all(s["layout"]["autosize"] and "width" not in s["layout"] for s in d.plots.sent.values())
    assert d.plots.wide == ["tasks", "training", "utilization"] and d.layout.width == "100%"


def test_an_update_sends_only_the_new_points(pipe, synth):
    d = Dashboard(pipe, throttle_s=0.0, watch=False)
    sent = _capture(d)
    pipe.reports.append(synth["report"](2))
    assert d.update(force=True) is True
    (msg,) = sent
    ops = {(op["fig"], op["op"]) for op in msg["ops"]}
    assert ("throughput", "extend") in ops and not any(op == "figure" for _f, op in ops)
    (tp,) = [op for op in msg["ops"] if op["fig"] == "throughput"]
    assert tp["points"] == {"x": [2], "y": [402.0]}
    assert d.plots.sent["throughput"]["data"][0]["y"] == [400.0, 401.0, 402.0]
    d.update(force=True)  # nothing new: nothing sent
    assert len(sent) == 1


def _train(step):
    m = {"loss": 0.5, "kl": 0.01, "entropy": 2.0, "grad_norm": 1.0, "clip_frac": 0.1, "response_length": 9.0 + step}
    return {**m, "mismatch_kl": 0.002, "mismatch_ratio_out": 0.0, "cross_version_frac": 0.25}


def test_the_training_plot_shows_each_metric_and_takes_new_steps_as_points(synth, trajectories):
    pipe = synth["fake_pipeline"](trajectories, [synth["report"](i, train=_train(i)) for i in range(2)])
    d = Dashboard(pipe, throttle_s=0.0, watch=False)
    traces = d.plots.sent["training"]["data"]
    assert [t["name"] for t in traces] == list(TRAIN_METRICS)
    assert all(t["x"] == [0, 1] for t in traces) and traces[5]["y"] == [9.0, 10.0]
    sent = _capture(d)
    pipe.reports.append(synth["report"](2, train=_train(2)))
    d.update(force=True)
    (msg,) = sent
    ops = [op for op in msg["ops"] if op["fig"] == "training"]
    # one extend per metric, carrying the new step only
    assert [(op["op"], op["index"]) for op in ops] == [("extend", i) for i in range(len(TRAIN_METRICS))]
    assert ops[5]["points"] == {"x": [2], "y": [11.0]} and ops[0]["points"] == {"x": [2], "y": [0.5]}
    assert d.plots.sent["training"] == spec_of(figures.training_figure(pipe.reports))


def test_update_is_throttled_and_the_watcher_catches_up(pipe, synth):
    d = Dashboard(pipe, throttle_s=0.3, poll_s=0.02)
    try:
        first = d.redraws
        results = []
        for i in range(10):  # a burst of steps inside one throttle interval
            pipe.reports.append(synth["report"](2 + i))
            results.append(d.update())
        assert results.count(True) == 0 and d.redraws == first
        assert _until(lambda: _points(d) == 12, timeout=5)  # the watcher draws the burst once it is due
        assert d.redraws <= first + 2
    finally:
        d.close()


def _tick_until(d, cond, timeout=5.0):
    """Tick as the watcher does until ``cond`` (a push also waits out 4x the last push's cost)."""
    return _until(lambda: d._tick() or cond(), timeout=timeout, every=0.01)


def test_the_next_push_waits_for_the_browser_to_draw_the_last(pipe, synth):
    d = Dashboard(pipe, throttle_s=0.0, ack_timeout_s=30.0, watch=False)
    sent = _capture(d)
    pipe.reports.append(synth["report"](2))
    assert _tick_until(d, lambda: len(sent) == 1)
    assert sent[0]["seq"] == 1 and d.plots.awaiting_draw()
    for i in range(3):  # steps while the browser has not drawn seq 1: no push, the status line follows
        pipe.reports.append(synth["report"](3 + i))
        time.sleep(4 * d._push_cost + 0.05)  # past the throttle interval
        d._tick()
        assert d.update() is False
    assert len(sent) == 1 and _points(d) == 3
    assert "6 step(s)" in d.status.value
    d.plots._handle_custom_msg({"drawn": 1}, [])  # the view's answer, as ipywidgets dispatches it
    d._tick()
    assert [m["seq"] for m in sent] == [1, 2] and _points(d) == 6  # the three steps in one push


def test_without_an_answer_the_next_push_goes_after_the_timeout(pipe, synth):
    d = Dashboard(pipe, throttle_s=0.0, ack_timeout_s=1.0, watch=False)  # never displayed: no answers
    sent = _capture(d)
    pipe.reports.append(synth["report"](2))
    assert _tick_until(d, lambda: len(sent) == 1)
    pushed = time.monotonic()
    pipe.reports.append(synth["report"](3))
    assert _tick_until(d, lambda: len(sent) == 2)
    assert time.monotonic() - pushed >= 0.9  # not before the timeout ...
    assert d.plots.drawn_seq == 0 and _points(d) == 4  # ... and then without an answer


def test_the_watcher_pushes_as_soon_as_the_browser_answers(pipe, synth):
    d = Dashboard(pipe, throttle_s=0.0, ack_timeout_s=30.0, poll_s=5.0)  # polls rarely: the answer wakes it
    try:
        sent = _capture(d)
        pipe.reports.append(synth["report"](2))
        d.update(force=True)
        assert len(sent) == 1
        pipe.reports.append(synth["report"](3))
        d._poke()
        time.sleep(4 * d._push_cost + 0.3)  # past the throttle interval
        assert len(sent) == 1  # seq 1 not drawn yet
        t = time.monotonic()
        d.plots._handle_custom_msg({"drawn": 1}, [])
        assert _until(lambda: len(sent) == 2, timeout=5, every=0.005)
        assert time.monotonic() - t < 3.0 and _points(d) == 4  # not the next poll, 5 s away
    finally:
        d.close()


def test_run_starts_a_background_run(pipe):
    d = Dashboard(pipe, throttle_s=0.0, watch=False)
    assert d.run(3) is None
    (call,) = [c for c in pipe.calls if c[0] == "run"]
    assert call == ("run", 3, True, False)
    d.update(force=True)
    assert _points(d) == 5


def test_pause_button_does_not_block_and_says_pausing(pipe):
    d = Dashboard(pipe, throttle_s=0.0, watch=False)
    d.pause()
    assert [c[0] for c in pipe.calls if c[0] in ("pause", "wait")] == ["pause", "wait"]
    pipe.calls.clear()
    pipe.state = "running"
    d.pause_button.click()
    assert pipe.calls == [("pause",)]
    d.update(force=True)
    assert "pausing after the step in progress" in d.status.value


def test_step_button_runs_one_step_on_a_thread(pipe):
    d = Dashboard(pipe, throttle_s=0.0, watch=False)
    th = d.step(background=True)
    assert isinstance(th, threading.Thread)
    th.join(5)
    assert len(pipe.reports) == 3 and _points(d) == 3
    assert d.step().step == 3


def test_a_failing_step_raises_the_banner(pipe):
    d = Dashboard(pipe, throttle_s=0.0, watch=False)

    def boom():
        raise RuntimeError("reward for trajectory 0badc0ffee raised ValueError")

    pipe.step = boom
    d.step(background=True).join(5)
    assert "rollart-state'>failed: RuntimeError" in d.status.value
    assert d.banner.layout.display == "block"
    assert "reward for trajectory 0badc0ffee raised ValueError" in d.banner.value
    assert "trajectory <code>0badc0ffee</code>" in d.banner.value


def test_redraw_survives_a_pipeline_without_trajectories(pipe):
    def closed(**kw):
        raise RuntimeError("closed")

    pipe.trajectories = closed
    d = Dashboard(pipe, throttle_s=0.0, watch=False)
    assert len(d.plots.sent["reward"]["data"]) >= 2 and d.plots.sent["utilization"]["data"][0]["x"] == []


def test_the_watcher_never_raises_and_close_stops_it(pipe, caplog):
    d = Dashboard(pipe, throttle_s=0.0, poll_s=0.01)
    type(pipe).error = property(lambda self: 1 / 0)  # a broken pipeline: every look fails
    try:
        time.sleep(0.2)
        assert d._watcher.is_alive()
        assert sum("dashboard update failed" in r.message for r in caplog.records) == 1  # logged once
    finally:
        del type(pipe).error
        d.close()
    assert not d._watcher.is_alive()


# -- with a real pipeline (SimSession: in-process, steps take milliseconds) -------------------------
def test_the_watcher_follows_a_background_run_while_this_thread_is_busy(sim_pipeline):
    sess, pipe = sim_pipeline
    dash = pipe.dashboard(throttle_s=0.1, poll_s=0.02)
    sent = _capture(dash)
    seen = []
    pipe.run(60, background=True, progress=False)  # not through the dashboard: no on_step
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (len(pipe.reports) < 60 or _points(dash) < 60):
        time.sleep(0.05)  # busy: this thread never calls the dashboard
        seen.append(_points(dash))
    assert _points(dash) == 60
    assert len(set(seen)) >= 3, f"the plots should have moved during the run: {sorted(set(seen))}"
    assert "60 step(s)" in dash.status.value
    # incremental: no whole figure after the first draw; each extend carries only the new steps
    assert sent and not any(op["op"] == "figure" for m in sent for op in m["ops"])
    drawn = 0
    for m in sent:
        (tp,) = [op for op in m["ops"] if op["fig"] == "throughput"] or [None]
        if tp is None:
            continue
        assert tp["op"] == "extend" and tp["points"]["x"] == list(range(drawn, drawn + len(tp["points"]["x"])))
        drawn += len(tp["points"]["x"])
        small = [op for op in m["ops"] if op["fig"] != "utilization"]
        # about 100 bytes per op and new step: it grows with the steps since the last update, not with the run
        assert len(json.dumps(small)) < 200 * len(small) * len(tp["points"]["x"])
    assert drawn == 60
    # what the browser holds (the first state plus every message) is the whole figure
    reports = list(pipe.reports)
    assert dash.plots.sent["step_time"] == spec_of(figures.step_time_figure(reports))
    assert dash.plots.sent["reward"]["data"] == spec_of(figures.reward_figure(reports))["data"]
    # the sim trainer reports the response length (and no loss: it has none), drawn step by step
    assert dash.plots.sent["training"] == spec_of(figures.training_figure(reports))
    lengths = dash.plots.sent["training"]["data"][TRAIN_METRICS.index("response_length")]
    assert lengths["name"] == "response_length" and len(lengths["x"]) >= 55 and all(y > 0 for y in lengths["y"])
    assert dash.plots.messages[0][0] == 0 and len(dash.plots.messages) == len(sent) + 1
    dash.close()


def test_a_failing_run_shows_failed_with_the_reason_and_the_failed_per_step_plot(sim_pipeline):
    sess, pipe = sim_pipeline
    dash = pipe.dashboard(throttle_s=0.05, poll_s=0.02)
    pipe.run(3, progress=False)

    def flaky(traj):  # about a third of math trajectories fail, the same ones every run
        if int(traj.id, 16) % 3 == 0:
            raise ValueError("flaky reward")
        return 1.0

    pipe.swap_reward("math", flaky)
    pipe.run(4, background=True, progress=False)
    assert _until(lambda: any("flaky reward" in t["name"] for t in dash.plots.sent["failures"]["data"]))
    assert _until(lambda: "flaky reward" in dash.banner.value)
    assert "trajectories failed in step" in dash.banner.value or "trajectory failed" in dash.banner.value
    rate = [t for t in dash.plots.sent["reward"]["data"] if t["name"] == "failure rate"]
    assert rate and any(y for y in rate[0]["y"] if y)
    pipe.wait()

    def broken(traj):
        raise ValueError("broken reward")

    pipe.swap_reward("math", broken)
    pipe.run(5, background=True, progress=False)
    assert _until(lambda: "rollart-state'>failed" in dash.status.value, timeout=60)
    assert "failed: RolloutStalledError" in dash.status.value
    assert dash.banner.layout.display == "block"
    assert "Run failed" in dash.banner.value and "broken reward" in dash.banner.value
    assert dash.failure is not None and dash.failure["trajectory"]
    assert f"<code>{dash.failure['trajectory']}</code>" in dash.banner.value
    with pytest.raises(Exception, match="broken reward"):
        dash.wait()  # as pipe.wait(): re-raises ...
    assert "Run failed" in dash.banner.value  # ... and the banner stays
    sess.close()  # the closed state wins; the banner keeps the failure
    assert _until(lambda: "rollart-state'>closed" in dash.status.value, timeout=10)
    assert "Run failed" in dash.banner.value
    assert _until(lambda: not dash._watcher.is_alive(), timeout=5)


def test_status_says_closed_after_close_and_the_watcher_ends(sim_pipeline):
    sess, pipe = sim_pipeline
    dash = pipe.dashboard(throttle_s=0.05, poll_s=0.02)
    pipe.run(2, background=True, progress=False)
    assert _until(lambda: "running" in dash.status.value or _points(dash) == 2)
    pipe.wait()
    pipe.close()
    assert _until(lambda: "rollart-state'>closed" in dash.status.value, timeout=10)
    assert _until(lambda: not dash._watcher.is_alive(), timeout=5)
    assert _points(dash) == 2 and dash.plots.figures == dash.plots.sent  # the whole state is in the model
