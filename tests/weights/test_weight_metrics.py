"""WeightSyncMetrics ratios."""

from __future__ import annotations

import pytest

from rollart_nb.weights.metrics import WeightSyncMetrics


def test_ratios():
    m = WeightSyncMetrics(version=2, push_s=1.0, pull_s=8.0, exposed_pull_s=2.0, bytes=16 * 10**9, pulls=2)
    assert m.hidden_fraction == pytest.approx(0.75)
    assert m.pull_gbps == pytest.approx(2.0)
    assert m.effective_gbps == pytest.approx(16 / 3)
    d = m.as_dict()
    assert d["hidden_fraction"] == pytest.approx(0.75) and d["bytes"] == 16 * 10**9


def test_empty_metrics_do_not_divide_by_zero():
    m = WeightSyncMetrics()
    assert m.hidden_fraction == 0.0 and m.pull_gbps == 0.0 and m.effective_gbps == 0.0


def test_add_sums_and_keeps_newest_version():
    a = WeightSyncMetrics(version=1, push_s=1, pull_s=2, exposed_pull_s=0.5, bytes=10, pulls=1)
    b = WeightSyncMetrics(version=3, push_s=1, pull_s=2, exposed_pull_s=0.5, bytes=10, pulls=1)
    s = a.add(b)
    assert (s.version, s.push_s, s.pull_s, s.exposed_pull_s, s.bytes, s.pulls) == (3, 2, 4, 1.0, 20, 2)
