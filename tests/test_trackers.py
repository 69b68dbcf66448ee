"""The real TensorBoard, W&B (offline) and MLflow (SQLite) trackers: steps go in as the pipeline
sends them (resolve_trackers by name, start, log_step per step, close) and come back out through
each library's own reader. No Ray, no network."""

from __future__ import annotations

import importlib
import json
import math
import struct
import sys
import time
from pathlib import Path

import psutil
import pytest

from rollart_nb.control.report import StepReport
from rollart_nb.errors import ConfigError, StateError
from rollart_nb.trackers import (
    SAMPLE_COLUMNS,
    MLflowTracker,
    TensorBoardTracker,
    WandbTracker,
    resolve_trackers,
    sample_rows,
    step_scalars,
)
from rollart_nb.trajectory import Status, Trajectory, Turn

SECRETS = ("sk-config-secret-123", "hunter2pass", "tok-in-reason-456", "zz-env-secret-789")
CONFIG = {
    "pipeline": "exp",
    "mode": "async",
    "alpha": 1,
    "batch_size": 8,
    "tasks": ["code", "math"],
    "algo": "GRPO",
    "algo.kl_coef": 0.01,
    "api_key": SECRETS[0],
    "endpoint": f"https://user:{SECRETS[1]}@scores.example/x",
}
EVENT = {
    "kind": "generator_replaced",
    "worker": "actor_gen-1",
    "pool": "H20",
    "version": 1,
    "at": 12.5,
    "reason": f"worker died (token={SECRETS[2]})",
}


def _reports() -> list[StepReport]:
    """Three steps: rewards, phases, counts, env faults, train metrics; a validation and a
    failover event at step 1; a NaN reward (a task with no finished sample) at step 2."""
    out = []
    for s in range(3):
        out.append(
            StepReport(
                step=s,
                version=s + 1,
                mode="async",
                step_s=2.0 + s,
                batch_size=8,
                tokens=1000 * (s + 1),
                throughput=500.0 + s,
                phases={"rollout_wait": 1.0, "suspend": 0.1, "update": 0.2, "resume": 0.1, "train": 0.5 * s},
                reward={"math": 0.25 * (s + 1), "code": math.nan if s == 2 else 0.1 * s},
                counts={"completed": 8 + s, "aborted_stale": s},
                env={"restarts": s, "timeouts": 0},
                train={"loss": 1.5 - 0.25 * s, "grad_norm": 0.3},
                weights={"push_s": 0.05},
                validation={"math": 0.4} if s == 1 else {},
                staleness={0: 6, 1: 2 + s},
                events=[EVENT] if s == 1 else [],
            )
        )
    return out


def _samples() -> list[dict]:
    """Table rows of two of four trajectories (one per task), a secret in a response."""
    trajs = []
    for i, task in enumerate(["math", "math", "code", "code"]):
        turn = Turn(observation=f"What is {i} + 1?", action=f"{i + 1} token={SECRETS[2]}", version=1, response_ids=[5])
        trajs.append(
            Trajectory(task=task, id=f"t{i}", turns=[turn], start_version=1, status=Status.COMPLETED, reward=i)
        )
    return sample_rows(trajs, 2)


def _feed(tracker) -> list[StepReport]:
    """What the pipeline does with a tracker: start with the run config, each step (with a table
    of trajectories after step 1), close."""
    reports = _reports()
    tracker.start(CONFIG)
    for r in reports:
        tracker.log_step(r)
        if r.step == 1:
            tracker.log_samples(r.step, _samples())
    tracker.close()
    return reports


def test_sample_rows_spread_over_the_batch_and_redact_text():
    rows = _samples()
    assert [(r["id"], r["task"], r["reward"]) for r in rows] == [("t0", "math", 0.0), ("t2", "code", 2.0)]
    assert list(rows[0]) == list(SAMPLE_COLUMNS)
    assert rows[1]["prompt"] == "What is 2 + 1?" and rows[1]["response"] == "3 token=***"
    assert (rows[0]["min_version"], rows[0]["max_version"], rows[0]["turns"], rows[0]["status"]) == (
        1,
        1,
        1,
        "completed",
    )
    assert sample_rows([], 4) == [] and sample_rows(list(range(3)), 0) == []
    assert rows[0]["advantage"] is None and json.loads(rows[0]["trainer_logprobs"]) == [None]


def test_sample_rows_carry_the_train_steps_per_token_figures():
    turn = Turn(
        "obs", "a b", [1, 2], [3, 4], logprobs=[-1.0, -2.0], loss_mask=[1, 1], version=2, spans=[(0, 2), (1, 3)]
    )
    turn.entropy = [0.5, 0.25]
    t = Trajectory("math", id="x", turns=[turn], reward=1.0, start_version=2)
    lp = [math.nan, -0.9, -1.5, -2.0]
    t.train = {"step": 0, "version": 3, "advantage": 0.5, "rows": [{"logprob": lp, "entropy": lp, "loss_weight": lp}]}
    (row,) = sample_rows([t], 1)
    assert row["advantage"] == 0.5 and json.loads(row["versions"]) == [2, 3] and json.loads(row["token_ids"]) == [3, 4]
    assert json.loads(row["trainer_logprobs"]) == [-1.5, -2.0] and json.loads(row["entropies"]) == [0.5, 0.25]
    r = math.exp(-0.5)  # the first token's importance ratio; the second's is 1
    assert row["mismatch_kl"] == pytest.approx((r - 1 - math.log(r)) / 2, abs=1e-6)


def _expected(reports: list[StepReport], key: str) -> list[tuple[int, float]]:
    return [(r.step, step_scalars(r)[key]) for r in reports if key in step_scalars(r)]


KEYS = (
    "reward/math",
    "reward/code",
    "validation/math",
    "phase/train",
    "count/completed",
    "env/restarts",
    "train/loss",
    "weights/push_s",
    "step/tokens_per_s",
    "failover/events",
    "staleness/mean",
)


def _same(got: list[tuple[int, float]], want: list[tuple[int, float]], rel: float = 1e-6) -> bool:
    return len(got) == len(want) and all(
        gs == ws and (math.isnan(gv) and math.isnan(wv) or gv == pytest.approx(wv, rel=rel))
        for (gs, gv), (ws, wv) in zip(got, want, strict=True)
    )


def _no_secret_under(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            for s in SECRETS:
                assert s.encode() not in data, f"{s} written to {f}"


@pytest.fixture
def env(monkeypatch):
    """A secret in the environment (it must never reach a tracker) and no network telemetry."""
    monkeypatch.setenv("ROLLART_TEST_SECRET", SECRETS[3])
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return monkeypatch


# -- the shared helpers -----------------------------------------------------------------------
def test_step_scalars_flattens_a_report_to_numbers():
    r = _reports()[1]
    r.train["note"] = "not a number"  # type: ignore[assignment]
    sc = step_scalars(r)
    assert sc["reward/math"] == 0.5 and sc["validation/math"] == 0.4 and sc["phase/rollout_wait"] == 1.0
    assert sc["count/completed"] == 9.0 and isinstance(sc["count/completed"], float)
    assert sc["env/restarts"] == 1.0 and sc["train/loss"] == 1.25 and sc["weights/push_s"] == 0.05
    assert sc["step/version"] == 2.0 and sc["step/batch_size"] == 8.0 and sc["step/tokens_per_s"] == 501.0
    assert sc["failover/events"] == 1.0
    assert "train/note" not in sc and all(isinstance(v, float) for v in sc.values())


def test_unknown_name_and_non_tracker_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown tracker 'neptune'.*\['mlflow', 'tensorboard', 'wandb'\]"):
        resolve_trackers(["tensorboard", "neptune"], run_dir=tmp_path, name="exp")
    with pytest.raises(ConfigError, match="not a tracker: it needs start"):
        resolve_trackers([object()], run_dir=tmp_path, name="exp")
    assert resolve_trackers(None, run_dir=tmp_path, name="exp") == []


@pytest.mark.parametrize(
    "cls, modules",
    [
        (TensorBoardTracker, ["torch.utils.tensorboard"]),
        (WandbTracker, ["wandb"]),
        (MLflowTracker, ["mlflow.entities", "mlflow.tracking"]),
        (MLflowTracker, ["sqlalchemy"]),
    ],
)
def test_a_missing_library_names_the_extra_to_install(cls, modules, tmp_path, env):
    # Imported for real first: a library imported while a dependency looked missing would keep
    # that state (MLflow registers its SQLite stores at import) for the later tests.
    for m in ("torch.utils.tensorboard", "wandb", "mlflow.entities", "mlflow.tracking", "sqlalchemy", "alembic"):
        importlib.import_module(m)
    for m in modules:  # None in sys.modules makes the import fail as if not installed
        env.setitem(sys.modules, m, None)
    with pytest.raises(ConfigError, match=r"pip install 'rollart_nb\[trackers\]'"):
        cls(log_dir=tmp_path / "t", run_name="exp")


# -- TensorBoard ------------------------------------------------------------------------------
def test_tensorboard_scalars_config_and_failover_read_back(tmp_path, env):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (t,) = resolve_trackers("tensorboard", run_dir=tmp_path, name="exp")
    assert isinstance(t, TensorBoardTracker) and t.log_dir == tmp_path / "tensorboard"
    reports = _feed(t)
    ea = EventAccumulator(str(t.log_dir))
    ea.Reload()
    for key in KEYS:  # stored as float32
        assert _same([(e.step, e.value) for e in ea.Scalars(key)], _expected(reports, key)), key
    assert set(ea.Tags()["scalars"]) == set().union(*(step_scalars(r) for r in reports))
    (config,) = ea.Tensors("config/text_summary")
    text = config.tensor_proto.string_val[0].decode()
    assert config.step == 0 and "| mode | async |" in text and "| api_key | *** |" in text
    (failover,) = ea.Tensors("failover/text_summary")
    assert failover.step == 1 and "generator_replaced" in failover.tensor_proto.string_val[0].decode()
    (samples,) = ea.Tensors("samples/text_summary")
    table = samples.tensor_proto.string_val[0].decode()
    assert samples.step == 1 and table.startswith("| id | task | status | reward |")
    assert "| t2 | code | completed | 2.0 |" in table and "3 token=*** |" in table
    _no_secret_under(tmp_path)


# -- Weights & Biases, offline ----------------------------------------------------------------
def _wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` file, parsed with W&B's own protobuf schema.

    The file is a LevelDB-style log (wandb >= 0.18 has no Python reader for it): a 7-byte
    header (``:W&B``, magic, version), then 32 KiB blocks of chunks, each ``crc32c(4) len(2)
    type(1) data`` with type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4, a block's tail under 7 bytes
    zero-padded.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf, out = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + n > len(data):
            break  # a chunk still being written
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _wandb_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "wandb" in " ".join(p.cmdline())]


@pytest.fixture
def wandb_env(env, tmp_path):
    env.setenv("WANDB_MODE", "offline")
    env.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        env.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    env.delenv("WANDB_API_KEY", raising=False)
    yield env
    import wandb

    wandb.teardown()  # the service process lives until teardown or the end of the process
    for p in _wandb_children():
        p.wait(timeout=10)
    assert not _wandb_children()


def test_wandb_offline_run_holds_the_history_and_config(tmp_path, wandb_env):
    (t,) = resolve_trackers(["wandb"], run_dir=tmp_path, name="exp")
    assert isinstance(t, WandbTracker) and t.mode == "offline" and t.log_dir == tmp_path / "wandb"
    reports = _feed(t)
    (run_dir,) = (t.log_dir / "wandb").glob(f"offline-run-*-{t.run.id}")
    # finish() returns once the run is closed; W&B's service writes the file's tail a moment later
    deadline = time.monotonic() + 30
    while True:
        records = _wandb_records(run_dir / f"run-{t.run.id}.wandb")
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    history: dict[str, list[tuple[int, float]]] = {}
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            row = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            for k, v in row.items():
                if isinstance(v, int | float):  # the samples table is a file reference
                    history.setdefault(k, []).append((row["_step"], float(v)))
    for key in KEYS:
        assert _same(history[key], _expected(reports, key)), key
    tables = [  # a table is logged as its fields under "samples." (a reference to the table's file)
        {k: json.loads(i.value_json) for i in rec.history.item if (k := i.key or ".".join(i.nested_key))}
        for rec in records
        if rec.WhichOneof("record_type") == "history"
    ]
    (logged,) = [row for row in tables if "samples._type" in row]
    assert logged["_step"] == 1 and logged["samples._type"] == "table-file" and logged["samples.nrows"] == 2
    (table_file,) = run_dir.glob("files/media/table/samples_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == list(SAMPLE_COLUMNS) and [row[0] for row in table["data"]] == ["t0", "t2"]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert run.display_name == "exp" and run.project == "rollart_nb"
    assert config["mode"] == "async" and config["algo.kl_coef"] == 0.01 and config["api_key"] == "***"
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finished
    with pytest.raises(StateError, match="not running"):
        t.log_step(reports[0])
    _no_secret_under(tmp_path)


def test_wandb_mode_is_offline_without_credentials(tmp_path, wandb_env):
    wandb_env.delenv("WANDB_MODE")
    wandb_env.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    netrc = tmp_path / "netrc"
    wandb_env.setenv("NETRC", str(netrc))
    assert WandbTracker(tmp_path).mode == "offline"  # no key, no netrc: never a login prompt
    netrc.write_text("machine api.wandb.ai login user password 0123456789abcdef\n")
    netrc.chmod(0o600)
    assert WandbTracker(tmp_path).mode == "online"
    netrc.unlink()
    wandb_env.setenv("WANDB_API_KEY", "x" * 40)
    assert WandbTracker(tmp_path).mode == "online"
    wandb_env.setenv("WANDB_MODE", "disabled")
    assert WandbTracker(tmp_path).mode == "disabled"
    assert WandbTracker(tmp_path, mode="offline").mode == "offline"


# -- MLflow, local SQLite store ---------------------------------------------------------------
def test_mlflow_metrics_params_and_failover_read_back(tmp_path, env):
    from mlflow.tracking import MlflowClient

    (t,) = resolve_trackers("mlflow", run_dir=tmp_path, name="exp")
    assert isinstance(t, MLflowTracker) and t.tracking_uri == f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    reports = _feed(t)
    client = MlflowClient(t.tracking_uri)
    for key in KEYS:
        got = sorted((m.step, m.value) for m in client.get_metric_history(t.run_id, key))
        assert _same(got, _expected(reports, key)), key
    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "exp"
    assert client.get_experiment(run.info.experiment_id).name == "rollart_nb"
    params = run.data.params
    assert params["mode"] == "async" and params["batch_size"] == "8" and params["api_key"] == "***"
    assert params["tasks"] == '["code", "math"]' and "hunter2pass" not in params["endpoint"]
    (art,) = client.list_artifacts(t.run_id, "failover")
    assert art.path == "failover/step_000001.json"
    (event,) = json.loads(Path(client.download_artifacts(t.run_id, art.path, str(tmp_path / "dl"))).read_text())
    assert event["kind"] == "generator_replaced" and event["worker"] == "actor_gen-1"
    (art,) = client.list_artifacts(t.run_id, "samples")
    table = json.loads(Path(client.download_artifacts(t.run_id, art.path, str(tmp_path / "dl"))).read_text())
    assert art.path == "samples/step_000001.json" and list(table) == list(SAMPLE_COLUMNS)
    assert table["id"] == ["t0", "t2"] and table["reward"] == [0.0, 2.0]
    with pytest.raises(StateError, match="not running"):
        t.log_step(reports[0])
    _no_secret_under(tmp_path)


def test_mlflow_keys_are_made_valid(tmp_path, env):
    from mlflow.tracking import MlflowClient

    t = MLflowTracker(tmp_path / "m", run_name="odd", experiment="odd-names")
    t.start({"a key@with:odd*chars": 1, "nested": {"x": "y"}})
    r = StepReport(step=4, version=1, mode="sync", reward={"math@v2": 0.5, "../up": 0.25})
    t.log_step(r)
    t.close()
    client = MlflowClient(t.tracking_uri)
    assert set(client.get_run(t.run_id).data.params) == {"a key_with_odd_chars", "nested.x"}
    assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "reward/math_v2")] == [(4, 0.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "reward/_/up")] == [(4, 0.25)]
