"""plan(): a small simulator search within a budget, with its reasoning."""

from __future__ import annotations

import pytest

from rollart_nb.errors import ConfigError
from rollart_nb.planner import Plan, _mixes, plan
from rollart_nb.resources.profiles import PROFILES


def test_mixes_stay_within_budget():
    for m in _mixes(30.0, quick=False):
        cost = sum(PROFILES[h].price_per_hour * n for h, n in m.items())
        assert 0 < cost <= 30.0
    assert {"H800", "H20"} <= set().union(*_mixes(30.0, quick=False))


def test_budget_too_small():
    with pytest.raises(ConfigError, match="budget"):
        plan("gem-math", budget=5.0, train_gpus=4)


def test_plan_quick_search():
    p = plan(
        {"lake": "frozenlake", "math": "gem-math"},
        budget=20.0,
        model="qwen3-0.6b",
        train_gpus=2,
        batch=8,
        group=4,
        envs_per_task=8,
        quick=True,
    )
    assert isinstance(p, Plan)
    stages = [t.stage for t in p.trials]
    assert stages.count("pool mix") >= 2 and "alpha" in stages
    assert p.cost_per_hour <= 20.0 + 1e-9 and p.step_s > 0
    assert min(t.cost_per_step for t in p.trials if t.stage == "pool mix") <= p.trials[0].cost_per_step
    assert p.choice["rollout"] in [t.config["rollout"] for t in p.trials]
    assert "s/step" in repr(p) and "<table>" in p._repr_html_() and p.reasoning
