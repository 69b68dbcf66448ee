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
    """Stopped once a quarter of worked training sums come out right, the base solves held-out
    sums it never saw: a partly right base, not a memorised table."""
    from rollart_nb.models.pretraining import pretrain_record

    env = Arithmetic(max_operand=99, holdout=200, fixed_width=True, reverse_answer=True, balance_answers=False)
    init = tiny_qwen(task_vocab=env.vocab, seed=0, path=str(tmp_path / "init"))
    assert held_out_exact_match(init, env) == 0.0
    losses = []
    kw = {"steps": 400, "batch": 64, "stop_at": {"math": 0.25}, "path": str(tmp_path / "base")}
    base = pretrain(init, {"math": env}, progress=lambda step, loss: losses.append(loss), **kw)
    rec = pretrain_record(base)
    assert rec["stopped_at"] == len(losses) and sum(losses[-20:]) < sum(losses[:20]) / 2
    score = held_out_exact_match(base, env)
    assert 0.1 <= score < 0.9, score  # generalised to sums it never saw, and not done yet
    again = pretrain(init, {"math": env}, progress=lambda step, loss: losses.append(loss), **kw)
    assert again.path == base.path and len(losses) == rec["stopped_at"]  # cached: no second training


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


def test_micro_batches_by_length_give_the_steps_own_gradient(tmp_path):
    """One step on a batch that mixes short sums with long FrozenLake walks: split into
    length-sorted micro-batches (less padding), the step has the unsplit loss and weights."""

    from rollart_nb.envs import FrozenLake
    from rollart_nb.models.pretraining import supervised

    envs = {"math": Arithmetic(max_operand=99, fixed_width=True), "frozenlake": FrozenLake(random_maps=True)}
    examples = corpus(envs, 32, seed=1)
    init = tiny_qwen(
        task_vocab=sorted({*envs["math"].vocab, *envs["frozenlake"].vocab}), seed=0, path=str(tmp_path / "i")
    )
    kw = {"steps": 1, "batch": 32, "lr": 1e-3, "seed": 0, "name": "x", "max_grad_norm": 1.0}
    # 32 prompts of 10+ tokens each: 256 padded tokens a micro-batch makes at least two of them
    losses: list = []
    whole = (
        supervised(init, examples, out=tmp_path / "whole", progress=lambda _, loss: losses.append(loss), **kw)
        .load_model()
        .state_dict()
    )
    split = (
        supervised(
            init,
            examples,
            out=tmp_path / "split",
            micro_batch_tokens=256,
            progress=lambda _, loss: losses.append(loss),
            **kw,
        )
        .load_model()
        .state_dict()
    )
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)  # the parts' losses add up to the step's
    # Adam's first step is about lr * sign(grad): summation-order noise flips only the signs of
    # gradients that are nearly 0, so nearly every weight is the same
    changed = sum(int((whole[k] - split[k]).abs().gt(1e-6).sum()) for k in whole)
    assert changed <= 0.01 * sum(v.numel() for v in whole.values())
    losses = losses[1:]
    assert len(losses) == 1 and losses[0] > 0
    with pytest.raises(ConfigError, match="schedule"):
        supervised(init, examples, out=tmp_path / "bad", schedule="cosin", **kw)


def test_stop_at_ends_the_stage_once_training_problems_reach_the_accuracy(tmp_path):
    """Small sums are learned within a few dozen steps: stop_at stops there (at a check, every
    CHECK_EVERY steps), records where and what it measured, and a second call is the cached base."""
    from rollart_nb.models.pretraining import CHECK_EVERY, pretrain_record, training_accuracy

    env = Arithmetic(max_operand=4)
    init = tiny_qwen(task_vocab=env.vocab, seed=0, path=str(tmp_path / "init"))
    examples = corpus({"math": env}, 50, seed=5)
    assert training_accuracy(init.load_model(), init.load_tokenizer(), examples) == {"math": 0.0}
    steps: list = []
    base = pretrain(init, {"math": env}, steps=300, stop_at={"math": 0.6}, progress=lambda s, _: steps.append(s))
    rec = pretrain_record(base)
    assert rec["stopped_at"] == len(steps) < 300 and rec["stopped_at"] % CHECK_EVERY == 0
    assert rec["accuracy"]["math"] >= 0.6
    assert training_accuracy(base.load_model(), base.load_tokenizer(), examples)["math"] >= 0.4  # other draws
    assert pretrain(init, {"math": env}, steps=300, stop_at={"math": 0.6}).path == base.path
    with pytest.raises(ConfigError, match="stop_at"):
        pretrain(init, {"math": env}, steps=10, stop_at={"maths": 0.5})
    with pytest.raises(ConfigError, match="stop_at"):
        pretrain(init, {"math": env}, steps=10, stop_at={"math": 1.5})
