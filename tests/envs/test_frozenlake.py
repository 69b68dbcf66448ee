import copy
import pickle

import pytest

from rollart_nb.envs import FrozenLake
from rollart_nb.envs.frozenlake import parse_move
from rollart_nb.errors import ConfigError, StateError


def test_known_path_reaches_goal_and_pays_one():
    env = FrozenLake()
    obs, info = env.reset(seed=0)
    assert info["start"] == (0, 0)
    assert obs.splitlines()[1] == "PFFF"
    rewards = []
    for move in ["down", "down", "right", "down", "right", "right"]:
        obs, reward, terminated, truncated, _ = env.step(move)
        rewards.append(reward)
    assert rewards == [0.0] * 5 + [1.0]
    assert terminated and not truncated
    assert obs.startswith("reached the goal")


def test_wrong_path_falls_in_hole_without_reward():
    env = FrozenLake()
    env.reset(seed=0)
    env.step("right")
    obs, reward, terminated, truncated, _ = env.step("down")  # (1, 1) is a hole
    assert (reward, terminated, truncated) == (0.0, True, False)
    assert obs.startswith("fell in a hole")
    with pytest.raises(StateError, match="reset"):
        env.step("down")


@pytest.mark.parametrize("call", [lambda e: e.step("down"), lambda e: e.solve()])
def test_step_or_solve_before_reset_is_a_state_error(call):
    with pytest.raises(StateError, match=r"call reset\(\)"):
        call(FrozenLake())


def test_invalid_action_is_a_noop_turn_and_counts_towards_truncation():
    env = FrozenLake(max_turns=2)
    first, _ = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step("jump")
    assert info["move"] is None and reward == 0.0 and not terminated and not truncated
    assert obs.startswith("invalid action")
    assert obs.splitlines()[1:] == first.splitlines()[1:]  # same grid: nobody moved
    _, _, terminated, truncated, _ = env.step("right")
    assert truncated and not terminated


def test_parse_move_last_word_wins_case_insensitive_whole_words():
    assert parse_move("first up, then finally DOWN") == "down"
    assert parse_move("upwards leftover") is None
    assert parse_move("") is None


def test_validation_seeds_cover_distinct_reachable_starts_and_all_are_solvable():
    env = FrozenLake()
    seeds = env.validation_seeds()
    starts = []
    for seed in seeds:
        _, info = env.reset(seed=seed)
        starts.append(info["start"])
        path = env.solve()
        assert path is not None
        reward = 0.0
        for move in path:
            _, reward, terminated, _, _ = env.step(f"i choose {move}")
        assert reward == 1.0 and terminated
    assert len(set(starts)) == len(seeds) == 11  # 16 cells - 4 holes - goal
    # Same seed, same start (deterministic), and seeds wrap around.
    assert env.reset(seed=3)[1]["start"] == env.reset(seed=3 + len(seeds))[1]["start"]


def test_random_maps_differ_per_seed():
    env = FrozenLake(size=5, random_maps=True)
    maps = {tuple(env.reset(seed=s)[1]["map"]) for s in env.validation_seeds()}
    assert len(maps) == len(env.validation_seeds())


def test_custom_map_and_validation():
    env = FrozenLake(map=["SF", "HG"])
    assert env.size == 2 and env.validation_seeds() == [0, 1]
    with pytest.raises(ConfigError):
        FrozenLake(map=["SFF", "HG"])
    with pytest.raises(ConfigError):
        FrozenLake(map=["SH", "HG"], max_turns=0)  # two problems at once
    with pytest.raises(ConfigError, match="reach the goal"):
        FrozenLake(map=["FH", "HG"])


@pytest.mark.parametrize("compact", [True, False])
def test_hints_and_vocab_cover_observations(compact):
    from rollart_nb.models.tiny import UNK, build_tokenizer

    env = FrozenLake(compact=compact)
    assert env.shape == "prefill" and env.max_turns == 10
    obs, _ = env.reset(seed=1)
    obs2, *_ = env.step("blah")
    obs3, *_ = env.step("down")
    tok = build_tokenizer(env.vocab)
    unk = tok.convert_tokens_to_ids(UNK)
    for o in (obs, obs2, obs3):
        assert unk not in tok.encode(o)
        # every word is known as a whole: the spaced rendering; grid rows are letter runs in the compact one
        assert {w for w in o.split() if not set(w) <= set("PFHGS")} <= set(env.vocab)


def test_picklable_and_copyable_mid_episode():
    env = FrozenLake()
    env.reset(seed=0)
    env.step("down")
    clone = pickle.loads(pickle.dumps(env))
    assert clone._gym is None  # rebuilt on reset, not shipped
    obs, _ = clone.reset(seed=0)
    assert "PFFF" in obs
    assert copy.deepcopy(env).reset(seed=0)[0] == obs


def test_slippery_is_deterministic_per_seed():
    def run(seed):
        env = FrozenLake(is_slippery=True, max_turns=20)
        env.reset(seed=seed)
        return [env.step("right")[4]["position"] for _ in range(3)]

    assert run(5) == run(5)


def test_compact_rendering_is_one_token_per_cell_and_half_the_spaced_length():
    from rollart_nb.models.tiny import build_tokenizer

    compact, spaced = FrozenLake(), FrozenLake(compact=False)
    tok = build_tokenizer(sorted(set(compact.vocab)))
    first_c, _ = compact.reset(seed=0)
    first_s, _ = spaced.reset(seed=0)
    assert first_s.splitlines()[1] == "P F F F"
    step_c = compact.step("right")[0]
    step_s = spaced.step("right")[0]
    assert step_c == "FPFF\nFHFH\nFFFH\nHFFG"  # a plain move: the grid alone
    assert step_s.startswith("moved right .")
    grid_tokens = tok.encode(step_c)
    assert len(grid_tokens) == 16 + 3  # one token per cell plus the newlines
    assert tok.decode(grid_tokens) == step_c  # round-trips exactly
    assert len(tok.encode(first_c)) + len(grid_tokens) < 0.6 * (len(tok.encode(first_s)) + len(tok.encode(step_s)))
