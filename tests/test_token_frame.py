"""The trajectory debugger's data: what the trainer computed per token, which policy version
wrote each token, the token frame and its files, and the sampler's entropy."""

import asyncio
import json
import math

import pandas as pd
import pytest
import torch

from rollart_nb.algo import GRPO
from rollart_nb.algo.provenance import MISMATCH_METRICS
from rollart_nb.backends import HFBackend, TorchTrainBackend
from rollart_nb.control.ledger import TrainRecords
from rollart_nb.errors import ConfigError
from rollart_nb.models import format_history, tiny_qwen
from rollart_nb.protocols import GenerationRequest
from rollart_nb.trajectory import Trajectory, TrajectoryList, Turn, VersionSegment
from rollart_nb.trajectory_frames import COLUMNS


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return tiny_qwen(seed=0, path=str(tmp_path_factory.mktemp("m") / "tiny"))


@pytest.fixture(scope="module")
def trained(ref):
    """Two trajectories of one group (rewards 1 and 0, so advantages +0.5 and -0.5 without std
    scaling) whose sampler logprobs are the trainer's own shifted by a known amount; the first's
    first turn was continued across a weight update (versions 3, then 4 from its third token)."""
    trainer = TorchTrainBackend(ref, GRPO(group_size=2, scale_by_std=False, lr=1e-3))
    tok = trainer.tokenizer
    p1 = tok.encode(format_history([("you are at start", None)]))
    r1 = tok.encode("left left down") + [tok.eos_token_id]
    p2 = p1 + r1 + tok.encode(" <|user|> ice <|assistant|>")
    r2 = tok.encode("up") + [tok.eos_token_id]
    trajs = []
    for i, (reward, shift) in enumerate(((1.0, 0.1), (0.0, 0.0))):
        t = Trajectory(task="lake", group_id="g", id=f"t{i}", reward=reward, start_version=3)
        for k, (p, r) in enumerate(((p1, r1), (p2, r2))):
            lp = [x + shift for x in trainer.logprobs(p, r)]
            t.turns.append(Turn("obs", "act", p, r, logprobs=lp, loss_mask=[1] * len(r), version=3 + (i == 0) * k))
        trajs.append(t)
    trajs[0].turns[0].spans = [(0, 3), (2, 4)]
    trajs[1].turns[1].logprobs[0] += 1.0  # one token the sampler found e times likelier: ratio 1/e
    expected = {t.id: [lp for u in t.turns for lp in trainer.logprobs(u.prompt_ids, u.response_ids)] for t in trajs}
    metrics = trainer.train_step(trajs)
    return trajs, metrics, expected, (r1, r2)


def test_versions_list_each_segment_and_the_oldest_counts(trained):
    (t, _), _, _, (r1, r2) = trained
    assert t.versions == [
        VersionSegment(0, 0, 2, 3),
        VersionSegment(0, 2, len(r1), 4),
        VersionSegment(1, 0, len(r2), 4),
    ]
    assert (t.min_version, t.max_version) == (3, 4)
    back = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.versions == t.versions and back.turns[0].spans == [(0, 3), (2, 4)]


def test_the_train_step_records_each_tokens_logprob_advantage_and_weight(trained):
    trajs, metrics, expected, _ = trained
    records = metrics["token_records"]
    assert [records[t.id]["advantage"] for t in trajs] == pytest.approx([0.5, -0.5])
    assert {r["version"] for r in records.values()} == {0}  # the policy before the update
    n_trained = sum(len(u.response_ids) for t in trajs for u in t.turns)
    weights = 0.0
    for t in trajs:
        (row,) = records[t.id]["rows"]
        resp = [i for i, m in enumerate(_mask(t)) if m]
        assert [row["logprob"][i] for i in resp] == pytest.approx(expected[t.id], abs=1e-4)
        assert math.isnan(row["logprob"][0]) and all(math.isfinite(row["entropy"][i]) for i in resp)
        weights += sum(row["loss_weight"])
    assert weights == pytest.approx(1.0) and n_trained == len(expected["t0"]) * 2


def test_the_mismatch_figures_are_the_k3_kl_and_the_share_outside_the_band(trained):
    trajs, metrics, expected, (r1, r2) = trained
    n = 2 * len(expected["t0"])
    k3 = lambda r: r - 1 - math.log(r)  # noqa: E731
    want_kl = (len(expected["t0"]) * k3(math.exp(-0.1)) + k3(math.exp(-1.0))) / n
    assert metrics["mismatch_kl"] == pytest.approx(want_kl, rel=1e-3)
    assert metrics["mismatch_ratio_out"] == pytest.approx(1 / n)  # only the token at 1/e
    cross = (len(r1) - 2) + len(r2)  # t0's tokens written by version 4, its oldest being 3
    assert metrics["cross_version_frac"] == pytest.approx(cross / n)
    for m in MISMATCH_METRICS:
        assert metrics[f"{m}/lake"] == pytest.approx(metrics[m])


def test_the_token_frame_shows_sampler_trainer_and_provenance_per_token(trained):
    trajs, metrics, _, (r1, r2) = trained
    store = TrainRecords()
    store.add(metrics["token_records"], step=7)
    tl = TrajectoryList([Trajectory.from_dict(t.to_dict()) for t in trajs])
    store.attach(tl)
    df = tl.token_frame()
    assert tuple(df.columns) == COLUMNS["token"] and len(df) == 2 * len(trajs[0].turns[1].prompt_ids + r2)
    t0 = df[df.trajectory_id == "t0"]
    resp, prompt = t0[t0.side == "response"], t0[t0.side == "prompt"]
    assert list(resp.version) == [3, 3] + [4] * (len(r1) - 2) + [4] * len(r2)
    assert list(resp.cross_version) == [v == 4 for v in resp.version] and not prompt.cross_version.any()
    assert set(prompt[prompt.turn == 0].version) == {3} and set(prompt[prompt.turn == 1].version) == {4}
    assert (resp.advantage == 0.5).all() and prompt.advantage.isna().all()
    assert resp.importance_ratio.to_numpy() == pytest.approx(math.exp(-0.1), rel=1e-3)
    assert (resp.trainer_logprob - resp.sampler_logprob).to_numpy() == pytest.approx(-0.1, abs=1e-4)
    assert prompt.loss_weight.eq(0).all() and prompt.trainer_entropy.isna().all()
    assert resp.loss_weight.sum() == pytest.approx(0.5) and resp.trainer_entropy.notna().all()
    assert tl[0].train["step"] == 7 and t0.replay_logprob.isna().all()
    untrained = Trajectory.from_dict(trajs[0].to_dict()).token_frame()
    assert untrained.trainer_logprob.isna().all() and untrained.advantage.isna().all()


def test_the_token_frame_writes_parquet_and_jsonl(trained, tmp_path):
    trajs, metrics, _, _ = trained
    tl = TrajectoryList([Trajectory.from_dict(t.to_dict()) for t in trajs])
    TrainRecords().attach(tl)
    want = tl.token_frame()
    pq = pd.read_parquet(tl.write_tokens(tmp_path / "tokens.parquet"))
    assert tuple(pq.columns) == COLUMNS["token"] and len(pq) == len(want)
    assert list(pq.version) == list(want.version) and pq.sampler_logprob.equals(want.sampler_logprob)
    first = json.loads(tl[0].write_tokens(tmp_path / "t.jsonl").read_text().splitlines()[0])
    assert set(first) == set(COLUMNS["token"]) and first["trajectory_id"] == "t0"
    with pytest.raises(ConfigError, match=r"\.parquet or \.jsonl"):
        tl.write_tokens(tmp_path / "tokens.csv")


def test_a_bounded_store_forgets_the_oldest_trajectories_first():
    store = TrainRecords(max_tokens=10)
    row = {"logprob": [0.0] * 4, "entropy": [0.0] * 4, "loss_weight": [0.0] * 4}
    for i in range(4):
        store.add({f"t{i}": {"version": 0, "advantage": 1.0, "rows": [row]}}, step=i)
    tl = [Trajectory("x", id=f"t{i}") for i in range(4)]
    store.attach(tl)
    assert [t.train is not None for t in tl] == [False, False, True, True] and store.tokens == 8


def test_the_hf_sampler_reports_each_tokens_entropy(ref):
    gen = HFBackend(ref, batch_wait_s=0.001)
    prompt = gen.tokenizer.encode(format_history([("say 3", None)]))
    res = asyncio.run(gen.generate(GenerationRequest("e", "say", prompt, max_new_tokens=6, seed=3)))
    assert len(res.entropy) == len(res.token_ids) > 0
    net = ref.load_model()
    ids = torch.tensor([prompt + res.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(net(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
    assert res.entropy == pytest.approx((-(logp.exp() * logp).sum(-1)).tolist(), abs=1e-4)


def _mask(t: Trajectory) -> list[int]:
    last = t.turns[-1]
    mask = [0] * (len(last.prompt_ids) + len(last.response_ids))
    for u in t.turns:
        mask[len(u.prompt_ids) : len(u.prompt_ids) + len(u.response_ids)] = [1] * len(u.response_ids)
    return mask


def test_a_pipeline_hands_out_what_its_train_steps_computed(local_session):
    """Sync mode on a real tiny model: the trainer scores exactly the weights that sampled, so the
    mismatch it reports is ~0, and every trained trajectory comes back with its record."""
    from rollart_nb.envs import Arithmetic
    from rollart_nb.workers.roles import HFGenerator, TorchTrainer

    sess = local_session
    model = tiny_qwen(seed=0)
    gen = sess.cluster("actor_gen", HFGenerator, pool="H20", model=model)
    train = sess.cluster("actor_train", TorchTrainer, pool="H800", model=model)
    tasks = sess.tasks({"math": Arithmetic()}, envs_per_task=4)
    algo = GRPO(group_size=2, skip_zero_advantage=False, regularize_all_rows=True)
    pipe = sess.pipeline(train, gen, tasks, algo=algo, batch_size=4, mode="sync", name="debug")
    reps = pipe.run(2, progress=False)
    for r in reps:
        assert 0 <= r.train["mismatch_kl"] < 1e-4 and r.train["mismatch_ratio_out"] == 0.0
        assert r.train["mismatch_kl/math"] == r.train["mismatch_kl"] and "mismatch_kl" in r.row()
    trained = [t for t in pipe.trajectories() if t.train is not None]
    assert len(trained) == 8 and {t.train["step"] for t in trained} == {0, 1}
    df = TrajectoryList(trained).token_frame()
    resp = df[df.loss_mask == 1]
    assert resp.trainer_logprob.notna().all() and resp.entropy.notna().all()
    assert (resp.trainer_logprob - resp.sampler_logprob).abs().max() < 1e-3
    pipe.close()
    sess.close_cluster("actor_gen")
    sess.close_cluster("actor_train")
