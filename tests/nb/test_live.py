"""LivePlots: the difference between two figure specs, as the browser applies it."""

import copy
import json
import time

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
    assert sent == [{"ops": figure_ops("f", _fig(2), _fig(4)), "seq": 1}] and p.figures == {"f": _fig(2)}
    assert p.messages[-1] == (1, len(json.dumps(sent[0])))
    p.sync()
    assert p.figures == p.sent == {"f": _fig(4)}


def _sending(**kw):
    p = LivePlots(order=["f"], **kw)
    sent = []
    p.send = sent.append
    p.update({"f": _fig(2)})  # the first draw: the state, no message
    return p, sent


def test_each_message_carries_an_increasing_seq_and_nothing_new_sends_nothing():
    p, sent = _sending()
    assert p.sent_seq == 0 and not p.awaiting_draw()  # the state travels as a trait: nothing to wait for
    p.update({"f": _fig(3)})
    p.update({"f": _fig(3)})  # no change: no message, no seq
    p.update({"f": _fig(5)})
    assert [m["seq"] for m in sent] == [1, 2] and p.sent_seq == 2


def test_a_views_answer_ends_the_wait_and_the_highest_answer_counts():
    p, sent = _sending(ack_timeout_s=30.0)
    p.update({"f": _fig(3)})
    p.update({"f": _fig(4)})
    assert p.awaiting_draw() and p.drawn_seq == 0 and p.drawn_at is None
    p._handle_custom_msg({"drawn": 1}, [])  # as ipywidgets dispatches a view's model.send(...)
    assert p.drawn_seq == 1 and p.drawn_at is not None and p.awaiting_draw()  # seq 2 still on its way
    p._handle_custom_msg({"drawn": 2}, [])
    assert p.drawn_seq == 2 and not p.awaiting_draw()
    p._handle_custom_msg({"drawn": 1}, [])  # a slower second view: the highest answer stays
    p._handle_custom_msg({"other": 5}, [])  # not an answer
    p._handle_custom_msg({"drawn": True}, [])
    assert p.drawn_seq == 2
    p.update({"f": _fig(6)})
    assert p.awaiting_draw()


def test_the_wait_is_bounded_by_the_timeout():
    p, sent = _sending(ack_timeout_s=0.2)
    p.update({"f": _fig(3)})
    assert p.awaiting_draw() and p.awaiting_draw(timeout_s=10.0)
    assert not p.awaiting_draw(timeout_s=0.0)
    time.sleep(0.25)
    assert not p.awaiting_draw() and p.awaiting_draw(timeout_s=10.0)
    assert p.drawn_seq == 0  # no answer came: only the time ran out
