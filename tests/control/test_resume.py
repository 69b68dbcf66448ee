"""Checkpoint -> new session -> resume: same version and optimizer state, generators serve it."""

import shutil
import warnings

import pytest
import torch

import rollart_nb as rn
from rollart_nb.algo import GRPO
from rollart_nb.envs import Arithmetic, FrozenLake
from rollart_nb.errors import ConfigError, StateError
from rollart_nb.models import from_pretrained, tiny_qwen
from rollart_nb.workers.roles import HFGenerator, SimGenerator, SimTrainer, TorchTrainer

POOLS = {"H800": 2, "H20": 1, "cpu": 2}


def build(sess, model):
    # A reward that differs between group members, so every step has a gradient (random-init
    # FrozenLake rewards are all 0: zero advantages would leave weights and Adam moments at 0).
    sess.reward("fl", lambda t: float(sum(t.turns[0].response_ids) % 7))
    train = sess.cluster("actor_train", TorchTrainer, pool="H800", model=model)
    gen = sess.cluster("actor_gen", HFGenerator, pool="H20", model=model)
    return train, gen, sess.tasks({"fl": FrozenLake()}, envs_per_task=4)


def logprobs(net, ids):
    with torch.no_grad():
        t = torch.tensor([ids])
        return torch.log_softmax(net(input_ids=t).logits[0, :-1].float(), -1).gather(-1, t[0, 1:, None])[:, 0]


def test_checkpoint_new_session_resume(tmp_path):
    model, algo = tiny_qwen(seed=0), GRPO(group_size=2)
    initial = model.load_model().state_dict()

    # -- the first session: train two steps in an overlapped mode, save, close ----------------------
    with rn.Session.local(POOLS, serverless=False) as sess:
        train, gen, tasks = build(sess, model)
        pipe = sess.pipeline(train, gen, tasks, algo=algo, batch_size=4, mode="rollart", name="run")
        assert [r.version for r in pipe.run(2, progress=False)] == [0, 1]
        path = pipe.save(tmp_path / "ckpt")  # waits for step 1's batch, still training behind rollout
        assert train.version() == 2 and pipe.version == 1
        saved_opt, saved_weights = train.optimizer_state(), train.state_dict()
        assert pipe.step().version == 2  # the pipeline goes on after a save
    assert sess.state == "closed"
    assert any(not torch.equal(saved_weights[k], initial[k]) for k in initial)  # training moved the weights

    # -- the second session: a fresh Ray, fresh workers built from the initial model -------------------
    with rn.Session.local(POOLS, serverless=False) as sess:
        train, gen, tasks = build(sess, model)
        assert train.version() == 0 and gen.version() == [0]

        with pytest.raises(StateError, match="does not exist"):
            sess.pipeline(train, gen, tasks, resume_from=tmp_path / "nothing", name="x")
        partial = tmp_path / "partial"
        shutil.copytree(path, partial)
        (partial / "pipeline.json").unlink()
        with pytest.raises(StateError, match=r"pipeline.json missing"):
            sess.pipeline(train, gen, tasks, resume_from=partial, name="x")
        broken = tmp_path / "broken"
        shutil.copytree(path, broken)
        (broken / "trainer" / "trainer.pt").unlink()
        with pytest.raises(StateError, match="trainer.pt"):
            sess.pipeline(train, gen, tasks, resume_from=broken, name="x")
        with pytest.raises(ConfigError, match=r"task 'fl' is in the checkpoint but not in tasks"):
            sess.pipeline(train, gen, sess.tasks({"lake": FrozenLake()}, envs_per_task=2), resume_from=path, name="x")
        bigger = sess.cluster("other_train", TorchTrainer, pool="H800", model=tiny_qwen(seed=0, size="m"))
        with pytest.raises(ConfigError, match=r"hidden_size: checkpoint \d+, this trainer \d+"):
            sess.pipeline(bigger, gen, tasks, resume_from=path, name="x")
        assert bigger.version() == 0 and train.version() == 0 and not sess.runtime.pipelines  # nothing changed
        sess.close_cluster("other_train")

        pipe = sess.pipeline(train, gen, tasks, algo=algo, batch_size=4, mode="sync", name="run", resume_from=path)
        # the saved version, served from the start
        assert pipe.version == train.version() == 2 and gen.version() == [2]
        # the trainer's optimizer state is the saved one, tensor for tensor
        opt = train.optimizer_state()
        assert opt["state"].keys() == saved_opt["state"].keys() and len(opt["state"]) > 0
        for k, st in saved_opt["state"].items():
            assert float(opt["state"][k]["step"]) == float(st["step"]) == 2.0
            assert torch.equal(opt["state"][k]["exp_avg"], st["exp_avg"])
            assert torch.equal(opt["state"][k]["exp_avg_sq"], st["exp_avg_sq"])
        now = train.state_dict()
        assert all(torch.equal(now[k], v) for k, v in saved_weights.items())
        # the generator serves exactly the checkpoint's weights (its model dir is servable as is)
        ids = model.load_tokenizer().encode("you are at start")
        net = from_pretrained(f"{path}/trainer/model").load_model()
        (got,) = gen.score_tokens(ids)
        assert torch.allclose(torch.tensor(got), logprobs(net, ids), atol=1e-5)

        rep = pipe.step()  # sync: trains on the batch generated at version 2 -> version 3
        assert rep.step == 2 and rep.version == 3  # step numbers go on from the saved count and gen.version() == [3]
        assert float(train.optimizer_state()["state"][0]["step"]) == 3.0
        versions = {t.version for tr in pipe.trajectories(status="completed", last=None) for t in tr.turns}
        assert 2 in versions and versions <= {2, 3}  # responses carry the resumed version, never 0
        assert pipe.resumed_from is not None and pipe.resumed_from.steps == 2


def test_sim_pipeline_saves_and_resumes(tmp_path):
    spec = rn.models.spec("qwen3-0.6b")
    with rn.Session.local(POOLS, serverless=False) as sess:
        gen = sess.cluster("actor_gen", SimGenerator, pool="H20", model=spec, time_scale=1e-4, mean_response_tokens=8)
        train = sess.cluster("actor_train", SimTrainer, pool="H800", model=spec, time_scale=1e-4)
        tasks = sess.tasks({"math": Arithmetic()}, envs_per_task=8)
        pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, mode="sync", name="a")
        pipe.run(2, progress=False)
        path = pipe.save(tmp_path / "sim")
        assert (tmp_path / "sim" / "trainer" / "sim_trainer.json").is_file()
        pipe.close()
        other = sess.cluster("other_train", SimTrainer, pool="H800", model=rn.models.spec("qwen3-8b"), time_scale=1e-4)
        with pytest.raises(ConfigError, match=r"of model 'qwen3-0.6b', this trainer models 'qwen3-8b'"):
            sess.pipeline(other, gen, tasks, resume_from=path, name="b")
        with pytest.raises(ConfigError, match="SimTrainBackend has no optimizer state"):
            other.optimizer_state()
        sess.close_cluster("other_train")
        fresh = sess.cluster("actor_train", SimTrainer, pool="H800", model=spec, time_scale=1e-4)  # version 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe = sess.pipeline(fresh, gen, tasks, batch_size=8, group_size=4, mode="sync", name="b", resume_from=path)
        assert not [w for w in caught if "different rewards" in str(w.message)]  # same (default) reward
        assert pipe.version == fresh.version() == 2 and gen.version() == [2]
        rep = pipe.step()
        assert (rep.step, rep.version) == (2, 3)
        pipe.close()
        sess.reward("math", lambda t: 1.0)
        with pytest.warns(UserWarning, match=r"different rewards for \['math'\]"):
            pipe = sess.pipeline(fresh, gen, tasks, batch_size=8, group_size=4, mode="sync", name="c", resume_from=path)
        assert pipe.version == 2 and pipe.step().reward["math"] == 1.0


def test_a_resumed_pipeline_has_the_saved_config(tmp_path):
    """pipe.save stores the pipeline's config; resume_from starts from it (group size included),
    and keywords given with resume_from change only what they name."""
    spec = rn.models.spec("qwen3-0.6b")
    with rn.Session.local(POOLS, serverless=False) as sess:
        gen = sess.cluster("actor_gen", SimGenerator, pool="H20", model=spec, time_scale=1e-4, mean_response_tokens=8)
        train = sess.cluster("actor_train", SimTrainer, pool="H800", model=spec, time_scale=1e-4)
        tasks = sess.tasks({"math": Arithmetic()}, envs_per_task=8)
        cfg = rn.PipelineConfig(
            batch_size=8, alpha=3, mode="sync", validate_every=7, rollout=rn.RolloutConfig(max_turns=2)
        )
        pipe = sess.pipeline(train, gen, tasks, group_size=4, config=cfg, health_every_s=2.5, name="a")
        saved = pipe.config
        assert saved == cfg.replace(health_every_s=2.5)
        pipe.run(1, progress=False)
        path = pipe.save(tmp_path / "ckpt")
        pipe.close()
        pipe = sess.pipeline(train, gen, tasks, resume_from=path, name="b")
        assert pipe.config == saved and pipe.cfg.group_size == 4
        assert pipe.step().step == 1
        pipe.close()
        pipe = sess.pipeline(train, gen, tasks, resume_from=path, alpha=0, name="c")
        assert pipe.config == saved.replace(alpha=0)
        pipe.close()
