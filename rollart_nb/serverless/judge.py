"""LLM-as-judge as a stateless reward function.

The judge's weights never change, so judging is a pure function of the trajectory and can run
serverless (``ServeManager.deploy("judge", LLMJudge(...))``). :class:`LLMJudge` renders a prompt,
has a frozen model (``hf`` or the hash-based ``sim`` backend) answer greedily, and parses a score.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import re
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, cast

from rollart_nb.errors import ConfigError, RewardError
from rollart_nb.trajectory import Trajectory, Turn

__all__ = ["DEFAULT_TEMPLATE", "LLMJudge", "parse_score", "parse_yes_no"]

DEFAULT_TEMPLATE = (
    "You are a strict grader. Task: {task}. Reference answer: {answer}.\n"
    "Conversation:\n{transcript}\n"
    "Rate the final answer from 0 to 1. Score:"
)
"""Fields: ``task``, ``answer`` (``info["answer"]``), ``transcript``, ``last_action``, ``info``."""

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def parse_score(text: str, scale: float = 1.0) -> float:
    """The first number in ``text`` divided by ``scale``; must land in [0, 1].

    Use ``functools.partial(parse_score, scale=10)`` for judges that answer out of 10.

    Raises:
        RewardError: no number, or the number is outside ``[0, scale]``.
    """
    m = _NUMBER.search(text)
    if m is None:
        raise RewardError(f"judge answer {text[:80]!r} holds no number; fix the prompt or pass parse=...")
    score = float(m.group()) / scale
    if not 0.0 <= score <= 1.0:
        raise RewardError(f"judge answered {m.group()} in {text[:80]!r}, outside [0, {scale:g}]")
    return score


def parse_yes_no(text: str) -> float:
    """1.0 if the answer starts with "yes", 0.0 if with "no".

    Raises:
        RewardError: it starts with neither.
    """
    word = (text.strip().split() or [""])[0].strip(".,:;!").lower()
    if word in ("yes", "no"):
        return 1.0 if word == "yes" else 0.0
    raise RewardError(f"judge answer {text[:80]!r} starts with neither yes nor no; fix the prompt or pass parse=...")


class LLMJudge:
    """A frozen LLM that scores trajectories: ``LLMJudge(...)(trajectory) -> float in [0, 1]``.

    Args:
        model: a :class:`~rollart_nb.models.tiny.ModelRef` or HF model directory (``hf``);
            None for ``sim``.
        prompt_template: ``str.format`` template; fields as in :data:`DEFAULT_TEMPLATE`.
        parse: ``parse(answer_text) -> float``; raise to reject an answer.
        backend: "hf" or "sim"; default "hf" when ``model`` is given, else "sim".
        max_new_tokens: answer budget (greedy decoding, so the same input scores the same).
        device: torch device for ``hf`` (default: CUDA when available).
        sim_latency_s: ``sim`` only: seconds each judgement takes (a stand-in reward LLM).

    Example:
        >>> judge = LLMJudge(rn.models.tiny_qwen(), parse=my_parse)      # doctest: +SKIP
        >>> mgr.deploy("judge", judge, num_cpus=1)                     # doctest: +SKIP
        >>> LLMJudge()(traj)                                              # doctest: +SKIP
        0.42
    """

    def __init__(
        self,
        model: Any = None,
        prompt_template: str = DEFAULT_TEMPLATE,
        parse: Callable[[str], float] = parse_score,
        backend: str | None = None,
        *,
        max_new_tokens: int = 8,
        device: str | None = None,
        sim_latency_s: float = 0.0,
    ) -> None:
        backend = backend or ("hf" if model is not None else "sim")
        problems = []
        if backend not in ("hf", "sim"):
            problems.append(f"backend {backend!r} must be 'hf' or 'sim'")
        if backend == "hf" and model is None:
            problems.append("backend 'hf' needs a model (rn.models.tiny_qwen() or a model directory)")
        if not callable(parse):
            problems.append(f"parse must be callable, got {type(parse).__name__}")
        if max_new_tokens < 1:
            problems.append(f"max_new_tokens={max_new_tokens} must be >= 1")
        if sim_latency_s < 0:
            problems.append(f"sim_latency_s={sim_latency_s} must be >= 0")
        try:  # a typo in a field name should fail here, not on every trajectory in a replica
            prompt_template.format_map(_fields(Trajectory("task", turns=[Turn("obs", "act")])))
        except (KeyError, IndexError, ValueError) as e:
            problems.append(
                f"prompt_template does not format ({type(e).__name__}: {e}); "
                "fields: task, answer, transcript, last_action, info"
            )
        if problems:
            raise ConfigError(problems, where="LLMJudge")
        self.model, self.prompt_template, self.parse = model, prompt_template, parse
        self.backend, self.max_new_tokens, self.device = backend, max_new_tokens, device
        self.sim_latency_s = sim_latency_s
        self._engine: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: weakref.finalize | None = None  # stops the loop thread: close(), GC or exit
        self._lock = threading.Lock()
        self.calls = 0

    # Pickled to Serve replicas without the loaded model: each replica loads its own.
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_engine=None, _loop=None, _stop=None, _lock=None, calls=0)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def setup(self) -> None:
        """Load the judge model now (idempotent); Serve replicas call this at start."""
        if self.backend == "hf":
            self._started()

    def _started(self) -> tuple[Any, asyncio.AbstractEventLoop]:
        """The loaded engine and its loop, read together under the lock (so a concurrent
        close() cannot hand back one without the other); loads them first if needed."""
        with self._lock:
            if self._engine is None:
                from rollart_nb.backends.hf import HFBackend

                # one turn per request: no KV reuse
                self._engine = HFBackend(self.model, device=self.device, name="judge", kv_reuse=False)
                # HFBackend batches concurrent generate() calls on one event loop; a private loop
                # thread lets sync __call__s from many threads share it (and batch together).
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="rollart-judge-loop", daemon=True)
                thread.start()
                self._loop = loop
                # A judge nobody closes still stops its thread when collected or at exit, while
                # the interpreter is whole, not as a daemon thread torn down with it.
                self._stop = weakref.finalize(self, _stop_loop_thread, loop, thread)
            # _loop is set together with _engine, so it is not None here
            return self._engine, cast(asyncio.AbstractEventLoop, self._loop)

    def close(self) -> None:
        """Stop the loop thread and drop the model (idempotent); the next call loads it again."""
        with self._lock:
            if self._stop is not None:
                self._stop()
            self._engine, self._loop, self._stop = None, None, None

    def __enter__(self) -> LLMJudge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def render(self, traj: Trajectory) -> str:
        """The prompt the judge sees for ``traj``."""
        return self.prompt_template.format_map(_fields(traj))

    def answer(self, traj: Trajectory) -> str:
        """The judge's raw greedy answer text for ``traj``."""
        prompt = self.render(traj)
        if self.backend == "sim":
            if self.sim_latency_s:
                time.sleep(self.sim_latency_s)
            h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
            return f"{h % 101 / 100:.2f}"
        from rollart_nb.protocols import GenerationRequest

        engine, loop = self._started()
        ids = engine.tokenizer.encode(prompt)
        # Keep the end of a long prompt: the question to grade sits there.
        ids = ids[-max(1, engine.max_len - self.max_new_tokens - 1) :]
        req = GenerationRequest(traj.id, traj.task, ids, max_new_tokens=self.max_new_tokens, temperature=0.0)
        try:
            fut = asyncio.run_coroutine_threadsafe(engine.generate(req), loop)
            return fut.result().text
        except (concurrent.futures.CancelledError, RuntimeError) as e:
            # only close() cancels these requests or closes the loop under them
            if isinstance(e, RuntimeError) and not loop.is_closed():
                raise
            raise RewardError(f"the judge was closed while scoring trajectory {traj.id}") from e

    def __call__(self, traj: Trajectory) -> float:
        """Score ``traj`` in [0, 1].

        Raises:
            RewardError: the answer does not parse, or parses outside [0, 1].
        """
        text = self.answer(traj)
        self.calls += 1
        try:
            score = float(self.parse(text))
        except RewardError:
            raise
        except Exception as e:  # a user parser's own error: say which answer it choked on
            raise RewardError(f"parse failed on judge answer {text[:80]!r}: {type(e).__name__}: {e}") from e
        if not 0.0 <= score <= 1.0:
            raise RewardError(f"parse turned judge answer {text[:80]!r} into {score}, outside [0, 1]")
        return score

    def __repr__(self) -> str:
        name = getattr(self.model, "name", self.model) if self.model is not None else "-"
        return f"LLMJudge(backend={self.backend!r}, model={name!r}, loaded={self._engine is not None})"


def _stop_loop_thread(loop: asyncio.AbstractEventLoop, thread: threading.Thread, timeout: float = 10.0) -> None:
    """Cancel what ``loop`` still runs (its callers get a clear error), let its executor threads
    finish, stop it, join its thread and close it."""
    if loop.is_closed():
        return
    if threading.current_thread() is thread:  # collected on the loop thread itself: just stop
        loop.stop()
        return

    async def drain() -> None:
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        await asyncio.sleep(0)  # their done callbacks tell the callers' futures
        await loop.shutdown_default_executor()
        loop.stop()

    if thread.is_alive():
        try:
            asyncio.run_coroutine_threadsafe(drain(), loop)
        except RuntimeError:  # closed meanwhile
            return
        thread.join(timeout)
    if not thread.is_alive() and not loop.is_closed():
        loop.close()


def _fields(traj: Trajectory) -> dict[str, Any]:
    transcript = "\n".join(f"User: {t.observation}\nAssistant: {t.action}" for t in traj.turns)
    return {
        "task": traj.task,
        "answer": traj.info.get("answer", ""),
        "transcript": transcript,
        "last_action": traj.turns[-1].action if traj.turns else "",
        "info": traj.info,
    }
