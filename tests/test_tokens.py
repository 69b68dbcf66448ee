"""TokenSeq / TokenView: a read-only list of ids over one shared buffer, pickled once."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Sequence

import pytest

from rollart_nb.tokens import TokenSeq, TokenView, starts_with
from rollart_nb.trajectory import Trajectory, Turn


def test_a_view_behaves_as_a_read_only_list():
    seq = TokenSeq([5, 6, 7])
    v = seq.view(1, 3)
    assert isinstance(v, Sequence) and len(v) == 2 and list(v) == [6, 7]
    assert v[0] == 6 and v[-1] == 7 and v[:1] == [6] and v[::-1] == [7, 6] and type(v[:]) is list
    with pytest.raises(IndexError):
        v[2]
    assert v == [6, 7] and [6, 7] == v and v != [6] and v == (6, 7) and v == seq.view(1, 3)
    assert v + [8] == [6, 7, 8] and [4] + v == [4, 6, 7] and v + v == [6, 7, 6, 7]
    assert repr(v) == "[6, 7]" and 7 in v and v.index(7) == 1 and v.count(6) == 1
    with pytest.raises(TypeError):
        v[0] = 1
    with pytest.raises(TypeError):
        hash(v)
    grown = seq.extend([8, 9])
    assert grown == [8, 9] and v == [6, 7] and len(seq) == 5  # appends leave earlier views alone
    assert seq.view() == [5, 6, 7, 8, 9] and not TokenView(seq.buffer, 2, 2)
    with pytest.raises(IndexError):
        TokenView(seq.buffer, 3, 9)


def test_views_pickle_with_one_shared_buffer():
    seq = TokenSeq(range(10_000))
    views = [seq.view(0, k) for k in range(0, 10_000, 500)]
    blob = pickle.dumps(views)
    assert len(blob) < 4 * 10_000 + 4_000  # the buffer once, 4 bytes an id
    back = pickle.loads(blob)
    assert back == views and all(back[0].same_buffer(v) for v in back)
    deep = copy.deepcopy(views)
    assert deep == views and deep[1].same_buffer(deep[2]) and not deep[1].same_buffer(views[1])


def test_starts_with_by_position_and_by_value():
    seq = TokenSeq([1, 2, 3])
    p = seq.view(0, 2)
    r = seq.view(2, 3)
    seq.extend([4, 5])
    nxt = seq.view(0, 5)
    assert starts_with(nxt, (p, r)) and not starts_with(p, (p, r))
    assert starts_with([1, 2, 3, 4], ([1, 2], [3])) and not starts_with([1, 2, 9], ([1, 2], [3]))
    assert starts_with(nxt, ([1, 2], r)) and not starts_with(nxt, ([1, 9], r))


def test_turns_built_with_lists_or_views_serialize_alike():
    seq = TokenSeq([5, 6, 7, 8])
    t_view = Turn("o", prompt_ids=seq.view(0, 3), response_ids=seq.view(3, 4), logprobs=[-0.1], loss_mask=[1])
    t_list = Turn("o", prompt_ids=[5, 6, 7], response_ids=[8], logprobs=[-0.1], loss_mask=[1])
    assert t_view == t_list and t_view.to_dict() == t_list.to_dict() and t_view.num_tokens == 4
    traj = Trajectory(task="x", turns=[t_view, t_list])
    assert Trajectory.from_dict(traj.to_dict()).turns == [t_list, t_list]
