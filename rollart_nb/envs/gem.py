"""Adapter for GEM environments (the ``gem-llm`` package, ``pip install 'rollart_nb[gem]'``).

GEM envs already speak our protocol; the adapter adds ``max_turns``, ``shape``, ``vocab`` and
``validation_seeds()``, appends ``info["suffix"]`` to observations, and builds the GEM env on
first use (cheap to ship through Ray). ``import gem`` calls ``logging.basicConfig`` (undone
here), and GEM's ``reset(seed)`` reseeds the global ``random`` and ``numpy`` RNGs.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["GEMEnv"]


def _import_gem() -> Any:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import gem
    except ImportError as e:
        raise ImportError("GEMEnv needs the gem-llm package; install it with pip install 'rollart_nb[gem]'") from e
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return gem


class GEMEnv:
    """A GEM environment as a rollart_nb env.

    Args:
        env_id: GEM id, e.g. ``"game:GuessTheNumber-v0-easy"``; built with ``gem.make``.
        env: an already built GEM-compatible env instead of ``env_id`` (tests, custom envs).
        max_turns: turn budget; default: the GEM env's own ``max_turns`` attribute, if any.
        shape: ``"prefill"`` or ``"decode"`` hint for routing.
        vocab: words the env uses; GEM text is natural language, so by default empty
            (use a subword tokenizer).
        append_suffix: append ``info["suffix"]`` to observations.
        num_validation_seeds: how many seeds ``validation_seeds()`` returns.
        **kwargs: passed to ``gem.make``.

    Example:
        >>> env = GEMEnv("game:GuessTheNumber-v0-easy")  # doctest: +SKIP
        >>> obs, info = env.reset(seed=0)  # doctest: +SKIP
        >>> env.step("\\\\boxed{5}")  # doctest: +SKIP
    """

    def __init__(
        self,
        env_id: str | None = None,
        *,
        env: Any = None,
        max_turns: int | None = None,
        shape: str = "decode",
        vocab: list[str] | None = None,
        append_suffix: bool = True,
        num_validation_seeds: int = 32,
        **kwargs: Any,
    ) -> None:
        if (env_id is None) == (env is None):
            from rollart_nb.errors import ConfigError

            raise ConfigError("give exactly one of env_id or env", where="GEMEnv")
        self.env_id, self.kwargs = env_id, kwargs
        self.shape = shape
        self.append_suffix = append_suffix
        self.num_validation_seeds = num_validation_seeds
        self._vocab = list(vocab or [])
        self._max_turns = max_turns
        self._env = env
        self._owns_env = env is None

    @property
    def gem_env(self) -> Any:
        """The wrapped GEM env, built on first access."""
        if self._env is None:
            self._env = _import_gem().make(self.env_id, **self.kwargs)
        return self._env

    @property
    def max_turns(self) -> int | None:
        if self._max_turns is not None:
            return self._max_turns
        turns = getattr(self.gem_env, "max_turns", None)
        return int(turns) if turns is not None else None

    @property
    def vocab(self) -> list[str]:
        return list(self._vocab)

    def validation_seeds(self) -> list[int]:
        return list(range(self.num_validation_seeds))

    def _obs(self, obs: Any, info: dict[str, Any]) -> str:
        text = obs if isinstance(obs, str) else str(obs)
        suffix = info.get("suffix") if self.append_suffix else None
        return f"{text}\n{suffix}" if suffix else text

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        obs, info = self.gem_env.reset(seed=seed)
        info = dict(info or {})
        return self._obs(obs, info), info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.gem_env.step(action)
        info = dict(info or {})
        return self._obs(obs, info), float(reward), bool(terminated), bool(truncated), info

    def __getstate__(self) -> dict[str, Any]:
        # Ship the id, not the built env: it is rebuilt where it runs.
        state = dict(self.__dict__)
        if self._owns_env:
            state["_env"] = None
        return state

    def __repr__(self) -> str:
        return f"GEMEnv({self.env_id!r})" if self.env_id else f"GEMEnv(env={self._env!r})"
