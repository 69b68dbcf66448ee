"""HFBackend: batched generation whose logprobs the trainer reproduces, versioned weights."""

import asyncio
import threading

import pytest
import torch

from rollart_nb.algo import GRPO
from rollart_nb.backends import HFBackend, TorchTrainBackend
from rollart_nb.errors import GenerationError, WeightSyncError
from rollart_nb.models import format_history, tiny_qwen
from rollart_nb.protocols import GenerationBackend, GenerationRequest
from rollart_nb.trajectory import Trajectory, Turn


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return tiny_qwen(seed=0, path=str(tmp_path_factory.mktemp("m") / "tiny"))


@pytest.fixture()
def backend(ref):
    return HFBackend(ref, batch_wait_s=0.02)


def encode(be, *turns):
    return be.tokenizer.encode(format_history(turns))


def req(traj, prompt, **kw):
    return GenerationRequest(traj_id=traj, task="t", prompt_ids=prompt, **kw)


def test_implements_protocol(backend):
    assert isinstance(backend, GenerationBackend)
    assert backend.version == 0


def test_batched_logprobs_match_trainer(ref, backend):
    prompts = [
        encode(backend, ("say 3", None)),
        encode(backend, ("what is 12+3? answer with a number", None)),
        encode(backend, ("go left", "left"), ("you fell into a hole", None)),
    ]

    async def run():
        return await asyncio.gather(
            *[backend.generate(req(f"t{i}", prompts[i % 3], max_new_tokens=6, seed=i)) for i in range(9)]
        )

    results = asyncio.run(run())
    assert backend.stats["batches"] == 1 and backend.stats["requests"] == 9  # served together
    trainer = TorchTrainBackend(ref, GRPO())
    for i, r in enumerate(results):
        assert r.version == 0 and r.worker == "hf" and len(r.token_ids) == len(r.logprobs) > 0
        expected = trainer.logprobs(prompts[i % 3], r.token_ids)
        assert max(abs(a - b) for a, b in zip(expected, r.logprobs, strict=True)) <= 1e-4


def test_seeded_sampling_does_not_depend_on_batch_mates(backend):
    prompt = encode(backend, ("say 3", None))

    async def run():
        alone = await backend.generate(req("a", prompt, max_new_tokens=8, seed=7))
        crowd = await asyncio.gather(
            backend.generate(req("b", encode(backend, ("hello world again", None)), max_new_tokens=3, seed=1)),
            backend.generate(req("c", prompt, max_new_tokens=8, seed=7)),
        )
        other = await backend.generate(req("d", prompt, max_new_tokens=8, seed=8))
        return alone, crowd[1], other

    alone, in_batch, other = asyncio.run(run())
    assert alone.token_ids == in_batch.token_ids
    assert other.token_ids != alone.token_ids


def test_greedy_is_argmax_and_stops_at_length_or_stop_string(backend):
    prompt = encode(backend, ("say 3", None))

    async def run(**kw):
        return await backend.generate(req("g", prompt, temperature=0.0, **kw))

    r1, r2 = asyncio.run(run(max_new_tokens=5)), asyncio.run(run(max_new_tokens=5))
    assert r1.token_ids == r2.token_ids and r1.finish_reason == "length" and len(r1.token_ids) == 5
    with torch.no_grad():
        logits = backend.model(torch.tensor([prompt])).logits[0, -1]
    assert r1.token_ids[0] == int(logits.argmax())
    # Stop strings: cut right after the first token whose text contains one.
    sampled = asyncio.run(backend.generate(req("s", prompt, max_new_tokens=6, seed=11)))
    k = next(i for i, t in enumerate(sampled.token_ids) if backend.tokenizer.decode([t], skip_special_tokens=True))
    stop = backend.tokenizer.decode([sampled.token_ids[k]], skip_special_tokens=True)
    cut = asyncio.run(backend.generate(req("s", prompt, max_new_tokens=6, seed=11, stop=[stop])))
    assert cut.token_ids == sampled.token_ids[: k + 1] and cut.finish_reason == "stop"
    assert cut.text.endswith(stop)


def _train_towards(ref, prompt, target, steps=12):
    """Hand-made groups: `target` earns 1, other tokens 0 -> greedy moves to `target`."""
    trainer = TorchTrainBackend(ref, GRPO(group_size=4, lr=3e-3), seed=0)
    for step in range(steps):
        batch = []
        for j, tok in enumerate([target, target + 1, target + 2, target + 3]):
            t = Trajectory(task="t", group_id=f"g{step}")
            t.turns.append(Turn("say 3", prompt_ids=prompt, response_ids=[tok], loss_mask=[1]))
            t.reward = 1.0 if j == 0 else 0.0
            batch.append(t)
        trainer.train_step(batch)
    return trainer


def test_load_weights_changes_greedy_output_and_version(ref, backend):
    prompt = encode(backend, ("say 3", None))
    three = backend.tokenizer.convert_tokens_to_ids("3")

    def greedy():
        return asyncio.run(backend.generate(req("w", prompt, temperature=0.0, max_new_tokens=1)))

    before = greedy()
    assert before.token_ids != [three] and before.version == 0
    trainer = _train_towards(ref, prompt, three)
    backend.load_weights(trainer.state_dict(), trainer.version)
    after = greedy()
    assert after.token_ids == [three] and after.version == trainer.version == 12
    assert abs(after.logprobs[0] - trainer.logprobs(prompt, [three])[0]) <= 1e-4


def test_score_reproduces_the_sampler_at_any_temperature_and_follows_the_weights(ref, backend):
    prompts = [encode(backend, ("say 3", None)), encode(backend, ("go left", "left"), ("you fell", None))]

    async def sample():
        return await asyncio.gather(
            *[
                backend.generate(req(f"s{i}", p, max_new_tokens=8, seed=i, temperature=0.7))
                for i, p in enumerate(prompts)
            ]
        )

    results = asyncio.run(sample())
    rows = [p + r.token_ids for p, r in zip(prompts, results, strict=True)]
    scored = asyncio.run(backend.score(rows))
    assert scored.version == 0 and [len(r) for r in scored.rows] == [len(r) - 1 for r in rows]
    for p, r, lps in zip(prompts, results, scored.rows, strict=True):
        # the sampler's temperature-1 logprobs; tempered ones would be off by far more
        assert max(abs(a - b) for a, b in zip(lps[len(p) - 1 :], r.logprobs, strict=True)) <= 1e-4
    assert scored.rows[0] == pytest.approx(backend.recompute(rows[0]), abs=1e-6)
    trainer = _train_towards(ref, prompts[0], backend.tokenizer.convert_tokens_to_ids("3"), steps=2)
    backend.load_weights(trainer.state_dict(), trainer.version)
    after = asyncio.run(backend.score(rows[:1]))
    assert after.version == 2 and max(abs(a - b) for a, b in zip(after.rows[0], scored.rows[0], strict=True)) > 1e-3
    with pytest.raises(GenerationError, match="does not fit"):
        asyncio.run(backend.score([[5] * (backend.max_len + 1)]))


def test_load_weights_rejects_mismatch_and_changes_nothing(backend):
    state = {k: v.clone() for k, v in backend.model.state_dict().items()}
    bad = dict(state)
    bad.pop("model.norm.weight")
    bad["model.embed_tokens.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightSyncError, match="missing.*model.norm.weight"):
        backend.load_weights(bad, 5)
    assert backend.version == 0
    assert all(torch.equal(v, state[k]) for k, v in backend.model.state_dict().items())


def test_recompute_after_weight_update_equals_fresh_prefill(ref, backend):
    p1 = encode(backend, ("say 3", None))

    async def turn(prompt):
        return await backend.generate(req("traj", prompt, max_new_tokens=4, seed=3))

    r1 = asyncio.run(turn(p1))
    assert r1.recomputed_tokens == 0
    three = backend.tokenizer.convert_tokens_to_ids("3")
    trainer = _train_towards(ref, p1, three, steps=3)
    backend.load_weights(trainer.state_dict(), trainer.version)
    p2 = p1 + r1.token_ids + backend.tokenizer.encode(" <eos> <|user|> again <|assistant|>")
    r2 = asyncio.run(turn(p2))
    assert r2.version == 3 and r2.recomputed_tokens == len(p2)
    fresh = backend.recompute(p2 + r2.token_ids)[len(p2) - 1 :]
    assert max(abs(a - b) for a, b in zip(fresh, r2.logprobs, strict=True)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(trainer.logprobs(p2, r2.token_ids), r2.logprobs, strict=True)) <= 1e-4


def test_abort_queued_and_in_flight(backend):
    prompt = encode(backend, ("go left", None))
    backend.batch_wait_s = 0.0

    async def run():
        long = asyncio.create_task(backend.generate(req("long", prompt, temperature=0.0, max_new_tokens=3000)))
        while not backend._running:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        queued = asyncio.create_task(backend.generate(req("queued", prompt, max_new_tokens=4)))
        await asyncio.sleep(0)
        await backend.abort("queued")
        await backend.abort("long")
        return await long, await queued

    long, queued = asyncio.run(run())
    assert queued.finish_reason == "abort" and queued.token_ids == []
    assert long.finish_reason == "abort" and 0 < len(long.token_ids) < 3000


def test_weight_load_waits_for_the_running_batch(ref, backend):
    prompt = encode(backend, ("go left", None))
    v0_state = {k: v.clone() for k, v in backend.model.state_dict().items()}
    trainer = _train_towards(ref, prompt, 5, steps=2)
    blocked = []

    async def run():
        task = asyncio.create_task(backend.generate(req("x", prompt, temperature=0.0, max_new_tokens=300)))
        while not backend._running:
            await asyncio.sleep(0.005)
        loader = threading.Thread(target=backend.load_weights, args=(trainer.state_dict(), 2))
        loader.start()
        await asyncio.sleep(0.05)
        if backend._running:  # batch still decoding: the load must be waiting for it
            blocked.append(loader.is_alive() and backend.version == 0)
        result = await task
        await asyncio.to_thread(loader.join)
        return result

    result = asyncio.run(run())
    assert result.version == 0 and backend.version == 2
    assert blocked == [True]
    check = HFBackend(ref)
    check.load_weights(v0_state, 0)
    assert check.recompute(prompt + result.token_ids)[len(prompt) - 1 :] == pytest.approx(result.logprobs, abs=1e-5)


def test_bad_prompts_raise(backend):
    with pytest.raises(GenerationError, match="empty prompt"):
        asyncio.run(backend.generate(req("e", [])))
    with pytest.raises(GenerationError, match="does not fit"):
        asyncio.run(backend.generate(req("e", [5] * 5000)))


def test_kv_reuse_across_turns_matches_fresh_prefill(ref):
    """Turn 2 of a trajectory prefills only its new tokens, batched with a row that has no
    history and a row whose prompt diverges from its cache; all rows equal a fresh prefill."""
    reuse, fresh = HFBackend(ref, batch_wait_s=0.02), HFBackend(ref, batch_wait_s=0.02, kv_reuse=False)
    first = {"a": encode(reuse, ("go left", None)), "b": encode(reuse, ("what is 2+3 ?", None))}

    async def turn(be, prompts):
        return await asyncio.gather(*[be.generate(req(t, p, max_new_tokens=5, seed=7)) for t, p in prompts.items()])

    r1 = asyncio.run(turn(reuse, first))
    assert reuse.stats["reused_tokens"] == 0 and reuse.stats["prefill_tokens"] == sum(map(len, first.values()))
    more = reuse.tokenizer.encode(" <eos> <|user|> you fell into a hole <|assistant|>")
    second = {
        "a": first["a"] + r1[0].token_ids + more,  # extends its cache: only the new tokens prefill
        "b": first["b"][:3] + more,  # shares 3 tokens with its cache
        "c": encode(reuse, ("go up", None)),  # no history
    }
    r2 = asyncio.run(turn(reuse, second))
    assert reuse.stats["batches"] == 2
    held = len(first["a"]) + len(r1[0].token_ids) - 1  # the last sampled token was never fed
    assert reuse.stats["reused_tokens"] == min(held, len(second["a"]) - 1) + 3
    want = asyncio.run(turn(fresh, second))
    trainer = TorchTrainBackend(ref, GRPO())
    for (t, p), got, exp in zip(second.items(), r2, want, strict=True):
        assert got.token_ids == exp.token_ids, t  # same seed, same weights: same sample
        assert got.logprobs == pytest.approx(exp.logprobs, abs=1e-5), t
        assert got.logprobs == pytest.approx(trainer.logprobs(p, got.token_ids), abs=1e-4), t
    # A weight update drops every cached KV: the next turn recomputes its whole history.
    before = reuse.stats["reused_tokens"]
    reuse.load_weights(reuse.model.state_dict(), 1)
    third = {"a": second["a"] + r2[0].token_ids + more}
    (r3,) = asyncio.run(turn(reuse, third))
    assert reuse.stats["reused_tokens"] == before and r3.recomputed_tokens == len(third["a"])
    # An aborted trajectory's KV is dropped too; the cache stays within its token budget.
    asyncio.run(reuse.abort("a"))
    asyncio.run(turn(reuse, {"d": first["a"]}))
    assert "a" not in reuse._kv and reuse._kv_held == sum(len(kv.ids) for kv in reuse._kv.values())
    small = HFBackend(ref, kv_cache_tokens=len(first["a"]) + 10)
    asyncio.run(turn(small, first))
    assert small._kv_held <= small.kv_cache_tokens and list(small._kv) == ["b"]  # least recent out


def test_last_turn_keeps_no_kv_and_samples_the_same(ref):
    """A request marked ``last_turn`` leaves no KV behind (nothing would reuse it); its sample and
    logprobs are those of a backend without KV reuse, and a batch mate's KV is still kept."""
    be, plain = HFBackend(ref, batch_wait_s=0.02), HFBackend(ref, batch_wait_s=0.02, kv_reuse=False)
    prompts = {"a": encode(be, ("go left", None)), "b": encode(be, ("what is 2+3 ?", None))}

    async def go(backend):
        return await asyncio.gather(
            *[backend.generate(req(t, p, max_new_tokens=5, seed=3, last_turn=t == "a")) for t, p in prompts.items()]
        )

    got, want = asyncio.run(go(be)), asyncio.run(go(plain))
    assert be.stats["batches"] == 1
    assert "a" not in be._kv and "b" in be._kv and be._kv_held == len(be._kv["b"].ids)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and g.logprobs == pytest.approx(w.logprobs, abs=1e-6)


def test_sample_rows_follows_the_tempered_softmax_and_never_draws_a_zero_probability_token():
    import torch

    from rollart_nb.backends.hf import sample_rows

    logits = torch.tensor([[2.0, 1.0, 0.0, float("-inf"), -1.0]] * 2)
    temps = torch.tensor([1.0, 0.5])
    n = 20_000
    counts = torch.zeros(2, 5)
    for k in range(n // 100):
        gens = [torch.Generator().manual_seed(k * 1000 + j) for j in range(100)]
        # rows alternate between the two temperatures
        got = sample_rows(logits[[j % 2 for j in range(100)]], temps[[j % 2 for j in range(100)]], gens)
        counts[0] += torch.bincount(got[0::2], minlength=5)
        counts[1] += torch.bincount(got[1::2], minlength=5)
    assert counts[:, 3].sum() == 0  # -inf logit: never
    freq = counts / counts.sum(-1, keepdim=True)
    expected = torch.softmax(logits / temps[:, None], -1)
    # 10k draws per row: standard error <= 0.005, so 0.02 is a 4-sigma band
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)
    # the same generator state gives the same token whatever the rest of the batch holds
    a = sample_rows(logits[:1], temps[:1], [torch.Generator().manual_seed(5)])
    b = sample_rows(
        torch.cat([torch.randn(3, 5), logits[:1]]),
        torch.ones(4),
        [torch.Generator().manual_seed(s) for s in (1, 2, 3, 5)],
    )
    assert int(a[0]) == int(b[3])


def test_prefix_and_tail_equals_whole_history(ref):
    """Turns sent as (held prefix, new tokens) sample what the whole history sends; a prefix the
    backend does not hold (forgotten, or a fresh backend) raises HistoryMiss."""
    from rollart_nb.errors import HistoryMiss

    split, whole = HFBackend(ref, batch_wait_s=0.0), HFBackend(ref, batch_wait_s=0.0)
    more = split.tokenizer.encode(" <eos> <|user|> you fell into a hole <|assistant|>")
    history, held = encode(split, ("go left", None)), 0
    for k in range(3):
        a = asyncio.run(split.generate(req("t", history[held:], max_new_tokens=5, seed=k, prefix_len=held)))
        b = asyncio.run(whole.generate(req("t", list(history), max_new_tokens=5, seed=k)))
        assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        history = history + a.token_ids
        held = len(history)
        assert split.history.held("t") == held
        history += more
    assert split.history.stats()["hits"] == 2 and split.history.stats()["resolved_tokens"] > 0
    with pytest.raises(HistoryMiss):
        asyncio.run(HFBackend(ref).generate(req("t", history[held:], prefix_len=held)))
    split.forget("t")
    with pytest.raises(HistoryMiss):
        asyncio.run(split.generate(req("t", history[held:], prefix_len=held)))
    asyncio.run(whole.abort("t"))
    assert "t" not in whole.history
