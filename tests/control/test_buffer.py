"""SampleBuffer invariants, held by property tests (hypothesis)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollart_nb.control.buffer import SampleBuffer
from rollart_nb.control.staleness import Staleness
from rollart_nb.errors import ConfigError
from rollart_nb.trajectory import Status, Trajectory

G = 4  # group size

ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 7), st.integers(0, 3)),  # (group, versions behind)
        st.tuples(st.just("bump"), st.just(0), st.just(0)),
        st.tuples(st.just("take"), st.integers(1, 3), st.just(0)),
    ),
    max_size=120,
)


def traj(group: int, start: int) -> Trajectory:
    return Trajectory(
        "t",
        seed=group,
        group_id=f"g{group}",
        start_version=start,
        status=Status.COMPLETED,
        reward=1.0,
        reward_version=0,
    )


@settings(max_examples=300, deadline=None)
@given(ops=ops, alpha=st.integers(0, 3), E=st.integers(4, 24))
def test_invariants(ops, alpha, E):
    cap = (alpha + 1) * E
    buf = SampleBuffer(group_size=G, staleness=Staleness(alpha), capacity=cap)
    version = 0
    seen: dict[str, Trajectory] = {}
    returned: set[str] = set()
    for op, a, b in ops:
        if op == "put":
            t = traj(a, max(0, version - b))
            seen[t.id] = t
            buf.put(t)
        elif op == "bump":
            version += 1
            buf.set_version(version)
        else:
            n = a * G
            if buf.ready(n):
                batch = buf.take_batch(n)
                assert len(batch) == n
                # groups whole, no sample older than the bound, never returned twice
                by_group: dict[str, int] = {}
                for t in batch:
                    by_group[t.group_id] = by_group.get(t.group_id, 0) + 1
                    assert t.start_version >= version - alpha
                    assert t.status is Status.COMPLETED
                    assert t.id not in returned
                    returned.add(t.id)
                assert all(c == G for c in by_group.values())
        assert len(buf) <= cap  # the O(alpha * E) bound
        for members in buf._groups.values():
            assert len(members) <= G
            for t in members:
                assert t.start_version >= version - alpha  # eviction at every version bump
    # every trajectory is in exactly one place: returned, still buffered, or ended with a terminal status
    buffered = {t.id for m in buf._groups.values() for t in m}
    for tid, t in seen.items():
        places = (tid in returned) + (tid in buffered) + (t.status in (Status.ABORTED_STALE, Status.CANCELLED))
        assert places == 1, (t, tid in returned, tid in buffered)


def test_take_batch_prefers_task_shares():
    buf = SampleBuffer(group_size=2, staleness=Staleness(1), capacity=64)
    for g, task in enumerate(["a", "a", "a", "b"]):
        for _ in range(2):
            buf.put(Trajectory(task, group_id=f"g{g}", status=Status.COMPLETED, reward=0.0, reward_version=0))
    batch = buf.take_batch(4, {"a": 1.0, "b": 1.0})
    assert sorted({t.task for t in batch}) == ["a", "b"]


def test_stale_put_is_rejected_and_marked():
    buf = SampleBuffer(group_size=1, staleness=Staleness(1), capacity=8)
    buf.set_version(5)
    t = Trajectory("a", group_id="g", start_version=3, status=Status.COMPLETED, reward=0.0, reward_version=0)
    assert buf.put(t) == [t] and t.status is Status.ABORTED_STALE and "alpha=1" in t.reason
    assert len(buf) == 0


def test_bad_config_reports_all_problems():
    with pytest.raises(ConfigError) as ei:
        SampleBuffer(group_size=0, staleness=Staleness(1), capacity=-1)
    assert len(ei.value.problems) == 2


def test_a_rule_that_does_not_abort_keeps_old_samples():
    buf = SampleBuffer(group_size=1, staleness=Staleness(1, abort_stale=False), capacity=8)
    buf.put(Trajectory("a", group_id="g", start_version=0, status=Status.COMPLETED, reward=0.0, reward_version=0))
    assert buf.set_version(10) == [] and len(buf) == 1
