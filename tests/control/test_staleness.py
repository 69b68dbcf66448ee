"""The α rule on small deterministic cases: eviction/abort, reasons, the admission window."""

import pytest

from rollart_nb.control.staleness import Staleness
from rollart_nb.trajectory import Trajectory, Turn


def traj(start: int, *turn_versions: int) -> Trajectory:
    t = Trajectory("t", group_id="g", start_version=start)
    t.turns = [Turn("o", "a", [1], [2], [0.0], [1], version=v) for v in turn_versions]
    return t


@pytest.mark.parametrize(
    ("alpha", "start", "version", "stale"),
    [(0, 3, 3, False), (0, 2, 3, True), (1, 2, 3, False), (1, 1, 3, True), (2, 1, 3, False), (2, 0, 3, True)],
)
def test_a_trajectory_is_kept_while_its_oldest_version_is_within_alpha(alpha, start, version, stale):
    assert Staleness(alpha).is_stale(traj(start), version) is stale
    assert Staleness(alpha).floor(version) == version - alpha


def test_the_oldest_turn_decides_and_a_rule_that_does_not_abort_keeps_everything():
    t = traj(5, 2, 5)  # an old turn kept across a resume: its version counts, not the start
    assert t.min_version == 2 and Staleness(1).is_stale(t, 5)
    assert not Staleness(1, abort_stale=False).is_stale(t, 5)
    assert not Staleness(0, abort_stale=False).is_stale(traj(0), 100)


def test_reasons_name_the_versions_and_alpha():
    rule = Staleness(1)
    assert rule.reason(traj(2), 5) == "stale: began at version 2, policy is at 5, alpha=1"
    assert rule.group_reason(5) == "stale group: a member began before version 4, policy is at 5, alpha=1"


def test_the_admission_window_is_batches_taken_plus_alpha_plus_one_batches():
    rule = Staleness(alpha=1)  # quota 2 groups a batch: (taken + 2) * 2 groups may be live
    assert [rule.admits(live, 0, 2) for live in (3, 4)] == [True, False]
    assert [rule.admits(live, 3, 2) for live in (9, 10)] == [True, False]
    assert Staleness(0).admits(0, 0, 1) and not Staleness(0).admits(1, 0, 1)  # on-policy: one batch ahead


def test_ahead_limit_and_capacity_grow_with_alpha():
    assert Staleness(0).ahead_limit(quota=2, group_size=4, envs=3) == 11
    assert Staleness(2).ahead_limit(quota=2, group_size=4, envs=3) == 27
    assert Staleness(1).buffer_capacity(groups=2, group_size=4, envs=3) == 27
    # the cap sits above every task's limit summed (here one task): it is only a safety net
    assert Staleness(1).buffer_capacity(2, 4, 3) > Staleness(1).ahead_limit(2, 4, 3)
