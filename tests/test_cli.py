"""``rollart-nb`` argument handling, in process: versions, help, defaults, usage errors and the
exit status of errors raised by a run. Nothing here starts Ray: ``run_train`` and
``run_experiments`` are replaced where a test reaches them."""

import argparse
import json
import re

import pytest

import rollart_nb
import rollart_nb.bench
import rollart_nb.train
from rollart_nb.bench import EXPERIMENTS
from rollart_nb.cli import build_parser, main
from rollart_nb.errors import ConfigError, StateError
from rollart_nb.train import TrainConfig, demo_config


@pytest.fixture
def no_runs(monkeypatch):
    """Any attempt to start a demo or an experiment fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a usage error must not start a run")

    monkeypatch.setattr(rollart_nb.train, "run_train", refuse)
    monkeypatch.setattr(rollart_nb.bench, "run_experiments", refuse)


@pytest.fixture
def fake_demo(monkeypatch):
    """Records the TrainConfig and ``quiet`` that ``rollart-nb demo`` / ``train`` pass to run_train."""
    calls = []

    def run_demo(cfg, *, quiet=False):
        calls.append((cfg, quiet))
        return {"first": {"math": 0.1}, "last": {"math": 0.2}, "wall_s": 1.0}

    monkeypatch.setattr(rollart_nb.train, "run_train", run_demo)
    return calls


def test_version_prints_the_package_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"rollart-nb {rollart_nb.__version__}\n"


def _option_blocks(help_text: str) -> dict[str, str]:
    """Option string -> its help text, from argparse's formatted help."""
    blocks: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        m = re.match(r"  (-{1,2}[\w-]+)", line)
        if m:
            current = m.group(1)
            blocks[current] = line[m.end() :]
        elif current is not None and line.startswith("   "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


@pytest.mark.parametrize("cmd", ["demo", "train", "bench", "env-server"])
def test_every_flag_has_help_that_shows_its_default(cmd, capsys):
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    sub = commands.choices[cmd]
    flags = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert flags
    assert main([cmd, "--help"]) == 0
    blocks = _option_blocks(capsys.readouterr().out)
    for action in flags:
        text = " ".join(blocks[action.option_strings[-1]].split())
        assert action.help, action.option_strings
        assert "(default: " in text or (action.required and "(required)" in text), (action.option_strings, text)


def test_demo_help_shows_demo_config_defaults(capsys):
    assert main(["demo", "--help"]) == 0
    blocks = {k: " ".join(v.split()) for k, v in _option_blocks(capsys.readouterr().out).items()}
    c = demo_config()
    assert f"(default: {c.steps})" in blocks["--steps"]
    assert f"(default: {c.minutes})" in blocks["--minutes"]
    assert f"(default: {c.pipeline.alpha})" in blocks["--alpha"]
    assert f"(default: {c.algo.lr})" in blocks["--lr"]
    assert "(default: frozenlake,math)" in blocks["--tasks"]
    assert "(default: frozenlake=1,math=7)" in blocks["--weights"]
    assert "None" not in " ".join(blocks.values())


def test_demo_without_flags_runs_the_default_config(fake_demo, capsys):
    assert main(["demo"]) == 0
    ((cfg, quiet),) = fake_demo
    assert cfg == demo_config() and quiet is False
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last.removeprefix("RESULT ")) == {"first": {"math": 0.1}, "last": {"math": 0.2}, "wall_s": 1.0}


def test_demo_flags_reach_the_config(fake_demo):
    assert (
        main(
            [
                "demo",
                "--steps",
                "3",
                "--minutes",
                "0.5",
                "--mode",
                "areal",
                "--alpha",
                "0",
                "--batch-size",
                "16",
                "--group-size",
                "4",
                "--entropy",
                "0.01",
                "--kl",
                "0",
                "--tasks",
                "math",
                "--weights",
                "math=2",
                "--no-std",
                "--math-curriculum",
                "0.25",
                "--math-reward",
                "exact",
                "--validate-every",
                "0",
                "--seed",
                "7",
                "--out",
                "somewhere",
                "--quiet",
            ]
        )
        == 0
    )
    ((cfg, quiet),) = fake_demo
    assert quiet is True
    p, a, math_task = cfg.pipeline, cfg.algo, cfg.tasks["math"]
    assert (cfg.steps, cfg.minutes, p.mode, p.alpha, p.batch_size, a.group_size) == (3, 0.5, "areal", 0, 16, 4)
    assert (a.entropy_coef, a.kl_coef, list(cfg.tasks), math_task.weight) == (0.01, 0.0, ["math"], 2.0)
    assert (a.scale_by_std, math_task.curriculum, math_task.reward) == (False, 0.25, "exact")
    assert (p.validate_every, cfg.seed, cfg.out) == (0, 7, "somewhere")
    # the rest is demo.yaml's
    assert (p.rollout.max_new_tokens, a.micro_batch_tokens, cfg.model.pretrain_batch) == (6, 1024, 80)


def test_demo_overrides_come_after_the_flags(fake_demo):
    assert main(["demo", "--alpha", "0", "pipeline.alpha=3", "pipeline.rollout.max_turns=8", "algo.lr=5e-4"]) == 0
    ((cfg, _),) = fake_demo
    assert (cfg.pipeline.alpha, cfg.pipeline.rollout.max_turns, cfg.algo.lr) == (3, 8, 5e-4)


def test_train_loads_a_yaml_file_applies_overrides_and_prints_it(tmp_path, fake_demo, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("name: exp\nsteps: 7\npipeline:\n  alpha: 2\n  rollout: {max_turns: 4}\nalgo: {group_size: 4}\n")
    assert main(["train", str(f), "algo.lr=5e-4", "pipeline.batch_size=8", "--print-config"]) == 0
    printed = capsys.readouterr().out
    from rollart_nb.config import load

    back = tmp_path / "printed.yaml"
    back.write_text(printed)
    cfg = load(TrainConfig, back)
    assert (cfg.name, cfg.steps, cfg.pipeline.alpha, cfg.pipeline.rollout.max_turns) == ("exp", 7, 2, 4)
    assert (cfg.algo.lr, cfg.algo.group_size, cfg.pipeline.batch_size) == (5e-4, 4, 8)
    assert cfg.pipeline.rollout.max_new_tokens == TrainConfig().pipeline.rollout.max_new_tokens  # a default
    assert not fake_demo  # --print-config runs nothing
    assert main(["train", str(f), "algo.lr=5e-4", "pipeline.batch_size=8", "--quiet"]) == 0
    ((run_cfg, quiet),) = fake_demo
    assert run_cfg == cfg and quiet is True


def test_train_with_only_overrides_and_the_option_list(fake_demo, capsys):
    assert main(["train", "steps=2", "tasks={math: {env: math}}"]) == 0
    ((cfg, _),) = fake_demo
    assert cfg.steps == 2 and list(cfg.tasks) == ["math"]
    assert main(["train", "--list-options"]) == 0
    out = capsys.readouterr().out
    for name in ("pipeline.alpha (int, default 1)", "pipeline.rollout.max_turns (int, default 16)", "algo.lr (float"):
        assert name in out
    assert "Per-trajectory staleness bound" in out and "Turns per trajectory" in out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["train", "no/such/file.yaml"], "config file 'no/such/file.yaml' does not exist"),
        (["train", "pipeline.alpah=2"], "pipeline.alpah is not a setting; did you mean pipeline.alpha?"),
        (["train", "algo.lr=-1", "model.size=xl"], "2 problems"),
        (["train", "pipeline.batch_size=12"], "must be a multiple of algo.group_size=8"),
        (["train", "envs_per_task={chess: 4}"], "envs_per_task names ['chess'], which are not tasks of this run"),
        (["train", "envs_per_task={math: 0}"], "envs_per_task={'math': 0} must be a whole number >= 1"),
        (["train", "model.pretrain_weights={maths: 1}"], "model.pretrain_weights names ['maths']"),
        (["train", "model.pretrain_weights={math: -1}"], "must map task names to weights >= 0"),
        (["train", "model.pretrain_stop_at={chess: 0.5}"], "model.pretrain_stop_at names ['chess']"),
    ],
)
def test_train_config_errors_are_one_line_with_status_2(argv, says, no_runs, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and says in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["demo", "--steps", "-1"], "--steps: '-1' is not a whole number >= 1"),
        (["demo", "--steps", "abc"], "--steps: 'abc'"),
        (["demo", "--minutes", "nan"], "--minutes: 'nan'"),
        (["demo", "--mode", "nope"], "--mode: invalid choice: 'nope'"),
        (["demo", "--alpha", "0.5"], "--alpha: '0.5' is not a whole number >= 0"),
        (["demo", "--alpha", "-1"], "--alpha: '-1'"),
        (["demo", "--lr", "0"], "--lr: '0' is not a number > 0"),
        (["demo", "--math-curriculum", "1.5"], "--math-curriculum: '1.5'"),
        (["demo", "--weights", "junk"], "--weights: 'junk' is not task=number"),
        (["demo", "--weights", "chess=1"], "unknown task 'chess'; choose from frozenlake, math"),
        (["demo", "--weights", "math=-1"], "share >= 0"),
        (["demo", "--tasks", "frozenlake,chess"], "unknown task 'chess'; choose from frozenlake, math"),
        (["demo", "--tasks", ","], "no task in ','"),
        (["demo", "--batch-size", "12"], "--batch-size 12 is not a multiple of --group-size 8"),
        (["demo", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["bench", "nosuch"], "unknown experiment 'nosuch'; choose 'all' or one of r1_affinity"),
        (
            ["env-server", "--env", "rollart_nb.envs:FrozenLake", "--kwargs", "{size: 4}"],
            "--kwargs: '{size: 4}' is not JSON",
        ),
        (["env-server", "--env", "rollart_nb.envs:FrozenLake", "--kwargs", "[1]"], "must be a JSON object"),
        (["env-server", "--env", "rollart_nb.envs:FrozenLake", "--port", "70000"], "--port 70000 is not a port"),
        (["env-server"], "the following arguments are required: --env"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_values_are_a_one_line_usage_error_with_status_2(argv, says, no_runs, capsys):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    *usage, last = err.strip().splitlines()
    assert usage[0].startswith("usage: rollart-nb")
    assert re.match(r"rollart-nb( [\w-]+)?: error: ", last) and says in last, err


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (ConfigError(["batch too small", "group too big"], where="pipeline config"), 2),
        (StateError("Pipeline is closed; create a new one with session.pipeline(...)"), 1),
    ],
)
def test_an_error_of_the_run_prints_one_line_and_its_status(error, status, monkeypatch, capsys):
    def run_demo(cfg, *, quiet=False):
        raise error

    monkeypatch.setattr(rollart_nb.train, "run_train", run_demo)
    assert main(["demo", "--steps", "1"]) == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    if status == 2:
        assert err == "error: invalid pipeline config: 2 problems: batch too small; group too big\n"
    else:
        assert err == f"error: {error}\n"


def test_an_unexpected_exception_keeps_its_traceback(monkeypatch):
    def run_demo(cfg, *, quiet=False):
        raise RuntimeError("a bug")

    monkeypatch.setattr(rollart_nb.train, "run_train", run_demo)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["demo"])


def test_env_server_that_cannot_load_its_env_says_so_in_one_line(capsys):
    assert main(["env-server", "--env", "no_such_module_here:Env"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot load env 'no_such_module_here:Env'") and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["bench"], ["bench", "--list"], ["bench", "all", "--list"]])
def test_bench_lists_every_experiment_with_one_line_each(argv, no_runs, capsys):
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == [*EXPERIMENTS, "all"]
    assert all(len(ln.split()) > 3 for ln in lines[:-1])  # name, aliases, a description
    assert re.search(r"^alpha_sweep\s+alpha, r4\s+R4: ", "\n".join(lines), re.M)


def test_bench_runs_an_experiment_by_alias(monkeypatch, capsys):
    calls = []

    def run_experiments(name, out, quick):
        calls.append((name, out, quick))
        return {"wall_s": 0.1}

    monkeypatch.setattr(rollart_nb.bench, "run_experiments", run_experiments)
    assert main(["bench", "r1", "--quick", "--out", "figs"]) == 0
    assert calls == [("r1", "figs", True)]
    assert capsys.readouterr().out.strip() == 'RESULT {"wall_s": 0.1}'


def test_per_task_envs_and_corpus_weights_reach_the_session_and_the_base_model_stage(monkeypatch):
    """``envs_per_task`` may differ per task (``sess.tasks`` gets every task, DEFAULT_ENVS for one it
    leaves out), and the base-model corpus is mixed by ``model.pretrain_weights`` instead of the RL
    batch weights."""
    import rollart_nb.models.pretraining as pretraining
    from rollart_nb.config import apply_overrides

    cfg = apply_overrides(
        TrainConfig(),
        ["envs_per_task={math: 48}", "model.pretrain_steps=5", "model.pretrain_weights={frozenlake: 2}"],
    )
    assert cfg.envs_per_task == {"math": 48}
    assert rollart_nb.train._envs_per_task(cfg) == {"frozenlake": rollart_nb.train.DEFAULT_ENVS, "math": 48}
    assert rollart_nb.train._envs_per_task(TrainConfig(envs_per_task=5)) == 5
    seen = {}

    def fake_pretrain(model, envs, **kw):
        seen.update(kw, envs=sorted(envs))
        return model

    monkeypatch.setattr(pretraining, "pretrain", fake_pretrain)
    monkeypatch.setattr(pretraining, "pretrain_record", lambda m: {})
    rollart_nb.train._pretrain("base", {"frozenlake": object(), "math": object()}, cfg, quiet=True)
    # math is left out of the corpus (weight 0), not given its RL batch weight
    assert seen["weights"] == {"frozenlake": 2.0, "math": 0.0} and seen["envs"] == ["frozenlake", "math"]
    plain = apply_overrides(TrainConfig(), ["model.pretrain_steps=5", "tasks.math.weight=3"])
    rollart_nb.train._pretrain("base", {"frozenlake": object(), "math": object()}, plain, quiet=True)
    assert seen["weights"] == {"frozenlake": 1.0, "math": 3.0}  # default: the batch weights


def test_a_config_cut_to_some_tasks_keeps_only_their_settings():
    """``--tasks`` (``TrainConfig.only``) drops the other tasks from every per-task setting, so a
    config whose corpus mix or stop rule names two tasks still runs one of them."""
    from rollart_nb.config import apply_overrides

    cfg = apply_overrides(
        TrainConfig(),
        [
            "envs_per_task={math: 48}",
            "model.pretrain_weights={frozenlake: 2, math: 3}",
            "model.pretrain_stop_at={math: 0.25}",
        ],
    )
    lake = cfg.only(["frozenlake"])
    assert list(lake.tasks) == ["frozenlake"] and lake.model.pretrain_weights == {"frozenlake": 2}
    assert lake.model.pretrain_stop_at is None and lake.envs_per_task == rollart_nb.train.DEFAULT_ENVS
    math = cfg.only(["math"])
    assert (math.envs_per_task, math.model.pretrain_stop_at) == ({"math": 48}, {"math": 0.25})
    assert cfg.only(["math", "frozenlake"]) == cfg and TrainConfig(envs_per_task=5).only(["math"]).envs_per_task == 5
    with pytest.raises(ConfigError, match=r"unknown tasks \['chess'\]"):
        cfg.only(["chess"])


def test_every_shipped_config_loads():
    """The YAML files under rollart_nb/configs are valid TrainConfigs (their task names, weights and
    per-task settings pass the config's checks), and the demo mixes its corpus apart from its
    batches."""
    from pathlib import Path

    from rollart_nb.config import load

    files = sorted((Path(rollart_nb.__file__).parent / "configs").glob("*.yaml"))
    assert {f.name for f in files} >= {"demo.yaml", "format.yaml"}
    cfgs = {f.stem: load(TrainConfig, f) for f in files}
    assert {n: c.name for n, c in cfgs.items()} == {n: n for n in cfgs}
    held = cfgs["demo"]
    assert held.model.pretrain_weights == {"frozenlake": 2.0, "math": 3.0}
    assert held.model.pretrain_batch == 80
    assert {t: c.weight for t, c in held.tasks.items()} == {"frozenlake": 1.0, "math": 7.0}
