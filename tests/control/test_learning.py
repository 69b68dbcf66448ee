"""Real learning through the whole stack: Session.local() + Pipeline + HF generator + torch GRPO.

A tiny model with a format-only warm start (random directions, never the right one) learns
FrozenLake 4x4 in ``rollart`` mode. Seeded and bounded by steps, not by wall time; greedy
validation over every start cell is taken every few steps. Greedy success is still unstable
from one validation to the next (docs/learning.md, "One task at a time"), so the assertion is on the
best validation of the run, with a generous margin over the warm start, plus a rise of the
sampled training reward (the first 10 steps against the last 20: one step's 32 samples vary by
+-0.15 from step to step).
"""

import pytest

from rollart_nb.algo import GRPO
from rollart_nb.control.env_manager import RolloutConfig
from rollart_nb.envs import FrozenLake
from rollart_nb.models import tiny_qwen
from rollart_nb.models.warmstart import format_warm_start
from rollart_nb.workers.roles import HFGenerator, TorchTrainer

STEPS = 120
VALIDATE_EVERY = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    envs = {"frozenlake": FrozenLake()}
    base = tiny_qwen(task_vocab=envs["frozenlake"].vocab, seed=0, path=str(tmp_path_factory.mktemp("models") / "tiny"))
    return format_warm_start(base, envs, steps=60, seed=0, path=str(tmp_path_factory.mktemp("models") / "warm"))


def test_frozenlake_greedy_success_rises_well_above_the_warm_start(local_session, model):
    sess = local_session
    # Micro-batches bounded by padded tokens, as in the demo: 120 steps take ~140 s, 80 took ~175 s without.
    algo = GRPO(group_size=8, lr=2e-3, kl_coef=0.1, micro_batch_size=64, micro_batch_tokens=1024)
    gen = sess.cluster("learn_gen", HFGenerator, pool="H20", model=model, seed=0)
    train = sess.cluster("learn_train", TorchTrainer, pool="H800", model=model, algo=algo, seed=0)
    tasks = sess.tasks({"frozenlake": FrozenLake()}, envs_per_task=16)
    pipe = sess.pipeline(
        train,
        gen,
        tasks,
        algo=algo,
        batch_size=32,
        alpha=2,
        mode="rollart",
        name="learn",
        rollout=RolloutConfig(max_new_tokens=4, temperature=1.0),
        validate_every=VALIDATE_EVERY,
    )
    before = pipe.validate()["frozenlake"]
    reports = pipe.run(STEPS, progress=False)
    pipe.close()
    assert len(reports) == STEPS and reports[-1].version >= STEPS - 1
    curve = [r.validation["frozenlake"] for r in reports if r.validation]
    assert len(curve) == STEPS // VALIDATE_EVERY
    n_starts = len(FrozenLake().validation_seeds())
    # 11 start cells; the warm start's greedy policy repeats one direction (0-2 cells solved).
    # Learning first finds "bottom row: right, else down" (6 cells) and may lose it again; runs
    # so far peaked at 4-6 cells within 60 steps (the async pipeline's timing varies the path),
    # so the bar is two more cells than the warm start solves.
    assert max(curve) >= before + 2 / n_starts - 1e-9, (before, curve)
    # A clean-clone CI run at 80 steps rose by only 0.1 (first 5 steps against the last 10); a run at
    # 120 steps rose by 0.38 between these windows (first 10 against the last 20 steps).
    early = [r.reward["frozenlake"] for r in reports[:10]]
    late = [r.reward["frozenlake"] for r in reports[-20:]]
    assert sum(late) / len(late) > sum(early) / len(early) + 0.15, (early, late)
