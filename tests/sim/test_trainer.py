"""SimTrainBackend: modelled step time, versions, honest metrics."""

from __future__ import annotations

import math
import time

import pytest

from rollart_nb.errors import ConfigError
from rollart_nb.models.spec import spec
from rollart_nb.protocols import TrainBackend
from rollart_nb.resources.profiles import PROFILES
from rollart_nb.sim import SimTrainBackend, roofline, train_time
from rollart_nb.sim.trainer import trajectory_tokens
from rollart_nb.trajectory import Trajectory, Turn

Q8, H800 = spec("qwen3-8b"), PROFILES["H800"]


def traj(prompt_lens, response=10, reward=math.nan):
    t = Trajectory(task="math", reward=reward)
    t.turns = [Turn("o", prompt_ids=[5] * p, response_ids=[6] * response) for p in prompt_lens]
    return t


def test_implements_the_protocol():
    assert isinstance(SimTrainBackend(Q8, H800), TrainBackend)


def test_trajectory_tokens_counts_the_full_sequence_once():
    assert trajectory_tokens(traj([100, 130, 160])) == 170  # cumulative history: last prompt + response
    assert trajectory_tokens(traj([100, 20])) == 100 + 10 + 20 + 10  # non-cumulative: every turn
    assert trajectory_tokens(Trajectory(task="x")) == 0


def test_train_step_times_bumps_version_and_reports_honest_metrics():
    t = SimTrainBackend(Q8, H800, gpus=8, time_scale=1e-1)
    batch = [traj([1000, 1500], reward=1.0), traj([2000], reward=0.0), traj([500])]
    expected_tokens = 1510 + 2010 + 510
    modelled = train_time(Q8, H800, expected_tokens, gpus=8)  # ~0.63 s modelled
    t0 = time.perf_counter()
    m = t.train_step(batch)
    assert time.perf_counter() - t0 >= modelled * 0.1 * 0.9
    assert m["tokens"] == expected_tokens and m["trajectories"] == 3
    assert m["modelled_s"] == pytest.approx(modelled)
    assert m["reward_mean"] == pytest.approx(0.5)  # the unscored one is left out
    assert "loss" not in m  # it has none, so it reports none
    assert t.version == 1 and m["version"] == 1
    assert t.state_dict()["version"] == 1
    assert math.isnan(t.train_step([traj([10])])["reward_mean"])
    assert t.version == 2 and t.modelled_s == pytest.approx(modelled + train_time(Q8, H800, 20, 8))


def test_more_gpus_train_faster():
    one = SimTrainBackend(Q8, H800, gpus=1, time_scale=0).train_step([traj([4000])])["modelled_s"]
    many = SimTrainBackend(Q8, H800, gpus=32, time_scale=0).train_step([traj([4000])])["modelled_s"]
    # compute splits 32 ways; the 32 GPUs then all-reduce the gradients over the network
    assert one == pytest.approx(32 * (many - roofline.grad_sync_time(Q8, H800, 32)))


def test_config_errors():
    with pytest.raises(ConfigError) as e:
        SimTrainBackend(Q8, H800, gpus=0, time_scale=-1, mfu=0)
    assert len(e.value.problems) == 3


def test_with_algo_a_step_is_priced_on_padded_micro_batches_and_the_reference_pass():
    from rollart_nb.algo.grpo import GRPO
    from rollart_nb.sim.trainer import flops_factor, padded_tokens

    algo = GRPO(kl_coef=0.1, micro_batch_size=64, micro_batch_tokens=1024)
    # sorted lengths 12 x 24 then 40 x 8: at most 1024 padded tokens a micro-batch, so the first
    # holds the 24 short rows and 1 long one, padded to 40 (25 x 40); the other 7 long rows follow.
    lengths = [12] * 24 + [40] * 8
    assert padded_tokens(lengths, algo) == 25 * 40 + 7 * 40
    assert padded_tokens(lengths, GRPO(micro_batch_size=64, micro_batch_tokens=0)) == 32 * 40
    assert flops_factor(algo) == pytest.approx(8 / 6) and flops_factor(GRPO(kl_coef=0.0)) == 1.0

    batch = [traj([8], response=4) for _ in range(24)] + [traj([36], response=4) for _ in range(8)]
    packed = SimTrainBackend(Q8, H800, time_scale=0).train_step(batch)["modelled_s"]
    padded = SimTrainBackend(Q8, H800, time_scale=0, algo=algo, step_overhead_s=0.25).train_step(batch)
    assert padded["tokens"] == sum(lengths)  # the batch's own tokens are still reported
    assert packed == pytest.approx(train_time(Q8, H800, sum(lengths), 1))
    assert padded["modelled_s"] == pytest.approx(train_time(Q8, H800, (25 + 7) * 40 * 8 / 6, 1) + 0.25)
    assert padded["modelled_s"] > packed + 0.25  # padding and the reference pass cost time
    with pytest.raises(ConfigError, match="step_overhead_s"):
        SimTrainBackend(Q8, H800, step_overhead_s=-1)


def test_export_overhead_and_a_step_slowed_by_a_shared_core():
    import asyncio

    from rollart_nb.clock import SimClock
    from rollart_nb.clock.cores import Host, SharedCores
    from rollart_nb.resources.profiles import HardwareProfile

    cpu = HardwareProfile("CPU-TEST-TRAINER", "cpu", 1.0, 20.0, 64.0, 0.0, "general")
    small = spec("qwen3-0.6b")

    def run(host, other_work):
        clock = SimClock()
        clock.host = host

        async def scenario():
            loop = asyncio.get_running_loop()
            t = SimTrainBackend(small, cpu, time_scale=1, export_overhead_s=0.02)
            t0 = loop.time()
            state = await t.aexport()
            exported = loop.time() - t0
            busy = asyncio.ensure_future(host.compute(other_work))
            m = await t.atrain_step([traj([400])])
            await busy
            return exported, state["version"], m

        try:
            return clock.run(scenario(), timeout=30)
        finally:
            clock.close()

    exported, version, alone = run(Host(), 0.0)
    assert exported == pytest.approx(0.02) and version == 0
    assert alone["step_s"] == pytest.approx(alone["modelled_s"])
    _, _, shared = run(Host(SharedCores(1)), alone["modelled_s"] / 2)  # other work for half the step
    assert shared["modelled_s"] == pytest.approx(alone["modelled_s"])  # the same work ...
    assert shared["step_s"] == pytest.approx(1.5 * alone["modelled_s"])  # ... at half speed while shared
    with pytest.raises(ConfigError, match="export_overhead_s"):
        SimTrainBackend(small, cpu, export_overhead_s=-1)
