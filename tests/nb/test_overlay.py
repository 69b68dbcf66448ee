"""Token overlays: each token coloured by a column of its token frame, a legend, a tooltip with
the token's row; the viewer's mismatch and cross-version filters; two trajectories compared."""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("ipywidgets")

from rollart_nb.errors import ConfigError  # noqa: E402
from rollart_nb.nb import compare, token_html  # noqa: E402
from rollart_nb.nb.overlay import colour, mismatch_of  # noqa: E402
from rollart_nb.nb.viewer import TrajectoryViewer  # noqa: E402
from rollart_nb.trajectory import Trajectory, Turn  # noqa: E402


def traj(tid: str, ratios: tuple[float, float], spans: list | None = None, adv: float = 0.5) -> Trajectory:
    """Prompt [1, 2], response [3, 4] sampled at logprob -1, trained at -1 + log(ratio)."""
    u = Turn("obs", "act", [1, 2], [3, 4], logprobs=[-1.0, -1.0], loss_mask=[1, 1], version=2, spans=spans or [])
    u.entropy = [0.5, 1.5]
    t = Trajectory("math", id=tid, turns=[u], reward=1.0, start_version=2)
    lp = [math.nan, -0.5, -1.0 + math.log(ratios[0]), -1.0 + math.log(ratios[1])]
    t.train = {"step": 0, "version": 2, "advantage": adv, "rows": [{"logprob": lp, "entropy": lp, "loss_weight": lp}]}
    return t


def spans_of(page: str) -> list[tuple[str, str]]:
    """(colour, tooltip) of each token span, the colour resolved through the page's classes."""
    classes = dict(re.findall(r"\.rn-o\w+ \.(c\d+)\{background:(#[0-9a-f]{6})\}", page))
    return [(classes[c], title) for c, title in re.findall(r'<span class="rn-t (c\d+)" title="([^"]*)"', page)]


def test_scales_put_the_middle_at_white_and_the_ends_at_their_colours():
    assert colour("diverging", 0.0, -1.0, 1.0) == "#ffffff"
    assert colour("diverging", 1.0, -1.0, 1.0) == "#b2182b" and colour("diverging", -5.0, -1.0, 1.0) == "#2166ac"
    assert colour("sequential", -10.0, -10.0, 0.0) == "#ffffff" and colour("sequential", 0.0, -10.0, 0.0) == "#54278f"
    assert colour("sequential", math.nan, 0.0, 1.0) == "#f4f4f4"


def test_the_importance_ratio_overlay_colours_each_token_and_its_tooltip_holds_the_row():
    page = token_html(traj("a", (2.0, 1.0)), "importance_ratio")
    tokens = spans_of(page)
    assert len(tokens) == 4  # the whole sequence: two prompt tokens, two response tokens
    (p0, _), (p1, t1), (r0, t_r0), (r1, _) = tokens
    assert p0 == "#f4f4f4"  # no ratio at position 0 (no trainer logprob)
    assert r0 == "#b2182b" and r1 == "#ffffff"  # ratio 2: the top of the scale; ratio 1: its middle
    assert "sampler -1, trainer -0.3069, ratio 2" in t_r0 and "adv 0.5" in t_r0 and "entropy 0.5" in t_r0
    assert "pos 2" in t_r0 and "id 3" in t_r0 and "response" in t_r0 and "mask 1" in t_r0
    assert "colour: <b>importance_ratio</b>" in page and "0.5 " in page and " 2 " in page and "unknown" in page
    with pytest.raises(ConfigError, match="colour_by must be one of"):
        token_html(traj("a", (2.0, 1.0)), "nope")


def test_the_version_overlay_marks_the_tokens_a_newer_policy_wrote():
    t = traj("b", (1.0, 1.0), spans=[(0, 2), (1, 3)])
    colours = [c for c, _ in spans_of(token_html(t, "version"))]
    assert colours[0] == colours[1] == colours[2] != colours[3]  # prompt read by v2, token 0 by v2, token 1 by v3
    page = token_html(t, "version")
    assert ">v2</span>" in page and ">v3</span>" in page
    adv = [c for c, _ in spans_of(token_html(traj("c", (1.0, 1.0), adv=-1.0), "advantage"))]
    assert adv[2] == adv[3] == "#2166ac" and adv[0] == "#f4f4f4"  # the most negative: full blue; prompt: none


def test_the_viewer_filters_by_mismatch_and_by_version_and_colours_on_demand():
    far, near, split = traj("far", (3.0, 1.0)), traj("near", (1.1, 1.0)), traj("split", (1.0, 1.0), [(0, 2), (1, 3)])
    assert mismatch_of(far) == pytest.approx(math.log(3.0)) and math.isnan(mismatch_of(Trajectory("x")))
    v = TrajectoryViewer([far, near, split])
    assert [t.id for t in v.set_filters(min_mismatch=0.5)] == ["far"]
    assert [t.id for t in v.set_filters(cross_version=True)] == ["split"]
    assert [t.id for t in v.set_filters(min_mismatch=0.05)] == ["far", "near"]
    v.select("near")
    v.colour_by("entropy")
    assert v.pane.value == "tokens" and "colour: <b>entropy</b>" in v.detail.value
    with pytest.raises(ConfigError):
        v.colour_by("nope")


def test_compare_aligns_two_trajectories_by_turn_or_one_with_its_replay():
    a, b = traj("a", (1.0, 1.0)), traj("b", (1.0, 1.0))
    b.turns.append(Turn("obs2", "act2", [1, 2, 3, 4, 9], [5], logprobs=[-2.0], loss_mask=[1], version=3))
    page = compare(a, b)._repr_html_()
    assert page.count("<tr><td") == 2 and ">a</th>" in page and ">b</th>" in page  # turns 0 and 1
    with pytest.raises(ConfigError, match="pipe.replay"):
        compare(a)
    a.replay = {"version": 5, "rows": [[math.nan, -0.2, -1.5, -0.5]]}
    page = compare(a)._repr_html_()
    assert "replay under v5" in page and "colour: <b>replay_logprob</b>" in page and "replay -1.5" in page
