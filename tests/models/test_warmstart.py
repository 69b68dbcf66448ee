"""Format-only warm start: examples are well-formed, cover later turns, and never carry the answer."""

from rollart_nb.envs import Arithmetic, FrozenLake
from rollart_nb.envs.arithmetic import parse_int
from rollart_nb.envs.frozenlake import parse_move
from rollart_nb.models.tiny import ASSISTANT, USER
from rollart_nb.models.warmstart import random_format_examples


def test_examples_are_in_format_cover_later_turns_and_are_not_the_answers():
    envs = {"frozenlake": FrozenLake(), "math": Arithmetic()}
    examples = random_format_examples(envs, 400, seed=0)
    lake = [(p, r) for p, r in examples if "H" in p]
    sums = [(p, r) for p, r in examples if "+" in p]
    assert len(lake) == len(sums) == 200
    assert all(p.endswith(ASSISTANT) for p, _ in examples)
    assert all(parse_move(r) == r for _, r in lake)
    assert all(parse_int(r) is not None for _, r in sums)
    turns = [p.count(USER) for p, _ in lake]
    assert min(turns) == 1 and max(turns) >= 3  # later turns of an episode are in format too
    # the responses are random: about 1/19 of the sums are right by chance, not all of them
    right = 0
    for p, r in sums:
        a, b = (int(x) for x in p.split(USER)[-1].split("=")[0].replace(" ", "").split("+"))
        right += parse_int(r) == a + b
    assert right < 0.2 * len(sums)
