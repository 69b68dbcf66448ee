import asyncio
import threading

import pytest

from rollart_nb.envs import Arithmetic, AsyncEnv, WithLatency, env_reset, env_step
from rollart_nb.errors import EnvError
from rollart_nb.protocols import Env


class Broken:
    def reset(self, seed=None):
        raise ValueError("boom")

    def step(self, action):
        return "", 0.0, True, False, {}


class AsyncOnly:
    """Records which method was called, to show the helpers prefer async ones."""

    def __init__(self):
        self.calls = []

    def reset(self, seed=None):
        self.calls.append("reset")
        return "", {}

    def step(self, action):
        self.calls.append("step")
        return "", 0.0, True, False, {}

    async def areset(self, seed=None):
        self.calls.append("areset")
        return "", {"thread": threading.current_thread().name}

    async def astep(self, action):
        self.calls.append("astep")
        return "", 1.0, True, False, {}


def test_sync_env_runs_in_a_thread():
    env = Arithmetic()

    async def main():
        obs, info = await env_reset(env, 2)
        return await env_step(env, info["answer"])

    assert asyncio.run(main())[1] == 1.0


def test_async_methods_are_preferred_and_run_on_the_loop_thread():
    env = AsyncOnly()

    async def main():
        _, info = await env_reset(env, 0)
        await env_step(env, "x")
        return info

    info = asyncio.run(main())
    assert env.calls == ["areset", "astep"]
    assert info["thread"] == threading.main_thread().name


def test_env_exceptions_become_env_error_with_cause():
    with pytest.raises(EnvError, match="Broken raised in reset: ValueError: boom") as e:
        asyncio.run(env_reset(Broken(), 0))
    assert isinstance(e.value.__cause__, ValueError)


def test_protocol_checks():
    assert isinstance(Arithmetic(), Env) and not isinstance(Arithmetic(), AsyncEnv)
    assert isinstance(WithLatency(Arithmetic(), 0, 0), AsyncEnv)
