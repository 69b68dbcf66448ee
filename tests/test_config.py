"""The typed config: one frozen dataclass per part, documented fields, every problem reported at
once, YAML round trips and dotted overrides. No Ray."""

import dataclasses

import pytest

from rollart_nb.algo import GRPO
from rollart_nb.config import (
    PipelineConfig,
    apply_overrides,
    describe,
    dump,
    field_docs,
    from_dict,
    load,
    to_dict,
)
from rollart_nb.control.env_manager import RolloutConfig
from rollart_nb.errors import ConfigError
from rollart_nb.train import FORMAT_YAML, TaskConfig, TrainConfig, demo_config


@pytest.mark.parametrize("cls", [PipelineConfig, TrainConfig, RolloutConfig, GRPO, TaskConfig])
def test_every_field_is_documented(cls):
    docs = field_docs(cls)
    missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
    assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        PipelineConfig().alpha = 3  # type: ignore[misc]


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        PipelineConfig(
            batch_size=0,
            alpha=0.5,
            mode="rolart",
            dispatch="nope",
            health_every_s=0,
            trackers=("tb",),
            rollout_shards=0,
            max_group_failures=0,
        )
    text = str(e.value)
    assert len(e.value.problems) == 8, text
    for piece in (
        "rollout_shards=0 must be a whole number >= 1 or None",
        "batch_size=0",
        "alpha=0.5",
        "did you mean 'rollart'",
        "dispatch='nope'",
        "health_every_s=0",
        "'tb' is not a tracker name",
        "max_group_failures=0 must be a whole number >= 1",
    ):
        assert piece in text


def test_rollout_shards_fit_in_the_batch_and_round_trip(tmp_path):
    assert PipelineConfig(batch_size=8, rollout_shards=8).rollout_shards == 8
    with pytest.raises(ConfigError, match=r"rollout_shards=9 must be <= batch_size=8: each shard supplies"):
        PipelineConfig(batch_size=8, rollout_shards=9)
    cfg = apply_overrides(PipelineConfig(), ["rollout_shards=3"])
    assert cfg.rollout_shards == 3 and from_dict(PipelineConfig, to_dict(cfg)) == cfg


def test_yaml_round_trip_and_defaults_for_what_a_file_leaves_out(tmp_path):
    cfg = apply_overrides(demo_config(), ["pipeline.trackers=[tensorboard]", "tasks.math.curriculum=0.25"])
    path = tmp_path / "cfg.yaml"
    dump(cfg, path)
    assert load(TrainConfig, path) == cfg
    assert from_dict(TrainConfig, to_dict(cfg)) == cfg
    (tmp_path / "small.yaml").write_text("steps: 3\npipeline:\n  alpha: 0\n")
    small = load(TrainConfig, tmp_path / "small.yaml")
    assert (small.steps, small.pipeline.alpha) == (3, 0)
    assert small.algo == GRPO() and small.pipeline.rollout == RolloutConfig()


def test_overrides_parse_yaml_values_and_exponent_floats():
    cfg = apply_overrides(
        TrainConfig(),
        [
            "algo.lr=5e-4",
            "pipeline.step_timeout_s=null",
            "pipeline.hw_affinity=false",
            "algo.scale_by_std={math: false}",
            "pipeline.rollout.temperature=0",
            "pipeline.validation_seeds={math: [1, 2]}",
            "pipeline.max_group_failures=4",
        ],
    )
    assert cfg.pipeline.max_group_failures == 4
    assert cfg.algo.lr == 5e-4 and isinstance(cfg.algo.lr, float)
    assert cfg.pipeline.step_timeout_s is None and cfg.pipeline.hw_affinity is False
    assert cfg.algo.scale_by_std == {"math": False} and cfg.pipeline.rollout.temperature == 0.0
    assert cfg.pipeline.validation_seeds == {"math": [1, 2]}


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["pipeline.alpah=2"], "did you mean pipeline.alpha?"),
        (["algo=3"], "algo must be a mapping"),
        (["nonsense"], "must look like name=value"),
        (["pipeline.rollout.max_turns.x=1"], "is not a setting"),
    ],
)
def test_bad_overrides_say_what_to_fix(overrides, says):
    with pytest.raises(ConfigError, match="") as e:
        apply_overrides(TrainConfig(), overrides)
    assert says in str(e.value)


def test_nested_problems_carry_their_dotted_names_and_come_together():
    with pytest.raises(ConfigError) as e:
        from_dict(
            TrainConfig,
            {
                "algo": {"lr": -1},
                "pipeline": {"rollout": {"max_turns": 0}, "alpha": -1},
                "tasks": {"math": {"env": "chess"}},
                "stepz": 3,
            },
        )
    text = str(e.value)
    for piece in (
        "stepz is not a setting of TrainConfig; did you mean steps?",
        "algo.lr must be",
        "pipeline.rollout.max_turns=0",
        "pipeline.alpha=-1",
        "tasks.math.env='chess'",
    ):
        assert piece in text, text


def test_yaml_syntax_errors_and_missing_files_are_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1,\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load(TrainConfig, bad)
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of settings"):
        load(TrainConfig, tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load(TrainConfig, tmp_path / "nope.yaml")


def test_describe_lists_every_leaf_setting_with_its_default():
    rows = {name: (kind, default, doc) for name, kind, default, doc in describe(TrainConfig)}
    assert rows["pipeline.rollout.max_turns"][1] == 16 and rows["algo.lr"][1] == 1e-3
    assert rows["pipeline.alpha"][2].startswith("Per-trajectory staleness bound")
    assert "pipeline" not in rows and "pipeline.rollout" not in rows  # sections expand to their fields
    leaves = len(dataclasses.fields(PipelineConfig)) - 1 + len(dataclasses.fields(RolloutConfig))
    assert sum(n.startswith("pipeline.") for n in rows) == leaves


def test_the_shipped_demo_config_loads_and_differs_from_the_library_defaults_where_it_says():
    cfg = demo_config()
    assert cfg.name == "demo" and cfg.pipeline.alpha == 2 and cfg.pipeline.batch_size == 256
    assert cfg.tasks["math"].reward is None and cfg.tasks["math"].options["holdout"] == 200  # the env's own success
    assert cfg.model.warm_steps == 0 and cfg.model.pretrain_stop_at == {"math": 0.25} and cfg.pass_k == 8
    assert cfg.algo.kl_coef == 0.1 and cfg.algo.lr == 3e-4
    fmt = load(TrainConfig, FORMAT_YAML)  # the run without a base model
    assert fmt.model.pretrain_steps == 0 and fmt.model.warm_steps == 60
    assert fmt.tasks["math"].reward == "close" and fmt.tasks["math"].validate_with == "exact"
    assert fmt.algo.scale_by_std == {"math": False}
