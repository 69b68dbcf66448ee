"""Trajectories as tables (trajectory / turn / token rows), decoded text, GRPO group views.

Trajectories are rolled out the way the pipeline does it: an EnvManager runs a multi-turn
FrozenLake against an LLMProxy over an in-process sim generation backend that samples from the
tiny word-level tokenizer's vocabulary, so prompts, responses and their text are real.
"""

from __future__ import annotations

import asyncio
import html
import math
import pickle
import sys

import pytest

from rollart_nb.algo.grpo import GRPO, batch_advantages, group_advantages
from rollart_nb.control.env_manager import EnvManager, RolloutConfig
from rollart_nb.control.local import LocalGenerator, LocalHandle
from rollart_nb.control.proxy import GenTarget, LLMProxy
from rollart_nb.envs import FrozenLake
from rollart_nb.errors import ConfigError
from rollart_nb.models.spec import spec
from rollart_nb.models.tiny import build_tokenizer
from rollart_nb.resources.profiles import PROFILES
from rollart_nb.sim import SimBackend
from rollart_nb.trajectory import Status, Trajectory, TrajectoryList, Turn
from rollart_nb.trajectory_frames import COLUMNS, rows, sequence_tokens
from rollart_nb.trajectory_groups import GROUP_COLUMNS, groups_of

pd = pytest.importorskip("pandas")

REWARDS = {"lake0": 1.0, "lake1": 0.0, "lake2": 0.5, "lake3": 0.0, "lake4": 1.0, "lake5": 1.0, "lake6": 0.25}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def rolled(tok) -> list[Trajectory]:
    """Two GRPO groups of four 3-turn FrozenLake trajectories; group g1 at policy v1; lake7 failed.
    Rewards set as the reward worker sets them."""
    backend = SimBackend(
        spec("qwen3-0.6b"), PROFILES["H20"], time_scale=0, mean_response_tokens=4, vocab_size=len(tok), tokenizer=tok
    )

    async def roll() -> list[Trajectory]:
        proxy = LLMProxy([GenTarget(LocalHandle(LocalGenerator(backend)), "gen/0", "H20", "H20")], {})
        cfg = RolloutConfig(max_turns=3, max_new_tokens=6)
        out = []
        for i in range(8):
            if i == 4:
                backend.load_weights({}, 1)
            env = EnvManager(i, "lake", FrozenLake(max_turns=3), tok, proxy, cfg)
            t = Trajectory("lake", seed=i // 4, group_id=f"g{i // 4}", id=f"lake{i}", start_version=backend.version)
            out.append(await env.run(t))
        return out

    trajs = asyncio.run(roll())
    for t in trajs:
        if t.id in REWARDS:
            t.finish(Status.COMPLETED, now=t.created_s + 1.0)
            t.reward, t.reward_version = REWARDS[t.id], 0
        else:
            t.finish(Status.FAILED, "env: injected", now=t.created_s + 1.0)
    trajs[0].turn_rewards = [0.0, 0.5, 0.5]
    assert all(len(t.turns) == 3 for t in trajs), "FrozenLake(max_turns=3) with nonsense actions runs 3 turns"
    return trajs


def test_the_trajectory_level_has_one_row_per_trajectory(rolled, tok):
    df = TrajectoryList(rolled, tokenizer=tok).to_dataframe()
    assert tuple(df.columns) == COLUMNS["trajectory"] and list(df["id"]) == [t.id for t in rolled]
    row = df.set_index("id").loc["lake5"]
    t = rolled[5]
    last = t.turns[-1]
    assert row["task"] == "lake" and row["status"] == "completed" and row["reward"] == 1.0
    assert row["group_id"] == "g1" and (row["min_version"], row["max_version"]) == (1, 1) and row["turns"] == 3
    assert row["tokens"] == t.num_tokens and row["sequence_tokens"] == len(last.prompt_ids) + len(last.response_ids)
    assert row["trained_tokens"] == sum(len(u.response_ids) for u in t.turns)
    assert row["duration_s"] == pytest.approx(1.0)
    assert row["generate_s"] == pytest.approx(sum(u.timings["generate"] for u in t.turns))
    failed = df.set_index("id").loc["lake7"]
    assert failed["status"] == "failed" and failed["reason"] == "env: injected" and math.isnan(failed["reward"])
    assert rolled[4].to_dataframe().iloc[0]["id"] == "lake4"  # one trajectory alone


def test_the_turn_level_has_the_version_counts_and_decoded_text(rolled, tok):
    df = TrajectoryList(rolled, tokenizer=tok).to_dataframe(level="turn")
    assert tuple(df.columns) == COLUMNS["turn"] and len(df) == 3 * len(rolled)
    t0 = df[df["trajectory_id"] == "lake0"].set_index("turn")
    for k, u in enumerate(rolled[0].turns):
        assert t0.loc[k, "prompt_tokens"] == len(u.prompt_ids) and t0.loc[k, "response_tokens"] == len(u.response_ids)
        assert t0.loc[k, "prompt_text"] == tok.decode(u.prompt_ids) and t0.loc[k, "response_text"] == u.action
        assert t0.loc[k, "observation"] == u.observation and t0.loc[k, "version"] == 0
    assert "go to G" in t0.loc[0, "prompt_text"] and "<|assistant|>" in t0.loc[0, "prompt_text"]
    assert list(t0["reward"]) == [0.0, 0.5, 0.5]  # turn rewards where given
    assert set(df[df["trajectory_id"] == "lake4"]["version"]) == {1}
    assert df[df["trajectory_id"] == "lake1"]["reward"].isna().all()
    no_tok = TrajectoryList(rolled).to_dataframe(level="turn")
    assert no_tok["prompt_text"].isna().all() and (no_tok["action"] == df["action"]).all()


def test_the_token_level_covers_the_whole_sequence_with_the_trainers_mask(rolled, tok):
    from rollart_nb.backends.torch_train import build_rows

    df = TrajectoryList(rolled, tokenizer=tok).to_dataframe(level="token")
    assert tuple(df.columns) == COLUMNS["token"]
    for t in rolled:
        mine = df[df["trajectory_id"] == t.id]
        last = t.turns[-1]
        (row,) = build_rows(t)  # what the trainer trains on
        assert list(mine["token_id"]) == list(last.prompt_ids) + list(last.response_ids) == row.ids
        assert list(mine["position"]) == list(range(len(row.ids))) and set(mine["row"]) == {0}
        assert list(mine["loss_mask"]) == [int(m) for m in row.mask]
        assert (mine["side"] == "response").sum() == sum(len(u.response_ids) for u in t.turns)
        resp = mine[mine["side"] == "response"]
        assert list(resp["sampler_logprob"]) == pytest.approx([lp for u in t.turns for lp in u.logprobs])
        assert list(resp["turn"]) == [k for k, u in enumerate(t.turns) for _ in u.response_ids]
        assert (
            mine[mine["side"] == "prompt"]["sampler_logprob"].isna().all()
            and (mine[mine["side"] == "prompt"]["loss_mask"] == 0).all()
        )
        assert list(mine["text"]) == [tok.decode([i]) for i in row.ids]
        assert set(mine["version"]) == {t.turns[0].version}
        # each turn's prompt side is exactly what its prompt adds to the sequence so far
        for k, u in enumerate(t.turns):
            new = mine[(mine["turn"] == k) & (mine["side"] == "prompt")]
            start = 0 if k == 0 else len(t.turns[k - 1].prompt_ids) + len(t.turns[k - 1].response_ids)
            assert list(new["token_id"]) == list(u.prompt_ids[start:])
    assert df[df["trajectory_id"] == "lake0"]["text"].str.cat() == tok.decode(row_ids(rolled[0]))


def row_ids(t: Trajectory) -> list[int]:
    return list(t.turns[-1].prompt_ids) + list(t.turns[-1].response_ids)


def test_turns_that_do_not_extend_each_other_become_one_row_each():
    turns = [
        Turn("a", prompt_ids=[1, 2], response_ids=[5, 6], logprobs=[-0.5, -1.0], loss_mask=[1, 0], version=0),
        Turn("b", prompt_ids=[9, 2], response_ids=[7], logprobs=[], loss_mask=[], version=1),  # truncated history
    ]
    seq = sequence_tokens(Trajectory("t", turns=turns))
    assert [(s.row, s.position, s.token_id, s.side, s.mask) for s in seq] == [
        (0, 0, 1, "prompt", 0),
        (0, 1, 2, "prompt", 0),
        (0, 2, 5, "response", 1),
        (0, 3, 6, "response", 0),
        (1, 0, 9, "prompt", 0),
        (1, 1, 2, "prompt", 0),
        (1, 2, 7, "response", 1),  # no recorded mask: trained, as the trainer reads it
    ]
    assert math.isnan(seq[-1].logprob) and seq[-1].version == 1 and seq[2].logprob == -0.5
    assert [r["text"] for r in rows([Trajectory("t", turns=turns)], "token")] == [None] * 7


def test_levels_and_pandas_are_checked(rolled, monkeypatch):
    with pytest.raises(ConfigError, match="level must be one of 'trajectory', 'turn', 'token', got 'tokens'"):
        TrajectoryList(rolled).to_dataframe(level="tokens")
    empty = TrajectoryList().to_dataframe(level="token")
    assert len(empty) == 0 and tuple(empty.columns) == COLUMNS["token"]
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if the nb extra were not installed
    with pytest.raises(ConfigError, match=r"pip install 'rollart_nb\[nb\]'"):
        TrajectoryList(rolled).to_dataframe()
    assert rows(rolled[:1])[0]["id"] == "lake0"  # the rows themselves need no pandas


def test_a_group_shows_rewards_and_the_trainers_advantages(rolled, tok):
    tl = TrajectoryList(rolled, tokenizer=tok)
    flat = GRPO(group_size=4, scale_by_std=False)
    g0 = tl.group("g0", flat)
    assert [t.id for t in g0.members] == ["lake0", "lake1", "lake2", "lake3"] and not g0.scale_by_std
    assert g0.advantages == pytest.approx([0.625, -0.375, 0.125, -0.375]) and sum(g0.advantages) == pytest.approx(0)
    expected = group_advantages([1.0, 0.0, 0.5, 0.0], ["g0"] * 4, eps=flat.adv_eps, scale_by_std=False).tolist()
    assert g0.advantages == pytest.approx(expected)
    g1 = tl.group(rolled[6], flat)  # by a member; lake7 failed: no advantage, not in the baseline
    assert g1.group_id == "g1" and math.isnan(g1.advantages[3]) and len(g1.trained) == 3
    assert sum(g1.advantages[:3]) == pytest.approx(0) and g1.mean == pytest.approx(0.75)
    # std scaling on (the default): exactly what the trainer computes for a batch of these
    scaled = tl.group("g1")
    trained = [t for t in rolled if t.status is Status.COMPLETED]
    _, adv = batch_advantages(GRPO(), trained)
    assert scaled.advantages[:3] == pytest.approx(adv.tolist()[4:]) and scaled.std == pytest.approx(math.sqrt(2) / 4)
    with pytest.raises(ConfigError, match="no trajectory in this list is in group 'g9'"):
        tl.group("g9")


def test_groups_is_one_row_per_member(rolled, tok):
    df = TrajectoryList(rolled, tokenizer=tok).groups(GRPO(scale_by_std=False))
    assert tuple(df.columns) == GROUP_COLUMNS and len(df) == 8
    sums = df[df["trained"]].groupby("group_id")["advantage"].sum()
    assert sums.abs().max() < 1e-6 and set(sums.index) == {"g0", "g1"}
    lake7 = df.set_index("id").loc["lake7"]
    assert not lake7["trained"] and math.isnan(lake7["advantage"]) and lake7["group_trained"] == 3
    assert df.set_index("id").loc["lake0", "last_action"] == rolled[0].turns[-1].action
    assert TrajectoryList(rolled[:4]).group("g0").to_dataframe()["reward"].tolist() == [1.0, 0.0, 0.5, 0.0]
    # a group without ids groups by task/seed, as the trainer does
    loose = [Trajectory("m", seed=3, id=f"x{i}", status=Status.COMPLETED, reward=float(i)) for i in range(2)]
    (g,) = groups_of(loose, GRPO(scale_by_std=False))
    assert g.group_id == "m/3" and g.advantages == pytest.approx([-0.5, 0.5])


def test_a_trajectory_from_a_list_shows_decoded_text_alone(rolled, tok):
    pytest.importorskip("ipywidgets")
    tl = TrajectoryList(rolled, tokenizer=tok)
    t = tl[2]
    out = t._repr_html_()
    assert t.tokenizer is tok and "#" + str(t.turns[0].prompt_ids[1]) not in out
    assert f">{html.escape(tok.decode([t.turns[0].prompt_ids[1]]))}</span>" in out  # "go", not its id
    assert out.count("rn-tok rn-prompt") + out.count("rn-tok rn-response") == len(sequence_tokens(t))
    assert out.count("rn-tok rn-response rn-mask-1") == sum(len(u.response_ids) for u in t.turns)
    assert "no tokenizer" not in out and f"sequence: {len(sequence_tokens(t))} token(s) in 1 row(s)" in out
    assert "last_action=" in repr(t) and repr(t.turns[-1].action[:20])[1:-1] in repr(t)
    bare = Trajectory.from_dict(t.to_dict())
    assert bare.tokenizer is None and "no tokenizer: token ids shown" in bare._repr_html_()
    assert tl[1:3].tokenizer is tok and isinstance(tl[1:3], TrajectoryList)
    copy = pickle.loads(pickle.dumps(t))  # the tokenizer stays here; the data travels
    assert copy.tokenizer is None and copy.to_dict() == t.to_dict()


def test_the_group_html_puts_members_side_by_side(rolled, tok):
    g = TrajectoryList(rolled, tokenizer=tok).group("g1", GRPO(scale_by_std=False))
    out = g._repr_html_()
    assert out.count('class="rn-member"') == 4 and "advantage = r - mean" in out
    assert "+0.2500" in out and "-0.5000" in out and "4 member(s), 3 trained" in out
    assert html.escape(rolled[4].turns[0].action) in out


def test_a_sim_pipelines_trajectories_make_frames_and_groups():
    from rollart_nb.sim import SimEnv, response_tokens_fn, workload
    from rollart_nb.sim.tokenizer import SimTokenizer
    from rollart_nb.sim_session import SimSession
    from rollart_nb.workers.roles import SimGenerator, SimTrainer

    sess = SimSession({"H800": 4, "cpu": 4}, seed=0)
    try:
        m, wl = spec("qwen3-0.6b"), {"lake": workload("frozenlake")}
        gen = sess.cluster(
            "actor_gen", SimGenerator, pool="H800", model=m, time_scale=1e-4, response_tokens=response_tokens_fn(wl)
        )
        train = sess.cluster("actor_train", SimTrainer, pool="H800", model=m, time_scale=1e-4, gpus=1)
        tasks = sess.tasks({"lake": SimEnv(wl["lake"], time_scale=1e-4)}, envs_per_task=4)
        pipe = sess.pipeline(
            train,
            gen,
            tasks,
            batch_size=4,
            group_size=2,
            mode="sync",
            algo=GRPO(group_size=2, scale_by_std=False),
            rollout=RolloutConfig(max_turns=3, max_new_tokens=16, max_context=4096),
        )
        pipe.run(1, progress=False)
        tl = pipe.trajectories()
        assert len(tl) >= 4 and isinstance(tl.tokenizer, SimTokenizer)  # the generation model's
        assert len(tl.to_dataframe()) == len(tl)
        assert len(tl.to_dataframe(level="turn")) == sum(len(t.turns) for t in tl)
        tokens = tl.to_dataframe(level="token")
        assert len(tokens) == sum(len(sequence_tokens(t)) for t in tl) and tokens["text"].notna().all()
        groups = tl.groups()  # the pipeline's GRPO settings: no std scaling
        assert not groups["scale_by_std"].any()
        assert groups[groups["trained"]].groupby("group_id")["advantage"].sum().abs().max() < 1e-5
        assert tl[0].tokenizer is tl.tokenizer
        pipe.close()
    finally:
        sess.close()
