"""GRPO config validation, group advantages and the clipped loss."""

import math
import types

import pytest
import torch

from rollart_nb.algo import GRPO, group_advantages, grpo_loss, loss_weights
from rollart_nb.errors import ConfigError


def test_defaults_and_frozen():
    algo = GRPO()
    assert (algo.group_size, algo.clip_eps, algo.loss_agg, algo.micro_batch_size) == (8, 0.2, "token-mean", 8)
    with pytest.raises(AttributeError):
        algo.lr = 1.0  # type: ignore[misc]
    assert GRPO(**algo.to_dict()) == algo


def test_validation_reports_every_problem_at_once():
    with pytest.raises(ConfigError) as e:
        GRPO(group_size=0, clip_eps=1.5, lr=-1, loss_agg="sum", micro_batch_size=0, kl_coef=math.nan)
    msg = str(e.value)
    assert len(e.value.problems) == 6 and "6 problems" in msg
    for field in ("group_size", "clip_eps", "lr", "loss_agg", "micro_batch_size", "kl_coef"):
        assert field in msg


def test_group_advantages_zero_mean_unit_std_per_group():
    rewards = [1.0, 0.0, 0.0, 0.0, 5.0, 7.0, 9.0, 3.0]
    groups = ["a", "a", "a", "a", "b", "b", "b", "b"]
    adv = group_advantages(rewards, groups)
    for g in ("a", "b"):
        sel = torch.tensor([x == g for x in groups])
        assert abs(float(adv[sel].mean())) < 1e-6
        assert float(adv[sel].std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)
    assert float(adv[0]) > 0 > float(adv[1]) and float(adv[6]) > float(adv[5])


def test_group_advantages_degenerate_groups():
    adv = group_advantages([1.0, 1.0, 1.0, 2.0], ["same", "same", "same", "alone"])
    assert torch.equal(adv, torch.zeros(4))  # equal rewards and singletons carry no signal
    centred = group_advantages([0.0, 2.0], ["g", "g"], scale_by_std=False)
    assert centred.tolist() == [-1.0, 1.0]
    with pytest.raises(ConfigError, match="finite"):
        group_advantages([math.nan, 1.0], ["g", "g"])
    with pytest.raises(ConfigError, match="group ids"):
        group_advantages([1.0, 2.0], ["g"])


def test_std_scaling_per_task():
    algo = GRPO(scale_by_std={"math": False})
    tasks = ["math", "math", "lake", "lake"]
    flags = algo.std_scaling(tasks)
    assert flags == [False, False, True, True]  # tasks the mapping leaves out scale
    adv = group_advantages([0.0, 4.0, 0.0, 4.0], ["m", "m", "l", "l"], scale_by_std=flags)
    assert adv.tolist() == pytest.approx([-2.0, 2.0, -1.0, 1.0], abs=1e-5)  # math centred only, lake / std
    assert GRPO(scale_by_std=False).std_scaling(tasks) == [False] * 4
    assert GRPO(scale_by_std={"math": False}).to_dict()["scale_by_std"] == {"math": False}
    frozen = GRPO(scale_by_std=types.MappingProxyType({"math": False}))
    assert GRPO(**frozen.to_dict()).std_scaling(tasks) == flags  # to_dict round-trips any mapping
    with pytest.raises(ConfigError, match="scale_by_std"):
        GRPO(scale_by_std={"math": "no"})
    with pytest.raises(ConfigError, match="flags"):
        group_advantages([1.0, 2.0], ["g", "g"], scale_by_std=[True])


def test_loss_weights_token_vs_seq_mean():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    tok = loss_weights(mask, "token-mean")
    assert torch.allclose(tok, mask / 4) and float(tok.sum()) == pytest.approx(1.0)
    seq = loss_weights(mask, "seq-mean")
    assert torch.allclose(seq[0, :3], torch.full((3,), 1 / 6)) and float(seq[1, 0]) == pytest.approx(0.5)
    # Two rows of one trajectory weigh as one sequence.
    joined = loss_weights(mask, "seq-mean", seq_index=[7, 7])
    assert torch.allclose(joined, mask / 4)


def test_task_token_mean_gives_each_task_its_share_of_trajectories():
    # Rows 0-1: one long "lake" trajectory split in two rows (6 tokens); row 2: another lake
    # trajectory (4 tokens); rows 3-4: two "math" trajectories (1 and 2 tokens); row 5: a math
    # trajectory with no trained token, which counts for nothing.
    mask = torch.zeros(6, 4)
    for row, n in enumerate([3, 3, 4, 1, 2, 0]):
        mask[row, :n] = 1.0
    tasks = ["lake", "lake", "lake", "math", "math", "math"]
    w = loss_weights(mask, "task-token-mean", seq_index=[0, 0, 1, 2, 3, 4], task_index=tasks)
    assert float(w.sum()) == pytest.approx(1.0)
    lake, math_ = float(w[:3].sum()), float(w[3:].sum())
    assert lake == pytest.approx(0.5) and math_ == pytest.approx(0.5)  # 2 trajectories each
    assert torch.allclose(w[:3][mask[:3] > 0], torch.full((10,), 0.05))  # token-mean within lake
    assert torch.allclose(w[3:5][mask[3:5] > 0], torch.full((3,), 0.5 / 3))
    # token-mean would give math 3 of 13 tokens' weight
    assert float(loss_weights(mask, "token-mean")[3:].sum()) == pytest.approx(3 / 13)
    # one task alone is plain token-mean
    alone = loss_weights(mask[:3], "task-token-mean", seq_index=[0, 0, 1], task_index=tasks[:3])
    assert torch.allclose(alone, loss_weights(mask[:3], "token-mean"))
    with pytest.raises(ConfigError, match="one task per row"):
        loss_weights(mask, "task-token-mean")
    assert GRPO(loss_agg="task-token-mean").loss_agg == "task-token-mean"


def test_on_policy_gradient_follows_advantage():
    new = torch.zeros(2, 3, requires_grad=True)
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, m = grpo_loss(new, old, torch.tensor([1.0, -1.0]), mask)
    loss.backward()
    assert m["ratio_mean"] == pytest.approx(1.0) and m["clip_frac"] == 0.0
    assert float(loss.detach()) == pytest.approx(-(2 - 3) / 5)
    # Minimising raises logprobs of positive-advantage tokens, lowers negative ones, ignores masked.
    assert (new.grad[0, :2] < 0).all() and (new.grad[1] > 0).all() and new.grad[0, 2] == 0


def test_clipping_stops_gradient_beyond_trust_region():
    old = torch.zeros(1, 2)
    new = torch.tensor([[math.log(1.5), math.log(0.5)]], requires_grad=True)
    adv = torch.tensor([1.0])
    loss, m = grpo_loss(new, old, adv, torch.ones(1, 2), clip_eps=0.2)
    loss.backward()
    assert new.grad[0, 0] == 0  # ratio 1.5 > 1.2 with A > 0: clipped, no push further
    assert new.grad[0, 1] < 0  # ratio 0.5 with A > 0: still pushed up
    assert m["clip_frac"] == pytest.approx(0.5)
    _, m_high = grpo_loss(new.detach(), old, adv, torch.ones(1, 2), clip_eps=0.2, clip_eps_high=0.6)
    assert m_high["clip_frac"] == 0.0


def test_kl_and_entropy_terms():
    new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.ones(1, 2)
    base, _ = grpo_loss(new, new.detach(), torch.zeros(1), mask)
    assert float(base.detach()) == 0.0
    loss, m = grpo_loss(new, new.detach(), torch.zeros(1), mask, ref_logprobs=new.detach() - 0.5, kl_coef=0.1)
    assert m["kl_ref"] > 0 and float(loss.detach()) == pytest.approx(0.1 * m["kl_ref"])
    ent = torch.tensor([[2.0, 4.0]])
    loss, m = grpo_loss(new, new.detach(), torch.zeros(1), mask, entropy=ent, entropy_coef=0.5)
    assert float(loss.detach()) == pytest.approx(-0.5 * 3.0) and m["entropy"] == pytest.approx(3.0)
    with pytest.raises(ConfigError, match="ref_logprobs"):
        grpo_loss(new, new.detach(), torch.zeros(1), mask, kl_coef=0.1)


def test_padding_with_garbage_logprobs_is_harmless():
    new = torch.tensor([[-1.0, 80.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -80.0]])
    loss, _ = grpo_loss(new, old, torch.ones(1), torch.tensor([[1.0, 0.0]]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()


def _metrics(sums, *, response_length=5.0):
    from rollart_nb.algo.grpo import step_metrics

    rewards = torch.tensor([1.0, 0.0])
    return step_metrics(
        sums,
        grad_norm=0.5,
        rewards=rewards,
        adv=rewards - 0.5,
        num_trajectories=2,
        num_rows=2,
        num_tokens=10,
        step_s=0.1,
        version=1,
        response_length=response_length,
    )


def test_step_metrics_names_the_kl_it_has_under_kl():
    from rollart_nb.algo.grpo import TRAIN_METRICS

    with_ref = _metrics({"loss": 0.1, "clip_frac": 0.0, "approx_kl_old": 0.02, "kl_ref": 0.3, "entropy": 2.0})
    assert with_ref["kl"] == 0.3 and set(TRAIN_METRICS) <= with_ref.keys()  # the reference's k3 when kept
    behaviour = _metrics({"loss": 0.1, "clip_frac": 0.0, "approx_kl_old": 0.02, "entropy": 2.0})
    assert behaviour["kl"] == 0.02 and behaviour["response_length"] == 5.0 and behaviour["grad_norm"] == 0.5
    nothing = _metrics({"loss": 0.0, "clip_frac": 0.0})
    assert math.isnan(nothing["kl"]) and math.isnan(nothing["entropy"])


def test_mean_response_length_counts_generated_tokens_of_every_turn():
    from rollart_nb.algo.grpo import mean_response_length

    def traj(*lengths):
        return types.SimpleNamespace(turns=[types.SimpleNamespace(response_ids=[0] * n) for n in lengths])

    assert mean_response_length([traj(3, 4), traj(1), traj()]) == pytest.approx(8 / 3)
    assert math.isnan(mean_response_length([]))


def test_metrics_per_task_add_up_across_micro_batches_and_match_each_tasks_subset():
    """grpo_loss with task_weights: per-task metrics over two micro-batches equal the metrics of
    each task's rows alone (full-batch token mean), and step_metrics names the per-task KL."""
    from rollart_nb.algo.grpo import per_task, step_metrics, task_weights

    torch.manual_seed(0)
    new, old, ref = torch.randn(4, 5), torch.randn(4, 5), torch.randn(4, 5)
    adv, mask = torch.tensor([1.0, -1.0, 0.5, -0.5]), (torch.rand(4, 5) > 0.3).float()
    tasks = ["a", "b", "a", "b"]
    by_task = task_weights(mask, tasks)
    w = loss_weights(mask)
    sums: dict = {}
    for sl in (slice(0, 2), slice(2, 4)):
        _, m = grpo_loss(
            new[sl],
            old[sl],
            adv[sl],
            mask[sl],
            weights=w[sl],
            ref_logprobs=ref[sl],
            kl_coef=0.1,
            entropy=torch.ones(2, 5),
            task_weights={t: v[sl] for t, v in by_task.items()},
        )
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + v
    out = step_metrics(
        sums,
        grad_norm=0.0,
        rewards=torch.zeros(4),
        adv=adv,
        num_trajectories=4,
        num_rows=4,
        num_tokens=1.0,
        step_s=0.0,
        version=1,
        task_response_length={"a": 3.0},
    )
    got = per_task(out)
    for task, rows in (("a", [0, 2]), ("b", [1, 3])):
        _, alone = grpo_loss(new[rows], old[rows], adv[rows], mask[rows], ref_logprobs=ref[rows], kl_coef=0.1)
        assert got[task]["kl"] == pytest.approx(alone["kl_ref"], rel=1e-5)
        assert got[task]["clip_frac"] == pytest.approx(alone["clip_frac"], rel=1e-5)
        assert got[task]["entropy"] == pytest.approx(1.0)
    assert got["a"]["response_length"] == 3.0 and "response_length" not in got["b"]
