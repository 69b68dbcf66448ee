"""GEMEnv against a fake that mimics GEM's API, plus the real package when installed."""

import logging
import pickle
import sys

import pytest

from rollart_nb.envs import GEMEnv
from rollart_nb.errors import ConfigError


class FakeGuess:
    """Mimics gem's GuessTheNumber: \\boxed{n} guesses, info carries a suffix."""

    max_turns = 3

    def reset(self, seed=None):
        self.target, self.turn = (seed or 0) % 10 + 1, 0
        return "guess a number between 1 and 10 .", {"suffix": "Enter your next guess."}

    def step(self, action):
        self.turn += 1
        guess = int(action.split("{")[-1].rstrip("}"))
        if guess == self.target:
            return "correct !", 1, True, False, {"suffix": "Enter your next guess."}
        return "higher" if guess < self.target else "lower", 0, False, self.turn >= 3, {}


def test_adapter_passes_through_and_appends_suffix():
    env = GEMEnv(env=FakeGuess())
    assert env.max_turns == 3 and env.shape == "decode" and env.vocab == []
    obs, info = env.reset(seed=4)
    assert obs == "guess a number between 1 and 10 .\nEnter your next guess."
    assert info == {"suffix": "Enter your next guess."}
    obs, reward, terminated, truncated, _ = env.step("\\boxed{2}")
    assert (obs, reward, terminated, truncated) == ("higher", 0.0, False, False)
    obs, reward, terminated, _, _ = env.step("\\boxed{5}")
    assert reward == 1.0 and isinstance(reward, float) and terminated
    assert GEMEnv(env=FakeGuess(), append_suffix=False, max_turns=9).reset(0)[0].endswith(".")
    assert GEMEnv(env=FakeGuess(), max_turns=9).max_turns == 9


def test_needs_exactly_one_source():
    with pytest.raises(ConfigError):
        GEMEnv()
    with pytest.raises(ConfigError):
        GEMEnv("game:GuessTheNumber-v0-easy", env=FakeGuess())


def test_env_id_is_lazy_and_pickles_without_the_built_env(monkeypatch):
    monkeypatch.setitem(sys.modules, "gem", None)  # import gem -> ImportError
    env = GEMEnv("game:GuessTheNumber-v0-easy")  # nothing imported yet
    assert pickle.loads(pickle.dumps(env)).env_id == "game:GuessTheNumber-v0-easy"
    with pytest.raises(ImportError, match=r"rollart_nb\[gem\]"):
        env.reset(seed=0)


def test_real_gem_guess_the_number():
    pytest.importorskip("gem", reason="gem-llm not installed (pip install 'rollart_nb[gem]')")
    root = logging.getLogger()
    before = list(root.handlers)
    env = GEMEnv("game:GuessTheNumber-v0-easy")
    obs, _ = env.reset(seed=0)
    assert root.handlers == before  # gem's logging.basicConfig was undone
    assert "Guess The Number" in obs and obs.endswith("Enter your next guess.")
    assert env.max_turns == 4
    lo, hi, reward, done = 1, 10, 0.0, False
    while not done:  # binary search wins within 4 turns on 1..10
        mid = (lo + hi) // 2
        obs, reward, terminated, truncated, _ = env.step(f"\\boxed{{{mid}}}")
        done = terminated or truncated
        if "higher" in obs:
            lo = mid + 1
        elif "lower" in obs:
            hi = mid - 1
    assert reward == 1.0 and terminated and "Congratulations" in obs
    clone = pickle.loads(pickle.dumps(env))
    assert clone._env is None and clone.reset(seed=0)[0] == env.reset(seed=0)[0]
