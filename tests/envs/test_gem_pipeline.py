"""A real GEM env (gem-llm's offline ``game:GuessTheNumber``) through Session.local() + Pipeline."""

import importlib.util
import math

import pytest

from rollart_nb.envs import GEMEnv
from rollart_nb.models import tiny_qwen
from rollart_nb.workers.roles import HFGenerator, TorchTrainer

# find_spec, not importorskip: importing gem here would run its logging.basicConfig in pytest
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gem") is None, reason="gem-llm not installed (pip install 'rollart_nb[gem]')"
)

ENV_ID = "game:GuessTheNumber-v0-easy"  # needs no download


def test_gem_env_trains_through_the_pipeline(local_session):
    sess = local_session
    model = tiny_qwen(seed=0)
    gen = sess.cluster("actor_gen", HFGenerator, pool="H20", model=model)
    train = sess.cluster("actor_train", TorchTrainer, pool="H800", model=model)
    tasks = sess.tasks({"guess": GEMEnv(ENV_ID)}, envs_per_task=4)
    pipe = sess.pipeline(train, gen, tasks, batch_size=4, group_size=2, mode="rollart", name="gem")
    reps = pipe.run(2, progress=False)
    assert [r.batch_size for r in reps] == [4, 4] and [r.version for r in reps] == [0, 1]
    assert all(set(r.reward) == {"guess"} and -0.1 <= r.reward["guess"] <= 1.0 for r in reps)

    done = pipe.trajectories(task="guess", status="completed", last=None)
    assert len(done) >= 8
    for traj in done:
        # the reward is GEM's own (no reward fn set: the default is the env's return)
        assert traj.turns and not math.isnan(traj.reward) and traj.reward == pytest.approx(traj.env_return)
        first = traj.turns[0].observation
        assert first.startswith("You are playing Guess The Number.") and first.endswith("Enter your next guess.")
        assert traj.info.get("terminated") or traj.info.get("truncated")
        # replaying the actions in a fresh GEM env with the same seed gives the recorded rewards
        env = GEMEnv(ENV_ID)
        obs, _ = env.reset(seed=traj.seed)
        assert obs == first
        for turn in traj.turns:
            assert turn.observation == obs
            obs, reward, terminated, truncated, _ = env.step(turn.action)
            assert reward == turn.env_reward
        assert terminated or truncated
    pipe.close()
    sess.close_cluster("actor_gen")
    sess.close_cluster("actor_train")
