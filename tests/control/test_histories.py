"""A trajectory's token history is shipped to the generator once and stored once.

The EnvManager sends each turn only the tokens the generator does not hold (``prefix_len``
counts those it does), resends the whole history once when the generator lost it
(:class:`HistoryMiss`), and records every turn's ids as views of one per-trajectory buffer.
"""

from __future__ import annotations

import asyncio
import gc
import json
import pickle
import tracemalloc

import pytest

from rollart_nb.control.env_manager import EnvManager, RolloutConfig
from rollart_nb.errors import HistoryMiss
from rollart_nb.models.spec import spec
from rollart_nb.protocols import GenerationRequest, GenerationResult
from rollart_nb.resources.profiles import PROFILES
from rollart_nb.sim import SimBackend, SimTokenizer
from rollart_nb.tokens import Tokens, TokenView
from rollart_nb.trajectory import Trajectory

M = spec("qwen3-0.6b")


class Talk:
    """An async env of ``max_turns`` turns whose observations are ``words`` words long."""

    def __init__(self, max_turns: int = 4, words: int = 12) -> None:
        self.max_turns, self.words, self.k = max_turns, words, 0

    async def areset(self, seed=None):
        self.k = 0
        return " ".join(f"hello{seed}_{i}" for i in range(self.words)), {}

    async def astep(self, action):
        self.k += 1
        obs = " ".join(f"obs{self.k}_{i % 50}" for i in range(self.words))
        return obs, 0.5, False, False, {}

    # sync fallbacks the Env protocol names; the EnvManager prefers the async ones
    def reset(self, seed=None):
        return asyncio.run(self.areset(seed))

    def step(self, action):
        return asyncio.run(self.astep(action))


class Recording:
    """A proxy that forwards to a backend and records what each request carried."""

    def __init__(self, backend, forget_before: set[int] = frozenset()) -> None:
        self.backend, self.forget_before = backend, set(forget_before)
        self.sent: list[tuple[int, int]] = []  # (prefix_len, len(prompt_ids)) per request
        self.calls = 0

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        if self.calls in self.forget_before:
            self.backend.forget(req.traj_id)  # an eviction between turns
        self.calls += 1
        self.sent.append((req.prefix_len, len(req.prompt_ids)))
        return await self.backend.generate(req)


def sim(name="g0"):
    return SimBackend(M, PROFILES["H20"], time_scale=0, mean_response_tokens=8, name=name, seed=3)


def rollout(proxy, *, turns=4, words=12, traj_id="t0", tok=None, max_context=100_000):
    cfg = RolloutConfig(max_turns=turns, max_new_tokens=16, max_context=max_context, env_timeout_s=None)
    em = EnvManager(0, "talk", Talk(turns, words), tok or SimTokenizer(), proxy, cfg)
    traj = Trajectory(task="talk", seed=7, id=traj_id)
    asyncio.run(em.run(traj))
    return em, traj


def ids_of(traj):
    return [(list(t.prompt_ids), list(t.response_ids), list(t.logprobs)) for t in traj.turns]


def test_each_turn_after_the_first_ships_only_new_tokens():
    proxy = Recording(sim())
    em, traj = rollout(proxy, turns=5, words=12)
    assert len(traj.turns) == 5 and traj.reason == ""
    first = len(traj.turns[0].prompt_ids)
    assert proxy.sent[0] == (0, first)
    for k in range(1, 5):
        prev, cur = traj.turns[k - 1], traj.turns[k]
        held = len(prev.prompt_ids) + len(prev.response_ids)
        assert proxy.sent[k] == (held, len(cur.prompt_ids) - held)
        assert proxy.sent[k][1] == 12 + 2  # the observation's words and the two chat tags
    assert em.history_resends == 0
    # the recorded turns still hold whole histories, each extending the last
    last = traj.turns[-1]
    assert sum(n for _, n in proxy.sent) == len(last.prompt_ids) - sum(len(t.response_ids) for t in traj.turns[:-1])


@pytest.mark.parametrize("lost_at", [1, 3])
def test_a_generator_that_lost_the_history_gets_it_resent_once(lost_at):
    _, whole = rollout(Recording(sim()), turns=5)
    proxy = Recording(sim(), forget_before={lost_at})
    em, traj = rollout(proxy, turns=5)
    assert em.history_resends == 1
    assert proxy.sent[lost_at][0] > 0 and proxy.sent[lost_at + 1][0] == 0  # the miss, then the whole history
    assert proxy.sent[lost_at + 1][1] == len(traj.turns[lost_at].prompt_ids)
    assert proxy.sent[lost_at + 2][0] > 0  # later turns send only new tokens again
    assert ids_of(traj) == ids_of(whole)
    assert proxy.backend.stats()["history_misses"] == 1


def test_a_replaced_generator_misses_and_the_trajectory_completes_identically():
    _, whole = rollout(Recording(sim()), turns=4)

    class Replacing(Recording):
        async def generate(self, req):
            if self.calls == 2:
                self.backend = sim("g1")  # the worker died and a fresh one took over
            return await super().generate(req)

    proxy = Replacing(sim())
    em, traj = rollout(proxy, turns=4)
    assert em.history_resends == 1 and traj.reason == ""
    assert ids_of(traj) == ids_of(whole)


def test_a_miss_on_a_whole_history_is_not_retried():
    class Missing:
        calls = 0

        async def generate(self, req):
            self.calls += 1
            raise HistoryMiss("nothing held", traj_id=req.traj_id)

    proxy = Missing()
    em, traj = rollout(proxy, turns=3)
    assert proxy.calls == 1 and em.history_resends == 0
    assert traj.status.value == "failed" and "nothing held" in traj.reason


def test_turn_ids_are_views_of_one_buffer_and_serialize_as_lists():
    _, traj = rollout(Recording(sim()), turns=4)
    views = [v for t in traj.turns for v in (t.prompt_ids, t.response_ids)]
    assert all(isinstance(v, TokenView) for v in views)
    assert all(views[0].same_buffer(v) for v in views)
    d = traj.to_dict()
    text = json.dumps(d)
    back = Trajectory.from_dict(json.loads(text))
    assert back.turns == traj.turns and back.to_dict() == d
    assert all(type(t["prompt_ids"]) is list and type(t["response_ids"]) is list for t in d["turns"])
    copy = pickle.loads(pickle.dumps(traj))
    assert ids_of(copy) == ids_of(traj)
    assert copy.turns[0].prompt_ids.same_buffer(copy.turns[-1].response_ids)  # still one buffer


class Wide:
    """A tokenizer that turns every observation into ``n`` ids (whatever its text)."""

    eos_token_id = 1

    def __init__(self, n: int = 1000) -> None:
        self.n = n

    def encode(self, text: str) -> list[int]:
        return [3 + (len(text) + i) % 5000 for i in range(self.n)]

    def decode(self, ids) -> str:
        return "a"


class Echo:
    """A generator that holds nothing and answers 20 fixed tokens (a fake proxy)."""

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        return GenerationResult(req.traj_id, list(range(300, 320)), [-0.5] * 20, 0, text="a", worker="echo")


def test_memory_per_token_held_is_linear():
    cfg = dict(turns=20, words=1, tok=Wide(1000), max_context=10**7)
    rollout(Echo(), **cfg)  # warm caches (loggers, asyncio) outside the measurement
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _, traj = rollout(Echo(), **cfg)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    last = traj.turns[-1]
    held = len(last.prompt_ids) + len(last.response_ids)
    assert len(traj.turns) == 20 and held == 20 * 1000 + 20 * 20
    assert grown / held < 16, f"{grown / held:.1f} bytes a token"


def test_pickle_size_grows_linearly_with_turns():
    sizes = {}
    for turns in (10, 20):
        _, traj = rollout(Echo(), turns=turns, words=1, tok=Wide(1000), max_context=10**7)
        sizes[turns] = len(pickle.dumps(traj))
    assert sizes[20] < 2.2 * sizes[10]  # a full copy per turn would make it ~4x
    assert sizes[20] < 8 * 20 * 1020  # a few bytes a token, stored once


class TalkTokens(Talk):
    """:class:`Talk` whose env tokenizes its own observations (``Tokens``), as a service would."""

    def __init__(self, tok, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tok, self.tokenized = tok, 0

    async def areset(self, seed=None):
        text, info = await super().areset(seed)
        self.tokenized += 1
        return Tokens(self.tok.encode(text), text=text), info

    async def astep(self, action):
        text, r, term, trunc, info = await super().astep(action)
        self.tokenized += 1
        return Tokens(self.tok.encode(text), text=text), r, term, trunc, info


class CountingTokenizer(SimTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return super().encode(text)


def test_an_env_that_tokenizes_its_own_observations_gives_the_same_trajectory_untokenized_here():
    """Tokens from the env go between the chat tags as they are: the same ids and text as the
    string observation, and the rollout's tokenizer only encodes the two tags, once."""
    _, as_text = rollout(Recording(sim()), turns=4, words=30)
    tok = CountingTokenizer()
    env = TalkTokens(SimTokenizer(), 4, 30)
    cfg = RolloutConfig(max_turns=4, max_new_tokens=16, max_context=100_000, env_timeout_s=None)
    em = EnvManager(0, "talk", env, tok, Recording(sim()), cfg)
    traj = Trajectory(task="talk", seed=7, id="t0")
    asyncio.run(em.run(traj))
    assert ids_of(traj) == ids_of(as_text)
    assert [t.observation for t in traj.turns] == [t.observation for t in as_text.turns]
    assert all(isinstance(t.observation, str) and t.observation for t in traj.turns)
    assert tok.calls == 2 and em.env.tokenized == 5  # the tags; the env encoded reset + 4 steps
    json.dumps(traj.to_dict())


def test_tokens_pickle_compactly_and_an_env_check_accepts_them():
    from rollart_nb.envs import check

    obs = Tokens(list(range(1000)), text="x" * 10)
    back = pickle.loads(pickle.dumps(obs))
    assert list(back.ids) == list(range(1000)) and back.text == "x" * 10 and str(back) == "x" * 10
    assert len(pickle.dumps(obs)) < 4200  # 4 bytes an id, not a pickled int each

    class Env:
        max_turns = 2

        def reset(self, seed=None):
            return Tokens([5, 6], "a b"), {}

        def step(self, action):
            return Tokens([7], "c"), 1.0, True, False, {}

    report = check(Env(), seeds=2)
    assert report.episodes == 2 and report.steps == 2 and not report.skipped, report


class Drifting(Talk):
    """Talk whose first observation changes at every reset: not deterministic for a seed."""

    async def areset(self, seed=None):
        obs, info = await super().areset(seed)
        self.resets = getattr(self, "resets", 0) + 1
        return f"{obs} reset{self.resets}", info


def test_a_recorded_prefix_is_replayed_through_the_env_and_the_rest_generated():
    proxy = Recording(sim())
    _, first = rollout(proxy, turns=4)
    sent_before = len(proxy.sent)
    cfg = RolloutConfig(max_turns=4, max_new_tokens=16, env_timeout_s=None)
    again = Trajectory(task="talk", seed=7, id="t1")
    asyncio.run(EnvManager(0, "talk", Talk(4, 12), SimTokenizer(), proxy, cfg).run(again, prefix=first.turns[:2]))
    assert [u.action for u in again.turns[:2]] == [u.action for u in first.turns[:2]]
    assert ids_of(again)[:2] == ids_of(first)[:2] and len(again.turns) == 4
    # only turns 2 and 3 were generated, the first of them with the whole history
    assert len(proxy.sent) == sent_before + 2 and proxy.sent[sent_before][0] == 0
    assert list(again.turns[2].prompt_ids[: len(first.turns[2].prompt_ids)]) == list(first.turns[2].prompt_ids)

    drifted = Trajectory(task="talk", seed=7, id="t2")  # the env now answers the same seed otherwise
    asyncio.run(EnvManager(0, "talk", Drifting(4, 12), SimTokenizer(), proxy, cfg).run(drifted, prefix=first.turns[:2]))
    assert drifted.status.value == "failed" and drifted.info["replay_mismatch"] == 0
    assert "not deterministic for seed 7" in drifted.reason and len(proxy.sent) == sent_before + 2
