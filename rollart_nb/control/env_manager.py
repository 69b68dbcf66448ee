"""EnvManager: one environment instance on its own asyncio timeline.

``reset``, then loop {history -> LLMProxy -> action -> ``env.step`` -> record turn} until
terminated / truncated / max_turns / abort. An env that raises or hangs ends the trajectory
as failed with the reason and the env is recreated from its template; nothing here blocks
another EnvManager.

Token bookkeeping: turn ``k``'s prompt is turn ``k-1``'s prompt + its response + the new
observation, so prompts are exact prefixes of each other (no re-tokenization drift) and the
last turn's ``prompt_ids + response_ids`` is the whole conversation.
"""

from __future__ import annotations

import asyncio
import copy
import time
import zlib
from dataclasses import dataclass
from typing import Any

from rollart_nb.envs.base import env_reset, env_step
from rollart_nb.errors import EnvError, GenerationError
from rollart_nb.protocols import GenerationRequest, Tokenizer
from rollart_nb.trajectory import Status, Trajectory, Turn

__all__ = ["EnvManager", "RolloutConfig", "TurnBarrier", "request_seed"]


@dataclass(frozen=True)
class RolloutConfig:
    """How EnvManagers talk to envs and the model.

    Attributes:
        max_turns: turns per trajectory unless the env says less (``env.max_turns``).
        max_new_tokens: response budget per turn.
        max_context: tokens of history after which the trajectory is truncated.
        temperature: sampling temperature (0: greedy).
        env_timeout_s: an env ``reset``/``step`` slower than this fails the trajectory.
        user_tag / assistant_tag: chat markers around observations and responses.
    """

    max_turns: int = 16
    max_new_tokens: int = 32
    max_context: int = 4096
    temperature: float = 1.0
    env_timeout_s: float = 60.0
    user_tag: str = "<|user|>"
    assistant_tag: str = "<|assistant|>"


class TurnBarrier:
    """A reusable barrier whose party shrinks as trajectories end (batch-level env stepping)."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self._waiting = 0
        self._gen = 0
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
    """

    def __init__(self, index: int, task: str, template: Any, tokenizer: Tokenizer, proxy: Any,
                 config: RolloutConfig) -> None:
        self.index, self.task, self.template = index, task, template
        self.tok, self.proxy, self.cfg = tokenizer, proxy, config
        self.env = copy.deepcopy(template)
        self.busy = False
        self.trajectories = 0
        self.failures_in_a_row = 0

    @property
    def max_turns(self) -> int:
        return int(getattr(self.env, "max_turns", None) or self.cfg.max_turns)

    def _recreate(self) -> None:
        self.env = copy.deepcopy(self.template)

    def _encode_obs(self, obs: str) -> list[int]:
        return self.tok.encode(f"{self.cfg.user_tag} {obs} {self.cfg.assistant_tag}")

    async def run(self, traj: Trajectory, *, barrier: TurnBarrier | None = None, temperature: float | None = None,
                  clock: Any = time.monotonic) -> Trajectory:
        """Roll out ``traj`` (RUNNING on return if the episode ended normally, else FAILED)."""
        self.busy = True
        self.trajectories += 1
        temp = self.cfg.temperature if temperature is None else temperature
        try:
            await self._run(traj, barrier, temp, clock)
        except EnvError as e:
            traj.finish(Status.FAILED, f"env: {e}", now=time.time())
            self._recreate()
        except GenerationError as e:
            traj.finish(Status.FAILED, f"generation: {e}", now=time.time())
        finally:
            self.busy = False
            if barrier is not None:
                await barrier.leave()
        return traj

    async def _run(self, traj: Trajectory, barrier: TurnBarrier | None, temp: float, clock: Any) -> None:
        t0 = clock()
        obs, info = await env_reset(self.env, traj.seed, timeout_s=self.cfg.env_timeout_s)
        traj.info.update(info or {})
        reset_s = clock() - t0
        prompt = self._encode_obs(obs)
        for k in range(self.max_turns):
            t1, wall = clock(), time.time()
            req = GenerationRequest(traj.id, self.task, list(prompt), self.cfg.max_new_tokens, temp,
                                    seed=request_seed(traj, k), last_turn=k == self.max_turns - 1)
            res = await self.proxy.generate(req)
            t2 = clock()
            action = res.text or self.tok.decode(res.token_ids)
            turn = Turn(observation=obs, action=action, prompt_ids=list(prompt), response_ids=list(res.token_ids),
                        logprobs=list(res.logprobs), loss_mask=[1] * len(res.token_ids), version=res.version,
                        timings={"t": wall, "generate": t2 - t1, "prefill_model": res.prefill_s,
                                 "decode_model": res.decode_s}, worker=res.worker)
            if k == 0:
                turn.timings["reset"] = reset_s
            if res.recomputed_tokens:
                turn.timings["recomputed_tokens"] = float(res.recomputed_tokens)
            traj.turns.append(turn)
            obs, reward, terminated, truncated, step_info = await env_step(self.env, action,
                                                                           timeout_s=self.cfg.env_timeout_s)
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
            prompt = prompt + list(res.token_ids) + self._encode_obs(obs)
            if len(prompt) + self.cfg.max_new_tokens > self.cfg.max_context:
                traj.info["truncated"] = "context"
                return
        traj.info["truncated"] = "max_turns"


def request_seed(traj: Trajectory, turn: int) -> int:
    """Sampling seed of a trajectory's turn: reproducible across processes, distinct per group member."""
    return (traj.seed * 1000 + turn + zlib.crc32(traj.id.encode()) % 997) % 2**31


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if isinstance(v, int | float | str | bool | type(None))}
