"""SimBackend with histories: a request sent as prefix + tail equals the same request sent
whole, a prefix it does not hold raises HistoryMiss, and the PD path resolves on the P node."""

from __future__ import annotations

import asyncio

import pytest

from rollart_nb.errors import HistoryMiss
from rollart_nb.models.spec import spec
from rollart_nb.protocols import GenerationRequest
from rollart_nb.resources.profiles import PROFILES
from rollart_nb.sim import SimBackend
from rollart_nb.sim.workloads import response_tokens_fn, workload

Q8 = spec("qwen3-8b")
H800 = PROFILES["H800"]


def backend(**kw):
    return SimBackend(Q8, H800, time_scale=0, seed=5, **kw)


def turns(b, whole: bool, traj="t0", n=4, obs=50):
    """Run ``n`` turns; each adds ``obs`` observation tokens. Returns the results."""
    history: list[int] = []
    held = 0
    out = []
    for k in range(n):
        history += list(range(10 + k, 10 + k + obs))
        prefix = 0 if whole else held
        req = GenerationRequest(traj, "math", history[prefix:], 32, seed=k, prefix_len=prefix)
        r = asyncio.run(b.generate(req))
        out.append(r)
        history += r.token_ids
        held = len(history)
    return out


def test_prefix_and_tail_equals_whole():
    whole, split = backend(), backend()
    a, b = turns(whole, True), turns(split, False)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.logprobs for r in a] == [r.logprobs for r in b]
    assert [r.prefill_s for r in a] == pytest.approx([r.prefill_s for r in b])
    assert [r.decode_s for r in a] == pytest.approx([r.decode_s for r in b])
    assert whole.stats()["prefill_tokens"] == split.stats()["prefill_tokens"]
    assert split.history.stats()["hits"] == 3 and split.history.stats()["misses"] == 0


def test_workload_lengths_use_the_whole_prompt():
    fn = response_tokens_fn(workload("webshop"), seed=1)
    a, b = backend(response_tokens=fn), backend(response_tokens=fn)
    assert [r.token_ids for r in turns(a, True)] == [r.token_ids for r in turns(b, False)]


def test_a_prefix_not_held_raises_history_miss():
    b = backend()
    with pytest.raises(HistoryMiss) as e:
        asyncio.run(b.generate(GenerationRequest("new", "math", [5, 6], prefix_len=10)))
    assert e.value.traj_id == "new" and e.value.expected == 10 and e.value.held is None
    assert "prefix_len=0" in str(e.value)
    turns(b, False, traj="t", n=1)
    held = b.history.held("t")
    with pytest.raises(HistoryMiss):  # wrong length
        asyncio.run(b.generate(GenerationRequest("t", "math", [5], prefix_len=held + 3)))
    b.forget("t")
    with pytest.raises(HistoryMiss):
        asyncio.run(b.generate(GenerationRequest("t", "math", [5], prefix_len=held)))
    assert b.stats()["history_misses"] == 3


def test_abort_and_last_turn_drop_the_history():
    b = backend()
    turns(b, False, traj="a", n=1)
    assert "a" in b.history
    asyncio.run(b.abort("a"))
    assert "a" not in b.history
    asyncio.run(b.generate(GenerationRequest("z", "math", [5] * 20, 8, last_turn=True)))
    assert "z" not in b.history and b.stats()["history_tokens"] == 0


def test_pd_prefill_resolves_and_decode_uses_its_length():
    col = backend()
    p, d = backend(), backend()
    history: list[int] = []
    held = 0
    for k in range(3):
        history += list(range(20 + k, 60 + k))
        whole = GenerationRequest("t", "math", list(history), 32, seed=k)
        tail = GenerationRequest("t", "math", history[held:], 32, seed=k, prefix_len=held)
        c = asyncio.run(col.generate(whole))
        pre = asyncio.run(p.prefill(tail))
        assert pre["prompt_tokens"] == len(history) and not pre["aborted"]
        r = asyncio.run(d.decode(tail, pre))
        assert r.token_ids == c.token_ids and r.logprobs == c.logprobs
        history += r.token_ids
        held = len(history)
    assert len(d.history) == 0  # the decode node keeps nothing; the P node resolves histories
    with pytest.raises(HistoryMiss):
        asyncio.run(backend().prefill(GenerationRequest("t", "math", [1], prefix_len=held)))
