"""The base-model stage: a real tiny model, trained on worked training sums, solves held-out ones."""

import pytest

from rollart_nb.envs import Arithmetic
from rollart_nb.errors import ConfigError
from rollart_nb.models import tiny_qwen
from rollart_nb.models.pretraining import corpus, pretrain
from rollart_nb.models.tiny import format_history


def held_out_exact_match(ref, env):
    import torch

    tok, net = ref.load_tokenizer(), ref.load_model()
    problems = env.validation_problems()
    prompts = [tok.encode(format_history([(env.question(*p), None)])) for p in problems]
    assert len({len(p) for p in prompts}) == 1  # fixed width: one prompt length, no padding
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = net.generate(
            input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=tok.eos_token_id
        )
    said = [tok.decode(o[ids.shape[1] :], skip_special_tokens=True) for o in out]
    return sum(s.strip() == env.answer_text(a + b) for s, (a, _, b) in zip(said, problems, strict=True)) / len(problems)


def test_pretraining_on_training_sums_solves_held_out_ones_and_is_cached(tmp_path):
    env = Arithmetic(max_operand=99, holdout=200, fixed_width=True, reverse_answer=True, balance_answers=False)
    init = tiny_qwen(task_vocab=env.vocab, seed=0, path=str(tmp_path / "init"))
    assert held_out_exact_match(init, env) == 0.0
    losses = []
    base = pretrain(
        init,
        {"math": env},
        steps=250,
        batch=64,
        path=str(tmp_path / "base"),
        progress=lambda step, loss: losses.append(loss),
    )
    assert len(losses) == 250 and sum(losses[-20:]) < sum(losses[:20]) / 2
    score = held_out_exact_match(base, env)
    assert score >= 0.05, score  # generalised to sums it never saw (about 0.2 at 250 steps)
    again = pretrain(
        init,
        {"math": env},
        steps=250,
        batch=64,
        path=str(tmp_path / "base"),
        progress=lambda step, loss: losses.append(loss),
    )
    assert again.path == base.path and len(losses) == 250  # cached: no second training


def test_corpus_is_reproducible_and_apportioned():
    env = Arithmetic(max_operand=99, holdout=200, fixed_width=True, reverse_answer=True)
    from rollart_nb.envs import FrozenLake

    envs = {"math": env, "frozenlake": FrozenLake(random_maps=True, holdout=8)}
    a = corpus(envs, 400, seed=3, weights={"math": 3, "frozenlake": 1})
    assert a == corpus(envs, 400, seed=3, weights={"math": 3, "frozenlake": 1})
    assert a != corpus(envs, 400, seed=4, weights={"math": 3, "frozenlake": 1})
    assert sum(e.task == "math" for e in a) == 300
    with pytest.raises(ConfigError, match="weights"):
        corpus(envs, 4, weights={"math": -1})
    with pytest.raises(ConfigError, match="steps"):
        pretrain(tiny_qwen(seed=0), envs, steps=0)
