"""TorchTrainBackend: multi-turn rows and masks, exact accumulation, checkpoints, and learning."""

import asyncio
import math

import pytest
import torch

from rollart_nb.algo import GRPO
from rollart_nb.algo.grpo import TASK_METRICS, TRAIN_METRICS, per_task
from rollart_nb.backends import HFBackend, TorchTrainBackend, torch_train
from rollart_nb.backends.torch_train import ReferencePolicy, build_rows, micro_batches
from rollart_nb.errors import ConfigError, StateError
from rollart_nb.models import format_history, tiny_qwen
from rollart_nb.protocols import GenerationRequest, TrainBackend
from rollart_nb.trajectory import Trajectory, Turn


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return tiny_qwen(seed=0, path=str(tmp_path_factory.mktemp("m") / "tiny"))


@pytest.fixture(scope="module")
def tok(ref):
    return ref.load_tokenizer()


def two_turn(tok, reward, group="g", resp=("left", "up"), consistent=True):
    """A FrozenLake-like trajectory whose second prompt extends the first turn."""
    p1 = tok.encode(format_history([("you are at start", None)]))
    r1 = tok.encode(resp[0]) + [tok.eos_token_id]
    p2 = p1 + r1 + tok.encode(" <|user|> ice <|assistant|>")
    if not consistent:  # e.g. a history window that dropped the first turn
        p2 = tok.encode(format_history([("ice", None)]))
    r2 = tok.encode(resp[1]) + [tok.eos_token_id]
    t = Trajectory(task="lake", group_id=group)
    t.turns = [
        Turn("you are at start", resp[0], p1, r1, loss_mask=[1] * len(r1)),
        Turn("ice", resp[1], p2, r2, loss_mask=[1] * len(r2)),
    ]
    t.reward = reward
    return t


def test_implements_protocol(ref):
    assert isinstance(TorchTrainBackend(ref, GRPO()), TrainBackend)


def test_multi_turn_becomes_one_row_masked_on_every_response(tok):
    t = two_turn(tok, 1.0)
    t.turns[1].loss_mask[-1] = 0  # e.g. a truncated tail the env asked not to train on
    t.turns[0].logprobs = [-0.5] * len(t.turns[0].response_ids)
    (row,) = build_rows(t, 3)
    p1, r1, p2, r2 = (
        t.turns[0].prompt_ids,
        t.turns[0].response_ids,
        t.turns[1].prompt_ids,
        t.turns[1].response_ids,
    )
    assert row.ids == p2 + r2 and row.traj == 3
    trained = [i for i, m in enumerate(row.mask) if m]
    span1 = list(range(len(p1), len(p1) + len(r1)))
    span2 = list(range(len(p2), len(p2) + len(r2) - 1))
    assert trained == span1 + span2
    assert [row.ids[i] for i in span1] == r1
    assert all(row.old_logprobs[i] == -0.5 for i in span1) and all(math.isnan(row.old_logprobs[i]) for i in span2)


def test_inconsistent_history_falls_back_to_rows_per_turn(tok):
    t = two_turn(tok, 1.0, consistent=False)
    rows = build_rows(t, 0)
    assert len(rows) == 2
    for row, turn in zip(rows, t.turns, strict=True):
        assert row.ids == turn.prompt_ids + turn.response_ids
        assert sum(row.mask) == len(turn.response_ids)


def test_one_row_and_per_turn_rows_train_identically(ref, tok):
    """Span positions are right iff the single multi-turn row gives the same loss as exact per-turn rows."""

    def step(consistent_rows):
        trainer = TorchTrainBackend(ref, GRPO(group_size=2), seed=0)
        batch = [two_turn(tok, 1.0, resp=("left", "up")), two_turn(tok, 0.0, resp=("down", "right"))]
        if not consistent_rows:
            # A leading untrained turn that is not on the final sequence's prefix forces the
            # exact per-turn path; the trained tokens and their contexts stay the same.
            for t in batch:
                assert len(build_rows(t)) == 1
                t.turns.insert(0, Turn("pad", "", [1], [2], loss_mask=[0]))
                assert len(build_rows(t)) == 3
        return trainer.train_step(batch)

    one, split = step(True), step(False)
    assert one["num_rows"] == 2 and split["num_rows"] == 6
    assert one["num_tokens"] == split["num_tokens"]
    assert one["loss"] == pytest.approx(split["loss"], abs=1e-6)
    assert one["grad_norm"] == pytest.approx(split["grad_norm"], rel=1e-4)


def test_micro_batches_bound_rows_and_padded_tokens():
    lengths = [3, 3, 4, 10, 10, 30, 50]
    assert micro_batches(lengths, 3) == [(0, 3), (3, 6), (6, 7)]
    parts = micro_batches(lengths, 8, max_tokens=20)
    assert parts == [(0, 3), (3, 5), (5, 6), (6, 7)]  # 4 x 10 > 20 ends the first; long rows alone
    assert all((hi - lo) * lengths[hi - 1] <= 20 or hi - lo == 1 for lo, hi in parts)
    assert [i for lo, hi in parts for i in range(lo, hi)] == list(range(len(lengths)))


@pytest.mark.parametrize("loss_agg", ["seq-mean", "task-token-mean"])
def test_micro_batching_accumulates_exactly(ref, tok, loss_agg):
    batch = [
        two_turn(tok, float(i % 3), group=f"g{i // 4}", resp=(w, "up"))
        for i, w in enumerate(["left", "right", "up", "down"] * 2)
    ]
    for t in batch[4:]:
        t.task = "other"  # two tasks: "task-token-mean" weighs each by its share of trajectories
    grads, metrics = [], []
    for mbs, tokens in ((1, 0), (3, 0), (16, 0), (16, 40)):  # 40 tokens: 1-2 rows per micro-batch
        trainer = TorchTrainBackend(
            ref, GRPO(group_size=4, micro_batch_size=mbs, micro_batch_tokens=tokens, loss_agg=loss_agg), seed=0
        )
        metrics.append(trainer.train_step(batch))
        grads.append([p.grad.clone() for p in trainer.model.parameters()])
    for m in metrics[1:]:
        assert m["loss"] == pytest.approx(metrics[0]["loss"], abs=1e-6)
    # Compare accumulated gradients: Adam's first step is ~lr * sign(g), which float noise in
    # near-zero gradients would flip, so parameters are the wrong thing to compare.
    for g in grads[1:]:
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(g, grads[0], strict=True))
    assert metrics[0]["version"] == 1.0 and metrics[0]["grad_norm"] > 0


def test_flat_groups_are_left_out_and_an_all_flat_batch_makes_no_step(ref, tok):
    spread = [two_turn(tok, 1.0, group="a", resp=("left", "up")), two_turn(tok, 0.0, group="a", resp=("down", "up"))]
    flat = [two_turn(tok, 1.0, group="b", resp=("right", "up")), two_turn(tok, 1.0, group="b", resp=("up", "up"))]
    mixed = TorchTrainBackend(ref, GRPO(group_size=2), seed=0).train_step(spread + flat)
    alone = TorchTrainBackend(ref, GRPO(group_size=2), seed=0).train_step(spread)
    assert mixed["num_rows"] == 4 and mixed["trained_rows"] == 2
    # the flat group carries no signal: the step is the one on the informative group alone
    assert mixed["loss"] == pytest.approx(alone["loss"], abs=1e-7)
    assert mixed["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-5)
    kept = TorchTrainBackend(ref, GRPO(group_size=2, skip_zero_advantage=False), seed=0).train_step(spread + flat)
    assert kept["trained_rows"] == 4 and kept["num_tokens"] == 2 * mixed["num_tokens"]
    # A KL term acts on flat rows too, so they are trained, unless regularize_all_rows is off.
    kl = TorchTrainBackend(ref, GRPO(group_size=2, kl_coef=0.1), seed=0).train_step(spread + flat)
    kl_signal = TorchTrainBackend(ref, GRPO(group_size=2, kl_coef=0.1, regularize_all_rows=False), seed=0).train_step(
        spread + flat
    )
    assert kl["trained_rows"] == 4 and kl_signal["trained_rows"] == 2

    trainer = TorchTrainBackend(ref, GRPO(group_size=2), seed=0)
    trainer.train_step(spread)  # Adam now has momentum
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    m = trainer.train_step(flat)
    assert m["trained_rows"] == 0 and m["grad_norm"] == 0.0 and trainer.version == 2
    assert math.isnan(m["kl"]) and math.isnan(m["entropy"])  # nothing trained: nothing measured
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # momentum did not move the weights


def test_state_dict_is_a_detached_cpu_copy(ref):
    trainer = TorchTrainBackend(ref, GRPO())
    state = trainer.state_dict()
    assert all(v.device.type == "cpu" and not v.requires_grad for v in state.values())
    state["model.norm.weight"].add_(1.0)
    assert not torch.equal(state["model.norm.weight"], trainer.model.state_dict()["model.norm.weight"])


def test_checkpoint_round_trip_gives_same_next_step(ref, tok, tmp_path):
    algo = GRPO(group_size=2, kl_coef=0.05)
    batch = [two_turn(tok, 1.0), two_turn(tok, 0.0, resp=("down", "right"))]
    a = TorchTrainBackend(ref, algo, seed=0)
    a.train_step(batch)
    a.train_step(batch)
    a.save_checkpoint(tmp_path / "ckpt")
    b = TorchTrainBackend(ref, algo, seed=1)
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.version == a.version == 2
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)
    # The checkpoint's model dir is servable as is, and serves the saved weights.
    served = HFBackend(str(tmp_path / "ckpt" / "model"))
    prompt = tok.encode(format_history([("say 3", None)]))
    assert served.recompute(prompt) == pytest.approx(b.logprobs(prompt[:1], prompt[1:]), abs=1e-5)
    ma, mb = a.train_step(batch), b.train_step(batch)
    assert ma["loss"] == mb["loss"] and ma["kl_ref"] == mb["kl_ref"] > 0 and mb["version"] == 3
    with pytest.raises(StateError, match="trainer.pt"):
        b.load_checkpoint(tmp_path / "nothing")


def test_bad_batches_raise(ref, tok):
    trainer = TorchTrainBackend(ref, GRPO())
    with pytest.raises(ConfigError, match="empty"):
        trainer.train_step([])
    with pytest.raises(ConfigError, match="finite reward"):
        trainer.train_step([two_turn(tok, math.nan)])
    t = two_turn(tok, 1.0)
    for turn in t.turns:
        turn.loss_mask = [0] * len(turn.response_ids)
    with pytest.raises(ConfigError, match="no trainable tokens"):
        trainer.train_step([t])
    assert trainer.version == 0


def test_grpo_learns_to_say_3(ref):
    """Real RL on CPU: sample with HFBackend, score, train, publish weights, repeat."""
    trainer = TorchTrainBackend(ref, GRPO(group_size=8, lr=1e-3, micro_batch_size=64), seed=0)
    gen = HFBackend(ref, batch_wait_s=0.001, max_batch_size=64)
    prompt = gen.tokenizer.encode(format_history([("say 3", None)]))
    three = gen.tokenizer.convert_tokens_to_ids("3")

    async def rollouts(step):
        reqs = [
            GenerationRequest(f"{step}-{i}", "say", prompt, max_new_tokens=2, seed=1000 * step + i) for i in range(64)
        ]
        return await asyncio.gather(*[gen.generate(r) for r in reqs])

    curve, ratios = [], []
    for step in range(20):
        batch = []
        for i, r in enumerate(asyncio.run(rollouts(step))):
            assert r.version == trainer.version
            t = Trajectory(task="say", group_id=f"{step}-{i // 8}")
            t.turns.append(Turn("say 3", r.text, prompt, r.token_ids, r.logprobs, [1] * len(r.token_ids), r.version))
            t.reward = 1.0 if r.token_ids[:1] == [three] else 0.0
            batch.append(t)
        m = trainer.train_step(batch)
        gen.load_weights(trainer.state_dict(), trainer.version)
        curve.append(m["reward_mean"])
        ratios.append(m["ratio_mean"])
    # "3" is one token of ~240: almost never sampled at first, most of the time by the end.
    first, last = sum(curve[:4]) / 4, sum(curve[-8:]) / 8
    assert first < 0.05 and last > first + 0.3, curve
    assert max(abs(r - 1.0) for r in ratios) < 1e-3  # on-policy: generator and trainer agree


def test_algo_changes_reach_the_optimizer_and_a_checkpoint_restores_them(ref, tok, tmp_path):
    """configure()/algo= sets lr and weight decay on the optimizer and keeps a KL reference when KL
    is turned on; a checkpoint brings back the algo and the reference it trained with, even into a
    trainer built with other settings and no KL."""
    batch = [two_turn(tok, 1.0), two_turn(tok, 0.0, resp=("down", "right"))]
    a = TorchTrainBackend(ref, GRPO(group_size=2, lr=1e-3), seed=0)
    assert a.reference is None
    a.algo = GRPO(group_size=2, lr=5e-4, weight_decay=0.01, kl_coef=0.1)
    assert [(g["lr"], g["weight_decay"]) for g in a.optimizer.param_groups] == [(5e-4, 0.01)]
    assert a.reference is not None
    a.train_step(batch)
    assert a.train_step(batch)["kl_ref"] > 0  # the policy moved away from the reference
    a.save_checkpoint(tmp_path / "ckpt")
    b = TorchTrainBackend(ref, GRPO(group_size=2, lr=1e-2), seed=1)
    b.load_checkpoint(tmp_path / "ckpt")
    assert b.algo == a.algo and b.optimizer.param_groups[0]["lr"] == 5e-4
    ra, rb = a.reference.state_dict(), b.reference.state_dict()
    assert all(torch.equal(ra[k], rb[k]) for k in ra)
    assert b.train_step(batch)["loss"] == a.train_step(batch)["loss"]


def test_epochs_are_repeated_steps_on_one_batch_with_one_reference_pass(ref, tok):
    batch = [
        two_turn(tok, float(i % 2), group=f"g{i // 2}", resp=(w, "up"))
        for i, w in enumerate(["left", "right", "up", "down"])
    ]
    two = TorchTrainBackend(ref, GRPO(group_size=2, kl_coef=0.1, epochs=2), seed=0)
    ref_passes = []
    two.reference.register_forward_hook(lambda *_: ref_passes.append(1))
    m = two.train_step(batch)
    assert m["epochs"] == 2.0 and two.version == 1  # one published version per batch
    assert len(ref_passes) == 1  # the reference logprobs are reused by the second epoch
    one = TorchTrainBackend(ref, GRPO(group_size=2, kl_coef=0.1), seed=0)
    one.train_step(batch)
    after_one = {k: v.clone() for k, v in one.model.state_dict().items()}
    one.train_step(batch)
    s1, s2 = one.model.state_dict(), two.model.state_dict()
    assert all(torch.allclose(s1[k], s2[k], atol=1e-6) for k in s1)  # = two steps on the same batch
    assert not all(torch.allclose(after_one[k], s2[k], atol=1e-6) for k in s1)  # not one step
    with pytest.raises(ConfigError, match="epochs"):
        GRPO(epochs=0)


def _kl_batch(tok):
    batch = [two_turn(tok, float(i % 2), group=f"g{i // 2}", resp=(w, "up")) for i, w in enumerate(["left", "right"])]
    batch += [
        two_turn(tok, float(i % 2), group=f"h{i // 2}", resp=(w, "down"), consistent=False)
        for i, w in enumerate(["up", "down"])
    ]  # one row per turn
    return batch


def _second_step(ref, tok, scorer=None, clear=None):
    """Two KL steps; the second batch scored by ``scorer`` (the model has moved off the reference
    by then, so the KL term has a gradient). Returns metrics, gradients, reference passes."""
    trainer = TorchTrainBackend(ref, GRPO(group_size=2, kl_coef=0.5), seed=0)
    trainer.train_step(_kl_batch(tok))
    batch = _kl_batch(tok)
    if scorer is not None:
        scorer.score(batch)
    if clear is not None:
        batch[clear[0]].turns[clear[1]].ref_logprobs = []
    passes = []
    trainer.reference.register_forward_hook(lambda *_: passes.append(1))
    m = trainer.train_step(batch)
    return m, [p.grad.clone() for p in trainer.model.parameters()], len(passes)


def test_reference_policy_scores_every_turn_like_the_trainers_reference(ref, tok):
    batch = _kl_batch(tok)
    ReferencePolicy(ref).score(batch)
    probe = TorchTrainBackend(ref, GRPO(kl_coef=0.1), seed=0)  # untrained: its policy is the reference
    for t in batch:
        for turn in t.turns:
            assert len(turn.ref_logprobs) == len(turn.response_ids)
            want = probe.logprobs(turn.prompt_ids, turn.response_ids)
            assert turn.ref_logprobs == pytest.approx(want, abs=1e-5)
    back = Trajectory.from_dict(batch[0].to_dict())
    assert back.turns[1].ref_logprobs == batch[0].turns[1].ref_logprobs


def test_given_reference_logprobs_replace_the_trainers_reference_pass(ref, tok):
    base, base_grads, base_passes = _second_step(ref, tok)
    given, given_grads, given_passes = _second_step(ref, tok, ReferencePolicy(ref, micro_batch_tokens=16))
    assert base_passes >= 1 and given_passes == 0
    assert given["loss"] == pytest.approx(base["loss"], abs=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(given_grads, base_grads, strict=True))
    # a micro-batch with one unscored turn falls back to the trainer's own pass, same step
    part, part_grads, part_passes = _second_step(ref, tok, ReferencePolicy(ref), clear=(2, 0))
    assert part_passes >= 1 and part["loss"] == pytest.approx(base["loss"], abs=1e-6)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(part_grads, base_grads, strict=True))


def test_reference_logprobs_from_other_weights_change_the_kl_term(ref, tok, tmp_path):
    other = tiny_qwen(seed=1, path=str(tmp_path / "other"))
    base, _, _ = _second_step(ref, tok)
    wrong, _, passes = _second_step(ref, tok, ReferencePolicy(other))
    assert passes == 0 and wrong["loss"] != pytest.approx(base["loss"], abs=1e-4)


def _direct(model, batch):
    """Per trained token, straight from the logits of an unpadded forward pass: (logprob, entropy)."""
    lps, ents = [], []
    with torch.no_grad():
        for i, t in enumerate(batch):
            for row in build_rows(t, i):
                ids = torch.tensor([row.ids])
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                at = torch.tensor(row.mask[1:]) > 0
                lps.append(logp.gather(-1, ids[0, 1:, None])[:, 0][at])
                ents.append(-(logp.exp() * logp).sum(-1)[at])
    return torch.cat(lps), torch.cat(ents)


def test_training_metrics_match_direct_computations(ref, tok):
    """loss, kl, entropy, grad_norm, clip_frac and response_length on a tiny batch, against the logits."""
    batch = [two_turn(tok, 1.0, resp=("left", "up")), two_turn(tok, 0.0, resp=("down", "right"))]
    for t in batch:  # a stale behaviour policy on the first turn: ratios far above 1 + eps there
        t.turns[0].logprobs = [-20.0] * len(t.turns[0].response_ids)
    trainer = TorchTrainBackend(ref, GRPO(group_size=2), seed=0)
    new, entropy = _direct(trainer.model, batch)
    m = trainer.train_step(batch)
    assert set(TRAIN_METRICS) <= m.keys() and all(math.isfinite(m[k]) for k in TRAIN_METRICS)
    assert m["entropy"] == pytest.approx(float(entropy.mean()), rel=1e-5)  # token mean over trained tokens
    # clipped: the positive-advantage trajectory's first-turn tokens (ratio > 1.2 with A > 0) only
    n0 = len(batch[0].turns[0].response_ids)
    assert 0 <= m["clip_frac"] <= 1 and m["clip_frac"] == pytest.approx(n0 / new.numel())
    stale = torch.cat(
        [torch.tensor([1.0] * len(t.turns[0].response_ids) + [0.0] * len(t.turns[1].response_ids)) for t in batch]
    )
    old = torch.where(stale > 0, torch.full_like(new, -20.0), new)  # turns without logprobs: on policy
    assert m["kl"] == m["approx_kl_old"] == pytest.approx(float((old - new).mean()), rel=1e-5)
    assert m["response_length"] == sum(len(u.response_ids) for t in batch for u in t.turns) / 2
    assert m["grad_norm"] > 0 and math.isfinite(m["loss"])


def test_kl_metric_is_the_k3_estimate_to_the_reference(ref, tok):
    batch = [two_turn(tok, 1.0, resp=("left", "up")), two_turn(tok, 0.0, resp=("down", "right"))]
    trainer = TorchTrainBackend(ref, GRPO(group_size=2, kl_coef=0.1, lr=1e-2), seed=0)
    assert trainer.train_step(batch)["kl"] == 0.0  # the policy is still the reference
    new, _ = _direct(trainer.model, batch)
    old_ref, _ = _direct(trainer.reference, batch)
    m = trainer.train_step(batch)
    d = old_ref - new
    assert m["kl"] == m["kl_ref"] == pytest.approx(float((d.exp() - d - 1).mean()), rel=1e-4) and m["kl"] > 0


def test_metrics_per_task_are_each_tasks_own_token_means(ref, tok):
    """Two tasks in one batch: entropy, KL and clip fraction per task are the token means over
    that task's trained tokens alone (checked against the logits); response length per task is
    its trajectories' mean; the batch-wide numbers lie between the tasks' own."""
    lake = [two_turn(tok, 1.0, resp=("left", "up")), two_turn(tok, 0.0, resp=("down", "right"))]
    maze = [two_turn(tok, 1.0, group="m", resp=("up", "up")), two_turn(tok, 0.0, group="m", resp=("right", "left"))]
    for t in maze:
        t.task = "maze"
    for t in lake:  # a stale behaviour policy on lake's first turns only: clipped there, not in maze
        t.turns[0].logprobs = [-20.0] * len(t.turns[0].response_ids)
    tasks = {"lake": lake, "maze": maze}
    trainer = TorchTrainBackend(ref, GRPO(group_size=2, kl_coef=0.1, lr=1e-2), seed=0)
    trainer.train_step(lake + maze)  # moves the policy off the reference: KL > 0 next step
    direct = {task: (_direct(trainer.model, ts), _direct(trainer.reference, ts)[0]) for task, ts in tasks.items()}
    m = trainer.train_step(lake + maze)
    got = per_task(m)
    assert set(got) == {"lake", "maze"} and all(set(v) == set(TASK_METRICS) for v in got.values())
    for task, trajs in tasks.items():
        (new, entropy), ref_lp = direct[task]
        assert got[task]["entropy"] == pytest.approx(float(entropy.mean()), rel=1e-4)
        d = ref_lp - new
        assert got[task]["kl"] == pytest.approx(float((d.exp() - d - 1).mean()), rel=1e-3)
        assert got[task]["response_length"] == sum(len(u.response_ids) for t in trajs for u in t.turns) / 2
    assert got["maze"]["clip_frac"] == 0.0 < got["lake"]["clip_frac"]
    lo, hi = sorted(v["entropy"] for v in got.values())
    assert lo <= m["entropy"] <= hi
    assert not any(k.startswith(("kl_ref/", "approx_kl_old/")) for k in m)  # one KL name per task


def test_measuring_entropy_leaves_the_update_unchanged(ref, tok, monkeypatch):
    """With entropy_coef=0 the entropy is a metric: weights after the step equal those of a step
    whose entropy measurement is switched off, bit for bit."""
    batch = [two_turn(tok, 1.0, resp=("left", "up")), two_turn(tok, 0.0, resp=("down", "right"))]
    measured = TorchTrainBackend(ref, GRPO(group_size=2), seed=0)
    m = measured.train_step(batch)
    monkeypatch.setattr(torch_train, "_entropy_at", lambda logp, mask: torch.zeros(logp.shape[:2]))
    unmeasured = TorchTrainBackend(ref, GRPO(group_size=2), seed=0)
    u = unmeasured.train_step(batch)
    assert m["entropy"] > 0 and u["entropy"] == 0.0
    assert m["loss"] == u["loss"] and m["grad_norm"] == u["grad_norm"]
    a, b = measured.model.state_dict(), unmeasured.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the bonus path (entropy_coef > 0) reports the same number, differentiably
    bonus = TorchTrainBackend(ref, GRPO(group_size=2, entropy_coef=0.01), seed=0).train_step(batch)
    assert bonus["entropy"] == pytest.approx(m["entropy"], rel=1e-6)


def test_tis_weights_stale_tokens_and_is_a_no_op_when_sampler_and_trainer_agree(ref, tok):
    """The correct staleness policy's truncated importance sampling in a real step: with the
    sampler's logprobs equal to the trainer's, every weight is 1 and the step equals tis="off";
    with a sampler far less likely than the trainer, weights hit the cap and stale tokens count."""
    probe = TorchTrainBackend(ref, GRPO(group_size=2), seed=0)

    def batch(shift):
        out = [two_turn(tok, 1.0, resp=("left", "up")), two_turn(tok, 0.0, resp=("down", "right"))]
        for t in out:
            for turn in t.turns:
                lp = probe.logprobs(list(turn.prompt_ids), list(turn.response_ids))
                turn.logprobs, turn.version = [x - shift for x in lp], 0
        return out

    off = TorchTrainBackend(ref, GRPO(group_size=2), seed=0).train_step(batch(0.0))
    on = TorchTrainBackend(ref, GRPO(group_size=2, tis="token"), seed=0)
    on.version = 1  # the tokens are one version old
    same = on.train_step(batch(0.0))
    assert same["loss"] == pytest.approx(off["loss"], abs=1e-5)
    assert same["tis_clip_frac"] == 0.0 and same["tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert same["corrected_frac"] == pytest.approx(1.0) and same["corrected_frac/lake"] == pytest.approx(1.0)
    capped = TorchTrainBackend(ref, GRPO(group_size=2, tis="sequence", tis_cap=1.5), seed=0).train_step(batch(1.0))
    assert capped["tis_clip_frac"] == pytest.approx(1.0) and capped["tis_weight_mean"] == pytest.approx(1.5)
    assert capped["corrected_frac"] == 0.0  # the trainer is at version 0 too: nothing older than it


def test_tis_ppo_ratio_of_later_epochs_is_against_the_policy_before_the_update(ref, tok):
    """With ``tis`` on, every epoch's PPO ratio is taken against the trainer's logprobs from
    before the update (kept per micro-batch), not the epoch's own: the second epoch sees the
    first's update as a ratio away from 1; a single epoch's ratio is 1."""
    algo = GRPO(group_size=2, tis="token", epochs=2, lr=1e-2, micro_batch_size=1)

    def batch():
        return [two_turn(tok, 1.0, resp=("left", "up")), two_turn(tok, 0.0, resp=("down", "right"))]

    m = TorchTrainBackend(ref, algo, seed=0).train_step(batch())
    assert abs(m["approx_kl_old"]) > 1e-6 and m["epochs"] == 2.0  # the last epoch moved away from the kept reference
    one = TorchTrainBackend(ref, GRPO(group_size=2, tis="token", epochs=1, lr=1e-2, micro_batch_size=1), seed=0)
    assert one.train_step(batch())["approx_kl_old"] == pytest.approx(0.0, abs=1e-9)  # one epoch: ratio 1
