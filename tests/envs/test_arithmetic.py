import pytest

from rollart_nb.envs import Arithmetic, parse_answer, parse_int
from rollart_nb.envs.arithmetic import format_number
from rollart_nb.errors import ConfigError, StateError


@pytest.mark.parametrize(
    "text, value",
    [
        ("<answer> 1 2 </answer>", 12),
        ("answer 12", 12),
        ("3 + 9 = 1 2", 12),
        ("12", 12),
        ("= - 3", -3),
        ("answer: -4", -4),
        ("7 - 3", 3),  # a minus after a digit is subtraction, not a sign
        ("i think 5 . <answer> 7 </answer>", 7),
        ("no number here", None),
        ("<answer></answer>", None),
    ],
)
def test_parse_int(text, value):
    assert parse_int(text) == value


def test_parse_answer_prefers_last_tag_then_answer_word():
    assert parse_answer("<answer>a</answer> x <answer> b </answer>") == "b"
    assert parse_answer("the answer is : left") == "is : left"
    assert parse_answer("  plain ") == "plain"


def test_correct_answer_rewards_and_terminates():
    env = Arithmetic()
    obs, info = env.reset(seed=5)
    a, op, b = info["question"].split()
    assert op == "+" and info["answer"] == str(int(a) + int(b))
    assert obs == f"{a} + {b} ="
    _, reward, terminated, truncated, step_info = env.step(f"<answer> {' '.join(info['answer'])} </answer>")
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert step_info["correct"]


def test_wrong_answer_single_turn_truncates_with_zero():
    env = Arithmetic()
    _, info = env.reset(seed=5)
    wrong = int(info["answer"]) + 1
    _, reward, terminated, truncated, _ = env.step(str(wrong))
    assert (reward, terminated, truncated) == (0.0, False, True)
    with pytest.raises(StateError, match="reset"):
        env.step("1")


def test_step_before_reset_is_a_state_error():
    with pytest.raises(StateError, match=r"call reset\(\) first"):
        Arithmetic().step("1")


def test_multi_turn_retry():
    env = Arithmetic(max_turns=2)
    q, info = env.reset(seed=1)
    obs, reward, terminated, truncated, _ = env.step("nonsense")
    assert (reward, terminated, truncated) == (0.0, False, False) and obs.endswith(q)
    _, reward, terminated, _, _ = env.step(info["answer"])
    assert reward == 1.0 and terminated


def test_validation_seeds_enumerate_every_problem_once():
    env = Arithmetic(max_operand=4, ops=("+", "-", "*"))
    questions = [env.reset(seed=s)[1]["question"] for s in env.validation_seeds()]
    assert len(questions) == len(set(questions)) == 5 * 5 * 3
    # Consecutive training seeds are shuffled, not "0 + 0", "0 + 1", ...
    assert [env.reset(seed=s)[1]["question"] for s in range(3)] != ["0 + 0", "0 + 1", "0 + 2"]


def test_training_seeds_balance_answers_and_validation_seeds_still_cover_every_problem():
    import random
    from collections import Counter

    env = Arithmetic()  # single-digit sums: 9 is the answer to 10 problems, 0 and 18 to one each
    rng = random.Random(0)
    seeds = [rng.randrange(100, 2**31) for _ in range(19_000)]
    answers = Counter(int(env.reset(seed=s)[1]["answer"]) for s in seeds)
    assert sorted(answers) == list(range(19))
    assert max(answers.values()) < 1.2 * min(answers.values()), answers
    # Every problem still comes up, and the same seed always asks the same problem.
    assert len({env.reset(seed=s)[1]["question"] for s in seeds}) == 100
    assert env.reset(seed=seeds[7]) == env.reset(seed=seeds[7])
    plain = Arithmetic(balance_answers=False)
    skewed = Counter(int(plain.reset(seed=s)[1]["answer"]) for s in seeds)
    assert skewed[9] > 5 * skewed[0], skewed
    assert {env.reset(seed=s)[1]["question"] for s in env.validation_seeds()} == {
        plain.reset(seed=s)[1]["question"] for s in plain.validation_seeds()
    }


def test_multi_digit_numbers_are_spaced_and_vocab_covers_them():
    env = Arithmetic(max_operand=20, ops=("-", "*"))
    vocab = set(env.vocab)
    for seed in env.validation_seeds():
        obs, info = env.reset(seed=seed)
        assert set(obs.split()) <= vocab
        assert set(format_number(int(info["answer"])).split()) <= vocab
        _, reward, *_ = env.step(f"answer {format_number(int(info['answer']))}")
        assert reward == 1.0, (obs, info)
    assert Arithmetic(spaced_digits=False, max_operand=20).reset(seed=0)[0].count(" ") == 3


def test_config_errors_report_all_problems():
    with pytest.raises(ConfigError) as e:
        Arithmetic(max_operand=0, ops=("/",), max_turns=0)
    assert len(e.value.problems) == 3
