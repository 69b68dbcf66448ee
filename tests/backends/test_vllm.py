"""VLLMBackend on vLLM's CPU build: token-id generation, HF-equal logprobs, versioned reloads, abort.

One engine for the whole module (starting one costs ~20-70 s on CPU). Tests that change the
weights come after those that need the initial ones and leave the engine on a known state.
Run with the virtualenv of ``.ci/install-vllm.sh``:
``/opt/rollart-vllm/bin/python -m pytest tests/backends/test_vllm.py``.
"""

import asyncio
import sys
import threading
import time

import pytest
import torch

from rollart_nb.algo import GRPO
from rollart_nb.backends import TorchTrainBackend
from rollart_nb.errors import ConfigError, GenerationError, WeightSyncError
from rollart_nb.models import format_history, tiny_qwen
from rollart_nb.protocols import GenerationBackend, GenerationRequest
from rollart_nb.trajectory import Trajectory, Turn

# float32 on both sides. Measured max |vLLM - transformers| over 1843 sampled tokens (T in
# {0, 0.7, 1, 1.3}), before and after a weight reload: 9.5e-7 (same math, other kernels and
# summation order). 1e-4 leaves room for other CPUs' kernels, while a tempered logprob, a
# wrong position or a stale weight is off by >= 1e-2 here.
TOL = 1e-4


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return tiny_qwen(seed=0, path=str(tmp_path_factory.mktemp("m") / "tiny"))


@pytest.fixture(scope="module")
def engine(ref):
    pytest.importorskip("vllm")
    from rollart_nb.backends.vllm import VLLMBackend

    be = VLLMBackend(ref, dtype="float32", seed=0)
    # The first request pays vLLM's lazy set-up (seconds on CPU); keep it out of timed tests.
    asyncio.run(be.generate(GenerationRequest("warmup", "t", [5, 6], max_new_tokens=2)))
    yield be
    be.close()


@pytest.fixture(scope="module")
def trainer(ref):
    """The reference: transformers float32 logprobs (what the trainer recomputes)."""
    return TorchTrainBackend(ref, GRPO(group_size=4, lr=3e-3), seed=0)


def encode(be, *turns):
    return be.tokenizer.encode(format_history(turns))


def req(traj, prompt, **kw):
    return GenerationRequest(traj_id=traj, task="t", prompt_ids=prompt, **kw)


def gen(be, *requests):
    async def run():
        return await asyncio.gather(*[be.generate(r) for r in requests])

    return asyncio.run(run())


def max_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def train_towards(trainer, prompt, target, steps):
    """Hand-made groups: `target` earns 1, other tokens 0 -> greedy moves to `target`."""
    for step in range(steps):
        batch = []
        for j, tok in enumerate([target, target + 1, target + 2, target + 3]):
            t = Trajectory(task="t", group_id=f"g{trainer.version}-{step}")
            t.turns.append(Turn("say 3", prompt_ids=prompt, response_ids=[tok], loss_mask=[1]))
            t.reward = 1.0 if j == 0 else 0.0
            batch.append(t)
        trainer.train_step(batch)


def test_missing_vllm_raises_config_error_naming_the_install(ref, monkeypatch):
    from rollart_nb.backends.vllm import VLLMBackend

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail, installed or not
    with pytest.raises(ConfigError, match="install-vllm.sh"):
        VLLMBackend(ref)


@pytest.mark.vllm
def test_generates_token_ids_and_logprobs(engine):
    assert isinstance(engine, GenerationBackend) and engine.version == 0
    (r,) = gen(engine, req("a", encode(engine, ("say 3", None)), max_new_tokens=8, seed=1))
    assert r.worker == "vllm" and r.version == 0 and r.recomputed_tokens == 0
    assert len(r.token_ids) == len(r.logprobs) > 0 and all(lp <= 0 for lp in r.logprobs)
    assert r.finish_reason in {"stop", "length"}
    assert r.text == engine.tokenizer.decode(r.token_ids, skip_special_tokens=True)


@pytest.mark.vllm
def test_logprobs_match_transformers_at_any_temperature(engine, trainer):
    prompts = [
        encode(engine, ("say 3", None)),
        encode(engine, ("what is 12+3? answer with a number", None)),
        encode(engine, ("go left", "left"), ("you fell into a hole", None)),
    ]
    temps = [1.0, 0.7, 0.0, 1.3]
    results = gen(
        engine,
        *[req(f"lp{i}", prompts[i % 3], max_new_tokens=12, seed=i, temperature=temps[i % 4]) for i in range(12)],
    )
    worst = 0.0
    for i, r in enumerate(results):
        worst = max(worst, max_diff(trainer.logprobs(prompts[i % 3], r.token_ids), r.logprobs))
    # raw (temperature-1) logprobs: a tempered one would be off by far more than TOL
    assert worst <= TOL, worst


@pytest.mark.vllm
def test_score_reproduces_the_sampler_under_one_version(engine, trainer):
    prompts = [encode(engine, ("say 3", None)), encode(engine, ("go left", "left"), ("you fell", None))]
    results = gen(engine, *[req(f"sc{i}", p, max_new_tokens=8, seed=i, temperature=0.7) for i, p in enumerate(prompts)])
    rows = [p + r.token_ids for p, r in zip(prompts, results, strict=True)]
    scored = asyncio.run(engine.score(rows))
    assert scored.version == engine.version and [len(r) for r in scored.rows] == [len(r) - 1 for r in rows]
    for p, r, lps in zip(prompts, results, scored.rows, strict=True):
        assert max_diff(lps[len(p) - 1 :], r.logprobs) <= TOL  # raw: a tempered logprob is off by far more
    assert max_diff(scored.rows[0], trainer.logprobs(rows[0][:1], rows[0][1:])) <= TOL
    with pytest.raises(GenerationError, match="does not fit"):
        asyncio.run(engine.score([[5] * (engine.max_len + 1)]))


@pytest.mark.vllm
def test_seeded_sampling_is_reproducible_and_greedy_is_argmax(engine, trainer):
    prompt = encode(engine, ("hello world again", None))
    a, b, c = gen(
        engine,
        req("s1", prompt, max_new_tokens=10, seed=7),
        req("s2", prompt, max_new_tokens=10, seed=7),
        req("s3", prompt, max_new_tokens=10, seed=8),
    )
    assert a.token_ids == b.token_ids != c.token_ids
    (g,) = gen(engine, req("g", prompt, max_new_tokens=5, temperature=0.0))
    ids = list(prompt)
    for tok in g.token_ids:  # each greedy token is the argmax under transformers too
        with torch.no_grad():
            logits = trainer.model(input_ids=torch.tensor([ids])).logits[0, -1]
        assert tok == int(logits.argmax())
        ids.append(tok)
    assert g.finish_reason == "length" and len(g.token_ids) == 5


@pytest.mark.vllm
def test_stop_string_ends_the_response(engine):
    prompt = encode(engine, ("say 3", None))
    (full,) = gen(engine, req("st", prompt, max_new_tokens=8, seed=11))
    k = next(i for i, t in enumerate(full.token_ids) if engine.tokenizer.decode([t], skip_special_tokens=True))
    stop = engine.tokenizer.decode([full.token_ids[k]], skip_special_tokens=True)
    (cut,) = gen(engine, req("st", prompt, max_new_tokens=8, seed=11, stop=[stop]))
    assert cut.token_ids == full.token_ids[: k + 1] and cut.finish_reason == "stop"
    assert cut.text.endswith(stop)


@pytest.mark.vllm
def test_bad_prompts_and_weights_are_rejected(engine, trainer):
    with pytest.raises(GenerationError, match="empty prompt"):
        gen(engine, req("e", []))
    with pytest.raises(GenerationError, match="does not fit"):
        gen(engine, req("e", [5] * (engine.max_len + 1)))
    bad = trainer.state_dict()
    bad.pop("model.norm.weight")
    bad["model.embed_tokens.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightSyncError, match="missing.*model.norm.weight"):
        engine.load_weights(bad, 5)
    assert engine.version == 0


@pytest.mark.vllm
def test_abort_returns_promptly_with_partial_tokens(engine):
    prompt = encode(engine, ("go left", None))

    async def run():
        long = asyncio.create_task(engine.generate(req("long", prompt, temperature=0.0, max_new_tokens=3000)))
        await asyncio.sleep(1.0)
        t0 = time.perf_counter()
        await engine.abort("long")
        result = await long
        return result, time.perf_counter() - t0

    result, waited = asyncio.run(run())
    assert result.finish_reason == "abort" and 0 < len(result.token_ids) < 3000
    assert len(result.logprobs) == len(result.token_ids)
    assert waited < 1.0, waited
    (after,) = gen(engine, req("long", prompt, max_new_tokens=2, seed=0))  # engine still serves
    assert len(after.token_ids) == 2


@pytest.mark.vllm
def test_weight_update_changes_greedy_output_and_every_later_version(engine, trainer):
    prompt = encode(engine, ("say 3", None))
    three = engine.tokenizer.convert_tokens_to_ids("3")
    (before,) = gen(engine, req("w", prompt, temperature=0.0, max_new_tokens=1))
    assert before.token_ids != [three] and before.version == 0
    train_towards(trainer, prompt, three, steps=12)

    async def run():
        # One request in flight when the load starts: it must finish whole under version 0,
        # and requests that arrive during the load wait for it and get the new version.
        go = encode(engine, ("go left", None))  # greedy runs 1200+ tokens without EOS here
        running = asyncio.create_task(engine.generate(req("r", go, temperature=0.0, max_new_tokens=400)))
        while not engine._running:
            await asyncio.sleep(0.005)
        loader = threading.Thread(target=engine.load_weights, args=(trainer.state_dict(), trainer.version))
        loader.start()
        while engine._ready.is_set():  # the gate closes once the state is serialized
            await asyncio.sleep(0.001)
        overlapped = engine._running > 0 and engine.version == 0
        late = [asyncio.create_task(engine.generate(req(f"l{i}", prompt, max_new_tokens=3, seed=i))) for i in range(4)]
        held = asyncio.create_task(engine.generate(req("held", prompt, max_new_tokens=3)))
        await asyncio.sleep(0.01)
        await engine.abort("held")  # a request held by the load can be aborted too
        held = await held
        out = await asyncio.gather(running, *late)
        await asyncio.to_thread(loader.join)
        return overlapped, held, out

    overlapped, held, (running, *late) = asyncio.run(run())
    assert overlapped  # the load really waited for a running request
    assert held.finish_reason == "abort" and held.token_ids == []
    assert engine.version == trainer.version == 12
    assert running.version == 0 and len(running.token_ids) == 400
    assert {r.version for r in late} == {12}
    (after,) = gen(engine, req("w", prompt, temperature=0.0, max_new_tokens=1))
    assert after.token_ids == [three] and after.version == 12
    # the reload reached every weight (tied embeddings, fused qkv/gate_up): same numbers as HF
    for r in late:
        assert max_diff(trainer.logprobs(prompt, r.token_ids), r.logprobs) <= TOL


@pytest.mark.vllm
def test_next_turn_after_update_recomputes_kv_like_a_fresh_prefill(engine, trainer):
    p1 = encode(engine, ("say 3", None))
    (r1,) = gen(engine, req("kv", p1, max_new_tokens=4, seed=3))
    p2 = p1 + r1.token_ids + engine.tokenizer.encode(" <eos> <|user|> again <|assistant|>")
    (same,) = gen(engine, req("kv", p2, max_new_tokens=4, seed=3))
    assert same.recomputed_tokens == 0  # no weight change: nothing to recompute

    train_towards(trainer, p1, 7, steps=3)
    engine.load_weights(trainer.state_dict(), trainer.version)
    p3 = p2 + same.token_ids + engine.tokenizer.encode(" <eos> <|user|> go <|assistant|>")
    (r3,) = gen(engine, req("kv", p3, max_new_tokens=6, seed=5))
    assert r3.version == trainer.version and r3.recomputed_tokens == len(p3)
    fresh = engine.recompute(p3 + r3.token_ids)[len(p3) - 1 :]  # prompt logprobs: no prefix cache
    assert max_diff(fresh, r3.logprobs) <= TOL
    assert max_diff(trainer.logprobs(p3, r3.token_ids), r3.logprobs) <= TOL
    (again,) = gen(engine, req("kv2", p3, max_new_tokens=6, seed=5))  # now a prefix-cache hit
    assert again.token_ids == r3.token_ids and max_diff(again.logprobs, r3.logprobs) <= TOL
