"""LivePlots: the difference between two figure specs, as the browser applies it."""

import copy
import json

import pytest

pytest.importorskip("plotly")
pytest.importorskip("anywidget")

from rollart_nb.nb.live import LivePlots, apply_ops, figure_ops  # noqa: E402


def _fig(n, title="t", extra=None):
    data = [{"type": "scatter", "name": "a", "x": list(range(n)), "y": [float(i) for i in range(n)]}]
    return {"data": data + (extra or []), "layout": {"title": {"text": title}, "height": 300}}


def test_appended_points_travel_as_tails():
    ops = figure_ops("f", _fig(3), _fig(5))
    assert ops == [{"op": "extend", "fig": "f", "index": 0, "points": {"x": [3, 4], "y": [3.0, 4.0]}}]


def test_changed_traces_layout_keys_and_new_traces_alone():
    old, new = _fig(3), _fig(3, title="u", extra=[{"type": "bar", "name": "b", "x": [1], "y": [2]}])
    new["data"][0]["y"][0] = 9.0  # not an append: the trace goes whole
    ops = figure_ops("f", old, new)
    assert [op["op"] for op in ops] == ["trace", "trace", "layout"]
    assert ops[2]["layout"] == {"title": {"text": "u"}}
    assert figure_ops("f", new, _fig(3))[0]["op"] == "figure"  # a trace removed: the whole figure
    assert figure_ops("f", None, new) == [{"op": "figure", "fig": "f", "figure": new}]


@pytest.mark.parametrize("steps", [[(3, "t"), (5, "t"), (9, "u")], [(0, "t"), (1, "t")]])
def test_applying_the_ops_gives_the_new_figure(steps):
    held = {"f": _fig(steps[0][0], steps[0][1])}
    for n, title in steps[1:]:
        new = _fig(n, title)
        apply_ops(held, figure_ops("f", copy.deepcopy(held["f"]), new))
        assert held["f"] == new


def test_live_plots_sends_the_state_first_then_messages():
    p = LivePlots(order=["f"])
    sent = []
    p.send = sent.append
    p.update({"f": _fig(2)})
    assert p.figures == {"f": _fig(2)} and sent == []  # the first draw is the model's state
    p.update({"f": _fig(4)})
    assert sent == [{"ops": figure_ops("f", _fig(2), _fig(4))}] and p.figures == {"f": _fig(2)}
    assert p.messages[-1] == (1, len(json.dumps(sent[0])))
    p.sync()
    assert p.figures == p.sent == {"f": _fig(4)}
