"""Autosave, atomic checkpoints with a manifest, damaged files named, resume after a killed driver."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import rollart_nb as rn
from rollart_nb.algo import GRPO
from rollart_nb.control.checkpoint import latest_checkpoint, read_checkpoint, run_checkpoints
from rollart_nb.envs import FrozenLake
from rollart_nb.errors import CheckpointError, ConfigError
from rollart_nb.models import tiny_qwen
from rollart_nb.workers.roles import HFGenerator, TorchTrainer

POOLS = {"H800": 2, "H20": 1, "cpu": 2}

# The driver that gets killed: three sync steps with an autosave every two, its trainer state
# after step 2 dumped for comparison, then SIGKILL from inside (no cleanup of any kind runs).
DRIVER = """
import os, signal, torch, rollart_nb as rn
from rollart_nb.envs import FrozenLake
from rollart_nb.models import tiny_qwen
from rollart_nb.workers.roles import HFGenerator, TorchTrainer
model = tiny_qwen(seed=0)
sess = rn.Session.local({pools!r}, serverless=False)
sess.reward("fl", lambda t: float(sum(t.turns[0].response_ids) % 7))
train = sess.cluster("actor_train", TorchTrainer, pool="H800", model=model)
gen = sess.cluster("actor_gen", HFGenerator, pool="H20", model=model)
tasks = sess.tasks({{"fl": FrozenLake()}}, envs_per_task=4)
pipe = sess.pipeline(train, gen, tasks, algo=rn.GRPO(group_size=2), batch_size=4, mode="sync", name="run",
                     run_dir={run_dir!r}, autosave_every=2)
pipe.run(2, progress=False)
torch.save({{"weights": train.state_dict(), "optimizer": train.optimizer_state(), "version": train.version()}},
           {dump!r})
pipe.step()
print("KILLING", os.getpid(), sess.token_path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def build(sess, model):
    sess.reward("fl", lambda t: float(sum(t.turns[0].response_ids) % 7))
    train = sess.cluster("actor_train", TorchTrainer, pool="H800", model=model)
    gen = sess.cluster("actor_gen", HFGenerator, pool="H20", model=model)
    return train, gen, sess.tasks({"fl": FrozenLake()}, envs_per_task=4)


def same_tensors(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A run folder left behind by a driver killed with SIGKILL after its step-2 autosave."""
    tmp = tmp_path_factory.mktemp("killed")
    run_dir, dump = tmp / "run", tmp / "state_at_step2.pt"
    code = textwrap.dedent(DRIVER).format(pools=POOLS, run_dir=str(run_dir), dump=str(dump))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == -signal.SIGKILL and "KILLING" in out.stdout, out.stderr[-3000:]
    pid, token = out.stdout.split("KILLING")[1].split()
    time.sleep(1.0)
    # Ray's agents outlive a SIGKILLed driver: they are what a new session must clean up
    assert _holding(token), "expected the killed driver's Ray agents to be left running"
    return run_dir, dump, int(pid), token


def _holding(token: str) -> list[int]:
    """Processes whose environment names ``token`` as their Ray auth token."""
    entry = f"RAY_AUTH_TOKEN_PATH={token}".encode()
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                if entry in f.read().split(b"\0"):
                    out.append(int(p))
        except OSError:
            pass
    return out


@pytest.fixture(scope="module")
def sess(killed_run):
    with rn.Session.local(POOLS, serverless=False) as s:  # starts cleanly after the killed driver
        yield s


def test_a_new_session_cleans_up_what_a_killed_driver_left_and_says_so(killed_run, sess):
    _, _, pid, token = killed_run
    mine = [c for c in sess.cleaned if c["driver_pid"] == pid]
    assert len(mine) == 1 and mine[0]["token_dir"] == os.path.dirname(token)
    assert mine[0]["processes"] and all(n.startswith("ray::") or "ray" in n.lower() for n in mine[0]["processes"])
    assert not _holding(token) and not os.path.exists(token)  # the processes are gone, and so is the token
    assert sess.state == "attached"


def test_a_killed_driver_resumes_with_identical_weights_and_optimizer(killed_run, sess):
    run_dir, dump, _, _ = killed_run
    lines = (run_dir / "steps.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [0, 1, 2]  # every finished step was on disk
    assert [p.name for p in run_checkpoints(run_dir)] == ["step-000002"]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]  # no half checkpoint
    saved = torch.load(dump, weights_only=False)

    train, gen, tasks = build(sess, tiny_qwen(seed=0))
    assert train.version() == 0
    pipe = sess.pipeline(
        train, gen, tasks, algo=GRPO(group_size=2), batch_size=4, mode="sync", name="run", resume_from=run_dir
    )
    assert pipe.resumed_from.steps == 2 and pipe.version == train.version() == saved["version"]
    assert same_tensors(train.state_dict(), saved["weights"])
    assert same_tensors(train.optimizer_state(), saved["optimizer"])
    assert gen.version() == [saved["version"]]
    assert pipe.step().step == 2  # step numbers go on from the checkpoint
    pipe.close()


def test_autosave_every_n_steps_on_pause_and_close_keeps_the_newest(sess, tmp_path):
    train, gen, tasks = build(sess, tiny_qwen(seed=0))
    with pytest.raises(ConfigError, match="autosave_every"):
        sess.pipeline(train, gen, tasks, batch_size=4, group_size=2, name="bad", autosave_every=-1)
    run_dir = tmp_path / "auto"
    pipe = sess.pipeline(
        train,
        gen,
        tasks,
        algo=GRPO(group_size=2),
        batch_size=4,
        mode="rollart",
        name="auto",
        run_dir=run_dir,
        autosave_every=2,
        keep_checkpoints=2,
    )
    pipe.run(5, progress=False)
    assert [p.name for p in run_checkpoints(run_dir)] == ["step-000002", "step-000004"]
    pipe.run(50, background=True)
    while len(pipe.reports) < 6:
        time.sleep(0.05)
    pipe.pause()  # stops after the step in progress, and saves there
    pipe.wait()
    paused_at = len(pipe.reports)
    assert run_checkpoints(run_dir)[-1].name == f"step-{paused_at:06d}"
    pipe.step()
    pipe.close()  # saves the last step; only the newest keep_checkpoints=2 stay
    final = paused_at + 1
    assert [p.name for p in run_checkpoints(run_dir)] == [f"step-{paused_at:06d}", f"step-{final:06d}"]
    ckpt = latest_checkpoint(run_dir)
    assert ckpt.steps == final and ckpt.version == train.version()
    assert len((run_dir / "steps.jsonl").read_text().splitlines()) == final


def test_every_damaged_file_is_named_and_the_last_good_checkpoint_offered(sess, tmp_path):
    train, gen, tasks = build(sess, tiny_qwen(seed=0))
    run_dir = tmp_path / "dmg"
    pipe = sess.pipeline(
        train,
        gen,
        tasks,
        algo=GRPO(group_size=2),
        batch_size=4,
        mode="sync",
        name="dmg",
        run_dir=run_dir,
        autosave_every=1,
    )
    pipe.run(2, progress=False)
    pipe.close()
    good, newest = run_checkpoints(run_dir)[-2:]
    files = read_checkpoint(newest).files
    assert any(f.endswith(".safetensors") for f in files) and any(f.endswith("trainer.pt") for f in files)
    pristine = tmp_path / "pristine"
    shutil.copytree(newest, pristine)
    for rel, (size, _) in sorted(files.items()):
        shutil.rmtree(newest)
        shutil.copytree(pristine, newest)
        with open(newest / rel, "r+b") as f:
            f.truncate(size // 2)
        with pytest.raises(CheckpointError) as e:
            read_checkpoint(newest)
        msg = str(e.value)
        assert rel in msg and "truncated" in msg and str(good) in msg, msg
    # A flipped byte with the size unchanged, through the user's path (resume_from=...).
    shutil.rmtree(newest)
    shutil.copytree(pristine, newest)
    rel = next(f for f in files if f.endswith(".safetensors"))
    with open(newest / rel, "r+b") as f:
        f.seek(files[rel][0] - 1)
        last = f.read(1)
        f.seek(files[rel][0] - 1)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=rf"{rel} does not match its SHA-256"):
        sess.pipeline(train, gen, tasks, algo=GRPO(group_size=2), batch_size=4, name="x", resume_from=newest)
    (newest / "pipeline.json").write_text('{"version": 3, "ste')  # truncated manifest
    with pytest.raises(CheckpointError, match="pipeline.json cannot be read"):
        read_checkpoint(newest)
    # The run folder resumes from the newest intact checkpoint, saying which it skipped.
    with pytest.warns(UserWarning, match=r"skipped 1 newer checkpoint"):
        assert latest_checkpoint(run_dir).path == str(good)


def test_a_save_that_dies_midway_leaves_the_previous_checkpoint_whole(sess, tmp_path, monkeypatch):
    train, gen, tasks = build(sess, tiny_qwen(seed=0))
    pipe = sess.pipeline(train, gen, tasks, algo=GRPO(group_size=2), batch_size=4, mode="sync", name="atomic")
    pipe.step()
    path = Path(pipe.save(tmp_path / "ckpt"))
    before = read_checkpoint(path)
    pipe.step()

    def dies(directory):  # the trainer's write is cut off part way
        os.makedirs(directory, exist_ok=True)
        Path(directory, "trainer.pt").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(pipe.train, "save_checkpoint", dies)
    with pytest.raises(KeyboardInterrupt):
        pipe.save(path)
    after = read_checkpoint(path)  # verified against its manifest
    assert after.steps == before.steps == 1 and after.files == before.files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the partial write was removed
    pipe.close()
