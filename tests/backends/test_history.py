"""HistoryStore: resolve / keep / forget, misses, LRU by tokens, lengths-only mode."""

from __future__ import annotations

import pickle
import tracemalloc

import pytest

from rollart_nb.backends.history import HistoryStore
from rollart_nb.errors import ConfigError, GenerationError, HistoryMiss
from rollart_nb.protocols import GenerationRequest


def req(traj, ids, prefix=0):
    return GenerationRequest(traj, "math", list(ids), prefix_len=prefix)


def test_resolve_rebuilds_the_whole_prompt():
    s = HistoryStore(name="g0")
    assert s.resolve(req("t", [1, 2])) == [1, 2]
    s.keep("t", [1, 2, 3])
    assert s.held("t") == 3 and "t" in s
    assert s.resolve(req("t", [4], prefix=3)) == [1, 2, 3, 4]
    assert s.resolve(req("t", [9, 9])) == [9, 9]  # prefix_len 0: the request is whole
    st = s.stats()
    assert st["hits"] == 1 and st["resolved_tokens"] == 3 and st["tokens"] == 3 and st["trajectories"] == 1


def test_a_missing_or_different_history_is_a_miss():
    s = HistoryStore(name="g0")
    with pytest.raises(HistoryMiss) as e:
        s.resolve(req("t", [4], prefix=3))
    assert isinstance(e.value, GenerationError) and e.value.held is None and "g0" in str(e.value)
    s.keep("t", [1, 2])
    with pytest.raises(HistoryMiss) as e:
        s.resolve(req("t", [4], prefix=3))
    assert e.value.held == 2 and e.value.expected == 3
    back = pickle.loads(pickle.dumps(e.value))  # crosses Ray as it is
    assert isinstance(back, HistoryMiss) and (back.traj_id, back.expected, back.held) == ("t", 3, 2)
    s.forget("t")
    assert s.held("t") is None and s.stats()["misses"] == 2 and s.stats()["tokens"] == 0


def test_least_recently_used_histories_go_first_beyond_the_budget():
    s = HistoryStore(max_tokens=10)
    s.keep("a", range(4))
    s.keep("b", range(4))
    s.resolve(req("a", [], prefix=4))  # a is used again: b is now the oldest
    s.keep("c", range(4))
    assert "a" in s and "b" not in s and "c" in s and s.stats()["evicted"] == 1
    s.keep("huge", range(11))  # longer than the budget: not kept at all
    assert "huge" not in s and s.stats()["tokens"] == 8


def test_lengths_only():
    s = HistoryStore(keep_ids=False)
    s.keep_length("t", 5)
    assert s.full_len(req("t", [1, 2], prefix=5)) == 7
    with pytest.raises(HistoryMiss):
        s.full_len(req("t", [1], prefix=6))
    s.keep_length("t", 5, response_elsewhere=True)  # a PD prefill: the response is made elsewhere
    assert s.full_len(req("t", [1], prefix=9)) == 10
    with pytest.raises(HistoryMiss):
        s.full_len(req("t", [1], prefix=4))
    with pytest.raises(ConfigError):
        s.resolve(req("t", [1]))
    with pytest.raises(ConfigError):
        HistoryStore().keep_length("t", 3)
    with pytest.raises(ConfigError):
        HistoryStore(max_tokens=-1)


def test_ids_are_stored_compactly():
    s = HistoryStore()
    ids = list(range(100_000))
    tracemalloc.start()
    try:
        s.keep("t", ids)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 5 * len(ids)  # 4 bytes an id
