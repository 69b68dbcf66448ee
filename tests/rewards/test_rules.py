import pytest

from rollart_nb.envs import Arithmetic
from rollart_nb.errors import RewardError
from rollart_nb.rewards import close_answer, env_return, exact_answer, format_reward
from rollart_nb.trajectory import Trajectory, Turn


def traj(*actions, answer="12", rewards=None):
    rewards = rewards or [0.0] * len(actions)
    turns = [Turn(observation="q", action=a, env_reward=r) for a, r in zip(actions, rewards, strict=True)]
    info = {} if answer is None else {"answer": answer}
    return Trajectory(task="math", turns=turns, info=info)


@pytest.mark.parametrize(
    "action, expected",
    [
        ("<answer> 1 2 </answer>", 1.0),
        ("answer 12", 1.0),
        ("7 + 5 = 1 2", 1.0),
        ("12", 1.0),
        ("<answer> 1 3 </answer>", 0.0),
        ("I do not know", 0.0),
        ("<answer> 12 </answer> no wait <answer> 11 </answer>", 0.0),  # the last block counts
    ],
)
def test_exact_answer_integers(action, expected):
    assert exact_answer(traj(action)) == expected


def test_exact_answer_uses_the_last_turn_and_handles_negatives():
    assert exact_answer(traj("12", "13")) == 0.0
    assert exact_answer(traj("13", "answer - 3", answer="-3")) == 1.0


def test_exact_answer_text_answers_ignore_case_and_spacing():
    assert exact_answer(traj("<answer>  Left  Down </answer>", answer="left down")) == 1.0
    assert exact_answer(traj("<answer> left </answer>", answer="right")) == 0.0


def test_exact_answer_without_ground_truth_raises_a_reward_error():
    with pytest.raises(RewardError, match="no info\\['answer'\\]"):
        exact_answer(traj("12", answer=None))


def test_exact_answer_agrees_with_the_arithmetic_env():
    env = Arithmetic(max_operand=15, ops=("+", "-"))
    for seed in env.validation_seeds()[:60]:
        _, info = env.reset(seed=seed)
        action = f"<answer> {info['answer']} </answer>"
        _, env_reward, *_ = env.step(action)
        assert exact_answer(Trajectory(task="m", info=info, turns=[Turn("q", action)])) == env_reward == 1.0


def test_env_return_sums_turn_rewards():
    t = traj("a", "b", "c", rewards=[0.0, 0.5, 1.0])
    assert env_return(t) == 1.5 == t.env_return
    assert env_return(traj()) == 0.0


def test_format_reward_fraction_of_well_formed_turns():
    assert format_reward(traj("<answer> 1 </answer>", "1", "<answer></answer>", "<answer>1</answer><answer>")) == 0.25
    assert format_reward(traj("<move>up</move>"), tag="move") == 1.0
    assert format_reward(traj()) == 0.0


def test_close_answer_gives_partial_credit_by_distance():
    assert close_answer(traj("<answer> 1 2 </answer>")) == 1.0
    near, far = close_answer(traj("<answer> 1 1 </answer>")), close_answer(traj("<answer> 2 </answer>"))
    assert near == pytest.approx(0.5 * (1 - 1 / 18)) and far == pytest.approx(0.5 * (1 - 10 / 18))
    assert 1.0 > near > far > 0.0
    assert close_answer(traj("<answer> 9 9 </answer>")) == 0.0  # beyond the scale: no credit
    assert close_answer(traj("no number")) == 0.0
    assert close_answer(traj("<answer> 1 1 </answer>"), partial=0.2, scale=2) == pytest.approx(0.1)
    assert close_answer(traj("Paris", answer="paris")) == 1.0  # a text answer: exact match
    assert close_answer(traj("Rome", answer="paris")) == 0.0
    with pytest.raises(RewardError, match="scale"):
        close_answer(traj("1"), scale=0)
    with pytest.raises(RewardError, match="partial"):
        close_answer(traj("1"), partial=1.5)  # a near miss must not beat the right answer
    with pytest.raises(RewardError, match="no info"):
        close_answer(traj("1", answer=None))
