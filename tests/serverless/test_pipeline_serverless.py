"""Serverless rewards wired through the Session and Pipeline (Ray Serve on 127.0.0.1)."""

import pytest

from rollart_nb.envs import Arithmetic
from rollart_nb.models import spec
from rollart_nb.workers.roles import SimGenerator, SimTrainer


def quarter(traj):
    return 0.25


def three_quarters(traj):
    return 0.75


@pytest.mark.timeout(600)
def test_serverless_reward_and_hot_swap_through_the_pipeline(local_session):
    sess = local_session
    m = spec("qwen3-0.6b")
    gen = sess.cluster("actor_gen", SimGenerator, pool="H20", model=m, time_scale=1e-4, mean_response_tokens=4)
    train = sess.cluster("actor_train", SimTrainer, pool="H800", model=m, time_scale=1e-4)
    tasks = sess.tasks({"math": Arithmetic()}, envs_per_task=8)
    sess.reward("math", quarter, serverless=True, downscale_delay_s=5.0)
    ep = sess.runtime.serve_manager().endpoint("reward-math-v0")
    assert ep.url.startswith("http://127.0.0.1:")
    pipe = sess.pipeline(train, gen, tasks, batch_size=8, group_size=4, name="serverless")
    assert pipe.step().reward["math"] == 0.25
    version = pipe.swap_reward("math", three_quarters, serverless=True, downscale_delay_s=5.0)
    assert version == 1
    for _ in range(6):
        rep = pipe.step()
    assert rep.reward["math"] == 0.75
    scored = pipe.trajectories(task="math", status="completed", last=None)
    assert {t.reward_version for t in scored} == {0, 1}
    assert all((t.reward == 0.25) == (t.reward_version == 0) for t in scored)
    hist = pipe.reward_history()
    assert [h["version"] for h in hist] == [0, 1] and all(h["name"].startswith("endpoint:") for h in hist)
    pipe.close()
