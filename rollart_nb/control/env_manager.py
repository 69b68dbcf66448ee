"""EnvManager: one environment instance on its own asyncio timeline.

``reset``, then loop {history -> LLMProxy -> action -> ``env.step`` -> record turn} until
terminated / truncated / max_turns / abort. An env that raises or hangs ends the trajectory
as failed, with a reason naming the env, the call, the task and the manager (and the env's
traceback, trimmed to the user's frames), and the env is replaced by a fresh deep copy of its
template (a hung object is never reused: its abandoned thread may still be inside it). Sync
env methods run on the scheduler's :class:`~rollart_nb.envs.base.BlockingPool`, so nothing
here blocks another EnvManager or the control plane.

Token bookkeeping: turn ``k``'s prompt is turn ``k-1``'s prompt + its response + the new
observation (no re-tokenization drift), stored once in a :class:`~rollart_nb.tokens.TokenSeq`.
A request carries only the tokens the generator lacks (``prefix_len``); on
:class:`~rollart_nb.errors.HistoryMiss` the turn is resent once with the whole history.

Preemption: a turn stopped by a weight update is continued from the history plus its tokens so
far, within the same budget, recording the oldest version that wrote it (``timings["preempted"]``);
one the ``cancel`` staleness policy marked is generated again from its prompt instead.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
import zlib
from array import array
from collections.abc import Sequence
from typing import Any

from rollart_nb.config import RolloutConfig
from rollart_nb.control.staleness import DISCARDED, RENEW
from rollart_nb.envs.base import BlockingPool, env_name, env_reset, env_step
from rollart_nb.errors import EnvError, GenerationError, HistoryMiss, RollartError, StateError
from rollart_nb.logs import user_traceback
from rollart_nb.protocols import GenerationRequest, Tokenizer
from rollart_nb.tokens import Tokens, TokenSeq
from rollart_nb.trajectory import FAILED_IN, Status, Trajectory, Turn

__all__ = ["EnvManager", "RolloutConfig", "TurnBarrier", "env_stats", "request_seed"]

log = logging.getLogger(__name__)


class TurnBarrier:
    """A reusable barrier whose party shrinks as trajectories end (batch-level env stepping)."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self._waiting = self._gen = 0
        self._cond = asyncio.Condition()

    async def wait(self) -> None:
        async with self._cond:
            gen = self._gen
            self._waiting += 1
            if self._waiting >= self.parties:
                self._release()
            else:
                await self._cond.wait_for(lambda: self._gen != gen)

    async def leave(self) -> None:
        async with self._cond:
            self.parties -= 1
            if self.parties > 0 and self._waiting >= self.parties:
                self._release()

    def _release(self) -> None:
        self._waiting = 0
        self._gen += 1
        self._cond.notify_all()


class EnvManager:
    """Runs trajectories of one env instance.

    Args:
        index: manager index (for names and logs).
        task: task name.
        template: the env as given by the user; the manager works on a deep copy and makes a
            fresh copy after a failure.
        tokenizer: turns observations into token ids and responses into text.
        proxy: the LLMProxy (anything with ``async generate(request)``).
        config: :class:`RolloutConfig`.
        pool: where sync env methods run (default: the process-wide default pool).

    Attributes:
        restarts: times the env was replaced by a fresh copy of the template.
        timeouts: env calls that did not answer within ``config.env_timeout_s``.
        abandoned: sync env calls given up while still running (timeouts and cancellations).
        history_resends: turns sent again with the whole history because the generator had
            lost it (:class:`~rollart_nb.errors.HistoryMiss`).
    """

    def __init__(
        self,
        index: int,
        task: str,
        template: Any,
        tokenizer: Tokenizer,
        proxy: Any,
        config: RolloutConfig,
        pool: BlockingPool | None = None,
    ) -> None:
        self.index, self.task, self.template = index, task, template
        self.tok, self.proxy, self.cfg, self.pool = tokenizer, proxy, config, pool
        self.env: Any = copy.deepcopy(template)
        #: the scheduler's set of idle manager indices, kept up to date by :attr:`busy`
        self.idle_set: set[int] | None = None
        self._busy = False
        self.trajectories = self.failures_in_a_row = 0
        self.restarts = self.timeouts = self.abandoned = self.history_resends = 0
        self._call = ""  # the env call in progress, for error reasons
        self._abandoned_now = False  # a call of the current trajectory still runs on a thread
        self._broken = ""  # why the template could not be copied, when it could not
        self._tags: tuple[array, array] | None = None  # tag ids around an env's own Tokens

    @property
    def busy(self) -> bool:
        """Running (or reserved for) a trajectory."""
        return self._busy

    @busy.setter
    def busy(self, value: bool) -> None:
        self._busy = value
        if self.idle_set is not None:
            (self.idle_set.discard if value else self.idle_set.add)(self.index)

    @property
    def max_turns(self) -> int:
        return int(getattr(self.env, "max_turns", None) or self.cfg.max_turns)

    @property
    def name(self) -> str:
        """``env #3 (task 'math', WithFailures(Arithmetic))``: how errors name this env."""
        return f"env #{self.index} (task {self.task!r}, {env_name(self.template)})"

    def _replace_env(self) -> None:
        """Drop the env (a hung call may still hold it) for a fresh copy of the template."""
        self.restarts += 1
        _close_later(self.env)
        try:
            self.env, self._broken = copy.deepcopy(self.template), ""
        except Exception as e:  # reported by the next trajectory, which then fails with it
            self.env, self._broken = None, f"{type(e).__name__}: {e}"
            log.warning("%s: could not copy the env template: %s", self.name, self._broken)

    def _on_abandon(self) -> None:
        self.abandoned += 1
        self._abandoned_now = True

    async def _generate(
        self, traj: Trajectory, k: int, seq: TokenSeq, held: int, temp: float, max_new: int | None = None
    ) -> Any:
        """Turn ``k``'s generation: send the tokens of ``seq`` after the ``held`` ones the
        generator keeps; if it has lost them (:class:`HistoryMiss`), resend the whole history once."""

        def request(prefix_len: int) -> GenerationRequest:
            return GenerationRequest(
                traj.id,
                self.task,
                seq.tail(prefix_len),
                self.cfg.max_new_tokens if max_new is None else max_new,
                temp,
                seed=request_seed(traj, k),
                last_turn=k == self.max_turns - 1,
                prefix_len=prefix_len,
            )

        try:
            return await self.proxy.generate(request(held))
        except HistoryMiss:
            if held == 0:
                raise
            self.history_resends += 1
            log.debug(
                "%s: trajectory %s turn %d: generator lost its history; resending it whole", self.name, traj.id, k
            )
            return await self.proxy.generate(request(0))

    def _encode_obs(self, obs: str | Tokens) -> Any:
        """The observation's token ids between the user and assistant tags (an env's own
        :class:`~rollart_nb.tokens.Tokens` are copied, not tokenized)."""
        if isinstance(obs, Tokens):
            if self._tags is None:
                self._tags = (
                    array("i", self.tok.encode(self.cfg.user_tag)),
                    array("i", self.tok.encode(self.cfg.assistant_tag)),
                )
            return self._tags[0] + obs.ids + self._tags[1]
        return self.tok.encode(f"{self.cfg.user_tag} {obs} {self.cfg.assistant_tag}")

    async def run(
        self,
        traj: Trajectory,
        *,
        barrier: TurnBarrier | None = None,
        temperature: float | None = None,
        clock: Any = time.monotonic,
        prefix: Sequence[Turn] = (),
    ) -> Trajectory:
        """Roll out ``traj`` (RUNNING on return if the episode ended normally, else FAILED with a
        reason). Cancelling it is allowed (the caller records the status); an env call it
        interrupts on a thread gets the env replaced. ``prefix``: recorded turns played first,
        their actions stepped through the env instead of generated (see :meth:`_replayed`)."""
        self.busy = True
        self.trajectories += 1
        self._call, self._abandoned_now = "setup", False
        temp = self.cfg.temperature if temperature is None else temperature
        try:
            await self._run(traj, barrier, temp, clock, prefix)
        except EnvError as e:
            if isinstance(e.__cause__, TimeoutError):
                self.timeouts += 1
            reason = f"env: {e} [{self.name}, {self._call}, trajectory {traj.id}; env replaced]"
            cause = e.__cause__
            if cause is not None and _user_bug(cause):  # the env's own code raised: say where
                reason += "\n" + user_traceback(cause)
                log.warning("%s failed: %s", self.name, reason)
            traj.finish(Status.FAILED, reason, now=time.time())
            # where it failed: a failed step came after the model acted (see failed_trajectories)
            traj.info[FAILED_IN] = "env_step" if self._call.startswith("step of") else "env_reset"
            self._replace_env()
        except GenerationError as e:
            traj.finish(Status.FAILED, f"generation: {e} [{self.name}, trajectory {traj.id}]", now=time.time())
        except asyncio.CancelledError:
            if self._abandoned_now:  # its thread may still be inside the env: never reuse it
                self._replace_env()
            raise
        except Exception as e:  # a bug outside the env (tokenizer, proxy): still one recorded ending
            log.exception("%s: rollout of trajectory %s failed", self.name, traj.id)
            traj.finish(
                Status.FAILED,
                f"rollout error: {type(e).__name__}: {e} [{self.name}, {self._call or 'setup'}, trajectory {traj.id}]",
                now=time.time(),
            )
        finally:
            self.busy = False
            if barrier is not None:
                await barrier.leave()
        return traj

    async def _run(
        self, traj: Trajectory, barrier: TurnBarrier | None, temp: float, clock: Any, prefix: Sequence[Turn] = ()
    ) -> None:
        if self.env is None:
            self._replace_env()
            if self.env is None:
                raise EnvError(f"could not copy the env template ({self._broken}); make the env deep-copyable")
        t0 = clock()
        self._call = "reset"
        obs, info = await env_reset(
            self.env, traj.seed, timeout_s=self.cfg.env_timeout_s, pool=self.pool, on_abandon=self._on_abandon
        )
        traj.info.update(info or {})
        reset_s = clock() - t0
        seq = TokenSeq(self._encode_obs(obs))  # the whole conversation, stored once
        held = 0  # tokens of it the generator holds (sent before, plus its responses)
        for k in range(self.max_turns):
            if k < len(prefix):
                turn, held = self._replayed(traj, k, seq, prefix[k]), 0
            else:
                turn, held = await self._turn(traj, k, seq, held, temp, obs, clock)
            if k == 0:
                turn.timings["reset"] = reset_s
            t2 = clock()
            self._call = f"step of turn {k}"
            obs, reward, terminated, truncated, step_info = await env_step(
                self.env, turn.action, timeout_s=self.cfg.env_timeout_s, pool=self.pool, on_abandon=self._on_abandon
            )
            turn.env_reward = float(reward)
            turn.timings["env"] = clock() - t2
            if step_info:
                traj.info.setdefault("step_info", []).append(_jsonable(step_info))
            if barrier is not None:  # batch-level interaction: everyone waits for the slowest env
                t3 = clock()
                await barrier.wait()
                turn.timings["barrier"] = clock() - t3
            if terminated or truncated:
                traj.info["terminated"] = bool(terminated)
                return
            new = self._encode_obs(obs)
            if len(seq) + len(new) + self.cfg.max_new_tokens > self.cfg.max_context:
                traj.info["truncated"] = "context"
                return
            seq.extend(new)
        traj.info["truncated"] = "max_turns"

    def _replayed(self, traj: Trajectory, k: int, seq: TokenSeq, recorded: Turn) -> Turn:
        """Turn ``k`` as ``recorded`` (a regeneration's prefix), its response appended to ``seq``.

        Raises:
            StateError: ``seq`` is not the recorded prompt: the env answered otherwise than when
                the turn was recorded (``traj.info["replay_mismatch"]`` is set to ``k``).
        """
        if list(seq.tail()) != list(recorded.prompt_ids):
            traj.info["replay_mismatch"] = k
            raise StateError(
                f"turn {k}: the env's observations differ from the recorded ones, so it is not "
                f"deterministic for seed {traj.seed}; regenerate from turn {k} or an earlier one"
            )
        start = len(seq)
        seq.extend(recorded.response_ids)
        turn = dataclasses.replace(
            recorded, prompt_ids=seq.view(0, start), response_ids=seq.view(start, len(seq)), timings={}
        )
        traj.turns.append(turn)
        return turn

    async def _turn(
        self, traj: Trajectory, k: int, seq: TokenSeq, held: int, temp: float, obs: Any, clock: Any
    ) -> tuple[Turn, int]:
        """Generate turn ``k`` onto ``seq`` (continued across weight updates) and record it on
        ``traj``; returns the turn and the tokens of ``seq`` the generator now holds."""
        t1, wall = clock(), time.time()
        self._call = f"generate of turn {k}"
        prompt_len = len(seq)
        res = await self._generate(traj, k, seq, held, temp)
        parts = [res]
        seq.extend(res.token_ids)
        while True:
            if _renewed(traj, parts):  # the cancel staleness policy: this turn starts again, new weights
                traj.info[DISCARDED] = traj.info.get(DISCARDED, 0) + len(seq) - prompt_len
                seq.truncate(prompt_len)
                parts = []
            elif res.finish_reason != "preempted" or len(seq) - prompt_len >= self.cfg.max_new_tokens:
                break
            # stopped by a weight update: continue from the history plus the tokens so far, under
            # the new weights (the generator dropped its copy, so the whole history goes again)
            res = await self._generate(traj, k, seq, 0, temp, max_new=self.cfg.max_new_tokens - (len(seq) - prompt_len))
            parts.append(res)
            seq.extend(res.token_ids)
        t2 = clock()
        response = seq.view(prompt_len, len(seq))
        turn = Turn(
            observation=obs.text if isinstance(obs, Tokens) else obs,
            action=res.text if len(parts) == 1 and res.text else self.tok.decode(list(response)),
            prompt_ids=seq.view(0, prompt_len),
            response_ids=response,
            logprobs=_logprobs(parts),
            loss_mask=[1] * len(response),
            version=min(p.version for p in parts),  # the oldest weights that wrote part of it
            entropy=[e for p in parts for e in p.entropy]
            if all(len(p.entropy) == len(p.token_ids) for p in parts)
            else [],
            spans=_spans(parts),
            timings={
                "t": wall,
                "generate": t2 - t1,
                "prefill_model": sum(p.prefill_s for p in parts),
                "decode_model": sum(p.decode_s for p in parts),
            },
            worker=res.worker,
        )
        if len(parts) > 1:
            turn.timings["preempted"] = float(len(parts) - 1)
        recomputed = sum(p.recomputed_tokens for p in parts)
        if recomputed:
            turn.timings["recomputed_tokens"] = float(recomputed)
        traj.turns.append(turn)
        # An aborted generation drops the generator's copy: the next turn sends it all again.
        return turn, len(seq) if res.finish_reason not in ("abort", "preempted") else 0


_CLOSING: set[asyncio.Task] = set()  # closes in flight (the loop keeps only weak references)


def _close_later(env: Any) -> None:
    """Close a dropped env that can be closed without blocking: a RemoteEnv closes its HTTP
    client (instead of leaving it to garbage collection) and any episode it still has open.
    An episode whose step failed or timed out was already forgotten by the RemoteEnv; the
    server expires it when idle."""
    aclose = getattr(env, "aclose", None)
    if aclose is None:
        return
    try:
        task = asyncio.get_running_loop().create_task(aclose())
    except RuntimeError:  # no loop here: the server expires the episode
        return

    def done(t: asyncio.Task) -> None:
        _CLOSING.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.debug("closing a replaced env: %s", t.exception())

    _CLOSING.add(task)
    task.add_done_callback(done)


def env_stats(managers: list[EnvManager], pool: BlockingPool) -> dict[str, Any]:
    """Env faults of ``managers`` and the state of their thread ``pool`` (``stats()["env"]``)."""
    p = pool.stats()
    return {
        "restarts": sum(m.restarts for m in managers),
        "timeouts": sum(m.timeouts for m in managers),
        "abandoned_threads": p["abandoned"],
        "hung_threads": p["hung"],
        "threads": p["threads"],
        "thread_cap": p["cap"],
        "at_cap": p["at_cap"],
        "cap_hits": p["cap_hits"],
    }


def _user_bug(cause: BaseException | None) -> bool:
    """An exception the user's code raised (not a timeout, not one of ours): worth a traceback."""
    return isinstance(cause, Exception) and not isinstance(cause, TimeoutError | RollartError)


def request_seed(traj: Trajectory, turn: int) -> int:
    """Sampling seed of a trajectory's turn: reproducible across processes, distinct per group member."""
    return (traj.seed * 1000 + turn + zlib.crc32(traj.id.encode()) % 997) % 2**31


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if isinstance(v, int | float | str | bool | type(None))}


def _renewed(traj: Trajectory, parts: list[Any]) -> bool:
    """Whether the ``cancel`` staleness policy marked ``traj`` (:data:`RENEW`) and a version
    below its mark wrote part of the turn so far (then the mark is used up)."""
    below = traj.info.get(RENEW)
    if below is None or not parts:
        return False
    if any(p.version < below for p in parts):
        del traj.info[RENEW]
        return True
    return False


def _spans(parts: list[Any]) -> list[tuple[int, int]]:
    """``(offset, version)`` where each version's stretch of a continued turn starts; empty
    when one version wrote it all."""
    spans: list[tuple[int, int]] = []
    offset = 0
    for p in parts:
        if p.token_ids and (not spans or spans[-1][1] != p.version):
            spans.append((offset, p.version))
        offset += len(p.token_ids)
    return spans if len(spans) > 1 else []


def _logprobs(parts: list[Any]) -> list[float]:
    """The turn's log-probabilities: its one result's list as is (no copy), or the parts' joined."""
    if len(parts) == 1 and isinstance(parts[0].logprobs, list):
        return parts[0].logprobs
    return [lp for p in parts for lp in p.logprobs]
