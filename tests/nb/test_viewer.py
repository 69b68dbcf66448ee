"""TrajectoryViewer outside a kernel: filters, selection, rendering, refresh, export."""

import json
import math

import pytest

pytest.importorskip("ipywidgets")

from rollart_nb.nb.viewer import TokenDecoder, TrajectoryViewer, trajectory_html  # noqa: E402
from rollart_nb.trajectory import Status, TrajectoryList  # noqa: E402


class WordTokenizer:
    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


def test_filters_by_task_status_reward_and_version(trajectories):
    v = TrajectoryViewer(trajectories)
    assert len(v.filtered) == 5 and "5 of 5" in v.count.value
    assert [t.id for t in v.set_filters(task="fl")] == ["traj002", "traj003"]
    assert [t.id for t in v.set_filters(status="failed")] == ["traj002"]
    assert [t.id for t in v.set_filters(min_reward=0.5)] == ["traj000", "traj004"]  # NaN rewards excluded
    assert [t.id for t in v.set_filters(version=2)] == ["traj004"]
    assert [t.id for t in v.set_filters(task="math", version=1)] == ["traj001", "traj004"]
    assert v.set_filters(task="nope") == v.set_filters()  # unknown task: any
    assert v.task.options == ("any", "fl", "math") and v.version.options == ("any", "0", "1", "2")


def test_selection_follows_filters_and_renders_the_trajectory(trajectories):
    v = TrajectoryViewer(trajectories, tokenizer=WordTokenizer())
    assert v.selected.id == "traj004"  # newest by default
    v.set_filters(status="failed")
    assert v.selected.id == "traj002"
    assert "EnvError: injected failure" in v.detail.value and "failed" in v.detail.value
    v.set_filters()
    t = v.select("traj001")
    assert v.selector.value == "traj001" and [s.version for s in t.versions] == [0, 1, 1]
    assert v.detail.value.count("rn-version-change") == 1  # the v0 -> v1 switch, once
    assert "w10" in v.detail.value  # decoded with the tokenizer
    v.set_filters(task="nope", status="cancelled")
    assert v.selected is None and "no trajectory matches" in v.detail.value


def test_trajectory_html_masks_logprobs_and_failures(trajectories):
    out = trajectory_html(trajectories[3])
    assert out.count('class="rn-tok rn-response rn-mask-1"') == 6
    assert out.count('class="rn-tok rn-response rn-mask-0"') == 3
    # the turns' prompts do not extend each other: one row per turn, each with its whole prompt
    assert out.count('class="rn-tok rn-prompt rn-mask-0"') == 9 and "18 token(s) in 3 row(s)" in out
    assert "#10" in out and "no tokenizer: token ids shown" in out  # no tokenizer: ids
    short = trajectory_html(trajectories[3], max_prompt_tokens=1)  # the latest context of each turn only
    assert short.count("2 earlier prompt token(s) not shown") == 3 and short.count("rn-tok rn-prompt") == 3
    assert "aborted_stale" in out and "stale: started at v0" in out and "not scored" in out
    assert out.count("rn-logprobs") == 3 and "logprob -5.000" in out
    assert "generate 0.400s" in out and "reward fn v0" in out


def test_token_decoder_caches_and_survives_bad_ids():
    calls = []

    class Tok:
        def decode(self, ids):
            calls.append(ids)
            if ids[0] < 0:
                raise IndexError("out of vocab")
            return f"<{ids[0]}>"

    d = TokenDecoder(Tok())
    assert d(5) == "<5>" and d(5) == "<5>" and calls == [[5]]
    assert d(-1) == "#-1"
    assert TokenDecoder()(7) == "#7"


def test_refresh_pulls_from_the_source_with_its_query(synth, trajectories):
    pipe = synth["fake_pipeline"](trajectories[:2])
    v = TrajectoryViewer(pipe.trajectories(task="math", last=50))
    assert len(v.items) == 2
    pipe.items.extend(trajectories[2:])
    assert v.refresh() == 1  # only traj004 is new math
    assert pipe.calls[-1] == ("trajectories", "math", None, 50)
    assert [t.id for t in v.filtered] == ["traj000", "traj001", "traj004"]
    assert not v.refresh_button.disabled
    assert TrajectoryViewer(list(trajectories)).refresh() == 0  # no source: nothing to pull


def test_live_refresh_ticks_and_stops(synth, trajectories):
    import time

    pipe = synth["fake_pipeline"](trajectories)
    v = TrajectoryViewer(pipe.trajectories(), live_s=0.05)
    v.live.value = True
    deadline = time.time() + 5
    while sum(1 for c in pipe.calls if c[0] == "trajectories") < 3 and time.time() < deadline:
        time.sleep(0.02)
    v.live.value = False
    n = len(pipe.calls)
    time.sleep(0.2)
    assert n >= 3 and len(pipe.calls) <= n + 1
    v.close()


def test_export_jsonl_and_dataframe(tmp_path, trajectories):
    v = TrajectoryViewer(trajectories)
    v.set_filters(task="math")
    path = v.to_jsonl(tmp_path / "out.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["traj000", "traj001", "traj004"]
    assert rows[1]["turns"][1]["loss_mask"] == [1, 1, 0] and rows[1]["turns"][1]["version"] == 1
    assert len(v.to_jsonl(tmp_path / "sel.jsonl", which="selected").read_text().splitlines()) == 1
    pd = pytest.importorskip("pandas")
    df = v.to_dataframe(which="all")
    assert isinstance(df, pd.DataFrame) and len(df) == 5
    row = df.set_index("id").loc["traj001"]
    assert row["version_changes"] == 1 and row["turns"] == 3 and row["trained_tokens"] == 6
    assert math.isnan(df.set_index("id").loc["traj002", "reward"])
    with pytest.raises(ValueError, match="which must be"):
        v.to_dataframe(which="nope")
    v.export_path.value = str(tmp_path / "button.jsonl")
    v.export_button.click()
    assert (tmp_path / "button.jsonl").exists() and "written to" in v.count.value


def test_whole_sequence_masks_when_turns_extend_each_other(synth):
    t = synth["trajectory"](7, versions=(0, 1))
    t.turns[1].prompt_ids = [1, 2, 3, 10, 11, 12, 4, 5]  # turn 0's prompt + response + a new observation
    out = trajectory_html(t, WordTokenizer())
    assert "11 token(s) in 1 row(s), 5 prompt side, 4 trained" in out
    assert out.count("rn-tok rn-prompt") == 5 and out.count("rn-tok rn-response rn-mask-1") == 4
    assert ">w4</span>" in out and "new in this turn" in out and "#4" not in out


def test_the_group_pane_shows_the_selected_trajectorys_group(trajectories):
    v = TrajectoryViewer(TrajectoryList(trajectories, tokenizer=WordTokenizer()))
    v.select("traj001")
    assert "rn-group" not in v.detail.value and "w10" in v.detail.value  # the list's tokenizer
    v.pane.value = "group"
    g = v.group
    assert g.group_id == "g0" and [t.id for t in g.members] == ["traj000", "traj001"]
    assert g.advantages == pytest.approx([1.0, -1.0], abs=1e-4)  # (r - mean) / (std + eps), rewards 1 and 0
    assert 'class="rn-group"' in v.detail.value and v.detail.value.count('class="rn-member"') == 2
    assert "+1.0000" in v.detail.value and "-1.0000" in v.detail.value
    v.select("traj004")  # a group of one: no baseline, advantage 0
    assert v.group.advantages == [0.0] and "+0.0000" in v.detail.value


def test_viewer_dataframes_at_every_level(trajectories):
    pytest.importorskip("pandas")
    v = TrajectoryViewer(trajectories, tokenizer=WordTokenizer())
    v.set_filters(task="math")
    assert list(v.to_dataframe(level="turn")["trajectory_id"]) == ["traj000"] * 2 + ["traj001"] * 3 + ["traj004"] * 2
    tokens = v.to_dataframe(which="selected", level="token")
    assert set(tokens["trajectory_id"]) == {"traj004"} and len(tokens) == 12
    assert list(tokens["text"][:6]) == ["w1", "w2", "w3", "w10", "w11", "w12"]
    assert list(tokens["loss_mask"][:6]) == [0, 0, 0, 1, 1, 0] and list(tokens["side"][:4]) == ["prompt"] * 3 + [
        "response"
    ]


def test_trajectory_list_displays_the_viewer(monkeypatch, trajectories):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj))
    TrajectoryList(list(trajectories))._ipython_display_()
    assert isinstance(shown[0], TrajectoryViewer) and len(shown[0].items) == 5
    assert Status.FAILED.value in shown[0].status.options


def test_a_trajectory_shows_itself_as_html(trajectories):
    failed = next(t for t in trajectories if t.status is Status.FAILED)
    out = failed._repr_html_()
    assert out == trajectory_html(failed)  # the viewer's detail pane, through the views registry
    assert failed.id in out and "EnvError: injected failure" in out
    decoded = TrajectoryList(list(trajectories), tokenizer=WordTokenizer())[2]._repr_html_()
    assert decoded == trajectory_html(failed, WordTokenizer()) and ">w10</span>" in decoded and "#10" not in decoded
