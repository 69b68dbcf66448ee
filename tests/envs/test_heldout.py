"""Held-out validation: no validation problem reaches training, in any stage.

Arithmetic and FrozenLake with a ``holdout`` keep their validation problems behind seeds the
scheduler never draws; the pretraining corpus and the RL prompt stream (a real scheduler run on the
sim backend) are checked against the validation set problem by problem.
"""

import random

import pytest

from rollart_nb.envs import Arithmetic, FrozenLake
from rollart_nb.envs.arithmetic import HELDOUT_SEED_BASE
from rollart_nb.errors import ConfigError
from rollart_nb.models.pretraining import corpus
from rollart_nb.rewards import exact_answer
from rollart_nb.trajectory import Trajectory, Turn


def math_env(**kw):
    return Arithmetic(max_operand=99, holdout=200, fixed_width=True, reverse_answer=True, balance_answers=False, **kw)


def lake_env():
    return FrozenLake(random_maps=True, holdout=64)


def test_arithmetic_split_is_disjoint_and_covers_every_problem():
    env = math_env()
    val = env.validation_problems()
    train = {env.problem(s) for s in env.training_seeds()}
    assert len(set(val)) == 200 and len(train) == 100 * 100 - 200
    assert not set(val) & train
    rng = random.Random(0)
    for s in [0, 1, 199, 200, HELDOUT_SEED_BASE - 1, *(rng.randrange(HELDOUT_SEED_BASE) for _ in range(2000))]:
        assert env.problem(s) not in set(val), s
    # balanced training draws stay on training problems too
    bal = Arithmetic(max_operand=99, holdout=200)
    assert not {bal.problem(rng.randrange(HELDOUT_SEED_BASE)) for _ in range(2000)} & set(bal.validation_problems())
    # no split: validation is every problem, as before
    assert len(Arithmetic().validation_seeds()) == 100


def test_reversed_fixed_width_answers_and_their_rewards():
    env = math_env()
    obs, info = env.reset(seed=HELDOUT_SEED_BASE)
    a, _, b = env.problem(HELDOUT_SEED_BASE)
    assert obs == env.question(a, "+", b) and len(obs.split()) == 6  # "d d + d d ="
    written = env.answer_text(a + b)
    assert written.replace(" ", "") == f"{a + b:03d}"[::-1] == info["answer"] and info["value"] == a + b
    assert env.step(written)[1] == 1.0
    env.reset(seed=HELDOUT_SEED_BASE)
    assert env.step(str(a + b))[1] == 0.0 or str(a + b) == f"{a + b:03d}"[::-1]  # plain order is wrong
    # exact_answer reads every written digit when the answer has leading zeros
    t = Trajectory(task="math", info={"answer": "060"}, turns=[Turn("2 + 58 =", "0 6 0")])
    assert exact_answer(t) == 1.0
    t = Trajectory(task="math", info={"answer": "060"}, turns=[Turn("2 + 58 =", "6 0")])
    assert exact_answer(t) == 0.0
    with pytest.raises(ConfigError, match="reverse_answer"):
        Arithmetic(ops=("-",), reverse_answer=True)
    with pytest.raises(ConfigError, match="holdout"):
        Arithmetic(holdout=100)


def test_frozenlake_holdout_maps_never_reach_training():
    env = lake_env()
    val = set(env.validation_maps())
    assert len(val) == 64 and all(s >= HELDOUT_SEED_BASE for s in env.validation_seeds())
    rng = random.Random(1)
    for s in [0, 1, 2, *(rng.randrange(HELDOUT_SEED_BASE) for _ in range(3000))]:
        assert env.map_for(s) not in val
    # the map a training seed would have drawn is replaced, not played: the all-frozen map is
    # common (about 4% of draws) and held out, so some of these seeds needed a redraw
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    redrawn = [s for s in range(3000) if tuple(generate_random_map(4, seed=s)) in val]
    assert redrawn and all(env.map_for(s) not in val for s in redrawn)
    obs, info = env.reset(seed=redrawn[0])
    assert tuple(info["map"]) not in val
    with pytest.raises(ConfigError, match="holdout"):
        FrozenLake(holdout=3)


def _question(prompt: str) -> str:
    return prompt.split("<|user|>")[-1].split("<|assistant|>")[0].strip()


def test_pretraining_corpus_holds_no_validation_problem():
    math, lake = math_env(), lake_env()
    examples = corpus({"math": math, "frozenlake": lake}, 3000, seed=0, weights={"math": 3, "frozenlake": 1})
    assert {e.task for e in examples} == {"math", "frozenlake"}
    val_questions = {math.question(*p) for p in math.validation_problems()}
    asked = {_question(e.prompt) for e in examples if e.task == "math"}
    assert len(asked) > 1500 and not asked & val_questions
    # every math entry is a worked, right answer
    for e in examples[:200]:
        if e.task == "math":
            a, b = (int(x.replace(" ", "")) for x in _question(e.prompt).rstrip(" =").split(" + "))
            assert e.response == math.answer_text(a + b)
    # FrozenLake entries: the map of every entry's first observation is a training map
    val_grids = {"\n".join(m).replace("S", "P") for m in lake.validation_maps()}
    starts = [e.prompt.split("<|user|>")[1].split("<|assistant|>")[0] for e in examples if e.task == "frozenlake"]
    grids = {"\n".join(s.strip().splitlines()[1:]) for s in starts}
    assert len(grids) > 100 and not grids & val_grids
    with pytest.raises(ConfigError, match="demonstrate"):
        corpus({"x": object()}, 3)
