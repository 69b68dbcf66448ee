"""The pipeline end to end with bucketed weight transports: object store and Mooncake."""

import shutil

import pytest

from rollart_nb.envs import FrozenLake
from rollart_nb.models import tiny_qwen
from rollart_nb.workers.roles import HFGenerator, TorchTrainer


def has_mooncake() -> bool:
    try:
        from rollart_nb.weights.mooncake_master import find_master_binary

        return find_master_binary() is not None and shutil.which("true") is not None
    except Exception:
        return False


@pytest.mark.parametrize("weights", ["object_store", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def test_pipeline_with_weight_transport(local_session, weights):
    if weights == "mooncake" and not has_mooncake():
        pytest.skip("mooncake extra not installed")
    sess = local_session
    model = tiny_qwen(seed=0)
    gen = sess.cluster("actor_gen", HFGenerator, pool="H20", replicas=2, model=model)
    train = sess.cluster("actor_train", TorchTrainer, pool="H800", model=model)
    tasks = sess.tasks({"fl": FrozenLake()}, envs_per_task=4)
    pipe = sess.pipeline(train, gen, tasks, batch_size=4, group_size=2, weights=weights, name=f"w_{weights}")
    reps = pipe.run(3, progress=False)
    # steps 1 and 2 applied trained weights pulled through the transport
    for r in reps[1:]:
        w = r.weights
        assert w["push_s"] > 0 and w["push_bytes"] > 1e6  # the tiny model is ~4 MB of float32
        assert w["pull_s"] > 0 and 0 <= w["exposed_pull_s"] and w["bytes"] >= 2 * w["push_bytes"]
    assert gen.version() == [pipe.version, pipe.version] == [2, 2]
    # both generators serve exactly the trainer's current weights
    import torch

    net = model.load_model()
    net.load_state_dict(train.state_dict())
    ids = pipe.trajectories(last=1)[0].turns[0].prompt_ids
    with torch.no_grad():
        t = torch.tensor([ids])
        want = torch.log_softmax(net(input_ids=t).logits[0, :-1].float(), -1).gather(-1, t[0, 1:, None])[:, 0]
    for got in gen.score_tokens(ids):
        assert torch.allclose(torch.tensor(got), want, atol=1e-5)
    pipe.close()
    sess.close_cluster("actor_gen")
    sess.close_cluster("actor_train")
