"""The pool utilization timeline: segments and bars are exactly the input's turns and train steps."""

import pytest

from rollart_nb.nb import timeline

pytest.importorskip("plotly")


@pytest.fixture(autouse=True)
def _factories(synth):
    global T0, make_report, make_trajectory
    T0, make_report, make_trajectory = synth["T0"], synth["report"], synth["trajectory"]


def test_utilization_segments_from_turn_timings_and_train_steps():
    trajs = [make_trajectory(0), make_trajectory(1, worker="actor_gen/1")]
    trajs[0].turns[1].timings.pop("t")  # a turn without a wall start is skipped
    reps = [make_report(0), make_report(1, mode="sync")]
    segs = timeline.utilization_segments(trajs, reps)
    gen = [s for s in segs if s["kind"] == "generate"]
    assert [(s["row"], s["start"], s["end"]) for s in gen] == [
        ("actor_gen/0", T0, T0 + 0.4),
        ("actor_gen/1", T0 + 1, T0 + 1.4),
        ("actor_gen/1", T0 + 2, T0 + 2.4),
    ]
    train = [s for s in segs if s["kind"] == "train"]
    # overlapped mode: launched at the end of the step; sync: after the rollout wait
    assert [(s["start"], s["end"]) for s in train] == [(T0 + 2.0, T0 + 2.5), (T0 + 11.5, T0 + 12.0)]
    assert [s["start"] for s in segs] == sorted(s["start"] for s in segs)
    windowed = timeline.utilization_segments(trajs, reps, window_s=1.0)
    assert [s["kind"] for s in windowed] == ["train"]


def test_utilization_figure_rows_and_busy_fraction():
    trajs = [make_trajectory(0, versions=(0, 0, 0))]
    trajs[0].turns[1].timings["t"] = T0 + 0.2  # overlaps turn 0: counted once
    fig = timeline.utilization_figure(trajs)
    gen, train = fig.data
    assert list(gen.y) == ["actor_gen/0"] * 3 and list(gen.base) == pytest.approx([0.0, 0.2, 2.0])
    assert list(gen.x) == pytest.approx([0.4] * 3) and len(train.x) == 0
    # busy: [0, 0.6] + [2, 2.4] = 1.0 of 2.4 s
    assert f"actor_gen/0 {1.0 / 2.4:.0%}" in fig.layout.title.text


def test_timeline_figure_keeps_the_given_order_and_windows_by_axis_range():
    segs = [
        {"row": "g/0", "kind": "generate", "start": T0 + 5, "end": T0 + 6, "label": "b"},
        {"row": "g/0", "kind": "generate", "start": T0, "end": T0 + 1, "label": "a"},
    ]
    fig = timeline.timeline_figure(segs, t0=T0, window_s=2.0)
    assert list(fig.data[0].base) == [5.0, 0.0] and list(fig.data[0].hovertext) == ["b", "a"]
    assert list(fig.layout.xaxis.range) == [4.0, 6.0]
    assert "g/0 50%" in fig.layout.title.text  # busy 1 s of the 2 s shown
