"""The run's standalone outputs: the curves SVG and the HTML report."""

import pytest

from rollart_nb.nb import report

pytest.importorskip("plotly")


@pytest.fixture(autouse=True)
def _factories(synth):
    global make_report
    make_report = synth["report"]


def test_report_html_contains_charts_and_table():
    out = report.report_html([make_report(0), make_report(1)], before={"math": 0.1}, after={"math": 0.4})
    assert "plotly" in out and "<h2>Steps</h2>" in out and "0.400" in out


def test_report_html_includes_the_training_plot():
    reps = [make_report(i, train={"loss": 0.5 - 0.1 * i, "kl": 0.01 * i}) for i in range(2)]
    out = report.report_html(reps)
    assert out.count("KL from behaviour policy (approx.)") == 1 and "response length (tokens)" in out
    assert "held-out score (greedy)" in out  # the per-task curves


def test_curves_svg_draws_validation_and_reward_per_task_against_wall_seconds():
    import xml.etree.ElementTree as ET

    reps = [
        make_report(0),
        make_report(1, validation={"math": 0.7}),
        make_report(2, reward={"math": float("nan"), "fl": 0.5}),
        make_report(3, validation={"math": 1.0}),
    ]
    svg = report.curves_svg(reps, before={"math": 0.0, "fl": 0.0}, title="run <1>", width=760, height=300)
    root = ET.fromstring(svg)  # well-formed, title escaped
    ns = "{http://www.w3.org/2000/svg}"
    lines = [[tuple(map(float, p.split(","))) for p in pl.get("points").split()] for pl in root.iter(f"{ns}polyline")]
    solid = [ln for ln, pl in zip(lines, root.iter(f"{ns}polyline"), strict=True) if pl.get("stroke-opacity") is None]
    faded = [ln for ln, pl in zip(lines, root.iter(f"{ns}polyline"), strict=True) if pl.get("stroke-opacity")]
    # validation: fl before only; math before + two validations. Reward: fl 4 steps, math 3 (NaN skipped)
    assert sorted(len(ln) for ln in solid) == [1, 3] and sorted(len(ln) for ln in faded) == [3, 4]
    math_val = max(solid, key=len)
    left, top, plot_w, plot_h = 44, 28, 760 - 44 - 160, 300 - 28 - 36
    assert math_val[0] == pytest.approx((left, top + plot_h))  # 0.0 before training, at x = 0
    # the last point: step 3 ended at 3 * 10 + 2 = 32 s, the right edge, at score 1.0 (the top)
    assert math_val[2] == pytest.approx((left + plot_w, top), abs=0.06)
    assert math_val[1] == pytest.approx((left + plot_w * 12 / 32, top + plot_h * 0.3), abs=0.06)
    assert "wall seconds" in svg and "run &lt;1&gt;" in svg
    # the score after training closes the validation line at the right edge
    after = report.curves_svg(reps, before={"math": 0.0}, after={"math": 0.5})
    pts = [
        p
        for pl in ET.fromstring(after).iter(f"{ns}polyline")
        if pl.get("stroke-opacity") is None
        for p in [pl.get("points").split()]
    ]
    assert [tuple(map(float, q.split(","))) for q in pts[0]][-1] == pytest.approx((left + plot_w, top + plot_h * 0.5))


def test_curves_svg_falls_back_to_steps_without_start_times():
    reps = [make_report(i, started_at=0.0, validation={"math": 0.5}) for i in range(3)]
    assert ">step</text>" in report.curves_svg(reps)
