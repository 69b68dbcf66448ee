"""Dashboard outside a kernel: widgets build, updates copy figure data, redraws are throttled."""

import threading
import time

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from rollart_nb.nb.dashboard import Dashboard  # noqa: E402


@pytest.fixture
def pipe(synth, trajectories):
    return synth["fake_pipeline"](trajectories, [synth["report"](0), synth["report"](1)])


def test_builds_widgets_and_draws_the_reports(pipe):
    d = Dashboard(pipe, throttle_s=0.0)
    assert set(d.figures) == set(d.views) == {"reward", "step_time", "staleness", "utilization", "throughput"}
    names = {t.name: t for t in d.figures["reward"].data}
    assert list(names["reward/math"].y) == pytest.approx([0.0, 0.1])
    assert list(d.figures["throughput"].data[0].y) == [400.0, 401.0]
    rows = set(d.figures["utilization"].data[0].y)
    assert rows == {"actor_gen/0", "actor_gen/1"}
    assert "2 step(s)" in d.status.value and "idle" in d.status.value
    assert "rollart-dashboard" in d._dom_classes


def test_update_after_new_reports_shows_them(pipe, synth):
    d = Dashboard(pipe, throttle_s=0.0)
    step_time_out = d.views["step_time"].outputs
    pipe.reports.append(synth["report"](2))
    assert d.update(pipe.reports[-1]) is True
    assert list(d.figures["throughput"].data[0].y) == [400.0, 401.0, 402.0]
    (out,) = d.views["throughput"].outputs  # one plotly mime bundle per view, replaced
    spec = out["data"]["application/vnd.plotly.v1+json"]
    assert spec["data"][0]["y"] == [400.0, 401.0, 402.0] and spec["layout"]["title"]["text"] == "Throughput"
    assert d.views["throughput"] in d.children[2].children
    assert d.views["step_time"].outputs != step_time_out


def test_unchanged_figures_are_not_resent(pipe):
    d = Dashboard(pipe, throttle_s=0.0)
    before = {n: v.outputs for n, v in d.views.items()}
    d.update(force=True)
    assert all(d.views[n].outputs is before[n] for n in before)
    pipe.history.append({"task": "math", "version": 1, "created": pipe.reports[1].started_at - 1})
    d.update(force=True)
    assert [s.x0 for s in d.figures["reward"].layout.shapes] == [0.5]


def test_updates_are_throttled_with_one_trailing_redraw(pipe, synth):
    d = Dashboard(pipe, throttle_s=0.3)
    first = d.redraws
    results = []
    for i in range(10):  # a burst of steps inside one throttle interval
        pipe.reports.append(synth["report"](2 + i))
        results.append(d.update(pipe.reports[-1]))
    assert results.count(True) <= 1
    assert d.redraws <= first + 1
    time.sleep(0.8)
    assert d.redraws <= first + 2  # at most one trailing redraw for the whole burst
    assert len(d.figures["throughput"].data[0].y) == 12  # ... and it shows the last step


def test_run_starts_a_background_run_with_on_step(pipe):
    d = Dashboard(pipe, throttle_s=0.0)
    assert d.run(3) is None
    (call,) = [c for c in pipe.calls if c[0] == "run"]
    assert call == ("run", 3, True, False)
    assert len(d.figures["throughput"].data[0].y) == 5  # on_step redrew after the fake's steps


def test_pause_waits_for_the_step_in_progress(pipe):
    d = Dashboard(pipe, throttle_s=0.0)
    d.pause()
    assert [c[0] for c in pipe.calls if c[0] in ("pause", "wait")] == ["pause", "wait"]
    pipe.calls.clear()
    d.pause_button.click()  # the button does not block the kernel: waits on a thread
    deadline = time.time() + 5
    while ("wait",) not in pipe.calls and time.time() < deadline:
        time.sleep(0.01)
    assert pipe.calls[:2] == [("pause",), ("wait",)]


def test_step_button_runs_one_step_on_a_thread(pipe):
    d = Dashboard(pipe, throttle_s=0.0)
    th = d.step(background=True)
    assert isinstance(th, threading.Thread)
    th.join(5)
    assert len(pipe.reports) == 3 and len(d.figures["throughput"].data[0].y) == 3
    rep = d.step()
    assert rep.step == 3


def test_a_failing_step_shows_in_the_status_line(pipe):
    d = Dashboard(pipe, throttle_s=0.0)

    def boom():
        raise RuntimeError("pipeline is closed")

    pipe.step = boom
    d.step(background=True).join(5)
    assert "step failed: pipeline is closed" in d.status.value


def test_redraw_survives_a_pipeline_without_trajectories(pipe):
    def closed(**kw):
        raise RuntimeError("closed")

    pipe.trajectories = closed
    d = Dashboard(pipe, throttle_s=0.0)
    assert len(d.figures["reward"].data) >= 2 and len(d.figures["utilization"].data[0].x) == 0
