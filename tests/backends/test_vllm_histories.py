"""VLLMBackend histories: requests sent as (held prefix, new tokens) reach the engine whole.

The first test runs without vLLM: it replaces the engine call (``_generate``) with a recorder, so
only the backend's own history handling runs. The second needs vLLM (CPU build or GPU) and
compares a prefix + tail trajectory with the same one sent whole.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from rollart_nb.backends.history import HistoryStore
from rollart_nb.backends.vllm import VLLMBackend
from rollart_nb.errors import HistoryMiss
from rollart_nb.protocols import GenerationRequest, GenerationResult


class Recorded(VLLMBackend):
    """A VLLMBackend whose engine answers [7, 8] and records the whole prompts it was given."""

    def __init__(self) -> None:  # no engine: only the history handling around it runs
        self.name, self.version, self.max_len, self._closed = "rec", 0, 1000, False
        self._served: dict[str, int] = {}
        self.history = HistoryStore(name=self.name)
        self.prompts: list[list[int]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    async def _generate(self, request: GenerationRequest, prompt: list[int]) -> GenerationResult:
        self.prompts.append(list(prompt))
        return GenerationResult(request.traj_id, [7, 8], [-0.1, -0.2], self.version)

    async def _abort(self, traj_id: str) -> None:
        return None


def test_the_engine_sees_whole_prompts_and_misses_raise():
    be = Recorded()
    try:
        asyncio.run(be.generate(GenerationRequest("t", "x", [1, 2, 3])))
        asyncio.run(be.generate(GenerationRequest("t", "x", [4], prefix_len=5)))
        assert be.prompts == [[1, 2, 3], [1, 2, 3, 7, 8, 4]] and be.history.held("t") == 8
        with pytest.raises(HistoryMiss):
            asyncio.run(be.generate(GenerationRequest("t", "x", [4], prefix_len=5)))
        be.forget("t")
        assert "t" not in be.history
        asyncio.run(be.generate(GenerationRequest("u", "x", [1], last_turn=True)))
        assert "u" not in be.history
        asyncio.run(be.generate(GenerationRequest("v", "x", [1])))
        asyncio.run(be.abort("v"))
        assert "v" not in be.history
    finally:
        be._stop_loop()


def test_prefix_and_tail_equals_whole_on_vllm(tmp_path):
    pytest.importorskip("vllm")
    from rollart_nb.models import format_history, tiny_qwen

    ref = tiny_qwen(seed=0, path=str(tmp_path / "tiny"))
    be = VLLMBackend(ref, dtype="float32", seed=0)
    try:
        history = be.tokenizer.encode(format_history([("go left", None)]))
        more = be.tokenizer.encode(" <eos> <|user|> you fell into a hole <|assistant|>")
        held = 0
        for k in range(3):
            tail = GenerationRequest("s", "t", history[held:], 5, seed=k, prefix_len=held)
            a = asyncio.run(be.generate(tail))
            b = asyncio.run(be.generate(GenerationRequest("w", "t", list(history), 5, seed=k)))
            assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            history = history + a.token_ids
            held = len(history)
            history += more
    finally:
        be.close()
